"""Does interleaving the libraries call by call change each one's time? A fresh-coordinate layer
call (max pool 2/2 and a 3x3x3 submanifold conv, fp16 inference, new LiDAR batch per call) timed
three ways, twice in turn: flexplan alone (a block of calls), spconv alone, and the two
alternating call by call (what bench_common.time_paired does). If a library is slower
interleaved than alone, paired tables are biased against it (the other's work evicts its host
caches between its calls).

Usage (GPU): python3 scripts/probe_interleave.py [--calls 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-interleave-"))

import flexplan.nn.spconv as fx  # noqa: E402
from bench_common import time_call  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    import spconv.pytorch as sp

    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    seq = iter(range(10**6))

    def fresh(count):
        out = []
        for _ in range(count):
            b = lidar_batch(next(seq), 2, 0, device, scans=scans)
            out.append((torch.randn(b.indices.shape[0], 32, device=device, dtype=torch.float16),
                        b.indices, list(b.spatial_shape)))
        return out

    layers = {
        "max 2/2": {"flexplan": (fx, fx.SparseMaxPool3d(2, 2)),
                    "spconv": (sp, sp.SparseMaxPool3d(2, 2))},
        "subm 3x3x3 C32": {
            "flexplan": (fx, fx.SubMConv3d(32, 32, 3, bias=False).cuda().half()),
            "spconv": (sp, sp.SubMConv3d(32, 32, 3, bias=False).cuda().half())}}
    print(torch.cuda.get_device_name())
    for name, impls in layers.items():
        calls = {}
        for impl, (ns, layer) in impls.items():
            def call(b, ns=ns, layer=layer):
                with torch.no_grad():
                    layer(ns.SparseConvTensor(b[0], b[1], b[2], 2))
            calls[impl] = call
        for b in fresh(10):  # warm-up, both
            for c in calls.values():
                c(b)
        res = {k: [] for k in ("flexplan alone", "spconv alone", "flexplan interleaved",
                               "spconv interleaved")}
        for _ in range(2):
            for impl in ("flexplan", "spconv"):
                res[f"{impl} alone"] += [time_call(calls[impl], b)
                                         for b in fresh(args.calls)]
            for k, b in enumerate(fresh(args.calls)):
                for impl in (("flexplan", "spconv") if k % 2 else ("spconv", "flexplan")):
                    res[f"{impl} interleaved"].append(time_call(calls[impl], b))
        print(name + ": " + ", ".join(f"{k} {statistics.median(v):.3f} ms" for k, v in res.items()))


if __name__ == "__main__":
    main()
