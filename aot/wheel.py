"""`python -m aot --wheel`: a built bundle as installable wheels, one per target.

    flexplan_kernels_sm90-<flexplan version>+triton<version>.<digest>-py3-none-any.whl

holds the package flexplan_kernels_sm90: the bundle's manifest restricted to that target and
its binaries, as package data, and declares the package in the entry point group
flexplan.aot_bundles, through which the runtime finds it once installed
(flexplan.aot.bundle.installed_bundle_dirs; `python -m flexplan doctor` lists it). The runtime
still checks it as any bundle: another Triton version's is refused whole, another target's
binaries match no call. Pure Python (py3-none-any): GPU binaries do not depend on the host.
Written with zipfile (METADATA, WHEEL, RECORD by hand), so packing needs no build backend; the
wheel declares no dependencies (installing it must never change torch or Triton).
"""
from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path


ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed: the same bundle packs to the same bytes


def package_name(target: str) -> str:
    """flexplan_kernels_sm90 for sm_90, flexplan_kernels_gfx942 for gfx942."""
    return "flexplan_kernels_" + target.replace("_", "")


def _flexplan_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flexplan")
    except PackageNotFoundError:  # a source tree that is not installed
        return "0"


def wheel_version(manifest: dict, digest: str) -> str:
    """flexplan's version with a local label: the Triton version the binaries need and the
    manifest's digest (a rebuild is a new version: pip replaces the old one)."""
    return f"{_flexplan_version()}+triton{manifest['triton_version']}.{digest[:12]}"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _metadata(dist: str, version: str, target: str, manifest: dict) -> str:
    return (f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
            f"Summary: flexplan's ahead-of-time kernels for {target} "
            f"(Triton {manifest['triton_version']}, {len(manifest['entries'])} binaries)\n")


def _wheel_file() -> str:
    return "Wheel-Version: 1.0\nGenerator: flexplan aot\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def write_wheel(bundle: Path, target: str, dest: Path) -> Path:
    """Pack `target`'s part of the built bundle at `bundle` into a wheel in dest; its path."""
    from flexplan.aot.bundle import ENTRY_POINT_GROUP
    from flexplan.aot.keys import MANIFEST_NAME

    full = json.loads((bundle / MANIFEST_NAME).read_text())
    manifest = dict(full, targets=[target],
                    entries=[e for e in full["entries"] if e["target"] == target],
                    failed=[e for e in full.get("failed", []) if e["target"] == target])
    if not manifest["entries"]:
        raise SystemExit(f"aot: the bundle in {bundle} has no binary for {target}")
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    package = package_name(target)  # also the wheel's file and dist-info name
    version = wheel_version(manifest, hashlib.sha256(manifest_bytes).hexdigest())
    info = f"{package}-{version}.dist-info"
    files = {f"{package}/__init__.py": (
        f'"""flexplan\'s ahead-of-time kernels for {target}, Triton {manifest["triton_version"]}: '
        f'the runtime finds them through the {ENTRY_POINT_GROUP} entry point."""\n').encode(),
        f"{package}/{MANIFEST_NAME}": manifest_bytes}
    for entry in manifest["entries"]:
        for name in (entry["file"], entry["metadata"]):
            files[f"{package}/{name}"] = (bundle / name).read_bytes()
    files[f"{info}/METADATA"] = _metadata(package.replace("_", "-"), version, target, manifest).encode()
    files[f"{info}/WHEEL"] = _wheel_file().encode()
    files[f"{info}/entry_points.txt"] = f"[{ENTRY_POINT_GROUP}]\n{target} = {package}\n".encode()
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()

    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{package}-{version}-py3-none-any.whl"
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, data in files.items():  # the package, then dist-info, RECORD last
            member = zipfile.ZipInfo(name, ZIP_TIME)
            member.external_attr = 0o644 << 16
            member.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(member, data)
    tmp.replace(path)
    return path


def write_wheels(bundle: Path, dest: Path, targets: list[str] | None = None) -> list[Path]:
    """One wheel per target of the bundle (or of `targets`)."""
    from flexplan.aot.keys import MANIFEST_NAME

    built = json.loads((bundle / MANIFEST_NAME).read_text())
    present = sorted({e["target"] for e in built["entries"]})
    return [write_wheel(bundle, t, dest) for t in present if targets is None or t in targets]
