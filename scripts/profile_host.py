"""Where a fresh-coordinate step spends host time: cProfile of flexplan train / inference steps
of the bench_e2e networks (fp16, a new LiDAR batch every step), after a warm-up.

Usage (GPU): python3 scripts/profile_host.py [--network encoder|unet] [--phase train|infer]
             [--steps 10] [--sort tottime]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-prof-"))

import flexplan.nn.spconv as sp  # noqa: E402
from e2e_networks import LidarUNet, VoxelResBackBone8x  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402

NETS = {"encoder": VoxelResBackBone8x, "unet": LidarUNet}


def step_fn(net, opt, phase: str):
    """One step of the network on a LiDAR batch (fp16 features): train (zero_grad, forward,
    loss, backward, SGD) or infer (eval, no_grad); no synchronization."""
    def step(batch):
        x = sp.SparseConvTensor(batch.features, batch.indices, list(batch.spatial_shape), 2)
        if phase == "train":
            opt.zero_grad(set_to_none=True)
            net.loss(net(x), batch.labels).backward()
            opt.step()
        else:
            with torch.no_grad():
                net.eval()(x)
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--network", default="encoder", choices=sorted(NETS))
    parser.add_argument("--phase", default="train", choices=("train", "infer"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--lines", type=int, default=45)
    parser.add_argument("--kernels", action="store_true",
                        help="also a torch.profiler table of the steps' GPU kernels")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    net = NETS[args.network](sp).to(device).half()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    scans = lidar_scans(2, 0, device)
    batches = [lidar_batch(i, 2, 0, device, scans=scans) for i in range(10 + args.steps)]
    batches = [b._replace(features=b.features.half()) for b in batches]

    run = step_fn(net, opt, args.phase)

    def step(batch):
        run(batch)
        torch.cuda.synchronize()

    for b in batches[:10]:
        step(b)
    start = time.perf_counter()
    for b in batches[10:]:
        step(b)
    print(f"{args.network} {args.phase}: {(time.perf_counter() - start) / args.steps * 1e3:.1f} ms "
          "per step without the profiler")
    prof = cProfile.Profile()
    batches = [lidar_batch(100 + i, 2, 0, device, scans=scans) for i in range(args.steps)]
    batches = [b._replace(features=b.features.half()) for b in batches]
    prof.enable()
    for b in batches:
        step(b)
    prof.disable()
    pstats.Stats(prof).sort_stats(args.sort).print_stats(args.lines)
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile

        batches = [lidar_batch(200 + i, 2, 0, device, scans=scans) for i in range(args.steps)]
        batches = [b._replace(features=b.features.half()) for b in batches]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kprof:
            for b in batches:
                step(b)
        print(kprof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                         max_name_column_width=50))


if __name__ == "__main__":
    main()
