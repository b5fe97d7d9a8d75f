"""Host time of the pieces of a fresh-coordinate step, one at a time from an idle GPU: plan
builds (submanifold and strided, training and inference), the plan-cache path a layer takes,
and one convolution's forward and backward calls (host time until the call returns).

Usage (GPU): python3 scripts/probe_host_costs.py
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

import flexplan.nn.spconv as sp
import flexplan.ops  # noqa: F401
from flexplan import ConvGeometry, build_plan, tensor_plan
from flexplan.workloads import lidar_batch

from bench_common import host_times_us

ops = sys.modules["flexplan.ops.conv"]
REPS = 30


def host_ms(fn, reps=REPS):
    return statistics.median(host_times_us([fn] * reps)) / 1e3


def main():
    batch = lidar_batch(0, 2, 0, "cuda")
    coords, shape = batch.indices, tuple(batch.spatial_shape)
    subm = ConvGeometry.make(3)
    down = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    print(f"{coords.shape[0]} voxels")
    for name, geom in (("subm", subm), ("strided", down)):
        for training in (True, False):
            fn = lambda: build_plan(coords, shape, 2, geom, check=False, training=training)
            print(f"build_plan {name:8s} training={training!s:5s}: {host_ms(fn):.3f} ms", flush=True)
    feats = batch.features.half()
    w16 = torch.randn(16, 3, 3, 3, feats.shape[1], device="cuda", dtype=torch.float16) * 0.05
    for name, geom in (("subm", subm), ("strided", down)):
        for training in (True, False):
            def build_and_conv():  # a fresh plan's first convolution derives its views
                plan = build_plan(coords, shape, 2, geom, check=False, training=training)
                with torch.no_grad():
                    ops.sparse_conv(feats, plan, w16, None)
            print(f"build_plan + first conv fwd {name:8s} training={training!s:5s}: "
                  f"{host_ms(build_and_conv):.3f} ms", flush=True)

    def layer_path():
        x = sp.SparseConvTensor(feats, coords, list(shape), 2)
        tensor_plan(x, subm)
    print(f"SparseConvTensor + tensor_plan (subm, fresh tensor, same coords: memo + memory hit): "
          f"{host_ms(layer_path):.3f} ms")
    print(f"SparseConvTensor alone: {host_ms(lambda: sp.SparseConvTensor(feats, coords, list(shape), 2)):.3f} ms")
    plan = build_plan(coords, shape, 2, subm)
    for c in (16, 64):
        x = torch.randn(coords.shape[0], c, device="cuda", dtype=torch.float16, requires_grad=True)
        w = (torch.randn(c, 3, 3, 3, c, device="cuda", dtype=torch.float16) * 0.05).requires_grad_(True)
        b = torch.zeros(c, device="cuda", dtype=torch.float16, requires_grad=True)
        fwd = lambda: ops.sparse_conv(x, plan, w, b)
        print(f"sparse_conv fwd C={c}: {host_ms(fwd):.3f} ms host", flush=True)
        outs = []

        def bwd():
            outs[-1].backward(torch.ones_like(outs[-1]))
        times = []
        for _ in range(REPS):
            outs.append(ops.sparse_conv(x, plan, w, b))
            torch.cuda.synchronize()
            start = time.perf_counter()
            bwd()
            times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        print(f"sparse_conv bwd C={c}: {statistics.median(times):.3f} ms host (autograd incl.)")
        with torch.no_grad():
            print(f"sparse_conv fwd no_grad C={c}: {host_ms(fwd):.3f} ms host")
    bn = torch.nn.BatchNorm1d(16).cuda().half()
    x16 = torch.randn(coords.shape[0], 16, device="cuda", dtype=torch.float16)
    print(f"reference: BatchNorm1d + relu: {host_ms(lambda: torch.relu(bn(x16))):.3f} ms host")


if __name__ == "__main__" and "--backward" not in sys.argv:
    main()


def profile_backward(c: int = 16, calls: int = 50):
    """cProfile of SparseConvFunction.backward called directly (the autograd engine runs it on
    its own thread, where a profile of the caller does not see it)."""
    import cProfile
    import pstats
    from types import SimpleNamespace

    batch = lidar_batch(0, 2, 0, "cuda")
    plan = build_plan(batch.indices, tuple(batch.spatial_shape), 2, ConvGeometry.make(3))
    n = plan.num_in
    feats = torch.randn(n, c, device="cuda", dtype=torch.float16)
    w = torch.randn(c, 27, c, device="cuda", dtype=torch.float16) * 0.05
    grad = torch.randn(n, c, device="cuda", dtype=torch.float16)
    ctx = SimpleNamespace(saved_tensors=(feats, w), plan=plan, algo="auto", allow_tf32=False,
                          has_bias=True, needs_input_grad=(True, True, True))
    backward = ops.SparseConvFunction.backward
    print(f"direct backward C={c}: {host_ms(lambda: backward(ctx, grad)):.3f} ms host")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        backward(ctx, grad)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__" and "--backward" in sys.argv:
    profile_backward()
