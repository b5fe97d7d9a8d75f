"""Host time inside named flexplan functions during fresh-coordinate steps: each function is
wrapped (in every flexplan module that imported it, and on its class for methods) by a clock
of its inclusive host time; no synchronization is added inside the step. Reports calls and
host microseconds per step and per call, for bench_e2e's networks. Unlike cProfile, the
rest of the step runs at full speed.

Usage (GPU): python3 scripts/probe_host_parts.py [--network unet] [--phase train] [--mode fp16]
             [--steps 20] [--warmup 10] [--coords fresh|same] [--funcs module:qualname,...]
             [--key-twice]
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-parts-"))

from bench_e2e import MODES  # noqa: E402
from profile_host import NETS, lidar_batches, network_setup, step_fn  # noqa: E402

FUNCS = (
    "flexplan.plan_prefetch:_prefetch",
    "flexplan.cache.plan_cache:PlanCache.get_or_build",
    "flexplan.cache.plan_cache:PlanCache._build",
    "flexplan.planner:_build_plan",
    "flexplan.planner.hashmap:submanifold_neighbor_map_triton",
    "flexplan.planner.segments_triton:plan_schedule_triton",
    "flexplan.planner.generative_triton:generative_plan_triton",
    "flexplan.planner.generative_triton:transposed_gather_map",
    "flexplan.planner.rank_sort:rank_sorter",
    "flexplan.planner.rank_sort:CapturedSort.sort",
    "flexplan.planner.rank_sort:TorchSort.sort",
    "flexplan.plan_provider:tensor_plan",
    "flexplan.ops.conv:sparse_conv",
    "flexplan.ops.conv:SparseConvFunction.backward",
    "flexplan.ops.conv:gather_gemm",
    "flexplan.ops.conv:wgrad",
    "flexplan.launcher:launch",
    "flexplan.launcher:_call_key",
    "torch._tensor:Tensor.backward",
    "torch.optim.sgd:SGD.step",
)

_clock = collections.defaultdict(lambda: [0, 0.0])  # name -> [calls, seconds]


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = _clock[name]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
    return wrapper


def wrap(spec: str) -> None:
    module_name, qualname = spec.split(":")
    module = importlib.import_module(module_name)
    owner, attr = module, qualname
    if "." in qualname:
        cls_name, attr = qualname.split(".")
        owner = getattr(module, cls_name)
    # (inherited: a class's C method such as torch.Tensor.tolist, set on the class itself)
    raw = owner.__dict__[attr] if attr in owner.__dict__ else getattr(owner, attr)
    is_static = isinstance(raw, staticmethod)
    fn = raw.__func__ if is_static else raw
    wrapped = _timed(qualname, fn)
    setattr(owner, attr, staticmethod(wrapped) if is_static else wrapped)
    if owner is module:  # also where other modules imported it by name
        for other in list(sys.modules.values()):
            if (other is not None and getattr(other, "__name__", "").startswith("flexplan")
                    and other.__dict__.get(attr) is fn):
                setattr(other, attr, wrapped)


def wrap_launcher_runs() -> None:
    """Clock the launcher's memoized launches themselves (Triton's C launcher, or the direct
    driver launch): the closures made from here on (call before the first launch)."""
    import flexplan.launcher as launcher

    triton_run = launcher._triton_run
    launcher._triton_run = lambda compiled: _timed("launcher run (Triton's C launcher)",
                                                   triton_run(compiled))


def wrap_call_key_twice() -> None:
    """Run the launcher's class key twice per launch and clock each: the first as the step
    finds the host's caches, the second right after it (warm), telling a cold-cache cost from
    a slow host."""
    import flexplan.launcher as launcher

    call_key = launcher._call_key

    def twice(*args):
        start = time.perf_counter()
        call_key(*args)
        mid = time.perf_counter()
        key = call_key(*args)
        end = time.perf_counter()
        for name, seconds in (("_call_key, first", mid - start), ("_call_key, again", end - mid)):
            entry = _clock[name]
            entry[0] += 1
            entry[1] += seconds
        return key
    launcher._call_key = twice


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--network", default="unet", choices=sorted(NETS))
    p.add_argument("--phase", default="train", choices=("train", "infer"))
    p.add_argument("--mode", default="fp16", choices=sorted(MODES))
    p.add_argument("--coords", default="fresh", choices=("fresh", "same"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--funcs", default=",".join(FUNCS))
    p.add_argument("--key-twice", action="store_true",
                   help="clock the launcher's class key twice per launch (cold, then warm)")
    args = p.parse_args()
    mode = MODES[args.mode]
    net, opt, scans, sp = network_setup(args.network, mode)
    n = args.warmup + args.steps
    batches = lidar_batches([0] * n if args.coords == "same" else range(n), scans, mode)
    run = step_fn(net, opt, args.phase, mode, sp)
    for spec in args.funcs.split(","):
        wrap(spec)
    wrap_launcher_runs()
    if args.key_twice:
        wrap_call_key_twice()
    for b in batches[:args.warmup]:
        run(b)
        torch.cuda.synchronize()
    _clock.clear()
    wall = 0.0
    for b in batches[args.warmup:]:
        start = time.perf_counter()
        run(b)
        torch.cuda.synchronize()
        wall += time.perf_counter() - start
    steps = args.steps
    print(f"{args.network} {args.phase} {args.mode} {args.coords}: {wall / steps * 1e3:.2f} ms "
          f"per step ({torch.cuda.get_device_name()}, host clocks inclusive, nested)")
    for name, (calls, seconds) in sorted(_clock.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:42s} {calls / steps:7.1f} calls {seconds / steps * 1e3:8.3f} ms/step "
              f"{seconds / calls * 1e6:8.1f} us/call")
    print_kept_graphs()


def print_kept_graphs() -> None:
    """The plan builds' captured graphs at the end: kept, failed, their estimated bytes against
    the budget, keys asked for once (planner/graph_registry.py), and the device's memory."""
    from flexplan.planner import build_graphs

    registry = build_graphs._builds  # (a probe's look inside)
    entries = list(registry._kept.values())
    kept = [size for found, size, _ in entries if found is not None]
    print(f"build graphs: {len(kept)} kept ({sum(kept) / 2**20:.0f} MiB estimated, budget "
          f"{build_graphs.bytes_budget(torch.cuda.current_device()) / 2**20:.0f} MiB), {len(entries) - len(kept)} failed, "
          f"{len(registry._requested)} keys asked for once; device memory allocated "
          f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB, reserved "
          f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
