"""What `python -m aot` says when a build ends: failed variants, then binaries, size and time."""
from __future__ import annotations

import json
from pathlib import Path


def manifest_of(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def failure_lines(manifest: dict, shown: int = 5) -> list[str]:
    failed = manifest.get("failed", [])
    lines = [f"aot: {e['target']} {e['kernel']} {e['key']}: does not compile: {e['error']}"
             for e in failed[:shown]]
    if failed:
        lines.append(f"aot: {len(failed)} variants do not compile with this Triton (left to the "
                     "JIT; listed under 'failed' in manifest.json)")
    return lines


def bundle_bytes(out: Path, manifest: dict) -> int:
    """Bytes of the files the manifest lists (binaries and their metadata) and of itself."""
    total = (out / "manifest.json").stat().st_size
    for entry in manifest["entries"]:
        total += sum((out / entry[name]).stat().st_size for name in ("file", "metadata"))
    return total


def summary_line(out: Path, seconds: float) -> str:
    manifest = manifest_of(out)
    per_target = {}
    for entry in manifest["entries"]:
        per_target[entry["target"]] = per_target.get(entry["target"], 0) + 1
    targets = ", ".join(f"{t} {n}" for t, n in sorted(per_target.items())) or "none"
    return (f"aot: {len(manifest['entries'])} binaries ({targets}), "
            f"{bundle_bytes(out, manifest) / 1e6:.1f} MB, {seconds:.0f} s; Triton "
            f"{manifest['triton_version']}, in {out}")
