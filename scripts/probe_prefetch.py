"""Where a fresh step's plan prefetch spends its host time: each plan it builds, timed on the
host (no synchronization added), and the part of it spent waiting in host syncs (Tensor.tolist,
the builds' readbacks), for bench_e2e's networks on new LiDAR batches (fp16).

Usage (GPU): python3 scripts/probe_prefetch.py [--steps 20] [--warmup 5] [--networks encoder,unet]
             [--phases infer,train]
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-prefetch-"))

import flexplan.nn.spconv as sp  # noqa: E402
import flexplan.plan_prefetch as plan_prefetch  # noqa: E402
from bench_e2e import MODES  # noqa: E402
from e2e_networks import NETWORKS  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402
from profile_host import step_fn  # noqa: E402


class Clock:
    """Host seconds inside the wrapped calls, and inside syncs during them."""

    def __init__(self):
        self.entries: list[tuple[str, float, float]] = []  # (label, host s, sync s)
        self.sync_s = 0.0
        self.prefetch_s = 0.0

    def wrap_sync(self):
        tolist = torch.Tensor.tolist
        clock = self

        def timed_tolist(tensor):
            start = time.perf_counter()
            try:
                return tolist(tensor)
            finally:
                clock.sync_s += time.perf_counter() - start
        torch.Tensor.tolist = timed_tolist

    def wrap_cached(self):
        cached = plan_prefetch._cached
        clock = self

        def timed_cached(coords, grid, batch_size, geometry, identity, training, scheduled=True):
            sync_before, start = clock.sync_s, time.perf_counter()
            plan = cached(coords, grid, batch_size, geometry, identity, training, scheduled)
            label = (("subm" if geometry.submanifold else "transposed" if geometry.transposed
                      else "strided") + f" k{geometry.kernel_size[0]}{geometry.kernel_size[1]}"
                     f"{geometry.kernel_size[2]} " + ("train" if training else "infer")
                     + (" deferred" if plan.schedule_deferred else ""))
            clock.entries.append((label, time.perf_counter() - start, clock.sync_s - sync_before))
            return plan
        plan_prefetch._cached = timed_cached

    def wrap_prefetch(self):
        prefetch = plan_prefetch._prefetch
        clock = self

        def timed_prefetch(*args, **kwargs):
            start = time.perf_counter()
            try:
                return prefetch(*args, **kwargs)
            finally:
                clock.prefetch_s += time.perf_counter() - start
        plan_prefetch._prefetch = timed_prefetch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--networks", default="encoder,unet")
    p.add_argument("--phases", default="infer,train")
    args = p.parse_args()
    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    clock = Clock()
    clock.wrap_sync()
    clock.wrap_cached()
    clock.wrap_prefetch()
    mode = MODES["fp16"]
    print(torch.cuda.get_device_name(), torch.__version__)
    for name in args.networks.split(","):
        for phase in args.phases.split(","):
            torch.manual_seed(0)
            net = NETWORKS[name](sp).to(device).half()
            opt = torch.optim.SGD(net.parameters(), lr=1e-3)
            step = step_fn(net, opt, phase, mode)
            steps, per_entry, prefetch, syncs = [], collections.defaultdict(list), [], []
            for i in range(args.warmup + args.steps):
                b = lidar_batch(500 + i, 2, 0, device, scans=scans)
                b = b._replace(features=b.features.half())
                torch.cuda.synchronize()
                clock.entries.clear()
                clock.prefetch_s = clock.sync_s = 0.0
                start = time.perf_counter()
                step(b)
                torch.cuda.synchronize()
                if i < args.warmup:
                    continue
                steps.append(time.perf_counter() - start)
                prefetch.append(clock.prefetch_s)
                syncs.append(clock.sync_s)
                for k, (label, host, sync) in enumerate(clock.entries):
                    per_entry[(k, label)].append((host, sync))
            ms = lambda values: 1e3 * statistics.median(values)  # noqa: E731
            print(f"\n{name} {phase}: step {ms(steps):.2f} ms, prefetch {ms(prefetch):.2f} ms, "
                  f"all syncs in the step {ms(syncs):.2f} ms")
            for (k, label), values in sorted(per_entry.items()):
                print(f"  {k:2d} {label:28s} host {ms([h for h, _ in values]):.3f} ms, "
                      f"of it in syncs {ms([s for _, s in values]):.3f}")


if __name__ == "__main__":
    main()
