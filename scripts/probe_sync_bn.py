"""Host time of one training BatchNorm layer (forward + backward), per call, on every rank of a
process group (issue #26: what flexplan's SyncBatchNorm costs at 2 ranks, where the DDP step
loses its scaling; scripts/results/bench_ddp.md, session 44).

Variants, each on [rows, C] features like the LiDAR encoder's layers (fp16 on GPUs):
  flexplan-direct   flexplan.nn.SyncBatchNorm, collectives through the group's allreduce
  flexplan-dist     the same through dist.all_reduce (FLEXPLAN_SYNC_BN_DIRECT=0's path)
  torch-sync        torch.nn.SyncBatchNorm (GPUs only: it needs CUDA)
  per-rank          torch.nn.BatchNorm1d, no collective
Each rank runs the same loop of calls with no host sync inside (a host-bound step's view),
after a barrier; us per call is the slowest rank's window / calls.

Usage (2 GPUs): python3 scripts/probe_sync_bn.py [--world 2] [--rows 55000]
                [--channels 16,64,128] [--calls 200]
CPU (gloo; flexplan's torch-op path, no torch-sync): add --device cpu
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("flexplan-direct", "flexplan-dist", "torch-sync", "per-rank")


def _module(variant: str, channels: int, device: torch.device) -> torch.nn.Module:
    from flexplan.nn import SyncBatchNorm

    if variant.startswith("flexplan"):
        return SyncBatchNorm(channels, eps=1e-3, momentum=0.01).to(device)
    if variant == "torch-sync":
        return torch.nn.SyncBatchNorm(channels, eps=1e-3, momentum=0.01).to(device)
    return torch.nn.BatchNorm1d(channels, eps=1e-3, momentum=0.01).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(rank: int, world: int, args, init_file: str, out_dir: str) -> None:
    from flexplan.nn import sync_batchnorm

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    dtype = torch.float16 if cuda else torch.float32
    results = {}
    try:
        for channels in (int(c) for c in args.channels.split(",")):
            gen = torch.Generator().manual_seed(rank)
            x = torch.randn(args.rows, channels, generator=gen).to(device, dtype)
            x.requires_grad_(True)
            grad = torch.randn(args.rows, channels, generator=gen).to(device, dtype)
            for variant in VARIANTS:
                if variant == "torch-sync" and not cuda:
                    continue
                sync_batchnorm.direct_all_reduce = variant != "flexplan-dist"
                bn = _module(variant, channels, device)
                for _ in range(20):
                    bn(x).backward(grad)
                _sync(device)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.calls):
                    bn(x).backward(grad)
                _sync(device)
                results[(channels, variant)] = (time.perf_counter() - start) / args.calls
    finally:
        sync_batchnorm.direct_all_reduce = True
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rows", type=int, default=55000)
    p.add_argument("--channels", default="16,64,128")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        p.error(f"--world {args.world}: {torch.cuda.device_count()} GPUs here")
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "init")
        mp.spawn(_rank, args=(args.world, args, init_file, out_dir), nprocs=args.world)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(args.world)]
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (gloo)"
    print(f"{where}, {args.world} ranks, {args.rows} rows per rank, {args.calls} calls: us per "
          "BatchNorm forward + backward (the slowest rank)")
    print("| C | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS))
    for channels in (int(c) for c in args.channels.split(",")):
        cells = []
        for variant in VARIANTS:
            times = [r.get((channels, variant)) for r in ranks]
            cells.append("-" if None in times else f"{max(times) * 1e6:.0f}")
        print(f"| {channels} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
