"""Where bench_2d's single 2D submanifold layer spends its host time: cProfile of the call
bench_2d times (a SparseConvTensor over BEV pillars, the layer, and in training
`.features.float().sum().backward()`), on the same pillars every call, after a warm-up; then
the call's host time until return and until a synchronize, flexplan and spconv in turns.

Usage (GPU): python3 scripts/profile_2d.py [--phase train|infer] [--channels 64] [--calls 200]
             [--lines 40]
(Repeated pillars only: the row bench_2d's issue bound reads; new pillars per call are
bench_2d's "fresh" rows, which also empty the plan cache.)
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-prof2d-"))

import flexplan.nn.spconv as fx  # noqa: E402
from bench_2d import bev  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", default="train", choices=("train", "infer"))
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--lines", type=int, default=40)
    args = parser.parse_args()
    import spconv.pytorch as sp

    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    batches = 1
    pillars = [bev(lidar_batch(0, 2, 0, device, scans=scans))]
    feats = [torch.randn(idx.shape[0], args.channels, device=device) for idx, _ in pillars]
    libs = {"flexplan": fx, "spconv": sp}
    layers = {name: ns.SubMConv2d(args.channels, args.channels, 3, indice_key="k").cuda().half()
              for name, ns in libs.items()}
    layers["flexplan"].load_state_dict(layers["spconv"].state_dict())

    def call(name, i):
        (idx, shape), f = pillars[i % batches], feats[i % batches].half()
        x = libs[name].SparseConvTensor(f.requires_grad_(args.phase == "train"), idx, shape, 2)
        if args.phase == "train":
            layers[name](x).features.float().sum().backward()
        else:
            with torch.no_grad():
                layers[name](x)

    for i in range(30):
        for name in libs:
            call(name, i)
    torch.cuda.synchronize()
    host, wall = {n: [] for n in libs}, {n: [] for n in libs}
    for i in range(args.calls):
        for name in (libs if i % 2 else reversed(list(libs))):
            torch.cuda.synchronize()
            start = time.perf_counter()
            call(name, i)
            returned = time.perf_counter()
            torch.cuda.synchronize()
            host[name].append((returned - start) * 1e3)
            wall[name].append((time.perf_counter() - start) * 1e3)
    for name in libs:
        print(f"{name}: host until return {statistics.median(host[name]):.3f} ms, "
              f"until synchronized {statistics.median(wall[name]):.3f} ms (medians of "
              f"{args.calls})")
    for name in libs:
        profile = cProfile.Profile()
        torch.cuda.synchronize()
        profile.enable()
        for i in range(args.calls):
            call(name, i)
            torch.cuda.synchronize()
        profile.disable()
        print(f"=== cProfile, {name}, {args.calls} calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.lines)


if __name__ == "__main__":
    main()
