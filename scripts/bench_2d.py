"""2D sparse layers, flexplan vs spconv, side by side in one run: bird's-eye-view pillars of the
e2e benchmark's LiDAR batches (two ray-cast scans, z dropped, one pillar per (x, y) cell, as
VoxelNeXt-style 2D backbones see them) through SubMConv2d / SparseConv2d layers of both
libraries; inference and training (forward + backward), new pillars every call and repeated
ones. The two libraries are timed paired: interleaved call by call on the same pillars, so
host-speed drift moves both alike. Checks that both give the same outputs (fp32) first.

Usage (GPU): python3 scripts/bench_2d.py [--channels 64,128] [--steps 30] [--out FILE]
Results: scripts/results/bench_2d.md
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-2d-"))

import flexplan.nn.spconv as fx  # noqa: E402
from bench_common import host_launch_us, sorted_rows, time_paired, today  # noqa: E402
from flexplan.cache import plan_cache  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_2d.md"


def bev(batch) -> tuple[torch.Tensor, list]:
    """[N, 3] (batch, d1, d2) pillars of a voxel batch (its (z, y, x) grid: z dropped)."""
    idx = batch.indices[:, [0, 2, 3]]
    shape = list(batch.spatial_shape)[1:]
    key = (idx[:, 0].long() * shape[0] + idx[:, 1]) * shape[1] + idx[:, 2]
    uniq = torch.unique(key)
    b, rest = uniq // (shape[0] * shape[1]), uniq % (shape[0] * shape[1])
    return torch.stack([b, rest // shape[1], rest % shape[1]], 1).int(), shape


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--channels", default="64,128")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    import spconv
    import spconv.pytorch as sp

    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    count = args.warmup + args.steps
    pillars = [bev(lidar_batch(i, 2, 0, device, scans=scans)) for i in range(count)]
    lines = [f"# 2D sparse layers: flexplan vs spconv ({today()})", "",
             f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}, Triton "
             f"{__import__('triton').__version__}, spconv {getattr(spconv, '__version__', '?')}. "
             f"Host: {host_launch_us():.1f} us per small torch launch.",
             f"Input: BEV pillars of LiDAR batches of 2 scans, {pillars[0][0].shape[0]} pillars "
             f"(first batch), grid {pillars[0][1]}; {args.warmup} warm-up then {args.steps} timed "
             "calls per library, the two libraries interleaved call by call on the same pillars "
             "(which goes first alternates), synchronized around each call. spconv ms, flexplan "
             "ms: median per library; speedup: the ratio of those medians (spconv / flexplan); "
             "paired speedup: the median over the timed batches of spconv ms / flexplan ms on "
             "the same pillars. fresh: new pillars per call "
             "(flexplan's plan cache emptied first); same: one batch. Each call makes the "
             "SparseConvTensor from the pillars (coordinate check included); the x4 stack runs "
             "four convs with one indice_key on it, as a BEV backbone's stage does.", "",
             "| layer | C | dtype | phase | coords | spconv ms | flexplan ms | speedup "
             "| paired speedup | fp32 equal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines))
    gen = torch.Generator(device=device).manual_seed(0)
    for channels in (int(c) for c in args.channels.split(",")):
        feats = [torch.randn(idx.shape[0], channels, device=device, generator=gen)
                 for idx, _ in pillars]
        # A stack: what a BEV backbone's stage runs on one tensor (one indice_key, the
        # coordinates checked and planned once, then `depth` convolutions over them).
        for name, cls, layer_args, depth in (("subm 3x3", "SubMConv2d", (3,), 1),
                                             ("subm 3x3 x4 stack", "SubMConv2d", (3,), 4),
                                             ("conv 3x3 s2", "SparseConv2d", (3, 2, 1), 1)):
            def build(ns):
                mods = [getattr(ns, cls)(channels, channels, *layer_args, indice_key="k")
                        for _ in range(depth)]
                return (mods[0] if depth == 1 else ns.SparseSequential(*mods)).cuda()
            layers = {"spconv": build(sp), "flexplan": build(fx)}
            layers["flexplan"].load_state_dict(layers["spconv"].state_dict())
            make = {"spconv": sp.SparseConvTensor, "flexplan": fx.SparseConvTensor}
            (idx, shape), f = pillars[0], feats[0]
            outs = {i: layers[i](make[i](f, idx, shape, 2)) for i in layers}
            equal = (outs["spconv"].indices.shape == outs["flexplan"].indices.shape
                     and torch.allclose(
                         sorted_rows(torch.nn.functional.pad(outs["spconv"].indices, (0, 1)),
                                     outs["spconv"].features),
                         sorted_rows(torch.nn.functional.pad(outs["flexplan"].indices, (0, 1)),
                                     outs["flexplan"].features), rtol=1e-3, atol=1e-3))
            for dtype in (torch.float16,):
                for phase in ("infer", "train"):
                    for coords in ("fresh", "same"):
                        steps = {}
                        for impl in ("spconv", "flexplan"):
                            layer = layers[impl].to(dtype)

                            def step(i, layer=layer, impl=impl):
                                (idx, shape), f = pillars[i], feats[i].to(dtype)
                                x = make[impl](f.requires_grad_(phase == "train"), idx, shape, 2)
                                if phase == "train":
                                    layer(x).features.float().sum().backward()
                                else:
                                    with torch.no_grad():
                                        layer(x)
                            steps[impl] = step
                        run = list(range(count)) if coords == "fresh" else [0] * count
                        if coords == "fresh":
                            plan_cache.clear(disk=True)
                        timed = time_paired(steps, run, args.warmup, ratio=("spconv", "flexplan"))
                        ms = timed["ms"]
                        row = (f"| {name} | {channels} | {str(dtype).removeprefix('torch.')} | "
                               f"{phase} | {coords} | {ms['spconv']:.3f} | {ms['flexplan']:.3f} | "
                               f"{ms['spconv'] / ms['flexplan']:.2f}x | {timed['ratio']:.2f}x | "
                               f"{equal} |")
                        print(row, flush=True)
                        lines.append(row)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
