"""Host time inside named flexplan functions during one layer's calls on new coordinates:
bench_2d's single 2D submanifold layer (BEV pillars of fresh LiDAR batches, fp16), each call
making its SparseConvTensor (the coordinate check) and running the layer, synchronized around
the call as bench_2d times it. The clocks are probe_host_parts' (inclusive, nested); the wall
column is the call with its GPU work.

Usage (GPU): python3 scripts/probe_layer_call.py [--phase infer|train] [--calls 30]
             [--warmup 10] [--channels 64] [--funcs module:qualname,...]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-layer-"))

import flexplan.nn.spconv as fx  # noqa: E402
from bench_2d import bev  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402
from probe_host_parts import _clock, print_kept_graphs, wrap  # noqa: E402

FUNCS = (
    "flexplan.nn.sparse_conv_tensor:SparseConvTensor.__init__",
    "flexplan.coords_check:check_coords",
    "flexplan.plan_provider:tensor_plan",
    "flexplan.cache.plan_cache:PlanCache.get_or_build",
    "flexplan.cache.plan_cache:PlanCache._build",
    "flexplan.planner:_build_plan",
    "flexplan.planner.build_graphs:CapturedMapBuild.build",
    "flexplan.planner.build_graphs:LiveRowsGraph.replay",
    "flexplan.cache.memory:MemoryCache.put_recent",
    "flexplan.ops.conv:sparse_conv",
    "flexplan.ops.conv:gather_gemm",
    "flexplan.ops.conv:_kept_launch",
    "flexplan.launcher:launch",
    "torch._tensor:Tensor.tolist",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", default="infer", choices=("infer", "train"))
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--funcs", default=",".join(FUNCS))
    args = p.parse_args()
    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    count = args.warmup + args.calls
    pillars = [bev(lidar_batch(i, 2, 0, device, scans=scans)) for i in range(count)]
    gen = torch.Generator(device=device).manual_seed(0)
    feats = [torch.randn(idx.shape[0], args.channels, device=device, generator=gen,
                         dtype=torch.float16) for idx, _ in pillars]
    layer = fx.SubMConv2d(args.channels, args.channels, 3, indice_key="k").cuda().half()
    for spec in args.funcs.split(","):
        wrap(spec)

    def call(i):
        (idx, shape), f = pillars[i], feats[i]
        x = fx.SparseConvTensor(f.requires_grad_(args.phase == "train"), idx, shape, 2)
        if args.phase == "train":
            layer(x).features.float().sum().backward()
        else:
            with torch.no_grad():
                layer(x)

    walls = []
    for i in range(count):
        if i == args.warmup:
            _clock.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        call(i)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    timed = sorted(walls[args.warmup:])
    calls = args.calls
    print(f"SubMConv2d C {args.channels} fp16 {args.phase}, new pillars per call: "
          f"{timed[len(timed) // 2] * 1e3:.3f} ms median wall per call "
          f"({torch.cuda.get_device_name()}; host clocks inclusive, nested)")
    for name, (n, seconds) in sorted(_clock.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:42s} {n / calls:7.1f} calls {seconds / calls * 1e6:8.1f} us/call-of-layer "
              f"{seconds / n * 1e6:8.1f} us/call")
    print_kept_graphs()


if __name__ == "__main__":
    main()
