"""`python -m flexplan doctor`: this device, its AOT target, Triton, how bundle binaries are
launched, the bundles found, and which kernel variants will run precompiled vs be JIT-compiled here."""
from __future__ import annotations

import argparse
import os
from collections import Counter


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
    args = parser.parse_args(argv)

    import torch
    import triton

    from ..launcher import AOT_ENV
    from . import direct, runtime
    from .keys import gpu_target, target_name, triton_version

    device, target = _device_target()
    if args.target:
        target = gpu_target(args.target)
    print(f"device:  {device}")
    print(f"target:  {target_name(target) if target else '-'}")
    print(f"torch:   {torch.__version__}   Triton: {triton_version()}   "
          f"interpreter: {os.environ.get('TRITON_INTERPRET', '0') == '1'}   "
          f"{AOT_ENV}={os.environ.get(AOT_ENV, '1')}")
    why_not_direct = direct.unavailable()
    print("launch:  " + ("direct (CUDA driver API through ctypes; no host compiler)" if why_not_direct is None
                         else f"Triton's launcher ({why_not_direct})"))
    runtime.reset()
    bundles = runtime.bundle_summary()
    if not bundles:
        print("bundles: none found (build with `python -m aot --install`, or set FLEXPLAN_AOT_PATH)")
    for root, version, count in bundles:
        state = "usable" if version == triton.__version__ else f"refused (Triton {version})"
        print(f"bundle:  {root}  {count} binaries  {state}")
    if target is None:
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("interpreter mode: kernels are interpreted, nothing is compiled")
        return 0
    tname = target_name(target)
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


def _unbuilt_variants(tname: str, index: dict) -> Counter:
    """Registry variants whose key no bundle has for this target."""
    from .specialize import Specializer
    from .variants import enumerate_variants

    specializer, missing, seen = Specializer(tname), Counter(), set()
    for variant in enumerate_variants():
        key = specializer.spec(variant)["key"]
        if key not in seen:
            seen.add(key)
            missing[variant.kernel] += key not in index
    return +missing
