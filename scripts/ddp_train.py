"""DistributedDataParallel training of the scripts/bench_e2e.py networks, one process per rank,
shared by scripts/bench_ddp.py (throughput) and tests/test_ddp.py (gradients).

Each rank trains on its own stream of fresh LiDAR-like batches (flexplan.workloads.lidar_batch,
seeded by rank), as a data-parallel detector job does; every rank points FLEXPLAN_CACHE_DIR at
the same directory. On GPUs rank r runs on cuda:r with SyncBatchNorm and NCCL; on the CPU, gloo
and plain BatchNorm (torch's SyncBatchNorm needs GPUs), or flexplan's SyncBatchNorm where the
job asks for it (sync_bn_impl="flexplan": it needs only all_reduce, which gloo has).

run(world_size, job) spawns the ranks and returns what each rank's job wrote (a dict per rank).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Job:
    """One training run on every rank."""
    library: str = "flexplan"  # or "spconv"
    network: str = "encoder"  # bench_e2e network
    small: bool = False  # bench_e2e's --small sizes (tests)
    device: str = "cuda"  # "cuda" (rank r on cuda:r, NCCL, SyncBatchNorm) or "cpu" (gloo)
    dtype: str = "fp16"  # fp16 (model and data half) or fp32
    scans_per_rank: int = 2
    warmup: int = 10
    steps: int = 30
    seed: int = 0
    cache_dir: str = ""  # shared by the ranks ("" : a new temp dir)
    sync_bn: bool = True  # SyncBatchNorm on GPUs (False: each rank's own statistics)
    # whose SyncBatchNorm: "torch" (nn.SyncBatchNorm, GPUs only; it syncs with the host in
    # every forward) or "flexplan" (flexplan.nn.SyncBatchNorm: no host syncs; CPU ranks too)
    sync_bn_impl: str = "torch"
    record_grads: bool = False  # write each parameter's gradient after one step (no timing)
    # "step": every timed step starts with the ranks synchronized (GPU drained, barrier) and ends
    # with its GPU work done; "window": one barrier before the timed steps and one GPU drain
    # after them, as a training job runs (a rank's host may run ahead into its next step while
    # the GPUs finish; the collectives alone align the ranks). Each step's time is then the
    # window's mean.
    timing: str = "step"
    ddp: bool = True  # False: each rank trains its own model alone, no collective (host and
    #                   machine contention between the ranks' processes, nothing else)
    pin_cpus: bool = False  # each rank on its own share of this process's CPUs (in order)
    # DistributedDataParallel's broadcast_buffers: True (torch's default, OpenPCDet's) copies
    # rank 0's BatchNorm buffers to every rank before each forward (a collective and a copy per
    # buffer); mmengine (mmdet3d) passes False. Under SyncBatchNorm the buffers agree anyway.
    broadcast_buffers: bool = True
    # a file: rank 0's timed steps run under torch.profiler (CPU side: host calls, CUDA API
    # calls such as synchronizations, collectives) and its table is written there
    profile: str = ""
    # a file prefix: every rank's timed window (window timing) runs under torch.profiler with
    # CUDA activity only (kernels and CUDA API calls, no Python ops: little host cost), written
    # as a Chrome trace PREFIX-rank<r>.json (scripts/trace_summary.py reads them)
    trace: str = ""
    # environment variables each rank sets (None: unsets) before it imports flexplan; this
    # process's own stay as they are (e.g. TRITON_INTERPRET off in the ranks only: a kernel
    # module imported while it is off here would stay compiled-mode for this process)
    env: dict = field(default_factory=dict)


def namespace(library: str):
    if library == "spconv":
        import spconv.pytorch as sp
        return sp
    import flexplan.nn.spconv as sp
    return sp


def make_model(job: Job, device: torch.device, distributed: bool) -> nn.Module:
    from bench_e2e import sizes_for
    from e2e_networks import NETWORKS

    torch.manual_seed(job.seed)  # the same initial weights on every rank and in references
    sizes = sizes_for(job.small)
    net = NETWORKS[job.network](namespace(job.library), base=sizes.base)
    if distributed and job.sync_bn:
        if job.sync_bn_impl == "flexplan":
            from flexplan.nn import convert_sync_batchnorm

            net = convert_sync_batchnorm(net)
        elif job.sync_bn_impl != "torch":
            raise ValueError(f"sync_bn_impl {job.sync_bn_impl!r}: 'torch' or 'flexplan'")
        elif device.type == "cuda":
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = net.to(device)
    return net.half() if job.dtype == "fp16" else net


def batches_for(job: Job, rank: int, count: int, device: torch.device) -> list:
    """The first `count` fresh batches of rank `rank`'s stream."""
    from bench_e2e import sizes_for
    from flexplan.workloads import lidar_batch, lidar_scans

    sizes = sizes_for(job.small)
    scans = lidar_scans(sizes.scenes, job.seed, device, **sizes.scan)
    out = []
    for step in range(count):
        b = lidar_batch(step, job.scans_per_rank, job.seed + 1000 * (rank + 1), device,
                        sizes.grid, scans=scans)
        out.append(b._replace(features=b.features.half()) if job.dtype == "fp16" else b)
    return out


def train_step(model, loss_fn, opt, batch, sp, batch_size: int) -> tuple[float, float]:
    """One step; (host seconds making the input tensor, host seconds for the rest). Making a
    flexplan tensor checks new coordinates, which waits for the GPU to finish the work queued
    before: with window timing a GPU that lags its host shows there (spconv's tensor checks
    nothing; with step timing the GPU is drained before every step)."""
    start = time.perf_counter()
    x = sp.SparseConvTensor(batch.features, batch.indices, list(batch.spatial_shape), batch_size)
    made = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss_fn(model(x), batch.labels).backward()
    opt.step()
    return made - start, time.perf_counter() - made


