"""The `e2e` workload of `python -m flexplan doctor --workload e2e` (GPU): the two networks of
scripts/e2e_networks.py (OpenPCDet's VoxelResBackBone8x encoder and the LiDAR U-Net, their real
widths) for a few training steps and inference calls in each dtype users train in (fp16, bf16,
fp32 with 3xTF32, TF32, fp16 autocast), on small LiDAR batches. The doctor then reports which
of the kernel variants launched came from an AOT bundle and which were compiled.

Run alone it prints nothing but its own progress: python scripts/aot_workload.py [--steps 2]
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (name, model dtype, allow TF32, autocast dtype)
MODES = (("fp16", torch.float16, False, None), ("bf16", torch.bfloat16, False, None),
         ("fp32", torch.float32, False, None), ("tf32", torch.float32, True, None),
         ("amp-fp16", torch.float32, False, torch.float16))


def batches(count: int, device):
    """count LiDAR batches (ray-cast scans, a quarter of a full scan each, voxelized on the
    Waymo grid): thousands of voxels, the networks' real layers."""
    from flexplan.workloads import lidar_batch, lidar_scans

    scans = lidar_scans(2, 0, device, beams=32, azimuth_steps=1000)
    return [lidar_batch(step, 2, 0, device, scans=scans) for step in range(count)]


def autocast(dtype):
    return torch.autocast("cuda", dtype=dtype) if dtype else contextlib.nullcontext()


def run(steps: int = 2) -> None:
    import flexplan.nn.spconv as sp
    from e2e_networks import NETWORKS

    device = torch.device("cuda")
    data = batches(steps, device)
    for (mode, dtype, tf32, amp), (net_name, net_cls) in itertools.product(MODES, NETWORKS.items()):
        torch.manual_seed(0)
        net = net_cls(sp).to(device).to(dtype)
        for module in net.modules():  # flexplan's layers: TF32 only when asked (allow_tf32)
            if hasattr(module, "allow_tf32"):
                module.allow_tf32 = tf32
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        for batch in data:
            x = sp.SparseConvTensor(batch.features.to(dtype), batch.indices,
                                    list(batch.spatial_shape), batch.batch_size)
            net.train()
            opt.zero_grad(set_to_none=True)
            with autocast(amp):
                loss = net.loss(net(x), batch.labels)
            loss.backward()
            opt.step()
            net.eval()
            with torch.no_grad(), autocast(amp):
                net(x)
        torch.cuda.synchronize()
        print(f"aot_workload: {net_name} {mode}: {steps} train steps + inference calls, "
              f"{batch.indices.shape[0]} voxels in the last batch", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("aot_workload: needs a GPU")
        return 1
    run(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
