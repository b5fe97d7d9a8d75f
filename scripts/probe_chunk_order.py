"""GPU time of the gather GEMM with the chunks of sorted rows run in spatial order
(plan_views.chunk_order_triton) against the Gray order itself (gray_chunk_order), on the LiDAR
batch's submanifold plan and the coordinates of the strided levels (fp16 forward, C = 16..128).
Decides kernel_configs.CHUNK_ORDER_MIN_ROWS.

Usage (GPU): python3 scripts/probe_chunk_order.py
"""
from __future__ import annotations

import importlib

import torch
import triton.testing

import flexplan.plan_views as views
from flexplan import ConvGeometry, build_plan
from flexplan.workloads import lidar_batch

ops = importlib.import_module("flexplan.ops.conv")


def main():
    batch = lidar_batch(0, 2, 0, "cuda")
    coords, shape = batch.indices, tuple(batch.spatial_shape)
    subm = ConvGeometry.make(3)
    down = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    level, channels = coords, 16
    print("| rows | C | spatial order ms | Gray order ms | Gray / spatial |\n|---|---|---|---|---|")
    for _ in range(4):
        plan = build_plan(level, shape, 2, subm, training=False)
        m = plan.num_in
        x = torch.randn(m, channels, device="cuda", dtype=torch.float16)
        w = torch.randn(channels, 3, 3, 3, channels, device="cuda", dtype=torch.float16) * 0.05
        times = []
        for order in (views.chunk_order_triton(plan.fwd.sorted_idx),
                      views.gray_chunk_order(m, "cuda")):
            plan.fwd.derived_views["chunk_order"] = order  # (the kept view the kernels read)
            with torch.no_grad():
                times.append(triton.testing.do_bench(lambda: ops.sparse_conv(x, plan, w, None,
                                                                             algo="masked")))
        print(f"| {m} | {channels} | {times[0]:.4f} | {times[1]:.4f} | {times[1] / times[0]:.3f} |")
        strided = build_plan(level, shape, 2, down, training=False)
        level, shape = strided.out_coords, strided.out_spatial_shape
        channels *= 2


if __name__ == "__main__":
    main()
