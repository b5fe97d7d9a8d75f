"""Disk layer: one file per plan in a directory shared by every process of the user.

Readers take no lock: writers publish with os.replace, so a reader sees a whole old file, a whole
new one, or none. Builders take a per-key file lock so that N processes asking for the same
missing plan build it once; the others wait, then load. The directory is kept under a byte cap
by evicting the least recently used files (hits touch mtime, which survives noatime mounts).
A directory that cannot be written (read-only, full, no permission, any write, eviction or lock
error) turns the writes off with one warning; reading and convolving go on.

Trust boundary (like ssh's StrictModes): plans are read only from a directory, and files, that no
other user can write: owned by this user (or root) and not writable by group or others. Otherwise
the disk layer is off for that directory, said once, and plans live in memory.
"""
from __future__ import annotations

import contextlib
import os
import stat
import time
import warnings
from pathlib import Path

import filelock

from ..atomic_write import atomic_write
from ..file_trust import untrusted_reason
from .format import SUFFIX, PlanFileError, read_plan, write_plan
from .key import identity_binding_problem

# A build takes seconds at most: a lock held this long belongs to a stuck (or huge) builder, so
# build anyway rather than hang; past LOCK_NOTICE_S the wait is said once, with the lock's path.
LOCK_TIMEOUT_S = 120.0
LOCK_NOTICE_S = 5.0
_TEMP_PREFIX = ".tmp-"
_STALE_TEMP_S = 3600.0  # temp files of crashed writers older than this are removed by eviction


class DiskCache:
    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)
        self.writable = True
        self.errors = 0
        self._trust = None  # None: not checked yet; else the reason to distrust it, or ""

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    @property
    def trusted(self) -> bool:
        """May plans be read from (and written to) this directory? Checked once per process;
        an untrusted directory turns the disk layer off with one warning."""
        if self._trust is None:
            reason = untrusted_reason(self.directory)
            self._trust = reason or ""
            if reason:
                self.writable = False
                warnings.warn(f"flexplan plan cache: not using {self.directory}: {reason}, so "
                              "its plan files cannot be trusted; keeping plans in memory only "
                              "(use a directory only you can write: chmod go-w, or set "
                              "FLEXPLAN_CACHE_DIR)", RuntimeWarning, stacklevel=4)
        return not self._trust

    # ---- reading -------------------------------------------------------------------------
    def load(self, key: str, device, accept=None):
        """(plan, header), (None, header) if accept declined, or (None, None) if absent (or the
        directory is not trusted).

        Raises PlanFileError for a corrupt, truncated, foreign or other-user-writable file.
        """
        if not self.trusted:
            return None, None
        path = self.path(key)
        try:
            _require_regular_file(path)
            plan, header = read_bound_plan(path, device, key, accept)
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
        """Any error of a write, a lock or an eviction (full, read-only, EFBIG, EPERM, EISDIR,
        ...) turns the writes off for this directory, with one warning: never into a conv."""
        self._disable(exc)
        return True

    @contextlib.contextmanager
    def build_lock(self, key: str):
        """Held while building `key`; a no-op where locks cannot be created."""
        if not self.writable or not self.trusted:
            yield
            return
        try:
            lock_dir = self.directory / "locks"
            lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
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
        if not self.writable or not self.trusted:
            return False
        try:
            # 0700: only we may write where plans are read from (the trust boundary above)
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with atomic_write(self.path(key), prefix=_TEMP_PREFIX, suffix=SUFFIX) as out:
                write_plan(out, plan, key, extra)
        except OSError as exc:
            if not self._writable_error(exc):
                raise
            return False
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
            except OSError as exc:  # not ours to remove: skip it, and write no more here
                self._writable_error(exc)
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
    """Raise PlanFileError unless path is a regular file that no other user can write: opening a
    FIFO by a plan's name would block forever, a directory is no plan, and another user's file
    is not to be trusted."""
    reason = untrusted_reason(path)
    if reason:
        raise PlanFileError(f"{path}: {reason}")
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise PlanFileError(f"{path} is not a regular file")


def read_bound_plan(path, device, key: str, accept=None):
    """format.read_plan of the file of `key`, which must also bind to it: its recorded input
    coordinates' identity hashes to the key (key.identity_binding_problem); PlanFileError else."""
    plan, header = read_plan(path, device, expect_key=key, accept=accept)
    if plan is not None:
        try:
            problem = identity_binding_problem(key, header, plan)
        except (TypeError, ValueError) as exc:  # scalars of the wrong type in the header
            raise PlanFileError(f"header does not describe a valid plan: {exc!r}") from None
        if problem is not None:
            raise PlanFileError(problem)
    return plan, header


def verify_file(path: str | os.PathLike) -> str | None:
    """None if the file loads and checks out, else what is wrong with it."""
    try:
        _require_regular_file(Path(path))
        read_bound_plan(path, "cpu", Path(path).name.removesuffix(SUFFIX))
    except PlanFileError as exc:
        return str(exc)
    except OSError as exc:
        return f"unreadable: {exc}"
    return None


__all__ = ["DiskCache", "PlanFileError", "verify_file"]
