"""Files written whole or not at all: the one atomic-write helper (plan files, saved plans, the
journal of seen keys, tuned tables).

A reader of the path sees the old file or the new one, never a part: the data goes to a temp
file in the same directory (same filesystem, so the rename is atomic) and os.replace puts it in
place once the block ends without an error; otherwise the temp file is removed and the error
goes on. Temp names start with the given prefix, so a directory listing can skip writes in
progress. Imports nothing from flexplan.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", prefix: str = ".tmp-",
                 suffix: str = "", permissions: int | None = None) -> Iterator[IO]:
    """Open a temp file beside `path` for writing (mode "wb" or "w"); on a clean exit it
    replaces `path`. permissions: the file's mode bits (default mkstemp's 0600: only the owner
    reads it)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=suffix)
    try:
        if permissions is not None:
            os.fchmod(fd, permissions)
        with os.fdopen(fd, mode) as out:
            yield out
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
