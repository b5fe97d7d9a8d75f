"""How much of a fresh-coordinate step Python's cyclic garbage collector takes, flexplan and
spconv side by side in one process: gc pauses per step (gc.callbacks, per generation) and the
median step with the collector on, and off (gc.disable around the step, collected between
rounds, so garbage never piles up across rounds).

Usage (GPU): python3 scripts/probe_gc.py [--network encoder|unet] [--phase train|infer]
             [--steps 20] [--rounds 3]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-gc-"))

import flexplan.nn.spconv as flexplan_sp  # noqa: E402
from bench_e2e import MODES  # noqa: E402
from e2e_networks import LidarUNet, VoxelResBackBone8x  # noqa: E402
from profile_host import step_fn  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402

NETS = {"encoder": VoxelResBackBone8x, "unet": LidarUNet}


class Pauses:
    """Wall time inside the collector, per generation, while counting."""

    def __init__(self):
        self.ms = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._start = None
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            g = info["generation"]
            self.ms[g] += (time.perf_counter() - self._start) * 1e3
            self.count[g] += 1
            self._start = None

    def reset(self):
        self.ms, self.count = [0.0, 0.0, 0.0], [0, 0, 0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--network", default="encoder", choices=sorted(NETS))
    parser.add_argument("--phase", default="train", choices=("train", "infer"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import spconv.pytorch as spconv_sp
    device = torch.device("cuda")
    scans = lidar_scans(2, 0, device)
    mode = MODES["fp16"]
    libs = {"flexplan": flexplan_sp, "spconv": spconv_sp}
    steps = {}
    for name, lib in libs.items():
        torch.manual_seed(0)
        net = NETS[args.network](lib).to(device).half()
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        steps[name] = step_fn(net, opt, args.phase, mode, lib)
    pauses = Pauses()
    counter = [0]

    def batch():
        counter[0] += 1
        b = lidar_batch(counter[0], 2, 0, device, scans=scans)
        return b._replace(features=b.features.half())

    for name in libs:  # warm-up
        for _ in range(8):
            steps[name](batch())
    torch.cuda.synchronize()
    print(f"{args.network} {args.phase} fp16 fresh, gc thresholds {gc.get_threshold()}, "
          f"tracked objects {len(gc.get_objects())}")
    for r in range(args.rounds):
        for collector in ("on", "off"):
            for name in libs:
                batches = [batch() for _ in range(args.steps)]
                torch.cuda.synchronize()
                gc.collect()
                pauses.reset()
                times = []
                for b in batches:
                    if collector == "off":
                        gc.disable()
                    start = time.perf_counter()
                    steps[name](b)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - start) * 1e3)
                    gc.enable()
                times.sort()
                n = len(batches)
                print(f"round {r} {name:8s} gc {collector:3s}: median step {times[n // 2]:6.2f} "
                      f"ms, mean {sum(times) / n:6.2f}; gc ms/step "
                      + " ".join(f"g{g} {pauses.ms[g] / n:.2f} ({pauses.count[g] / n:.1f})"
                                 for g in range(3)), flush=True)


if __name__ == "__main__":
    main()
