"""`python -m flexplan doctor`: this device, its AOT target, Triton, how bundle binaries are
launched, the bundles found (and whether they serve this GPU), and which kernel variants will run
precompiled vs be JIT-compiled here. With --workload: run a workload on the GPU, then say which
of the kernel variants it launched came from a bundle and which were compiled, and why."""
from __future__ import annotations

import argparse
import os
from collections import Counter
from pathlib import Path

# --workload names: scripts of the source tree (scripts/ is not installed with the package).
WORKLOADS = {"e2e": "scripts/aot_workload.py"}
_SOURCE_TREE = Path(__file__).resolve().parents[2]


def _device_target():
    """(description, GPUTarget or None) of the current device."""
    import torch

    if not torch.cuda.is_available():
        return "no GPU (CPU only: kernels run through Triton's interpreter)", None
    from triton.runtime.driver import driver

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, driver.active.get_current_target()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexplan doctor", description=__doc__)
    parser.add_argument("--target", help="check for this target instead of the current GPU (e.g. sm_90)")
    parser.add_argument("--workload", help="run this on the GPU, then report where each launched "
                        f"kernel variant came from: {', '.join(WORKLOADS)} (scripts/e2e_networks.py's "
                        "networks, small batches) or a Python script's path")
    args = parser.parse_args(argv)

    import torch

    from ..launcher import AOT_ENV
    from . import direct, runtime
    from .keys import gpu_target, target_name, triton_version

    device, target = _device_target()
    if args.target:
        target = gpu_target(args.target)
    tname = target_name(target) if target else None
    print(f"device:  {device}")
    print(f"target:  {tname or '-'}")
    print(f"torch:   {torch.__version__}   Triton: {triton_version()}   "
          f"interpreter: {_interpreted()}   {AOT_ENV}={os.environ.get(AOT_ENV, '1')}")
    why_not_direct = direct.unavailable()
    print("launch:  " + ("direct (CUDA driver API through ctypes; no host compiler)" if why_not_direct is None
                         else f"Triton's launcher ({why_not_direct})"))
    print("native:  " + _native_state())
    runtime.reset()
    bundles = runtime.bundle_summary()
    if not bundles:
        print("bundles: none found (build with `python -m aot --install` or `--wheel`, or set "
              "FLEXPLAN_AOT_PATH)")
    for bundle in bundles:
        print(f"bundle:  {bundle.root}  {_bundle_state(bundle, tname)}")
    if args.workload:
        return _run_workload(args.workload)
    if target is None:
        return 0
    if _interpreted():
        print("interpreter mode: kernels are interpreted, nothing is compiled")
        return 0
    index = runtime.load_index()
    here = Counter(e["kernel"].rsplit(".", 1)[-1] for _, e in index.values() if e["target"] == tname)
    print(f"precompiled for {tname}: " + (", ".join(f"{k} x{n}" for k, n in sorted(here.items())) or "nothing"))
    missing = _unbuilt_variants(tname, index)
    if missing:
        print(f"JIT-compiled on first use here: {sum(missing.values())} variants of the registry ("
              + ", ".join(f"{k} x{n}" for k, n in sorted(missing.items())) + ")")
    else:
        print("JIT-compiled on first use here: none of the registry's variants")
    return 0


def _native_state() -> str:
    """The native launcher (flexplan/launch_native.py) as a process here finds it, without
    building it."""
    import torch
    import triton

    from .. import launch_native, launcher
    from .launch_abi import mirrors_triton_launcher

    if torch.version.hip:
        return "off (ROCm: Triton's launcher)"
    if not mirrors_triton_launcher():
        return f"off (Triton {triton.__version__}: it follows Triton 3.6's launcher)"
    native = launch_native.module(build=False)
    if native is None:
        return f"off ({launch_native.why_not})"
    bundles = "on" if launcher.NATIVE_BUNDLE_LAUNCHES else "off (launcher.NATIVE_BUNDLE_LAUNCHES)"
    return (f"{launch_native.library_path()} (JIT binaries' repeated launches; bundle "
            f"binaries' {bundles})")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _bundle_state(bundle, tname: str | None) -> str:
    """Whether a bundle serves this GPU: refused (another Triton, a bad manifest), usable but
    for other targets, or usable."""
    built_for = ",".join(bundle.targets) or "?"
    if bundle.problem:
        from .keys import triton_version

        if bundle.triton_version and bundle.triton_version != triton_version():
            return (f"for {built_for}  refused (Triton {bundle.triton_version}; this is "
                    f"Triton {triton_version()}: rebuild it under this one)")
        return f"refused ({bundle.problem})"
    state = f"{len(bundle.entries)} binaries for {built_for}  usable"
    if tname and bundle.targets and tname not in bundle.targets:
        state += f", but none for this target {tname} (its binaries serve other GPUs)"
    return state


def _unbuilt_variants(tname: str, index: dict) -> Counter:
    """Registry variants of this target whose key no bundle has."""
    from .specialize import Specializer
    from .variants import enumerate_variants

    specializer, missing, seen = Specializer(tname), Counter(), set()
    for variant in enumerate_variants(targets=[tname]):
        key = specializer.spec(variant)["key"]
        if key not in seen:
            seen.add(key)
            missing[variant.kernel] += key not in index
    return +missing


def _run_workload(name: str) -> int:
    """Run a workload script as __main__ on the GPU and print served.report_lines()."""
    import runpy
    import sys

    import torch

    from . import runtime, served

    if not torch.cuda.is_available() or _interpreted():
        print("workload: needs a GPU (without one kernels run through Triton's interpreter, which "
              "loads no binary and compiles nothing: there is nothing to report)")
        return 1
    path = _SOURCE_TREE / WORKLOADS[name] if name in WORKLOADS else Path(name)
    if not path.is_file():
        print(f"workload: {path} not found (the {name!r} workload is a script of flexplan's source "
              "tree; pass a script's path instead)")
        return 1
    runtime.reset()
    served.clear()
    argv = sys.argv
    sys.argv = [str(path)]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:  # a script's exit ends the workload, not the report
        if done.code not in (None, 0):
            print(f"workload: {path} exited with {done.code}")
    finally:
        sys.argv = argv
    torch.cuda.synchronize()
    print(f"workload: {path}")
    for line in served.report_lines(served.records()):
        print(line)
    return 0
