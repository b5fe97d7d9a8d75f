"""Where flexplan keeps files between runs: the one place that knows the cache directories.

Root: $FLEXPLAN_CACHE_DIR if set, else the per-user cache dir (platformdirs, e.g.
~/.cache/flexplan on Linux). Each kind of file has its own subdirectory and function; callers
create the directory when they write (a read-only or missing root must not break imports).
Also where the package ships its own files (tuned tables, AOT bundles), read-only.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

CACHE_DIR_ENV = "FLEXPLAN_CACHE_DIR"


def cache_root() -> Path:
    """Root of every flexplan cache; the variable is read at each call so tests and jobs can
    redirect it (the Path made of each value is kept: plan lookups ask on every build)."""
    return _root_of(os.environ.get(CACHE_DIR_ENV) or None)


@functools.lru_cache(maxsize=16)
def _root_of(override: str | None) -> Path:
    if override:
        return Path(override).expanduser()
    import platformdirs  # deferred: only needed when no override is set

    return Path(platformdirs.user_cache_dir("flexplan", appauthor=False))


def plan_cache_dir() -> Path:
    """Serialized execution plans (flexplan.cache)."""
    return _plans_of(cache_root())


@functools.lru_cache(maxsize=16)
def _plans_of(root: Path) -> Path:
    return root / "plans"


def aot_cache_dir() -> Path:
    """Ahead-of-time compiled kernel bundles (flexplan.aot)."""
    return cache_root() / "aot"


def native_launch_dir() -> Path:
    """The native launcher's compiled library, per source and Python (flexplan.launch_native)."""
    return cache_root() / "native"


def tuning_dir() -> Path:
    """Autotuned kernel-config tables (flexplan.tuning)."""
    return cache_root() / "tuning"


PACKAGE_DIR = Path(__file__).resolve().parent


def shipped_tables_dir() -> Path:
    """Tuned kernel-config tables shipped with the package, one JSON file per known GPU."""
    return PACKAGE_DIR / "tuning" / "tables"


def shipped_bundles_dir() -> Path:
    """AOT bundles shipped inside the package (none in a source checkout)."""
    return PACKAGE_DIR / "aot" / "bundles"
