"""Times each part (forward, grad-input, grad-weight) of one convolution layer alone, per dtype,
with the config the dispatcher picks and a few alternatives: where a slow layer's time goes.

Usage (GPU): python3 scripts/probe_parts.py [--level 2] [--channels 32] [--dtypes float32,tf32,float16]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch
from triton.testing import do_bench

import flexplan.nn.spconv as sp
import flexplan.ops  # noqa: F401
from flexplan import ConvGeometry, tensor_plan
from flexplan.kernel_configs import GATHER_GEMM, WGRAD, Problem, config_dtype
from flexplan.tuning import select_config
from flexplan.tuning.dispatch import forced_config
from flexplan.workloads import lidar_batch

ops = sys.modules["flexplan.ops.conv"]


def level_tensor(level: int):
    b = lidar_batch(0, 2, 0, "cuda")
    x = sp.SparseConvTensor(b.features, b.indices, list(b.spatial_shape), 2)
    for _ in range(level - 1):
        x = sp.SparseConv3d(x.features.shape[1], x.features.shape[1], 3, 2, 1).cuda()(x)
    return x


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--level", type=int, default=2)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--dtypes", default="float32,tf32,float16")
    args = p.parse_args()
    x = level_tensor(args.level)
    plan = tensor_plan(x, ConvGeometry.make(3))
    c = args.channels
    n = plan.num_in
    print(f"level {args.level}: {n} voxels, {plan.num_pairs} pairs, C={c}")
    for name in args.dtypes.split(","):
        tf32 = name == "tf32"
        dtype = torch.float32 if name in ("float32", "tf32") else getattr(torch, name)
        feats = torch.randn(n, c, device="cuda", dtype=dtype)
        grad = torch.randn(n, c, device="cuda", dtype=dtype)
        w = torch.randn(c, 27, c, device="cuda", dtype=dtype) * 0.05
        cd = config_dtype(name, False)
        parts = {
            "fwd": (GATHER_GEMM, Problem(n, c, c, 27, cd, "masked", "fwd"),
                    lambda: ops._gather_gemm(feats, w, None, plan.fwd, False, "fwd", "masked", tf32)),
            "dgrad": (GATHER_GEMM, Problem(n, c, c, 27, cd, "masked", "dgrad"),
                      lambda: ops._gather_gemm(grad, w, None, plan.fwd, True, "dgrad", "masked", tf32)),
            "wgrad": (WGRAD, Problem(plan.num_pairs, c, c, 27, cd, "masked_splitk", "wgrad"),
                      lambda: ops._wgrad(grad, feats, plan, w.shape, "masked_splitk", tf32)),
        }
        for part, (family, problem, fn) in parts.items():
            cfg = select_config(family, problem)
            base = do_bench(fn, warmup=5, rep=30)
            line = f"{name:8s} {part:6s} {base:7.3f} ms  {cfg}"
            alts = []
            for stages in (2, 3):
                for bk in (16, 32, 64):
                    alt = replace(cfg, num_stages=stages, block_k=bk)
                    with forced_config(alt):
                        try:
                            alts.append((do_bench(fn, warmup=3, rep=15), stages, bk))
                        except Exception as e:  # noqa: BLE001
                            alts.append((float("inf"), stages, f"{bk} {type(e).__name__}"))
            best = min(alts)
            print(line + f"  | best alt {best[0]:.3f} ms (stages {best[1]}, block_k {best[2]})",
                  flush=True)


if __name__ == "__main__":
    main()
