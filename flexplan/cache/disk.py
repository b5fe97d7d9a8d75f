"""Disk layer: one file per plan in a directory shared by every process of the user.

Readers take no lock: writers publish with os.replace, so a reader sees a whole old file, a whole
new one, or none. Builders take a per-key file lock so that N processes asking for the same
missing plan build it once; the others wait, then load. The directory is kept under a byte cap
by evicting the least recently used files (hits touch mtime, which survives noatime mounts).
A directory that cannot be written (read-only, full, no permission) turns the writes off with one
warning; reading and convolving go on.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import time
import warnings
from pathlib import Path

import filelock

from .format import SUFFIX, PlanFileError, read_plan, write_plan

# A build takes seconds at most: a lock held this long belongs to a stuck (or huge) builder, so
# build anyway rather than hang; past LOCK_NOTICE_S the wait is said once, with the lock's path.
LOCK_TIMEOUT_S = 120.0
LOCK_NOTICE_S = 5.0
_TEMP_PREFIX = ".tmp-"
_STALE_TEMP_S = 3600.0  # temp files of crashed writers older than this are removed by eviction
# Errors that mean "this directory cannot take writes", as opposed to bugs.
_UNWRITABLE = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.ENOENT,
               errno.ENOTDIR, errno.EEXIST, errno.EFBIG}  # EFBIG: a file-size limit (RLIMIT_FSIZE)


class DiskCache:
    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)
        self.writable = True
        self.errors = 0

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    # ---- reading -------------------------------------------------------------------------
    def load(self, key: str, device, accept=None):
        """(plan, header), (None, header) if accept declined, or (None, None) if absent.

        Raises PlanFileError for a corrupt, truncated or foreign file.
        """
        path = self.path(key)
        try:
            _require_regular_file(path)
            plan, header = read_plan(path, device, expect_key=key, accept=accept)
        except FileNotFoundError:
            return None, None
        if plan is not None:
            with contextlib.suppress(OSError):
                os.utime(path)  # LRU recency; a read-only directory just keeps the old time
        return plan, header

    def remove(self, key: str) -> None:
        with contextlib.suppress(OSError):
            self.path(key).unlink()

    # ---- writing -------------------------------------------------------------------------
    def _disable(self, exc: OSError) -> None:
        self.errors += 1
        if self.writable:
            self.writable = False
            warnings.warn(f"flexplan plan cache: cannot write to {self.directory} ({exc}); "
                          "keeping plans in memory only for this process", RuntimeWarning, stacklevel=4)

    def _writable_error(self, exc: OSError) -> bool:
        if exc.errno in _UNWRITABLE or isinstance(exc, PermissionError):
            self._disable(exc)
            return True
        return False

    @contextlib.contextmanager
    def build_lock(self, key: str):
        """Held while building `key`; a no-op where locks cannot be created."""
        if not self.writable:
            yield
            return
        try:
            lock_dir = self.directory / "locks"
            lock_dir.mkdir(parents=True, exist_ok=True)
            # 256 lock stripes by key prefix: a bounded set of lock files that are never deleted
            # (deleting a lock file others hold breaks exclusion); a shared stripe only delays.
            lock = filelock.FileLock(str(lock_dir / f"{key[:2]}.lock"))
            if not _acquire(lock, key):
                yield
                return
        except OSError as exc:
            if not self._writable_error(exc):
                raise
            yield
            return
        try:
            yield
        finally:
            lock.release()

    def store(self, key: str, plan, extra: dict | None = None) -> bool:
        """Write the plan atomically; False (and writes off) if the directory refuses."""
        if not self.writable:
            return False
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=_TEMP_PREFIX, suffix=SUFFIX)
            with os.fdopen(fd, "wb") as out:
                write_plan(out, plan, key, extra)
            os.replace(tmp, self.path(key))
            tmp = None
        except OSError as exc:
            if not self._writable_error(exc):
                raise
            return False
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        self.evict(self.max_bytes)
        return True

    # ---- maintenance ---------------------------------------------------------------------
    def entries(self) -> list[tuple[Path, int, float]]:
        """(path, bytes, mtime) of every plan file, least recently used first."""
        found = []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.scandir(self.directory):
                if entry.name.endswith(SUFFIX) and not entry.name.startswith(_TEMP_PREFIX):
                    with contextlib.suppress(OSError):
                        if not entry.is_file(follow_symlinks=False):
                            continue  # a directory, FIFO or link by that name: not ours
                        st = entry.stat(follow_symlinks=False)
                        found.append((Path(entry.path), st.st_size, st.st_mtime))
        return sorted(found, key=lambda e: e[2])

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self, max_bytes: int) -> list[Path]:
        """Remove least recently used files until the rest fit in max_bytes; returns the removed."""
        removed = []
        files = self.entries()
        total = sum(size for _, size, _ in files)
        for path, size, _ in files:
            if total <= max_bytes:
                break
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:  # another process evicted it first
                pass
            except OSError:  # not ours to remove (another user's, in a sticky directory): skip
                continue
            total -= size
        self._remove_stale_temps()
        return removed

    def _remove_stale_temps(self) -> None:
        now = time.time()
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory):
                if entry.name.startswith(_TEMP_PREFIX):
                    with contextlib.suppress(OSError):
                        if now - entry.stat().st_mtime > _STALE_TEMP_S:
                            os.unlink(entry.path)

    def clear(self) -> int:
        """Remove every plan file; returns how many."""
        return len(self.evict(0))


def _acquire(lock: filelock.FileLock, key: str) -> bool:
    """Take a build lock, saying so once if another process holds it for long; False when it
    is still held after LOCK_TIMEOUT_S (then the caller builds without it)."""
    try:
        lock.acquire(timeout=LOCK_NOTICE_S)
        return True
    except filelock.Timeout:
        warnings.warn(f"flexplan plan cache: another process has been building plan {key} for "
                      f"{LOCK_NOTICE_S:.0f} s (lock {lock.lock_file}); waiting up to "
                      f"{LOCK_TIMEOUT_S:.0f} s, then building here", RuntimeWarning, stacklevel=4)
    try:
        lock.acquire(timeout=max(LOCK_TIMEOUT_S - LOCK_NOTICE_S, 0.0))
        return True
    except filelock.Timeout:
        return False


def _require_regular_file(path: Path) -> None:
    """Raise PlanFileError unless path is a regular file: opening a FIFO by a plan's name would
    block forever, and a directory is no plan."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise PlanFileError(f"{path} is not a regular file")


def verify_file(path: str | os.PathLike) -> str | None:
    """None if the file loads and checks out, else what is wrong with it."""
    try:
        _require_regular_file(Path(path))
        read_plan(path, "cpu", expect_key=Path(path).name.removesuffix(SUFFIX))
    except PlanFileError as exc:
        return str(exc)
    except OSError as exc:
        return f"unreadable: {exc}"
    return None


__all__ = ["DiskCache", "PlanFileError", "verify_file"]
