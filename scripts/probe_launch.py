"""Host cost of one repeated kernel launch through flexplan.launcher.launch, piece by piece:
the whole call, the class key, the hook check, the stream lookup, the launcher itself, and a
small torch launch for scale (medians of --reps timed loops of --calls calls).

Usage (GPU): python3 scripts/probe_launch.py [--reps 20] [--calls 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from flexplan import launcher
from flexplan import plan as plan_module
from flexplan.plan import PendingCount
from flexplan.aot import direct
from flexplan.launch_spec import UNREAD_ADDRESS
from flexplan.planner.segments_triton import launch_gray_rank
from flexplan.planner.segments_torch import rank_words


def per_call_us(fn, reps: int, calls: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _python_path(kernel, grid, a, c) -> None:
    launcher.NATIVE_LAUNCHES = False
    try:
        launcher.launch(kernel, grid, *a, **c)
    finally:
        launcher.NATIVE_LAUNCHES = True


def _with_tensors(kernel, grid, a, c) -> None:
    launcher.TENSORS_AS_ADDRESSES = launcher.NATIVE_LAUNCHES = False
    try:
        launcher.launch(kernel, grid, *a, **c)
    finally:
        launcher.TENSORS_AS_ADDRESSES = launcher.NATIVE_LAUNCHES = True


_STATIC_TYPES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I",
                 "u8": "B", "u16": "H", "u32": "I", "u64": "K", "fp16": "f", "bf16": "f",
                 "fp32": "f", "f32": "f", "fp64": "d"}


def static_launch(compiled, args: tuple, grid: tuple):
    """A launch of `compiled` through torch's precompiled launcher for Triton cubins
    (torch._C._StaticCudaLauncher, what Inductor uses; a private API), or the reason it cannot."""
    import tempfile
    try:
        impl = torch._C._StaticCudaLauncher
    except AttributeError as exc:
        return str(exc)
    signature = list(compiled.src.signature.values())
    tys, kept = "", []
    for ty, arg in zip(signature, args):
        if ty == "constexpr":
            continue
        tys += "O" if ty.startswith("*") else _STATIC_TYPES[ty]
        kept.append(arg)
    for name in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(compiled.metadata, name):
            if getattr(compiled.metadata, name) > 0:
                return f"{name} > 0"
            tys += "O"
            kept.append(None)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    loaded = impl._load_kernel(f.name, compiled.metadata.name, compiled.metadata.shared,
                               torch.cuda.current_device())
    function = loaded[1] if len(loaded) == 4 else loaded[0]
    warps, shared, kept = compiled.metadata.num_warps, compiled.metadata.shared, tuple(kept)
    gx, gy, gz = (*grid, 1, 1)[:3]
    stream = torch.cuda.current_stream().cuda_stream
    launch_kernel = impl._launch_kernel

    def run():
        launch_kernel(function, gx, gy, gz, warps, shared, tys, kept, stream)
    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    device = torch.device("cuda")
    n, v = 4096, 27
    nmap = torch.randint(-1, n, (n, v), dtype=torch.int32, device=device)
    word_bits, word_dtype, words = rank_words(v)
    ranks = torch.empty(n, dtype=word_dtype, device=device)
    counts = torch.empty(v * n, dtype=torch.int32, device=device)

    recorded = {}

    def recording_run(kernel, grid, *a, **c):
        recorded.update(kernel=kernel, grid=grid, args=a, constexprs=c)
        launcher.launch(kernel, grid, *a, **c)

    launch_gray_rank(recording_run, nmap, ranks, counts, n, UNREAD_ADDRESS, 14, n, v, words,
                     word_bits)
    kernel, grid, a, c = (recorded[k] for k in ("kernel", "grid", "args", "constexprs"))
    dev = torch._C._cuda_getDevice()
    key = launcher._call_key(kernel, dev, a, c)
    run, tail = launcher._calls[key]
    full = a + tail
    addressed = launcher._call_class(kernel, dev, a, c)[1] + tail
    stream = direct.current_stream(dev)
    x = torch.empty(16, device=device)
    count = torch.zeros(1, dtype=torch.int64, device=device)
    pinned, event = plan_module._pinned_slot(count.dtype), torch.cuda.Event()
    compiled = kernel[grid](*a, **c)
    static = static_launch(compiled, addressed, grid) if compiled is not None else "no binary"
    if callable(static):  # same results as Triton's launch
        ranks_before = ranks.clone()
        ranks.zero_()
        static()
        torch.cuda.synchronize()
        print("static launcher output equal:", torch.equal(ranks, ranks_before))
    else:
        print("static launcher unavailable:", static)
    rows = [
        ("launch_gray_rank(launch, ...)", lambda: launch_gray_rank(
            launcher.launch, nmap, ranks, counts, n, UNREAD_ADDRESS, 14, n, v, words, word_bits)),
        ("launcher.launch(kernel, grid, *args)", lambda: launcher.launch(kernel, grid, *a, **c)),
        ("  the same, Python path (NATIVE_LAUNCHES off)", lambda: _python_path(kernel, grid, a, c)),
        ("  the same, tensors (TENSORS_AS_ADDRESSES off)", lambda: _with_tensors(kernel, grid, a, c)),
        ("_call_key", lambda: launcher._call_key(kernel, dev, a, c)),
        ("_calls.get(key)", lambda: launcher._calls.get(key)),
        ("direct.triton_hooks_set", lambda: direct.triton_hooks_set(kernel)),
        ("direct.current_stream", lambda: direct.current_stream(dev)),
        ("torch._C._cuda_getDevice", torch._C._cuda_getDevice),
        ("args + tail", lambda: a + tail),
        ("_call_class", lambda: launcher._call_class(kernel, dev, a, c)),
        ("run(grid, stream, args), tensors", lambda: run(grid, stream, full)),
        ("run(grid, stream, args), addresses", lambda: run(grid, stream, addressed)),
        ("kernel[grid](*args) (Triton's own)", lambda: kernel[grid](*a, **c)),
        *([("torch._C._StaticCudaLauncher, addresses", static)] if callable(static) else []),
        ("torch: x.fill_(1.0)", lambda: x.fill_(1.0)),
        ("PendingCount(count)", lambda: PendingCount(count)),
        ("  plan._pinned_slot", lambda: plan_module._pinned_slot(count.dtype)),
        ("  pinned.copy_(count, non_blocking=True)", lambda: pinned.copy_(count, non_blocking=True)),
        ("  torch.cuda.Event()", torch.cuda.Event),
        ("  event.record()", lambda: event.record()),
        ("torch: torch.empty(16)", lambda: torch.empty(16, device=device)),
    ]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name, fn in rows:
        print(f"  {name:40s} {per_call_us(fn, args.reps, args.calls):7.2f} us")


if __name__ == "__main__":
    main()
