"""Grad-input reading the weight as stored (ops.conv.reads_weight_kvn, 16-bit dtypes) against
over its transposed copy (ops.conv.DGRAD_WEIGHT_COPY, the former path), per layer shape of
bench_e2e's networks on a LiDAR batch: GPU time (triton.testing.do_bench, the copy's kernel
included where it runs) and the call's host time until return, both in one process.

Usage (GPU): python3 scripts/probe_dgrad_weight.py [--dtypes float16,bfloat16] [--calls 300]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
from triton.testing import do_bench

import flexplan.nn.spconv as sp
import flexplan.ops  # noqa: F401
from flexplan import ConvGeometry, tensor_plan
from flexplan.workloads import lidar_batch

from bench_common import host_times_us

ops = sys.modules["flexplan.ops.conv"]
# (level, Ci, Co, strided): the submanifold layers of each level (16-128 channels; a decoder's
# merge halves them) and the strided convs between levels.
SHAPES = ((1, 16, 16, False), (1, 32, 16, False), (2, 32, 32, False), (2, 64, 32, False),
          (3, 64, 64, False), (4, 128, 128, False), (1, 16, 32, True), (2, 32, 64, True),
          (3, 64, 128, True))


def level_tensors(levels: int):
    b = lidar_batch(0, 2, 0, "cuda")
    x = sp.SparseConvTensor(b.features, b.indices, list(b.spatial_shape), 2)
    out = [x]
    with torch.no_grad():
        for _ in range(levels - 1):
            c = x.features.shape[1]
            x = sp.SparseConv3d(c, c, 3, 2, 1).cuda()(x)
            out.append(x)
    return out


def host_us(fn, calls: int) -> float:
    return statistics.median(host_times_us([fn] * calls))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    tensors = level_tensors(4)
    print("| dtype | level | Ci | Co | conv | rows in | GPU us copy | GPU us as stored | "
          "copy / stored | host us copy | host us as stored |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for level, ci, co, strided in SHAPES:
            x = tensors[level - 1]
            geometry = (ConvGeometry.make(3, stride=2, padding=1, submanifold=False) if strided
                        else ConvGeometry.make(3))
            plan = tensor_plan(x, geometry)
            grad = torch.randn(plan.num_out, co, device="cuda", dtype=dtype)
            w = (torch.randn(co, 27, ci, device="cuda") * 0.05).to(dtype)

            def run():
                return ops.conv_dgrad(grad, w, plan, "auto", False)
            results = {}
            for copy in (True, False):
                ops.DGRAD_WEIGHT_COPY = copy
                results[copy] = (do_bench(run, warmup=25, rep=100) * 1e3, host_us(run, args.calls),
                                 run())
            ops.DGRAD_WEIGHT_COPY = False
            (gpu_c, host_c, out_c), (gpu_s, host_s, out_s) = results[True], results[False]
            same = torch.equal(out_c, out_s)
            print(f"| {name} | {level} | {ci} | {co} | {'s2' if strided else 'subm'} | "
                  f"{plan.num_in} | {gpu_c:.1f} | {gpu_s:.1f} | {gpu_c / gpu_s:.2f} | "
                  f"{host_c:.1f} | {host_s:.1f} |{'' if same else ' OUTPUTS DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
