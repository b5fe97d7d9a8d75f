"""Host cost of planning fresh coordinates, the way a layer asks for plans: SparseConvTensor
creation (coordinate check and hash), then tensor_plan for a 3x3x3 submanifold and a stride-2
plan (inference or training kinds), each on new LiDAR coordinates; median host ms per call
and a cProfile of the calls (where the Python and the launches go).

Usage (GPU): python3 scripts/profile_plans.py [--training] [--reps 30] [--lines 40]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time

import torch

os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-plans-"))

import flexplan.nn.spconv as sp  # noqa: E402
from flexplan import ConvGeometry, tensor_plan  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402

SUBM = ConvGeometry.make(3)
DOWN = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--training", action="store_true")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--lines", type=int, default=40)
    args = parser.parse_args()
    scans = lidar_scans(2, 0, "cuda")
    batches = [lidar_batch(i, 2, 0, "cuda", scans=scans) for i in range(2 * args.reps + 5)]
    times = {"tensor": [], "subm": [], "strided": []}

    def calls(batch, record):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = sp.SparseConvTensor(batch.features, batch.indices, list(batch.spatial_shape), 2)
        t1 = time.perf_counter()
        tensor_plan(x, SUBM, training=args.training)
        t2 = time.perf_counter()
        tensor_plan(x, DOWN, training=args.training)
        t3 = time.perf_counter()
        if record:
            for name, took in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                took and times[name].append(took * 1e3)

    for b in batches[:5]:
        calls(b, False)
    for b in batches[5:5 + args.reps]:
        calls(b, True)
    print("median host ms: " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in times.items()))
    prof = cProfile.Profile()
    prof.enable()
    for b in batches[5 + args.reps:]:
        calls(b, False)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.lines)


if __name__ == "__main__":
    main()
