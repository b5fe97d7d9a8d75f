"""Host work of one fresh plan build, counted on the CPU (a proxy for its host time on a GPU,
issue #20): per build kind, the aten ops dispatched (torch.empty, fill_, slices, views, ...),
the Triton launches, and the Python / C function calls the host makes outside the launches.

Kernels run through Triton's interpreter (this script sets TRITON_INTERPRET=1) with the Triton
backend forced, so the same Python runs as on a GPU; only the planner's sort differs there
(small builds replay a captured graph: rank_sort.py). The interpreter's own work inside a
launch is not counted (on a GPU a launch is one call).

Columns: aten ops (all, views included: each is a dispatcher call from Python), device ops
(those that queue device work: fills, copies, scans, sorts; on a GPU one torch.sort is about a
dozen, or one graph replay where rank_sort.py captured it), launches, host calls (Python and C
functions the host calls, outside launches) and host us (CPU wall time outside the launches:
noisy, and the CPU runs the device ops' work too).

Usage: python3 scripts/count_plan_ops.py [--rows 200] [--ops] (--ops lists each kind's ops)
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: interpreter kernels

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import flexplan  # noqa: E402,F401
from flexplan import launcher, plan_views  # noqa: E402
from flexplan.geometry import ConvGeometry  # noqa: E402
from flexplan.planner import build_plan  # noqa: E402
from flexplan.planner.generative_triton import transposed_map_and_t_triton  # noqa: E402
from flexplan.planner.hashmap import coords_problem_flags  # noqa: E402
from flexplan.workloads import random_coords  # noqa: E402

SHAPE, BATCH = (16, 16, 16), 2
SUBM = ConvGeometry.make(3)
DOWN = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
UP = ConvGeometry.make(3, stride=2, padding=1, submanifold=False, transposed=True)
# Modules that bind launcher.launch at import (plan_views looks it up on launcher per call).
LAUNCHING = ("flexplan.planner.hashmap", "flexplan.planner.segments_triton",
             "flexplan.planner.generative_triton", "flexplan.coords_hash")


# aten ops that only allocate or make views: no device work.
NO_DEVICE_WORK = {"empty", "empty_strided", "slice", "view", "detach", "as_strided", "alias",
                  "select", "t", "transpose", "unsqueeze", "squeeze", "expand", "split",
                  "split_with_sizes", "_unsafe_view", "unbind", "lift_fresh"}


class Counter(TorchDispatchMode):
    """aten ops and launches of the code run under it; nothing inside a launch counts."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.launches = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class LaunchTimer:
    """Wall time spent inside launches (the interpreter's), to leave out of the host time."""

    def __init__(self):
        self.seconds = 0.0
        self.paused = 0
        self._start = None

    def pause(self):
        self._start = time.perf_counter()

    def resume(self):
        self.seconds += time.perf_counter() - self._start


class CallCounter:
    """Python and C function calls made by the host outside launches (sys.setprofile)."""

    def __init__(self):
        self.calls = 0
        self.paused = 0

    def __call__(self, frame, event, arg):
        if event in ("call", "c_call") and not self.paused:
            self.calls += 1


_active: list = []  # the counters of the current measurement


def _counted_launch(real):
    def launch(kernel, grid, *args, **constexprs):
        for counter in _active:
            if isinstance(counter, Counter):
                counter.launches[getattr(kernel, "__name__", None) or kernel.fn.__name__] += 1
            counter.paused += 1
            if isinstance(counter, LaunchTimer):
                counter.pause()
        try:
            return real(kernel, grid, *args, **constexprs)
        finally:
            for counter in _active:
                counter.paused -= 1
                if isinstance(counter, LaunchTimer):
                    counter.resume()
    return launch


def _install_launch_wrapper():
    real = launcher.launch
    wrapped = _counted_launch(real)
    launcher.launch = wrapped
    for name in LAUNCHING:
        module = sys.modules[name]
        if getattr(module, "launch", None) is real:
            module.launch = wrapped


def coords_check(coords):
    """check_coords' GPU branch (the CPU takes torch ops): the hash insert's problem flags and
    the coordinates' identity lanes, read in one sync."""
    flags = coords_problem_flags(coords, SHAPE, BATCH, spare_slots=2, lanes=True)
    flags.tolist()


def first_conv_views(plan):
    """What a plan's first convolution derives (plan_views) and reads of the schedule."""
    gmap = plan.fwd
    plan_views.sorted_map_t(gmap)
    plan_views.chunk_order(gmap)
    gmap.kernel_offsets(32)
    gmap.valid_kernel_seg[32]


