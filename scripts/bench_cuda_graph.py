"""Latency of a small inference (about 20k voxels), eager against a replayed CUDA graph, with
the plans built (the same coordinates every call, as a served scene or a loaded plan set).

Usage (GPU): python3 scripts/bench_cuda_graph.py [--voxels 20000] [--out FILE]
Results: scripts/results/bench_cuda_graph.md
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flexplan.nn.spconv as sp  # noqa: E402
from bench_common import host_launch_us, time_steps, today  # noqa: E402
from e2e_networks import LidarUNet, VoxelResBackBone8x  # noqa: E402
from flexplan.workloads import random_coords  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_cuda_graph.md"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--voxels", type=int, default=20000)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    shape = (41, 400, 352)
    coords = random_coords(args.voxels, shape, 1, generator=torch.Generator().manual_seed(0)).cuda()
    lines = [f"# CUDA graphs: a small inference, eager vs replayed ({today()})", "",
             f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}, Triton "
             f"{__import__('triton').__version__}. Host: {host_launch_us():.1f} us per small "
             f"torch launch. {coords.shape[0]} voxels in a {shape} grid, fp16, batch 1; plans built "
             "before timing (same coordinates); median of 50 calls, synchronized.", "",
             "| network | eager ms | graph replay ms | speedup |", "|---|---|---|---|"]
    for name, cls in (("encoder", VoxelResBackBone8x), ("unet", LidarUNet)):
        torch.manual_seed(0)
        net = cls(sp).cuda().half().eval()
        static = torch.randn(coords.shape[0], 4, device="cuda").half()
        x = sp.SparseConvTensor(static, coords, list(shape), 1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(3):
                net(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            net(x)
        calls = [None] * 50
        with torch.no_grad():
            eager = time_steps(lambda _: net(x), calls, 0)
        replay = time_steps(lambda _: graph.replay(), calls, 0)
        row = f"| {name} | {eager:.3f} | {replay:.3f} | {eager / replay:.1f}x |"
        print(row, flush=True)
        lines.append(row)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
