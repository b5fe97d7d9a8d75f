"""Host microseconds of one sparse_conv forward call on a reused plan, repeated (no GPU wait):
CPU tensors with launches stubbed out (the Python path alone) and, on a GPU, CUDA tensors with
real launches. Compares hosts: the same Python path is several times slower on some machines.

Usage: python3 scripts/probe_conv_host.py
"""
from __future__ import annotations

import importlib
import time

import torch

from flexplan import ConvGeometry, build_plan
from flexplan.workloads import random_coords

ops = importlib.import_module("flexplan.ops.conv")


def per_call_us(feats, plan, weight, reps=3000) -> float:
    with torch.no_grad():
        for _ in range(50):
            ops.sparse_conv(feats, plan, weight, None, algo="masked")
        if feats.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            ops.sparse_conv(feats, plan, weight, None, algo="masked")
        took = time.perf_counter() - start
        if feats.is_cuda:
            torch.cuda.synchronize()
    return took / reps * 1e6


def main():
    coords = random_coords(2000, (64, 64, 64), 1, generator=torch.Generator().manual_seed(0))
    geometry = ConvGeometry.submanifold_conv(3)
    real_launch = ops.launch
    ops.launch = lambda *a, **k: None
    try:
        plan = build_plan(coords, (64, 64, 64), 1, geometry, backend="torch", training=False)
        feats, weight = torch.randn(coords.shape[0], 16).half(), torch.randn(16, 3, 3, 3, 16).half()
        print(f"python path (CPU tensors, no launch): {per_call_us(feats, plan, weight):.1f} us")
        t = time.perf_counter()
        for _ in range(10000):
            torch.empty(16)
        print(f"torch.empty(16) on the CPU: {(time.perf_counter() - t) / 10000 * 1e6:.2f} us")
    finally:
        ops.launch = real_launch
    if torch.cuda.is_available():
        coords = coords.cuda()
        plan = build_plan(coords, (64, 64, 64), 1, geometry, training=False)
        feats, weight = feats.cuda(), weight.cuda()
        print(f"CUDA, real launch: {per_call_us(feats, plan, weight):.1f} us")
        x = torch.empty(16, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10000):
            x.add_(1)
        print(f"small torch op on CUDA: {(time.perf_counter() - t) / 10000 * 1e6:.2f} us")


if __name__ == "__main__":
    main()
