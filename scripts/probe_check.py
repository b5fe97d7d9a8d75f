"""Host time of the coordinate check of a fresh LiDAR batch (SparseConvTensor's check_coords:
one hash-insert pass and one host sync), piece by piece, after a synchronize as a training step
starts (issues #20, #22). Fresh coordinate tensors each call.

Usage (GPU): python3 scripts/probe_check.py [--calls 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from flexplan.coords_check import check_coords  # noqa: E402
from flexplan.planner.hashmap import coords_problem_flags, table_capacity  # noqa: E402
from flexplan.planner.keys import EMPTY_KEY  # noqa: E402
from profile_host import lidar_batches  # noqa: E402
from bench_e2e import MODES  # noqa: E402
from profile_host import network_setup  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    _, _, scans, _ = network_setup("unet", MODES["fp16"])
    batches = lidar_batches(range(args.calls + 5), scans, MODES["fp16"])
    rows = {}

    def clock(name, fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        rows.setdefault(name, []).append((time.perf_counter() - start) * 1e6)
        return out

    for i, b in enumerate(batches):
        coords = b.indices.clone()  # a new tensor: nothing remembered
        shape, bs = tuple(b.spatial_shape), b.batch_size
        n = coords.shape[0]
        clock("check_coords (whole)", lambda: check_coords(coords, shape, bs))
        coords = b.indices.clone()
        clock("torch.full(table)", lambda: torch.full((table_capacity(n) + 4,), EMPTY_KEY,
                                                      dtype=torch.int64, device=coords.device))
        flags = clock("coords_problem_flags (no sync)",
                      lambda: coords_problem_flags(coords, shape, bs, spare_slots=2, lanes=True))
        clock("flags.tolist() (the sync)", lambda: flags.tolist())
        small = torch.zeros(4, dtype=torch.int64, device=coords.device)
        clock("tolist of 4 idle values", lambda: small.tolist())
        if i < 5:
            rows.clear()
    print(f"{torch.cuda.get_device_name()}, {batches[0].indices.shape[0]} rows, medians of "
          f"{args.calls}:")
    for name, us in rows.items():
        print(f"  {name:32s} {statistics.median(us):8.1f} us")


if __name__ == "__main__":
    main()