def _rank_main(rank: int, world_size: int, job: Job, init_file: str, out_dir: str) -> None:
    os.environ["FLEXPLAN_CACHE_DIR"] = job.cache_dir
    for name, value in job.env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if job.pin_cpus:
        cpus = sorted(os.sched_getaffinity(0))
        share = max(1, len(cpus) // world_size)
        os.sched_setaffinity(0, cpus[rank * share:(rank + 1) * share] or cpus)
    use_cuda = job.device == "cuda"
    if use_cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world_size)
    try:
        result = _train(rank, world_size, job, device)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _train(rank: int, world_size: int, job: Job, device: torch.device) -> dict:
    sp = namespace(job.library)
    net = make_model(job, device, distributed=job.ddp)
    loss_fn = type(net).loss
    model = nn.parallel.DistributedDataParallel(
        net, device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=job.broadcast_buffers) if job.ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if job.record_grads:
        batch = batches_for(job, rank, 1, device)[0]
        x = sp.SparseConvTensor(batch.features, batch.indices, list(batch.spatial_shape),
                                job.scans_per_rank)
        loss_fn(model(x), batch.labels).backward()
        return {"grads": {n: p.grad.detach().cpu() for n, p in net.named_parameters()}}
    batches = batches_for(job, rank, job.warmup + job.steps, device)
    for b in batches[:job.warmup]:
        train_step(model, loss_fn, opt, b, sp, job.scans_per_rank)
    compiles_before = _compiles()
    times, host = [], []
    if job.timing == "window":
        profiler = _profiler(job, rank)
        if profiler is not None:  # (started before the barrier: its start-up is not timed)
            profiler.start()
        torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for b in batches[job.warmup:]:
            host.append(train_step(model, loss_fn, opt, b, sp, job.scans_per_rank))
        torch.cuda.synchronize(device)
        times = [(time.perf_counter() - start) / job.steps] * job.steps
        if profiler is not None:  # (stopped after the window: its flush is not timed)
            profiler.stop()
        if profiler is not None and job.trace:
            profiler.export_chrome_trace(f"{job.trace}-rank{rank}.json")
        elif profiler is not None:
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            with open(job.profile, "w") as f:
                f.write(f"rank {rank} of {world_size}, {job.steps} steps\n{table}\n")
    elif job.timing == "step":
        for b in batches[job.warmup:]:
            torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            host.append(train_step(model, loss_fn, opt, b, sp, job.scans_per_rank))
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    else:
        raise ValueError(f"timing {job.timing!r}: 'step' or 'window'")
    voxels = sum(b.indices.shape[0] for b in batches[job.warmup:]) / job.steps
    return {"times": times, "voxels": voxels, "compiles": _compiles() - compiles_before,
            "input_s": [h[0] for h in host], "rest_s": [h[1] for h in host]}


def _profiler(job: Job, rank: int):
    """torch.profiler over the timed window: every rank's, CUDA activity only (Job.trace), or
    rank 0's, CPU activity only (Job.profile: the host's calls, where a host-bound rank's time
    goes); else None."""
    if job.trace:
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    if not job.profile or rank != 0:
        return None
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def _compiles() -> int:
    """Triton kernel binaries flexplan's kernels hold in this process so far (bench_e2e's count:
    JIT compiles and binaries an AOT bundle handed to the JIT)."""
    from bench_e2e import flexplan_jit_functions, jit_cache_entries

    return sum(jit_cache_entries(flexplan_jit_functions()).values())


def run(world_size: int, job: Job) -> list[dict]:
    """Spawn world_size ranks running `job`; each rank's result, by rank."""
    with tempfile.TemporaryDirectory(prefix="flexplan-ddp-") as tmp:
        if not job.cache_dir:
            job.cache_dir = os.path.join(tmp, "cache")
        init_file = os.path.join(tmp, "init")
        mp.spawn(_rank_main, args=(world_size, job, init_file, tmp), nprocs=world_size, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world_size)]


def single_process_grads(job: Job, rank: int, device: torch.device) -> dict:
    """The gradients DistributedDataParallel averages, computed without it: rank `rank`'s first
    batch through a plain (not synchronized) copy of the same model."""
    sp = namespace(job.library)
    net = make_model(job, device, distributed=False)
    batch = batches_for(job, rank, 1, device)[0]
    x = sp.SparseConvTensor(batch.features, batch.indices, list(batch.spatial_shape),
                            job.scans_per_rank)
    type(net).loss(net(x), batch.labels).backward()
    return {n: p.grad.detach().cpu() for n, p in net.named_parameters()}


def combined_grads(job: Job, world_size: int, device: torch.device) -> dict:
    """What a SyncBatchNorm DDP step of world_size ranks computes, in one process: every rank's
    first batch in one tensor (batch indices offset by rank), plain BatchNorm over all of it.
    Equal to DDP's averaged gradient where the loss is a mean over equally sized per-rank parts
    (the encoder's BEV map: every rank has scans_per_rank maps of one size)."""
    sp = namespace(job.library)
    net = make_model(job, device, distributed=False)
    parts = [batches_for(job, r, 1, device)[0] for r in range(world_size)]
    indices = []
    for r, b in enumerate(parts):
        shifted = b.indices.clone()
        shifted[:, 0] += r * job.scans_per_rank
        indices.append(shifted)
    x = sp.SparseConvTensor(torch.cat([b.features for b in parts]), torch.cat(indices),
                            list(parts[0].spatial_shape), job.scans_per_rank * world_size)
    type(net).loss(net(x), torch.cat([b.labels for b in parts])).backward()
    return {n: p.grad.detach().cpu() for n, p in net.named_parameters()}
