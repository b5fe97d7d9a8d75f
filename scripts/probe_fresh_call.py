"""Host time of a fresh-coordinate submanifold layer call, piece by piece (issues #20, #22): the
input tensor (its coordinate check and hash, one host sync), the plan (build, no sync for an
inference plan), the conv, then the wait for the GPU; spconv's whole call beside it. Fresh LiDAR
batch per call, fp16 inference, 3D (C 32) and 2D pillars (C 64); medians of 40 calls after 10.

Usage (GPU): python3 scripts/probe_fresh_call.py
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-fresh-call-"))

import flexplan.nn.spconv as fx  # noqa: E402
from bench_2d import bev  # noqa: E402
from flexplan.ops import sparse_conv  # noqa: E402
from flexplan.plan_provider import tensor_plan  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402


def main() -> None:
    import spconv.pytorch as sp

    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    voxels = [lidar_batch(i, 2, 0, device, scans=scans) for i in range(50)]
    cases = {
        "3D subm 3x3x3 C32": ([(torch.randn(b.indices.shape[0], 32, device=device).half(),
                                b.indices, list(b.spatial_shape)) for b in voxels],
                              fx.SubMConv3d(32, 32, 3, bias=False).cuda().half(),
                              sp.SubMConv3d(32, 32, 3, bias=False).cuda().half())}
    pillars = []
    for b in voxels:
        idx, shape = bev(b)
        pillars.append((torch.randn(idx.shape[0], 64, device=device).half(), idx, shape))
    cases["2D subm 3x3 C64"] = (pillars, fx.SubMConv2d(64, 64, 3, bias=False).cuda().half(),
                                sp.SubMConv2d(64, 64, 3, bias=False).cuda().half())
    print(torch.cuda.get_device_name())
    for name, (batches, layer, peer) in cases.items():
        parts = {k: [] for k in ("tensor", "plan", "conv", "gpu wait", "flexplan call",
                                 "spconv call", "second conv", "op alone", "floor", "third conv")}
        for k, (f, i, s) in enumerate(batches):
            with torch.no_grad():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                x = fx.SparseConvTensor(f, i, s, 2)
                t1 = time.perf_counter()
                tensor_plan(x, layer.geometry, training=False)
                t2 = time.perf_counter()
                layer(x)
                t3 = time.perf_counter()
                torch.cuda.synchronize()
                t4 = time.perf_counter()
                peer(sp.SparseConvTensor(f, i, s, 2))
                torch.cuda.synchronize()
                t5 = time.perf_counter()
                layer(x)  # the same plan again: what its first call made is kept
                t6 = time.perf_counter()
                torch.cuda.synchronize()
                # The op without the layer (flexplan.ops.sparse_conv), and a floor: what any
                # conv call must do on the host (allocate its output, one launch).
                plan, weight = x._plans.get(layer.geometry), layer.conv_weight()
                t7 = time.perf_counter()
                sparse_conv(x.features, plan, weight, None)
                t8 = time.perf_counter()
                torch.cuda.synchronize()
                t9 = time.perf_counter()
                torch.empty_like(x.features).copy_(x.features)
                t10 = time.perf_counter()
                torch.cuda.synchronize()
                t11 = time.perf_counter()  # the layer again, right after flexplan's own calls
                layer(x)                    # (the second followed spconv's: colder host caches)
                t12 = time.perf_counter()
                torch.cuda.synchronize()
            if k >= 10:
                for key, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, t5 - t4,
                                          t6 - t5, t8 - t7, t10 - t9, t12 - t11)):
                    parts[key].append(v * 1e3)
        print(f"{name}: " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in parts.items())
              + " (ms, medians)")
        if os.environ.get("PROFILE_FIRST_CONV"):
            import cProfile
            import pstats

            prof = cProfile.Profile()
            for f, i, s in batches[:20]:
                with torch.no_grad():
                    x = fx.SparseConvTensor(f, i, s, 2)
                    tensor_plan(x, layer.geometry, training=False)
                    torch.cuda.synchronize()
                    prof.enable()
                    layer(x)
                    prof.disable()
                    torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
