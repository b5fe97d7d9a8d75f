"""AOT bundles on disk: where they are searched, how a manifest is validated, installing one.

A bundle is a directory with manifest.json and the binaries it lists (see aot/). Searched, in
order: the directories in $FLEXPLAN_AOT_PATH (os.pathsep-separated), every bundle under the user
cache (flexplan.paths.aot_cache_dir()), bundles installed as packages (`python -m aot --wheel`:
each names its package in the entry point group flexplan.aot_bundles), and bundles shipped
inside flexplan's own wheel (flexplan/aot/bundles/*, package data).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..paths import aot_cache_dir
from .keys import MANIFEST_FORMAT, MANIFEST_NAME, triton_version

log = logging.getLogger("flexplan.aot")

AOT_PATH_ENV = "FLEXPLAN_AOT_PATH"
# Entry point group of installed bundle packages: name = the package holding manifest.json.
ENTRY_POINT_GROUP = "flexplan.aot_bundles"


@dataclass
class Bundle:
    root: Path
    triton_version: str | None
    entries: list[dict]
    problem: str | None = None  # why the bundle is refused; None when usable
    targets: tuple[str, ...] = ()  # what its manifest says it was built for

    def entry_files_ok(self, entry: dict) -> str | None:
        """None when the entry's binary and metadata match their sha256, else what is wrong."""
        for name, digest in ((entry["file"], entry["sha256"]), (entry["metadata"], entry["metadata_sha256"])):
            path = self.root / name
            try:
                actual = hashlib.sha256(path.read_bytes()).hexdigest()
            except OSError as exc:
                return f"{path}: unreadable ({exc.strerror})"
            if actual != digest:
                return f"{path}: damaged (sha256 mismatch)"
        return None


def bundle_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get(AOT_PATH_ENV, "").split(os.pathsep) if p]
    dirs += _bundles_under(aot_cache_dir())
    dirs += installed_bundle_dirs()
    return dirs + _bundles_under(paths.shipped_bundles_dir())


def _bundles_under(parent: Path) -> list[Path]:
    if not parent.is_dir():
        return []
    return sorted(p for p in parent.iterdir() if (p / MANIFEST_NAME).is_file())


def installed_bundle_dirs() -> list[Path]:
    """The directories of the bundle packages installed in this environment, found through
    their entry points without importing them."""
    from importlib.metadata import entry_points
    from importlib.util import find_spec

    dirs = []
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        try:
            spec = find_spec(point.module)
        except (ImportError, ValueError):  # a broken installation must not break the runtime
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            if (Path(location) / MANIFEST_NAME).is_file() and Path(location) not in dirs:
                dirs.append(Path(location))
    return dirs


def read_bundle(root: Path) -> Bundle:
    """The bundle at root; `problem` says why it cannot be used (never raises for bad files)."""
    path = root / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
        version, entries, fmt = manifest["triton_version"], manifest["entries"], manifest["format"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Bundle(root, None, [], f"{path}: unreadable manifest ({exc.__class__.__name__}: {exc})")
    targets = manifest.get("targets")
    targets = tuple(t for t in targets if isinstance(t, str)) if isinstance(targets, list) else ()
    if fmt != MANIFEST_FORMAT:
        return Bundle(root, version, [], f"{path}: manifest format {fmt}, this flexplan reads "
                                         f"{MANIFEST_FORMAT}", targets)
    if version != triton_version():
        return Bundle(root, version, [], (
            f"{path}: built with Triton {version}, but this is Triton {triton_version()}; its binaries "
            f"are not used (rebuild it with `python -m aot` under this Triton)"), targets)
    if not isinstance(entries, list):
        return Bundle(root, version, [], f"{path}: malformed manifest ('entries' is not a list)",
                      targets)
    malformed = sum(not _entry_well_formed(e) for e in entries)
    if malformed:  # a manifest that fails its schema is not trusted in part: refused whole
        return Bundle(root, version, [], f"{path}: malformed manifest ({malformed} of "
                                         f"{len(entries)} entries fail the schema)", targets)
    return Bundle(root, version, list(entries), targets=targets)


# The manifest fields every reader of an entry relies on (the runtime's index, the direct
# launcher, the integrity check, the installer), each a string.
_ENTRY_FIELDS = ("key", "kernel", "source_hash", "file", "sha256", "metadata", "metadata_sha256")


def _entry_well_formed(entry) -> bool:
    return isinstance(entry, dict) and all(isinstance(entry.get(f), str) for f in _ENTRY_FIELDS)


def install_bundle(built: Path) -> Path:
    """Copy a built bundle (manifest + the binaries it lists) into the user cache."""
    bundle = read_bundle(built)
    if bundle.problem:
        raise ValueError(bundle.problem)
    digest = hashlib.sha256((built / MANIFEST_NAME).read_bytes()).hexdigest()[:12]
    dest = aot_cache_dir() / f"triton-{bundle.triton_version}-{digest}"
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for entry in bundle.entries:
        for name in (entry["file"], entry["metadata"]):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(built / name, tmp / name)
    shutil.copyfile(built / MANIFEST_NAME, tmp / MANIFEST_NAME)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest
