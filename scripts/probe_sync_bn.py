"""Host time of one training BatchNorm layer (forward + backward), per call, on every rank of a
process group (issue #26: what flexplan's SyncBatchNorm costs at 2 ranks, where the DDP step
loses its scaling; scripts/results/bench_ddp.md, session 44).

Variants, each on [rows, C] features like the LiDAR encoder's layers (fp16 on GPUs):
  flexplan-direct   flexplan.nn.SyncBatchNorm, collectives through the group's allreduce
  flexplan-dist     the same through dist.all_reduce (FLEXPLAN_SYNC_BN_DIRECT=0's path)
  torch-sync        torch.nn.SyncBatchNorm (GPUs only: it needs CUDA)
  per-rank          torch.nn.BatchNorm1d, no collective
and, per call, one collective alone (a SyncBatchNorm layer makes two per step):
  allreduce-c10d    the group's allreduce of 2C + 1 float64 values (SyncBatchNorm's path)
  allreduce-nccl    ncclAllReduce of the same through ctypes on a communicator of this
                    probe's own (CUDA only): the collective without c10d's host work
Each rank runs the same loop of calls with no host sync inside (a host-bound step's view),
after a barrier; us per call is the slowest rank's window / calls.

Usage (2 GPUs): python3 scripts/probe_sync_bn.py [--world 2] [--rows 55000]
                [--channels 16,64,128] [--calls 200]
CPU (gloo; flexplan's torch-op path, no torch-sync): add --device cpu
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("flexplan-direct", "flexplan-dist", "torch-sync", "per-rank", "allreduce-c10d",
            "allreduce-nccl")


class RawNccl:
    """A NCCL communicator of the group's ranks through ctypes (libnccl as torch loaded it)."""

    def __init__(self, rank: int, world: int, device: torch.device):
        import ctypes

        class UniqueId(ctypes.Structure):  # (a struct: passed by value, as NCCL takes it)
            _fields_ = [("internal", ctypes.c_byte * 128)]

        self.lib = lib = ctypes.CDLL("libnccl.so.2")
        uid = UniqueId()
        if rank == 0:
            rc = lib.ncclGetUniqueId(ctypes.byref(uid))
            if rc:
                raise RuntimeError(f"ncclGetUniqueId: {rc}")
        shared = torch.tensor(list(bytes(uid)), dtype=torch.uint8, device=device)
        dist.broadcast(shared, 0)
        uid = UniqueId.from_buffer_copy(bytes(shared.cpu().tolist()))
        self.comm = ctypes.c_void_p()
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId,
                                         ctypes.c_int]
        rc = lib.ncclCommInitRank(ctypes.byref(self.comm), world, uid, rank)
        if rc:
            raise RuntimeError(f"ncclCommInitRank: {rc}")
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_void_p]

    def all_reduce_sum_f64(self, t: torch.Tensor) -> None:
        rc = self.lib.ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), 8, 0, self.comm,
                                    torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"ncclAllReduce: {rc}")


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


def _timed(op, calls: int, device: torch.device) -> tuple[float, float]:
    """(seconds per call, until the GPU finished; seconds per call the host took to queue)."""
    for _ in range(20):
        op()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        op()
    queued = time.perf_counter()
    _sync(device)
    return (time.perf_counter() - start) / calls, (queued - start) / calls


class _Identity(torch.autograd.Function):
    """An autograd Function doing nothing: what a Python Function's forward + backward cost."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _ReduceInBackward(torch.autograd.Function):
    """An Identity whose backward all-reduces a small tensor (the autograd thread's collective)."""

    @staticmethod
    def forward(ctx, x, stats, group):
        ctx.stats, ctx.group = stats, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        from flexplan.nn import sync_batchnorm as sbn

        sbn.all_reduce_sum(ctx.stats, ctx.group)
        return g, None, None


class _OpsInBackward(torch.autograd.Function):
    """An Identity whose backward runs the SyncBatchNorm backward's torch ops, no collective."""

    @staticmethod
    def forward(ctx, x, xd, m, s, w, count):
        ctx.save_for_backward(xd, m, s, w, count)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        xd, m, s, w, count = ctx.saved_tensors
        c = xd.shape[1]
        sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(g, xd, m, s, w, True, True,
                                                                    True)
        combined = torch.cat([sum_dy, sum_dy_xmu])
        return (torch.batch_norm_backward_elemt(g, xd, m, s, w, *combined.split(c),
                                                count), None, None, None, None, None)


def _parts(x: torch.Tensor, grad: torch.Tensor, calls: int, device) -> dict:
    """Host us per call of each piece of flexplan's SyncBatchNorm kernel path (every rank runs
    the same pieces in the same order: the collectives pair up)."""
    from flexplan.nn import sync_batchnorm as sbn

    channels = x.shape[1]
    group = dist.group.WORLD
    bn = sbn.SyncBatchNorm(channels, eps=1e-3, momentum=0.01).to(device)
    xd = x.detach()
    mean, invstd = torch.batch_norm_stats(xd, 0.0)
    packed = sbn.pack_sums(mean, invstd, xd.shape[0])
    stats, count = sbn.finalize_sums(packed, torch.float32, 1e-3, 0.01, bn.num_batches_tracked,
                                     bn.running_mean, bn.running_var)
    m, s = stats[0], stats[1]
    w = bn.weight.detach().float()
    sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(grad, xd, m, s, w, True, True,
                                                                True)
    combined = torch.cat([sum_dy, sum_dy_xmu])
    y = x.detach().requires_grad_(True)
    pieces = {
        "batch_norm_stats": lambda: torch.batch_norm_stats(xd, 0.0),
        "pack_sums (empty + launch)": lambda: sbn.pack_sums(mean, invstd, xd.shape[0]),
        "all_reduce_sum": lambda: sbn.all_reduce_sum(packed, group),
        "finalize_sums (2 empty + launch; counts the batch)": lambda: sbn.finalize_sums(
            packed, torch.float32, 1e-3, 0.01, bn.num_batches_tracked, bn.running_mean,
            bn.running_var),
        "stats.unbind(0)": lambda: stats.unbind(0),
        "batch_norm_elemt": lambda: torch.batch_norm_elemt(xd, w, w, m, s, 1e-3),
        "batch_norm_backward_reduce": lambda: torch.batch_norm_backward_reduce(
            grad, xd, m, s, w, True, True, True),
        "cat": lambda: torch.cat([sum_dy, sum_dy_xmu]),
        "combined.split(C)": lambda: combined.split(channels),
        "batch_norm_backward_elemt": lambda: torch.batch_norm_backward_elemt(
            grad, xd, m, s, w, sum_dy, sum_dy_xmu, count),
        "module._group()": bn._group,
        "Identity Function fwd + bwd": lambda: _Identity.apply(y).backward(grad),
        "Identity, all_reduce_sum in its backward": lambda: _ReduceInBackward.apply(
            y, packed, group).backward(grad),
        "Identity, the backward's torch ops in its backward": lambda: _OpsInBackward.apply(
            y, xd, m, s, w, count).backward(grad),
        "module fwd + bwd": lambda: bn(y).backward(grad),
        "module fwd (no_grad input)": lambda: bn(xd),
    }
    return {name: _timed(op, calls, device)[1] for name, op in pieces.items()}


def _rank(rank: int, world: int, args, init_file: str, out_dir: str) -> None:
    from flexplan.nn import sync_batchnorm

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    dtype = torch.float16 if cuda else torch.float32
    results, raw = {}, None
    try:
        if args.parts:
            gen = torch.Generator().manual_seed(rank)
            channels = int(args.channels.split(",")[0])
            x = torch.randn(args.rows, channels, generator=gen).to(device, dtype)
            grad = torch.randn(args.rows, channels, generator=gen).to(device, dtype)
            results = _parts(x, grad, args.calls, device)
            torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
            return
        for channels in (int(c) for c in args.channels.split(",")):
            gen = torch.Generator().manual_seed(rank)
            x = torch.randn(args.rows, channels, generator=gen).to(device, dtype)
            x.requires_grad_(True)
            grad = torch.randn(args.rows, channels, generator=gen).to(device, dtype)
            for variant in VARIANTS:
                if variant in ("torch-sync", "allreduce-nccl") and not cuda:
                    continue
                sync_batchnorm.direct_all_reduce = variant != "flexplan-dist"
                if variant.startswith("allreduce"):
                    stats = torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)
                    if variant == "allreduce-nccl":
                        raw = raw or RawNccl(rank, world, device)
                        op = (lambda: raw.all_reduce_sum_f64(stats))
                    else:
                        op = (lambda: sync_batchnorm.all_reduce_sum(stats, dist.group.WORLD))
                    results[(channels, variant)] = _timed(op, args.calls, device)
                    continue
                bn = _module(variant, channels, device)
                results[(channels, variant)] = _timed(lambda: bn(x).backward(grad), args.calls,
                                                      device)
                if args.profile and variant in args.profile.split(","):
                    # (every rank runs the calls: their collectives pair up; rank 0 records)
                    from torch.profiler import ProfilerActivity, profile

                    with (profile(activities=[ProfilerActivity.CPU]) if rank == 0
                          else contextlib.nullcontext()) as prof:
                        for _ in range(50):
                            bn(x).backward(grad)
                        _sync(device)
                    if rank == 0:
                        print(f"rank 0, C {channels}, {variant}, 50 calls under torch.profiler:\n"
                              + prof.key_averages().table(sort_by="self_cpu_time_total",
                                                          row_limit=25), flush=True)
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
    p.add_argument("--parts", action="store_true",
                   help="instead: host us per call of each piece of flexplan's SyncBatchNorm "
                        "(CUDA kernel path; the first of --channels)")
    p.add_argument("--profile", default="",
                   help="variants (comma-separated) whose calls rank 0 also runs under "
                        "torch.profiler (CPU side), printing its table")
    args = p.parse_args()
    if args.parts and args.device != "cuda":
        p.error("--parts times the CUDA kernel path: it needs --device cuda")
    unknown = set(filter(None, args.profile.split(","))) - set(VARIANTS[:4])
    if unknown:
        p.error(f"--profile {args.profile}: profiles the layer variants {VARIANTS[:4]}")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        p.error(f"--world {args.world}: {torch.cuda.device_count()} GPUs here")
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "init")
        mp.spawn(_rank, args=(args.world, args, init_file, out_dir), nprocs=args.world)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(args.world)]
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (gloo)"
    if args.parts:
        print(f"{where}, {args.world} ranks, {args.rows} x {args.channels.split(',')[0]}, "
              f"{args.calls} calls: host us per call, the slowest rank")
        for name in ranks[0]:
            print(f"| {name} | {max(r[name] for r in ranks) * 1e6:.1f} |")
        return 0
    print(f"{where}, {args.world} ranks, {args.rows} rows per rank, {args.calls} calls: us per "
          "BatchNorm forward + backward, or per collective (allreduce-*), the slowest rank: "
          "until the GPU finished / the host's queueing alone")
    print("| C | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS))
    for channels in (int(c) for c in args.channels.split(",")):
        cells = []
        for variant in VARIANTS:
            times = [r.get((channels, variant)) for r in ranks]
            cells.append("-" if None in times else
                         f"{max(t[0] for t in times) * 1e6:.0f} / {max(t[1] for t in times) * 1e6:.0f}")
        print(f"| {channels} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
