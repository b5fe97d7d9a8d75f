"""AOT bundles on disk: where they are searched, how a manifest is validated, installing one.

A bundle is a directory with manifest.json and the binaries it lists (see aot/). Searched, in
order: the directories in $FLEXPLAN_AOT_PATH (os.pathsep-separated), every bundle under the user
cache (flexplan.paths.aot_cache_dir()), and bundles shipped inside the wheel
(flexplan/aot/bundles/*, package data).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..paths import aot_cache_dir
from .keys import MANIFEST_FORMAT, MANIFEST_NAME, triton_version

log = logging.getLogger("flexplan.aot")

AOT_PATH_ENV = "FLEXPLAN_AOT_PATH"
SHIPPED_DIR = Path(__file__).parent / "bundles"


@dataclass
class Bundle:
    root: Path
    triton_version: str | None
    entries: list[dict]
    problem: str | None = None  # why the bundle is refused; None when usable

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
    for parent in (aot_cache_dir(), SHIPPED_DIR):
        if parent.is_dir():
            dirs += sorted(p for p in parent.iterdir() if (p / MANIFEST_NAME).is_file())
    return dirs


def read_bundle(root: Path) -> Bundle:
    """The bundle at root; `problem` says why it cannot be used (never raises for bad files)."""
    path = root / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
        version, entries, fmt = manifest["triton_version"], manifest["entries"], manifest["format"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Bundle(root, None, [], f"{path}: unreadable manifest ({exc.__class__.__name__}: {exc})")
    if fmt != MANIFEST_FORMAT:
        return Bundle(root, version, [], f"{path}: manifest format {fmt}, this flexplan reads {MANIFEST_FORMAT}")
    if version != triton_version():
        return Bundle(root, version, [], (
            f"{path}: built with Triton {version}, but this is Triton {triton_version()}; its binaries "
            f"are not used (rebuild it with `python -m aot` under this Triton)"))
    if not isinstance(entries, list):
        return Bundle(root, version, [], f"{path}: malformed manifest ('entries' is not a list)")
    malformed = sum(not _entry_well_formed(e) for e in entries)
    if malformed:  # a manifest that fails its schema is not trusted in part: refused whole
        return Bundle(root, version, [], f"{path}: malformed manifest ({malformed} of "
                                         f"{len(entries)} entries fail the schema)")
    return Bundle(root, version, list(entries))


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
