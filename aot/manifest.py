"""The last ninja edge: merge the per-artifact entries into the bundle's manifest.json.

    python -m aot.manifest BUNDLE_DIR ENTRY_LIST_FILE
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def write_manifest(bundle: Path, entry_files: list[str]) -> Path:
    from flexplan.aot.keys import MANIFEST_FORMAT, MANIFEST_NAME

    entries = [json.loads((bundle / f).read_text()) for f in entry_files]
    order = lambda e: (e["target"], e["kernel"], e["key"])  # noqa: E731
    versions = sorted({e["triton_version"] for e in entries})
    if len(versions) > 1:
        raise SystemExit(f"entries from several Triton versions {versions}; rebuild with one")
    manifest = {
        "format": MANIFEST_FORMAT,
        "triton_version": versions[0] if versions else None,
        "targets": sorted({e["target"] for e in entries}),
        "entries": sorted((e for e in entries if "error" not in e), key=order),
        "failed": sorted((e for e in entries if "error" in e), key=order),
    }
    path = bundle / MANIFEST_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, sort_keys=True))
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bundle, listing = Path(argv[0]), Path(argv[1])
    write_manifest(bundle, listing.read_text().split())
    return 0


if __name__ == "__main__":
    sys.exit(main())
