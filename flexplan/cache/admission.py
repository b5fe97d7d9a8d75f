"""Disk admission on the second sighting: the keys seen so far, here and (through a journal in the
plan directory) by every process sharing it.

Most coordinates of a real job never come back (augmented training scans, a new scan per request):
writing their plans costs a lock, a file and its bytes for nothing. In mode auto the plan cache
therefore sends a key to the disk only if it was seen before (policy.py); this module answers
"seen before?" with a set membership test, and records the sighting.

The journal (`seen-keys.log`) is a hint, not a record: one key (32 hex digits) per line.
- New keys are buffered and appended in one O_APPEND write per FLUSH_KEYS keys or FLUSH_SECONDS,
  plus one at exit (atexit, and multiprocessing's exit hook for DataLoader workers). Each write
  starts with a newline, so a line torn by a crashed writer never swallows the next key.
- It is read once when first needed, then only its new bytes, at most every REREAD_SECONDS and
  only if its size or inode changed. Lines that are not exactly 32 hex digits (a torn append,
  garbage) are ignored.
- Past 2 * keep keys it is rewritten with the newest `keep` (atomic_write). Appends
  racing with that rewrite may be lost: a lost sighting only delays a store by one sighting.
- A directory that refuses the writes (read-only, full, EFBIG, no permission) keeps the sightings
  in memory for this process, with one warning; nothing here raises into a convolution.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import re
import threading
import time
import warnings
import weakref
from pathlib import Path
from ..atomic_write import atomic_write

JOURNAL_NAME = "seen-keys.log"
KEEP_KEYS = 100_000    # the journal keeps the newest this many keys; this process at most twice
FLUSH_KEYS = 256       # append once this many new keys wait ...
FLUSH_SECONDS = 5.0    # ... or once this long passed since the last append (checked on misses)
REREAD_SECONDS = 2.0   # look at the journal's size at most this often
_LINE = 33             # bytes per key: 32 hex digits and a newline
_KEY_LINE = re.compile(r"^[0-9a-f]{32}$", re.MULTILINE)


def _keys_in(data: bytes) -> list[str]:
    """The lines of `data` that are exactly 32 lowercase hex digits (latin-1 decodes any bytes)."""
    return _KEY_LINE.findall(data.decode("latin-1"))


def _append(path: Path, data: bytes) -> int:
    """One O_APPEND write (whole lines, so concurrent appenders do not interleave them on a
    local file system); returns the file's size after it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # (the plan directory: disk.py)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, data)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _read_keys(path: Path, limit: int) -> list[str]:
    """The valid keys of the journal's last `limit` bytes, oldest first ([] if unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            data = f.read(limit)
    except OSError:
        return []
    return _keys_in(data)


class SeenKeys:
    """Keys seen by this process or found in the journal of `directory`."""

    def __init__(self, directory: str | os.PathLike, keep: int = KEEP_KEYS):
        self.path = Path(directory) / JOURNAL_NAME
        self.keep = int(keep)
        self.writable = True
        self._seen: dict[str, None] = {}  # an insertion-ordered set, newest last
        self._pending: list[str] = []     # seen here, not yet in the journal
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._last_look = float("-inf")   # monotonic time of the last look at the journal
        self._read_to = (None, 0)         # ((st_dev, st_ino), bytes) of the journal read so far
        _live.add(self)

    def __len__(self) -> int:
        return len(self._seen)

    # ---- the hot path (a plan cache miss) --------------------------------------------------
    def seen_before(self, key: str) -> bool:
        """Was `key` seen before (here or in the journal)? Either way it is seen from now on."""
        with self._lock:
            now = time.monotonic()
            if now - self._last_look >= REREAD_SECONDS:
                self._last_look = now
                self._read_new()
            seen = key in self._seen
            self._note(key, now)
            return seen

    def record(self, key: str) -> None:
        """Count `key` as seen without asking (its plan was stored: other processes should look)."""
        with self._lock:
            self._note(key, time.monotonic())

    def _note(self, key: str, now: float) -> None:
        if key not in self._seen:
            self._seen[key] = None
            self._pending.append(key)
            self._trim()
            _flush_at_exit()
        if self._pending and (len(self._pending) >= FLUSH_KEYS
                              or now - self._last_flush >= FLUSH_SECONDS):
            self._flush(now)

    # ---- the journal -----------------------------------------------------------------------
    def _read_new(self) -> None:
        """Add the keys appended since the last look (all of them if the file was replaced)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return  # absent or unreachable: nothing to learn
        ident, done = self._read_to
        if (st.st_dev, st.st_ino) != ident or st.st_size < done:
            ident, done = (st.st_dev, st.st_ino), max(0, st.st_size - 2 * self.keep * _LINE)
        if st.st_size == done:
            self._read_to = (ident, done)
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(done)
                data = f.read(st.st_size - done)
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # a torn last line waits for its end
        self._read_to = (ident, done + end)
        self._seen.update(dict.fromkeys(_keys_in(data[:end])))
        self._trim()

    def _trim(self) -> None:
        if len(self._seen) > 2 * self.keep:  # bounded memory: keep the newest `keep`
            self._seen = dict.fromkeys(list(self._seen)[-self.keep:])

    def flush(self) -> None:
        """Append the buffered keys to the journal now (done by itself in batches and at exit)."""
        if self._lock.acquire(timeout=1.0):  # at exit, never wait on a thread that died holding it
            try:
                self._flush(time.monotonic())
            finally:
                self._lock.release()

    def _flush(self, now: float) -> None:
        pending, self._pending, self._last_flush = self._pending, [], now
        if not pending or not self.writable:
            return
        try:
            size = _append(self.path, "".join(f"\n{k}" for k in pending).encode() + b"\n")
            if size > 2 * self.keep * _LINE:
                self._compact()
        except OSError as exc:
            self.writable = False
            warnings.warn(f"flexplan plan cache: cannot write the journal of seen keys {self.path} "
                          f"({exc}); remembering them in this process only", RuntimeWarning,
                          stacklevel=2)

    def __del__(self):  # a cache dropped before exit still hands in its sightings
        with contextlib.suppress(Exception):
            self._flush(time.monotonic())

    def _compact(self) -> None:
        """Rewrite the journal with its newest `keep` distinct keys, atomically."""
        keys = _read_keys(self.path, 4 * self.keep * _LINE)
        newest = list(dict.fromkeys(reversed(keys)))[: self.keep][::-1]
        with atomic_write(self.path, prefix=".tmp-seen-") as out:
            out.write("".join(f"{k}\n" for k in newest).encode())

    # ---- maintenance -----------------------------------------------------------------------
    def journal_keys(self) -> int:
        """Distinct valid keys in the journal file (reads it)."""
        return len(set(_read_keys(self.path, 4 * self.keep * _LINE)))

    def stats(self) -> dict:
        try:
            size = os.stat(self.path).st_size
        except OSError:
            size = 0
        return {"seen_keys": len(self._seen), "journal_bytes": size, "journal_writable": self.writable}

    def clear(self) -> None:
        """Forget every sighting and remove the journal."""
        with self._lock:
            self._seen.clear()
            self._pending.clear()
            self._read_to, self._last_look = (None, 0), float("-inf")
            with contextlib.suppress(OSError):
                self.path.unlink()


# ---- exit and fork -------------------------------------------------------------------------
_live: weakref.WeakSet[SeenKeys] = weakref.WeakSet()
_hooked_pid: int | None = None


def flush_all() -> None:
    for seen in list(_live):
        seen.flush()


def _flush_at_exit() -> None:
    """Register flush_all once per process: atexit, and multiprocessing's exit hook (its children,
    DataLoader workers included, end with os._exit and skip atexit)."""
    global _hooked_pid
    if _hooked_pid != os.getpid():
        _hooked_pid = os.getpid()
        atexit.register(flush_all)
        multiprocessing.util.Finalize(None, flush_all, exitpriority=0)


def _after_fork_in_child() -> None:
    # A forked child starts with fresh locks and no pending keys (the parent appends those).
    for seen in list(_live):
        seen._lock = threading.Lock()
        seen._pending = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
