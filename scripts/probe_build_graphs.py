"""Host time of a training build on fresh LiDAR batches, submanifold 3x3x3 and strided 3x3x3
(stride 2, padding 1): eager against replayed from CUDA graphs (flexplan/planner/
build_graphs.py, generative_graphs.py), one build per batch, the GPU drained before each
(host us per build_plan call, medians), and the number of buckets seen.

Usage (GPU): python3 scripts/probe_build_graphs.py [--batches 40] [--warmup 10]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from flexplan import ConvGeometry, build_plan
from flexplan.planner import build_graphs
from flexplan.planner.rank_sort import bucket
from flexplan.workloads import lidar_batch, lidar_scans

from bench_common import host_times_us


def host_us(batches, geometry, stride: int) -> list[float]:
    def build(batch):
        coords = batch.indices[::stride].contiguous() if stride > 1 else batch.indices
        return lambda: build_plan(coords, batch.spatial_shape, batch.batch_size, geometry,
                                  check=False)
    return host_times_us([build(batch) for batch in batches])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    device = torch.device("cuda")
    scans = lidar_scans(8, device=device)
    batches = [lidar_batch(step, scans=scans, device=device) for step in range(args.batches)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for geometry, stride in ((ConvGeometry.make(3), 1), (ConvGeometry.make(3), 4),
                             (ConvGeometry.make(3, stride=2, padding=1, submanifold=False), 1)):
        # full batches, a coarser level's row counts, a strided build
        rows = [b.indices[::stride].shape[0] for b in batches]
        print(f"{'submanifold' if geometry.submanifold else 'strided'}: rows "
              f"{min(rows)}-{max(rows)}, buckets {sorted({bucket(r) for r in rows})}")
        for label, on in (("eager", False), ("graph", True), ("eager", False), ("graph", True)):
            build_graphs.CAPTURE_BUILDS = on
            host_us(batches[:args.warmup], geometry, stride)  # (captures the buckets)
            times = host_us(batches[args.warmup:], geometry, stride)
            print(f"  {label}: {statistics.median(times):.0f} us per build "
                  f"(p25 {statistics.quantiles(times, n=4)[0]:.0f}, "
                  f"p75 {statistics.quantiles(times, n=4)[2]:.0f})")
        print("  graphs kept:", len(build_graphs.kept()))
        if geometry.submanifold:
            parts(batches[args.warmup:], stride)


def parts(batches, stride: int) -> None:
    """A replayed build's pieces, host us (medians): copy in, replay, copy out, pending."""
    found = [b for b in build_graphs.kept() if isinstance(b, build_graphs.CapturedBuild)]
    marks = []
    for batch in batches:
        coords = batch.indices[::stride].contiguous() if stride > 1 else batch.indices
        n = coords.shape[0]
        kept = [b for b in found if b.cap >= n and b.cap - b.cap // 4 <= n]
        if not kept or kept[0].graph is None:
            continue
        b = kept[0]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.coords[:n].copy_(coords)
        b.rows.fill_(n)
        t1 = time.perf_counter()
        b.graph.replay()
        t2 = time.perf_counter()
        arena, readback = b.outputs
        arena.clone()
        t3 = time.perf_counter()
        build_graphs.PendingCount(readback[1:2])
        t4 = time.perf_counter()
        marks.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    if marks:
        names = ("copy in + fill", "replay", "copy out", "PendingCount")
        print("  pieces:", ", ".join(f"{name} {statistics.median(m[i] for m in marks) * 1e6:.0f} us"
                                    for i, name in enumerate(names)))


if __name__ == "__main__":
    main()
