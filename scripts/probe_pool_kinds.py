"""A/B of the pools' plan kinds on fresh coordinates: maps-only plans (the default) against
scheduled inference plans (flexplan.nn.spconv_pool.MAPS_ONLY_PLANS False), each call on its own
new batch (no memo of one variant's call serves the other's), the variants alternating call by
call. Prints per kind the median ms per call (synchronized around each) and the paired ratio.

Usage (GPU): python3 scripts/probe_pool_kinds.py [--calls 40] [--warmup 10]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-poolkinds-"))

import flexplan.nn.spconv as fx  # noqa: E402
from flexplan.nn import spconv_pool  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    n = 2 * (args.calls + args.warmup)
    batches = [lidar_batch(i, 2, 0, device, scans=scans) for i in range(n)]
    feats = [torch.randn(b.indices.shape[0], 32, device=device, dtype=torch.float16)
             for b in batches]
    print(f"{torch.cuda.get_device_name()}; {batches[0].indices.shape[0]} voxels, C 32 fp16")
    for name, layer in (("max 2/2", fx.SparseMaxPool3d(2, 2)),
                        ("max 3/2 p1", fx.SparseMaxPool3d(3, 2, 1))):
        for phase in ("infer", "train"):
            times = {True: [], False: []}
            for k in range(n):
                maps_only = (k % 2 == 0) if (k // 2) % 2 == 0 else (k % 2 == 1)
                spconv_pool.MAPS_ONLY_PLANS = maps_only
                b, f = batches[k], feats[k]
                torch.cuda.synchronize()
                start = time.perf_counter()
                if phase == "train":
                    f = f.detach().requires_grad_()
                    layer(fx.SparseConvTensor(f, b.indices, list(b.spatial_shape), 2)
                          ).features.float().sum().backward()
                else:
                    with torch.no_grad():
                        layer(fx.SparseConvTensor(f, b.indices, list(b.spatial_shape), 2))
                torch.cuda.synchronize()
                if k >= 2 * args.warmup:
                    times[maps_only].append((time.perf_counter() - start) * 1e3)
            spconv_pool.MAPS_ONLY_PLANS = True
            ratio = statistics.median(s / m for s, m in zip(times[False], times[True]))
            print(f"{name} {phase}: maps-only {statistics.median(times[True]):.3f} ms, "
                  f"scheduled {statistics.median(times[False]):.3f} ms, "
                  f"scheduled / maps-only paired {ratio:.2f}")


if __name__ == "__main__":
    main()
