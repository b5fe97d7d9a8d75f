"""Where a fresh-coordinate step spends host time: cProfile of flexplan train / inference steps
of the bench_e2e networks (fp16 or another of bench_e2e's modes, a new LiDAR batch every step),
after a warm-up.

Usage (GPU): python3 scripts/profile_host.py [--network encoder|unet] [--phase train|infer]
             [--steps 10] [--sort tottime] [--coords fresh|same] [--impl flexplan|spconv]
             [--mode fp16|fp32|amp-fp16|amp-bf16|bf16] [--kernels] [--no-cprofile]
--impl spconv profiles the same step on spconv (the side-by-side of where each spends its GPU time).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-prof-"))

import flexplan.nn.spconv as flexplan_sp  # noqa: E402
from bench_e2e import MODES, Mode, autocast  # noqa: E402
from e2e_networks import LidarUNet, VoxelResBackBone8x  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans  # noqa: E402

NETS = {"encoder": VoxelResBackBone8x, "unet": LidarUNet}


def step_fn(net, opt, phase: str, mode: Mode, sp=flexplan_sp):
    """One step of the network on a LiDAR batch (features in the mode's dtype): train
    (zero_grad, forward, loss, backward, SGD; a GradScaler where the mode has one) or infer
    (eval, no_grad); under the mode's autocast; no synchronization."""
    device = torch.device("cuda")
    scaler = torch.amp.GradScaler("cuda") if mode.grad_scaler else None

    def step(batch):
        x = sp.SparseConvTensor(batch.features, batch.indices, list(batch.spatial_shape), 2)
        if phase == "train":
            opt.zero_grad(set_to_none=True)
            with autocast(mode, device):
                loss = net.loss(net(x), batch.labels)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        else:
            with torch.no_grad(), autocast(mode, device):
                net.eval()(x)
    return step


def network_setup(network: str, mode: Mode, impl: str = "flexplan"):
    """(net, optimizer, scans, sp): `network` built on `impl`'s spconv namespace (seed 0), on the
    GPU in the mode's dtype, its SGD optimizer, and the LiDAR scans batches are cut from."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    if impl == "spconv":
        import spconv.pytorch as sp
    else:
        sp = flexplan_sp
    net = NETS[network](sp).to(device).to(mode.model_dtype)
    return net, torch.optim.SGD(net.parameters(), lr=1e-3), lidar_scans(2, 0, device), sp


def lidar_batches(seeds, scans, mode: Mode) -> list:
    """A batch of 2 scans per seed (the same seed: the same coordinates), features in the
    mode's input dtype."""
    device = torch.device("cuda")
    return [b._replace(features=b.features.to(mode.input_dtype))
            for b in (lidar_batch(i, 2, 0, device, scans=scans) for i in seeds)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--network", default="encoder", choices=sorted(NETS))
    parser.add_argument("--phase", default="train", choices=("train", "infer"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--lines", type=int, default=45)
    parser.add_argument("--kernels", action="store_true",
                        help="also a torch.profiler table of the steps' GPU kernels")
    parser.add_argument("--coords", default="fresh", choices=("fresh", "same"),
                        help="same: every step on one batch (plans reused)")
    parser.add_argument("--impl", default="flexplan", choices=("flexplan", "spconv"))
    parser.add_argument("--mode", default="fp16", choices=sorted(MODES))
    parser.add_argument("--no-cprofile", action="store_true")
    parser.add_argument("--copies", action="store_true",
                        help="also list the step's CUDA copies and synchronizations per step "
                             "by the op and Python frames that made them (torch.profiler "
                             "with_stack; scripts/trace_summary.py)")
    args = parser.parse_args()
    mode = MODES[args.mode]
    net, opt, scans, sp = network_setup(args.network, mode, args.impl)

    def new_batches(first: int) -> list:
        seeds = [first] * args.steps if args.coords == "same" else range(first, first + args.steps)
        return lidar_batches(seeds, scans, mode)

    batches = new_batches(0)[:10] + new_batches(0 if args.coords == "same" else 10)

    run = step_fn(net, opt, args.phase, mode, sp)

    def step(batch):
        run(batch)
        torch.cuda.synchronize()

    for b in batches[:10]:
        step(b)
    allocator = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    before = {k: torch.cuda.memory_stats().get(k, 0) for k in allocator}
    start = time.perf_counter()
    for b in batches[10:]:
        step(b)
    print(f"{args.impl} {args.network} {args.mode} {args.phase} {args.coords}: "
          f"{(time.perf_counter() - start) / args.steps * 1e3:.1f} ms per step without the profiler")
    # cudaMalloc / cudaFree calls of the caching allocator during the timed steps (each costs
    # far more than a launch): sizes that change every step can fragment its pools.
    print("allocator calls per step: " + ", ".join(
        f"{k} {(torch.cuda.memory_stats().get(k, 0) - before[k]) / args.steps:.2f}"
        for k in allocator))
    if not args.no_cprofile:
        prof = cProfile.Profile()
        batches = new_batches(0 if args.coords == "same" else 100)
        prof.enable()
        for b in batches:
            step(b)
        prof.disable()
        pstats.Stats(prof).sort_stats(args.sort).print_stats(args.lines)
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile

        batches = new_batches(0 if args.coords == "same" else 200)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kprof:
            for b in batches:
                step(b)
        events = kprof.key_averages()
        # Kernel rows only: an op row's self device time counts again the kernels launched
        # inside it that no aten op owns (the Triton ones under SparseConvFunction).
        kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
        gpu_us = sum(e.self_device_time_total for e in kernels)
        launches = sum(e.count for e in kernels)
        print(f"GPU kernel time per step: {gpu_us / args.steps / 1e3:.2f} ms; "
              f"GPU ops per step: {launches / args.steps:.0f}")
        print(events.table(sort_by="self_device_time_total", row_limit=30,
                           max_name_column_width=60))
        # The same kernels by launches per step: in host-bound steps each one is host time.
        print("kernel launches per step, most first:")
        for e in sorted(kernels, key=lambda e: -e.count)[:40]:
            print(f"  {e.count / args.steps:6.1f}  {e.key[:100]}")
    if args.copies:
        from torch.profiler import ProfilerActivity, profile

        from trace_summary import callers, summarize

        batches = new_batches(0 if args.coords == "same" else 300)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     with_stack=True) as cprof:
            for b in batches:
                step(b)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            cprof.export_chrome_trace(path)
            print("\n".join(summarize(path, args.steps)))
            for api in ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaEventSynchronize"):
                print("\n".join(callers(path, api, args.steps)))

if __name__ == "__main__":
    main()
