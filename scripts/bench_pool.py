"""Sparse pooling, flexplan vs spconv, side by side in one run: the same LiDAR batches (two ray-cast
scans, the e2e benchmark's workload) through SparseMaxPool3d / SparseAvgPool3d layers of both
libraries, inference and training (forward + backward), on new coordinates every call (the plan
built each time, as spconv always does) and on repeated ones (flexplan reuses its plan). The two
libraries are timed paired: interleaved call by call on the same batches, so host-speed drift
moves both alike. Also checks that both give the same output coordinates and values (fp32).

Usage (GPU): python3 scripts/bench_pool.py [--channels 32] [--steps 30] [--out FILE]
Results: scripts/results/bench_pool.md
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-pool-"))

import flexplan.nn.spconv as fx  # noqa: E402
from flexplan.cache import plan_cache  # noqa: E402
from bench_common import host_launch_us, sorted_rows, time_paired, today  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_pool.md"
# (name, layer class name, args): the pools of sparse backbones.
LAYERS = [("max 2/2", "SparseMaxPool3d", (2, 2)), ("max 3/2 p1", "SparseMaxPool3d", (3, 2, 1)),
          ("avg 2/2", "SparseAvgPool3d", (2, 2))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    import spconv
    import spconv.pytorch as sp

    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    count = args.warmup + args.steps
    gen = torch.Generator(device=device).manual_seed(0)
    batches = []
    for i in range(count):
        b = lidar_batch(i, 2, 0, device, scans=scans)
        feats = torch.randn(b.indices.shape[0], args.channels, device=device, generator=gen)
        batches.append((feats, b.indices, list(b.spatial_shape)))
    lines = [f"# Sparse pooling: flexplan vs spconv ({today()})", "",
             f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}, Triton "
             f"{__import__('triton').__version__}, spconv {getattr(spconv, '__version__', '?')}. "
             f"Host: {host_launch_us():.1f} us per small torch launch.",
             f"Input: LiDAR batches of 2 scans, {batches[0][1].shape[0]} voxels (first batch), "
             f"C = {args.channels}; {args.warmup} warm-up then {args.steps} timed calls per "
             "library, the two libraries interleaved call by call on the same batches (which "
             "goes first alternates), synchronized around each call. spconv ms, flexplan ms: "
             "median per library; speedup: the ratio of those medians (spconv / flexplan); "
             "paired speedup: the median over the timed batches of spconv ms / flexplan ms on "
             "the same batch. fresh: a new batch per call (flexplan's plan cache emptied first); "
             "same: one batch.",
             "", "| layer | dtype | phase | coords | spconv ms | flexplan ms | speedup "
             "| paired speedup | fp32 outputs equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines))
    for name, cls, layer_args in LAYERS:
        layers = {"spconv": getattr(sp, cls)(*layer_args), "flexplan": getattr(fx, cls)(*layer_args)}
        tensor_of = {"spconv": sp.SparseConvTensor, "flexplan": fx.SparseConvTensor}
        # Same answer first (fp32): coordinates and values, rows put in one order.
        feats, idx, shape = batches[0]
        outs = {impl: layers[impl](tensor_of[impl](feats, idx, shape, 2)) for impl in layers}
        same = (outs["spconv"].indices.shape == outs["flexplan"].indices.shape and torch.allclose(
            sorted_rows(outs["spconv"].indices, outs["spconv"].features),
            sorted_rows(outs["flexplan"].indices, outs["flexplan"].features), rtol=1e-5, atol=1e-6))
        for dtype in (torch.float16, torch.float32):
            for phase in ("infer", "train"):
                for coords in ("fresh", "same"):
                    steps = {}
                    for impl in ("spconv", "flexplan"):
                        layer, make = layers[impl], tensor_of[impl]

                        def step(b, layer=layer, make=make):
                            f, i, s = b
                            f = f.to(dtype)
                            if phase == "train":
                                # A leaf of its own per call: both libraries read these batches
                                # (fp32's .to returns the batch's own tensor, whose .grad would
                                # otherwise carry from one library's call into the other's).
                                f = f.detach().requires_grad_()
                                layer(make(f, i, s, 2)).features.float().sum().backward()
                            else:
                                with torch.no_grad():
                                    layer(make(f, i, s, 2))
                        steps[impl] = step
                    run = batches if coords == "fresh" else [batches[0]] * count
                    if coords == "fresh":  # earlier rows saw these batches: forget them
                        plan_cache.clear(disk=True)
                    timed = time_paired(steps, run, args.warmup, ratio=("spconv", "flexplan"))
                    ms = timed["ms"]
                    row = (f"| {name} | {str(dtype).removeprefix('torch.')} | {phase} | {coords} | "
                           f"{ms['spconv']:.3f} | {ms['flexplan']:.3f} | "
                           f"{ms['spconv'] / ms['flexplan']:.2f}x | {timed['ratio']:.2f}x | "
                           f"{same} |")
                    print(row, flush=True)
                    lines.append(row)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
