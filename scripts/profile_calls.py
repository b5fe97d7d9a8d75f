"""Where one fresh-coordinate layer call spends its time: for the pool and 2D benchmarks' calls
(a max pool 2/2 training call, a 2D submanifold inference call, a 3D submanifold inference
call, each on new coordinates), the host time per call, the torch ops and Triton launches it
makes (torch.profiler, CPU side), its GPU kernel time, and a cProfile of the host side.

Usage (GPU): python3 scripts/profile_calls.py [--calls 30] [--top 25] [--only NAME,...]
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-calls-"))

import flexplan.nn.spconv as fx  # noqa: E402
from bench_2d import bev  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402


def calls(count: int):
    """name -> (step(batch), batches): each a new coordinate set."""
    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    voxels = [lidar_batch(i, 2, 0, device, scans=scans) for i in range(count)]
    gen = torch.Generator(device=device).manual_seed(0)
    vox = [(torch.randn(b.indices.shape[0], 32, device=device, generator=gen).half(), b.indices,
            list(b.spatial_shape)) for b in voxels]
    pillars = []
    for b in voxels:
        idx, shape = bev(b)
        pillars.append((torch.randn(idx.shape[0], 64, device=device, generator=gen).half(), idx,
                        shape))
    pool = fx.SparseMaxPool3d(2, 2)
    subm2 = fx.SubMConv2d(64, 64, 3, bias=False, indice_key="s").cuda().half()
    subm3 = fx.SubMConv3d(32, 32, 3, bias=False, indice_key="s").cuda().half()

    def pool_train(b):
        f, i, s = b
        pool(fx.SparseConvTensor(f.requires_grad_(), i, s, 2)).features.float().sum().backward()

    def infer(layer):
        def run(b):
            with torch.no_grad():
                layer(fx.SparseConvTensor(*b, 2))
        return run

    return {"pool max 2/2 train": (pool_train, vox), "subm2d C64 infer": (infer(subm2), pillars),
            "subm3d C32 infer": (infer(subm3), vox)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--only", default="")
    args = p.parse_args()
    warm = 5
    for name, (step, batches) in calls(warm + 3 * args.calls).items():
        if args.only and name not in args.only.split(","):
            continue
        for b in batches[:warm]:
            step(b)
        torch.cuda.synchronize()
        rest = batches[warm:]
        # 1. host ms per call, synchronized around each call (as bench_pool / bench_2d time)
        times = []
        for b in rest[:args.calls]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(b)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        print(f"\n=== {name}: {statistics.median(times):.3f} ms per call (median, synced)")
        # 2. torch ops and kernels per call
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for b in rest[args.calls:2 * args.calls]:
                step(b)
            torch.cuda.synchronize()
        ops = collections.Counter()
        gpu_us = 0.0
        kernels = collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                gpu_us += ev.device_time
                kernels[ev.name[:60]] += ev.device_time
            elif ev.name.startswith("aten::") or ev.name.startswith("cuda"):
                ops[ev.name] += 1
        n = args.calls
        print(f"GPU kernel time per call: {gpu_us / n / 1e3:.3f} ms")
        print("ops per call:", ", ".join(f"{k} {v / n:.1f}" for k, v in ops.most_common(30)))
        print("GPU us per call:", ", ".join(f"{k} {v / n:.1f}" for k, v in kernels.most_common(12)))
        # 3. cProfile of the host side
        prof = cProfile.Profile()
        prof.enable()
        for b in rest[2 * args.calls:]:
            step(b)
        torch.cuda.synchronize()
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top + 15)


if __name__ == "__main__":
    main()
