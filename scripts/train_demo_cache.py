"""Two training epochs over a small synthetic dataset, plans built in DataLoader workers.

Epoch 1: each worker builds the plan of its sample on the CPU (or finds it, if another worker
or an earlier run built it) and the plan travels with the batch: pinned by the DataLoader, then
copied to the GPU with non_blocking=True. Plans are written to the disk cache on their second
sighting (flexplan/cache/admission.py): epoch 2's workers, with empty memory, see each sample's
coordinates again and build and write them; epoch 3's load them all. Prints time per epoch and
where the plans came from.

    python scripts/train_demo_cache.py            # GPU sizes
    python scripts/train_demo_cache.py --tiny     # a few seconds on a CPU
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from flexplan import ConvGeometry, build_plan
from flexplan.ops import sparse_conv
from flexplan.workloads import random_coords, sphere_shell

GEOM = ConvGeometry.submanifold_conv(3)


class ShapesDataset(torch.utils.data.Dataset):
    """Sphere shells of varying radius, alternating with random voxel clouds; fixed per index."""

    def __init__(self, count: int, resolution: int, channels: int):
        self.count, self.resolution, self.channels = count, resolution, channels

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        from flexplan.cache import plan_cache

        g = torch.Generator().manual_seed(index)
        r = self.resolution
        if index % 2:
            coords = random_coords(r ** 3 // 20, (r, r, r), 1, generator=g)
        else:
            size = r // 2 + int(torch.randint(0, r // 2 + 1, (1,), generator=g))
            coords = sphere_shell(size)
        shape = (r, r, r)
        before = plan_cache.stats().get("builds", 0)
        plan = plan_cache.get_or_build(coords, shape, 1, GEOM, check=False)
        built = plan_cache.stats().get("builds", 0) > before
        feats = torch.randn(coords.shape[0], self.channels, generator=g)
        return feats, plan, built


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-sized run")
    parser.add_argument("--samples", type=int)
    parser.add_argument("--resolution", type=int)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-dir", help="plan cache root (default: a fresh temporary one)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    samples = args.samples or (8 if args.tiny else 32)
    resolution = args.resolution or (24 if args.tiny else 192)
    os.environ["FLEXPLAN_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="flexplan_demo_")
    os.environ.setdefault("FLEXPLAN_PLAN_CACHE", "auto")  # CPU builds are slow: auto stores them
    channels = 16
    algo = "auto" if device.type == "cuda" else "explicit"  # explicit: no Triton interpreter on CPU

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(0.1 * torch.randn(channels, 3, 3, 3, channels, device=device))
               for _ in range(2)]
    opt = torch.optim.SGD(weights, lr=1e-3)
    loader = torch.utils.data.DataLoader(
        ShapesDataset(samples, resolution, channels), batch_size=None, shuffle=True,
        num_workers=args.workers, pin_memory=device.type == "cuda")
    def step(feats, plan):
        x = feats
        for w in weights:
            x = torch.relu(sparse_conv(x, plan, w, algo=algo))
        loss = x.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    # Compile the conv kernels first (on a plan outside the cache), so epoch 1 times plans.
    warm = sphere_shell(16, device=device)
    step(torch.randn(warm.shape[0], channels, device=device), build_plan(warm, (16,) * 3, 1, GEOM))
    print(f"device {device}, {samples} samples at {resolution}^3, {args.workers} workers, "
          f"cache {os.environ['FLEXPLAN_CACHE_DIR']}")
    for epoch in (1, 2, 3):
        start, built, voxels = time.perf_counter(), 0, 0
        for feats, plan, was_built in loader:
            feats = feats.to(device, non_blocking=True)
            plan = plan.to(device, non_blocking=True)
            step(feats, plan)
            built += int(was_built)
            voxels += plan.num_in
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(f"epoch {epoch}: {seconds:.2f} s, {voxels:,} voxels, plans built {built}, "
              f"from cache {samples - built}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
