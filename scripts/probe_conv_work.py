"""The multiply-adds (rows x offsets x Ci x Co) of every inference convolution of bench_e2e's
networks that runs over a map without its masked schedule (a first sighting's submanifold map,
an inverse conv's), against ops.conv.SCHEDULE_WORK_MIN, above which such a convolution has its
map scheduled. fp16, new LiDAR batches (2 scans).

Usage (GPU): python3 scripts/probe_conv_work.py [--steps 3]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-work-"))

import flexplan.nn.spconv as sp  # noqa: E402
import flexplan.ops.conv as conv_ops  # noqa: E402
from e2e_networks import NETWORKS  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    works = []
    ask = conv_ops.masked_schedule_for
    conv_ops.masked_schedule_for = lambda gmap, work: (works.append(work), ask(gmap, work))[1]
    print(f"SCHEDULE_WORK_MIN 2^{math.log2(conv_ops.SCHEDULE_WORK_MIN):.1f}")
    for name, cls in NETWORKS.items():
        net = cls(sp).to(device).half().eval()
        for step in range(args.steps):
            b = lidar_batch(1000 + step, 2, 0, device, scans=scans)
            with torch.no_grad():
                net(sp.SparseConvTensor(b.features.half(), b.indices, list(b.spatial_shape), 2))
        print(f"{name}: {len(works) / args.steps:.0f} convs per step over unscheduled maps, "
              f"work 2^{math.log2(min(works)):.1f} .. 2^{math.log2(max(works)):.1f}, "
              f"{sum(w >= conv_ops.SCHEDULE_WORK_MIN for w in works)} at or above the minimum")
        works.clear()


if __name__ == "__main__":
    main()
