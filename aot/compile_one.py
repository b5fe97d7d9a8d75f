"""One ninja edge: compile one variant spec for its target; write binary, metadata and entry.

    python -m aot.compile_one SPEC.json ENTRY.json --triton-version V --source-hash H

The version and source hash sit on the command line so that ninja rebuilds the edge when either
changes. Kept light: flexplan's package imports its names lazily, so the kernel module comes
without torch (ninja starts one such process per artifact). Under `python -m aot` the edge
imports no Triton at all: it hands its arguments to the warm compile server
(aot/compile_server.py), whose forked child runs compile_spec below; without one it compiles here.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the build compiles; it never interprets
# Triton 3.9 warns once per process about its FP-fusion default; here that is once per edge.
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")


def _import_kernel(spec: dict):
    return getattr(importlib.import_module(spec["module"]), spec["attr"])


def read_spec(path: str) -> dict:
    return json.loads(Path(path).read_text())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compile_spec(spec: dict, entry_path: Path) -> dict:
    import triton
    from triton.compiler import ASTSource

    from flexplan.aot.keys import BINARY_EXT, TARGETS, gpu_target, source_hash
    from flexplan.aot.kernel_params import ptx_param_bytes

    fn = _import_kernel(spec)
    if source_hash(fn) != spec["source_hash"]:
        raise SystemExit(f"{spec['kernel']}: source changed since build.ninja was written; rerun `python -m aot`")
    if triton.__version__ != spec["triton_version"]:
        raise SystemExit(f"spec is for Triton {spec['triton_version']}, this is {triton.__version__}; rerun `python -m aot`")
    constants = {tuple(path): value for path, value in spec["constants"]}
    attrs = {tuple(path): value for path, value in spec["compile_attrs"]}
    src = ASTSource(fn, spec["signature"], constants, attrs)
    entry = {k: spec[k] for k in ("key", "kernel", "target", "triton_version", "source_hash",
                                  "signature", "constants", "attrs", "launch_options")}
    try:
        compiled = triton.compile(src, target=gpu_target(spec["target"]), options=spec["launch_options"])
    except Exception as exc:  # deterministic: recorded so the build goes on and is not retried
        compiled = None
        entry["error"] = _short_error(exc)

    ext = BINARY_EXT[TARGETS[spec["target"]][0]]
    out_dir = entry_path.parent
    binary = out_dir / f"{spec['key']}.{ext}"
    metadata = out_dir / f"{spec['key']}.json"
    if compiled is None:
        # Empty placeholders keep the edge's outputs complete (a no-op rebuild stays a no-op);
        # the manifest lists failed entries apart, without files.
        binary.write_bytes(b"")
        metadata.write_bytes(b"")
        _write_json(entry_path, entry)
        return entry
    binary.write_bytes(compiled.kernel)
    if "ptx" in compiled.asm:  # CUDA: the parameter sizes the direct launcher checks its layout against
        entry["param_bytes"] = ptx_param_bytes(compiled.asm["ptx"], compiled.name)
    meta_src = next(p for name, p in compiled.metadata_group.items() if name.endswith(".json"))
    shutil.copyfile(meta_src, metadata)
    bundle_root = entry_path.parent.parent.parent  # <root>/<target>/<kernel>/<key>.entry.json
    entry.update(file=str(binary.relative_to(bundle_root)), sha256=_sha256(binary),
                 metadata=str(metadata.relative_to(bundle_root)), metadata_sha256=_sha256(metadata))
    _write_json(entry_path, entry)
    return entry


def _short_error(exc: BaseException) -> str:
    """One line. Triton's CompilationError puts a source excerpt first and nests the reason."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    reason = getattr(exc, "error_message", None)
    if not reason:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip().strip("^")]
        reason = lines[-1] if lines else ""
    return f"{exc.__class__.__name__}: {reason}"[:300]


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True, indent=1))
    tmp.replace(path)  # the entry appears last: ninja sees a finished artifact or none


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aot.compile_one")
    parser.add_argument("spec")
    parser.add_argument("entry")
    parser.add_argument("--triton-version", required=True)
    parser.add_argument("--source-hash", required=True)
    args = parser.parse_args(argv)
    from aot.compile_server import compile_remotely

    if not compile_remotely(args.spec, args.entry):
        compile_spec(read_spec(args.spec), Path(args.entry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