def first_conv_views_deferred(plan):
    """The same over a deferred plan's map: its full schedule (plan_views.full_schedule), then
    that map's views."""
    first_conv_views(replace(plan, fwd=plan_views.full_schedule(plan.fwd)))


def kinds(coords):
    """name -> (the work counted, a setup run first whose result it takes)."""
    def build(geometry, training):
        return lambda _: build_plan(coords, SHAPE, BATCH, geometry, backend="triton", check=False,
                                    training=training)

    subm = lambda: build_plan(coords, SHAPE, BATCH, SUBM, backend="triton", training=False)
    deferred = lambda: build_plan(coords, SHAPE, BATCH, SUBM, backend="triton", check=False,
                                  training=False, scheduled=False)
    down = lambda: build_plan(coords, SHAPE, BATCH, DOWN, backend="triton", training=False)
    return {
        "coords check (+identity)": (lambda _: coords_check(coords), None),
        "subm 3x3x3 inference": (build(SUBM, False), None),
        "subm 3x3x3 inference, deferred (a first sighting's)": (lambda _: deferred(), None),
        "subm 3x3x3 training": (build(SUBM, True), None),
        "subm 3x3x3 inference, checked": (
            lambda _: build_plan(coords, SHAPE, BATCH, SUBM, backend="triton", training=False),
            None),
        "strided s2 p1 inference": (build(DOWN, False), None),
        "strided s2 p1 training": (build(DOWN, True), None),
        "strided s2 p1 maps-only (a pool's)": (
            lambda _: build_plan(coords, SHAPE, BATCH, DOWN, backend="triton", check=False,
                                 training=False, scheduled=False), None),
        "transposed s2 p1 inference": (build(UP, False), None),
        "transposed s2 p1 training": (build(UP, True), None),
        "inverse bwd map (inference plan)": (
            lambda plan: transposed_map_and_t_triton(plan.fwd.neighbor_map, plan.num_in), down),
        "first-conv views (subm)": (first_conv_views, subm),
        "first-conv views (deferred subm)": (first_conv_views_deferred, deferred),
    }


def measure(work, setup, reps: int = 3):
    """(Counter, host calls, median host us) of one run of work."""
    def fresh():
        _active[:] = []  # (the setup's own work is not counted)
        return setup() if setup is not None else None

    work(fresh())  # warm: caches, first-use work
    arg, ops = fresh(), Counter()
    _active[:] = [ops]
    with ops:
        work(arg)
    arg, calls = fresh(), CallCounter()
    _active[:] = [calls]
    sys.setprofile(calls)
    try:
        work(arg)
    finally:
        sys.setprofile(None)
    times = []
    for _ in range(reps):
        arg, timer = fresh(), LaunchTimer()
        _active[:] = [timer]
        start = time.perf_counter()
        work(arg)
        times.append((time.perf_counter() - start - timer.seconds) * 1e6)
    _active[:] = []
    return ops, calls.calls, statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200, help="random coordinates drawn")
    parser.add_argument("--ops", action="store_true", help="list each kind's aten ops")
    args = parser.parse_args()
    _install_launch_wrapper()
    gen = torch.Generator().manual_seed(0)
    coords = random_coords(args.rows, SHAPE, BATCH, generator=gen)
    print(f"{coords.shape[0]} rows, grid {SHAPE}, batch {BATCH}; Triton interpreter")
    print(f"| {'build':34s} | aten ops | device ops | sorts | launches | host calls | host us |")
    print(f"|{'-' * 36}|----------|------------|-------|----------|------------|---------|")
    listed = []
    for name, (work, setup) in kinds(coords).items():
        ops, calls, host_us = measure(work, setup)
        device_ops = sum(v for k, v in ops.ops.items() if k not in NO_DEVICE_WORK)
        print(f"| {name:34s} | {sum(ops.ops.values()):8d} | {device_ops:10d} "
              f"| {ops.ops['sort']:5d} | {sum(ops.launches.values()):8d} | {calls:10d} "
              f"| {host_us:7.0f} |", flush=True)
        listed.append((name, ops))
    if args.ops:
        for name, ops in listed:
            print(f"\n{name}:")
            print("  ops: " + ", ".join(f"{k} x{v}" for k, v in sorted(ops.ops.items())))
            print("  launches: " + ", ".join(f"{k} x{v}" for k, v in sorted(ops.launches.items())))


if __name__ == "__main__":
    main()
