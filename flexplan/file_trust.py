"""Whether a file or directory flexplan reads from its cache may be trusted (like ssh's
StrictModes): only what no other user can write. The plan cache's disk layer and the native
launcher's library (launch_native) ask here."""
from __future__ import annotations

import os
import stat
from pathlib import Path


def untrusted_reason(path: Path) -> str | None:
    """Why what is under `path` (a directory or a file: plans, the native launcher's library)
    must not be read: another user can write it. None where it is ours (or root's) and not
    group- or world-writable, or does not exist yet (then we create it). No check where the OS
    has no user ids."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not hasattr(os, "getuid"):
        return None
    if st.st_uid not in (os.getuid(), 0):
        return f"it is owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users can write it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None
