"""Which kernel binaries a training step of bench_e2e's U-Net or encoder asks for, step by step
over fresh LiDAR batches, under a given GPU's tuned table: on the CPU, no GPU needed. Each
conv part (forward, grad-input, grad-weight) is dispatched as the ops dispatch it
(ops.conv.resolve_algo, shape_config, the launch's constexprs) from the row and pair counts
of plans the torch planner builds; a binary is a kernel, its constexprs and the specialization
classes of its sizes. Prints the binaries first asked for after the warm-up steps: what a JIT
job without an AOT bundle would compile in its timed steps (issue #20's "finite kernel set").

Usage: python3 scripts/probe_dispatch_classes.py [--network unet|encoder] [--steps 20]
       [--warmup 10] [--dtypes float16,float32] [--gpu "NVIDIA H200"] [--sms 132]
       [--heuristic-misses] (a table miss runs the heuristic, as before session 46's
       dispatch.neighbour_config)
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from flexplan.geometry import ConvGeometry  # noqa: E402
from flexplan.kernel_configs import GATHER_GEMM, WGRAD  # noqa: E402
from flexplan.ops import conv as ops  # noqa: E402
from flexplan.planner import build_plan  # noqa: E402
from flexplan.tuning import dispatch  # noqa: E402
from flexplan.tuning.device import DeviceKey  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402

SUBM = ConvGeometry.make(3)


def down(padding=1):
    return ConvGeometry.make(3, stride=2, padding=padding, submanifold=False)


# (name, level in, level out, Ci, Co, geometry, kind): kind "subm", "down" (a strided conv
# from level in to level out) or "inverse" (the strided conv's plan from level out back to in:
# its forward over that plan's bwd map); the first layer's input needs no gradient.
UNET = (("conv_input", 1, 1, 4, 16, SUBM, "subm"), ("conv1", 1, 1, 16, 16, SUBM, "subm"),
        ("spconv2", 1, 2, 16, 32, down(), "down"), ("subm2", 2, 2, 32, 32, SUBM, "subm"),
        ("spconv3", 2, 3, 32, 64, down(), "down"), ("subm3", 3, 3, 64, 64, SUBM, "subm"),
        ("spconv4", 3, 4, 64, 128, down((0, 1, 1)), "down"),
        ("subm4", 4, 4, 128, 128, SUBM, "subm"),
        ("up4", 3, 4, 128, 64, down((0, 1, 1)), "inverse"), ("merge3", 3, 3, 128, 64, SUBM, "subm"),
        ("up3", 2, 3, 64, 32, down(), "inverse"), ("merge2", 2, 2, 64, 32, SUBM, "subm"),
        ("up2", 1, 2, 32, 16, down(), "inverse"), ("merge1", 1, 1, 32, 16, SUBM, "subm"))
# (the residual blocks' convs: one entry per level, their four convs ask for the same binaries)
ENCODER = (("conv_input", 1, 1, 4, 16, SUBM, "subm"), ("res1", 1, 1, 16, 16, SUBM, "subm"),
           ("spconv2", 1, 2, 16, 32, down(), "down"), ("res2", 2, 2, 32, 32, SUBM, "subm"),
           ("spconv3", 2, 3, 32, 64, down(), "down"), ("res3", 3, 3, 64, 64, SUBM, "subm"),
           ("spconv4", 3, 4, 64, 128, down((0, 1, 1)), "down"),
           ("res4", 4, 4, 128, 128, SUBM, "subm"),
           ("conv_out", 4, 5, 128, 128,
            ConvGeometry.make((3, 1, 1), stride=(2, 1, 1), padding=0, submanifold=False), "down"))
NETWORKS = {"unet": UNET, "encoder": ENCODER}


def parts(layer, plans) -> list:
    """(part, rows) of one layer's training step, and its map's kind for grad-input."""
    name, lin, lout, ci, co, geometry, kind = layer
    if kind == "subm":
        plan = plans[(lin, geometry)]
        rows_fwd = rows_dgrad = plan.num_in
    elif kind == "down":
        plan = plans[(lin, geometry)]
        rows_fwd, rows_dgrad = plan.num_out, plan.num_in
    else:  # inverse: out rows at level `lin`
        plan = plans[(lin, geometry)]
        rows_fwd, rows_dgrad = plan.num_in, plan.num_out
    out = [("fwd", rows_fwd), ("wgrad", plan.num_pairs)]
    if name != "conv_input":
        out.append(("dgrad", rows_dgrad))
    return out


def binary(part: str, rows: int, ci: int, co: int, v: int, reverse: bool, src) -> tuple:
    family = WGRAD if part == "wgrad" else GATHER_GEMM
    algo = ops.resolve_algo("auto", part, rows, ci, co, v,
                            ops._dtype_name(src.dtype, False, None))
    if algo == "explicit":
        return (part, algo)
    cfg, dtype, hip = ops.shape_config(family, part, algo, rows, ci, co, v, src, False)
    if part == "wgrad":
        consts = ops.wgrad_constexprs(cfg, dtype, hip)
        return (family, dtype, co % 16 == 0, ci % 16 == 0, v, tuple(sorted(consts.items())))
    k, n = (ci, co) if part == "fwd" else (co, ci)
    consts = ops.gather_gemm_constexprs(cfg, algo.startswith("masked"), reverse, dtype, hip,
                                        ops.reads_weight_kvn(part, dtype))
    return (family, dtype, k % 16 == 0, n % 16 == 0, v, tuple(sorted(consts.items())))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--network", default="unet", choices=sorted(NETWORKS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--dtypes", default="float16,float32")
    p.add_argument("--gpu", default="NVIDIA H200")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--triton", default="3.6.0")
    p.add_argument("--heuristic-misses", action="store_true")
    args = p.parse_args()
    if args.heuristic_misses:
        dispatch.neighbour_config = lambda configs, bucket: None
    key = DeviceKey(args.gpu, args.arch, args.sms, args.triton)
    dispatch.current_device_index = lambda: 0  # (a GPU faked: its shipped table)
    dispatch.device_key = lambda index: key
    dispatch.reset()
    layers = NETWORKS[args.network]
    scans = lidar_scans(2, 0, "cpu")
    first_seen = {}  # (dtype, layer, part, binary) -> step
    rows_seen = collections.defaultdict(list)
    for step in range(args.steps):
        batch = lidar_batch(step, 2, 0, "cpu", scans=scans)
        coords, shape = {1: batch.indices}, {1: tuple(batch.spatial_shape)}
        plans = {}
        for name, lin, lout, ci, co, geometry, kind in layers:
            if (lin, geometry) in plans:
                continue
            plan = build_plan(coords[lin], shape[lin], batch.batch_size, geometry,
                              backend="torch", training=True)
            plans[(lin, geometry)] = plan
            if kind == "down":
                coords[lout], shape[lout] = plan.out_coords, tuple(plan.out_spatial_shape)
        for dtype_name in args.dtypes.split(","):
            src = torch.empty(0, dtype=getattr(torch, dtype_name))
            for layer in layers:
                name, _, _, ci, co, geometry, kind = layer
                for part, rows in parts(layer, plans):
                    reverse = part == "dgrad" and kind == "subm"
                    b = binary(part, rows, ci, co, geometry.volume, reverse, src)
                    rows_seen[(dtype_name, name, part)].append(rows)
                    first_seen.setdefault((dtype_name, name, part, b), step)
        print(f"step {step}: {batch.indices.shape[0]} voxels", flush=True)
    late = [(k, s) for k, s in first_seen.items() if s >= args.warmup]
    binaries = {(k[0], k[3]) for k in first_seen}
    print(f"{len(binaries)} binaries over {args.steps} steps; first asked for after "
          f"{args.warmup} warm-up steps: {len(late)}")
    for (dtype_name, name, part, b), s in sorted(late, key=lambda x: x[1]):
        earlier = {(k[3]) for k, t in first_seen.items() if t < s}
        new = b not in earlier
        rows = rows_seen[(dtype_name, name, part)]
        print(f"  step {s}: {dtype_name} {name} {part} rows {min(rows)}-{max(rows)} "
              f"{'NEW BINARY' if new else '(another layer had it)'}: {b}")


if __name__ == "__main__":
    main()
