"""GPU time of one forward gather-GEMM per epilogue (none, bias, eval BatchNorm + ReLU in the
features' dtype and in float32), on a LiDAR level's submanifold plan: for A/B runs of the
kernel's epilogue between two checkouts (run each with PYTHONPATH pointing at it).

Usage (GPU): python3 scripts/probe_epilogue.py [--reps 50] [--dtype float16]
Prints one line per (channels, epilogue): median microseconds per launch (a CUDA graph of
--reps launches replayed between CUDA events), the same plan and inputs for every row.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from flexplan import ConvGeometry, build_plan
from flexplan.ops import sparse_conv
from flexplan.ops.conv import BatchNormReLU
from flexplan.workloads import lidar_batch


def time_us(fn, reps: int) -> float:
    """Median over 5 replays of a CUDA graph of `reps` calls (the kernels alone: a small
    conv's host call takes longer than its kernel, which timing eager calls would measure)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    batch = lidar_batch(0, 2, 0, device)
    coords, shape = batch.indices, tuple(batch.spatial_shape)
    plan = build_plan(coords, shape, 2, ConvGeometry.make(3), training=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for ci, co in ((16, 16), (32, 32), (64, 64)):
            feats = torch.randn(coords.shape[0], ci, device=device, generator=gen).to(dtype)
            weight = torch.randn(co, 3, 3, 3, ci, device=device, generator=gen).to(dtype) * 0.1
            bias = torch.randn(co, device=device, generator=gen).to(dtype)
            norms = {}
            for name, ndtype in (("bn", dtype), ("bn-fp32", torch.float32)):
                t = [torch.rand(co, device=device, generator=gen).to(ndtype) + 0.5
                     for _ in range(4)]
                norms[name] = BatchNormReLU(*t, 1e-3)
            rows = {"none": lambda: sparse_conv(feats, plan, weight),
                    "bias": lambda: sparse_conv(feats, plan, weight, bias)}
            for name, bn in norms.items():
                rows[name] = lambda bn=bn: sparse_conv(feats, plan, weight, bn_relu=bn)
            for name, fn in rows.items():
                print(f"rows {coords.shape[0]} C {ci}->{co} {args.dtype} {name}: "
                      f"{time_us(fn, args.reps):.1f} us")


if __name__ == "__main__":
    main()
