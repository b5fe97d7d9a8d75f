"""Plan build time (submanifold 3x3x3): flexplan vs spconv 2.3's index generation, one GPU run.

Sphere shells at R = 256, 512, 1024 (batch 1). flexplan: the whole build_plan (hash-table
neighbour map with the coords check on the way, Gray-code sort, valid_kernel for every
PLAN_BLOCK_SIZES entry, valid_signal) and each part alone, plus the CUDA kernels / memory ops
and host syncs of one build (torch.profiler); the torch backend for reference. spconv: the index
generation SubMConv3d runs on its first call, get_indice_pairs_implicit_gemm (MaskImplicitGemm,
training: forward and backward masks, mask argsort) and get_indice_pairs (native algorithm).
Times: triton.testing.do_bench median ms (warm-up included); the verdict (flexplan's build
with the coords check against spconv's training pairs) compares medians of ROUNDS rounds that
time both in turn. Also checks that the Triton plan
equals the torch plan exactly, and records the GPU's dense fp16 rate (a throttled or shared GPU
shows there). Writes scripts/results/bench_planner.md.

Usage: python scripts/bench_planner.py [--sizes 256 512 1024]
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import triton
from triton.testing import do_bench

from flexplan import ConvGeometry, build_plan
from flexplan.kernel_configs import PLAN_BLOCK_SIZES
from flexplan.plan import mirrored_signal_offsets
from flexplan.planner.hashmap import submanifold_neighbor_map_triton
from flexplan.planner.reference import submanifold_neighbor_map_torch
from flexplan.planner.segments import gather_map, plan_schedule, valid_signal
from flexplan.sparse_tensor import check_coords
from flexplan.workloads import sphere_shell

from bench_common import dense_tflops, host_launch_us, today

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_planner.md")
DATE = today()
GEOMETRY = ConvGeometry.make(3)
SIGNAL_OFFSETS = mirrored_signal_offsets(GEOMETRY.volume)  # what build_plan keeps
ROUNDS = 5
OURS, THEIRS = "flexplan build_plan (check=True)", "spconv implicit-gemm pairs (train)"


def bench(fn):
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def alternating(fns: dict) -> dict:
    """Median of ROUNDS timings of each fn, taken in turn round after round: the build is
    host-bound at small sizes, and host speed drifts within a run, for both sides alike."""
    times = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            times[name].append(bench(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def plans_equal(a, b) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def device_work(fn) -> tuple[int, int]:
    """(CUDA kernels + memcpys + memsets, host syncs) of one call of fn, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # compiled and cached before counting
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()  # a cudaDeviceSynchronize: not counted below
    events = prof.events()
    device = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)
    syncs = sum(e.name == "cudaStreamSynchronize" for e in events)
    return device, syncs


def spconv_timers(coords, r):
    """{name: fn} of spconv's SubMConv3d(k=3) index generation, or {} without spconv."""
    try:
        from spconv.core import ConvAlgo
        from spconv.pytorch import ops
    except ImportError as e:
        print("spconv unavailable:", e)
        return {}
    args = dict(ksize=[3] * 3, stride=[1] * 3, padding=[1] * 3, dilation=[1] * 3,
                out_padding=[0] * 3, subm=True, transpose=False)
    return {
        "spconv implicit-gemm pairs (train)": lambda: ops.get_indice_pairs_implicit_gemm(
            coords, 1, [r] * 3, ConvAlgo.MaskImplicitGemm, is_train=True, **args),
        "spconv native pairs": lambda: ops.get_indice_pairs(
            coords, 1, [r] * 3, ConvAlgo.Native, args["ksize"], args["stride"], args["padding"],
            args["dilation"], args["out_padding"], True, False),
    }


def run_size(r):
    coords = sphere_shell(r, 1, device="cuda")
    shape = (r, r, r)
    nmap, _ = submanifold_neighbor_map_triton(coords, shape, 1, GEOMETRY)
    equal = plans_equal(build_plan(coords, shape, 1, GEOMETRY, backend="triton"),
                        build_plan(coords, shape, 1, GEOMETRY, backend="torch"))
    times = {
        "flexplan build_plan (check=True)": lambda: build_plan(coords, shape, 1, GEOMETRY),
        "flexplan build_plan (check=False)": lambda: build_plan(coords, shape, 1, GEOMETRY,
                                                                check=False),
        "  neighbour map + coords check (hash table)": lambda: submanifold_neighbor_map_triton(
            coords, shape, 1, GEOMETRY),
        "  schedule: gray sort, valid_kernel (all blocks), valid_signal": lambda: plan_schedule(
            nmap, PLAN_BLOCK_SIZES, signal_offsets=SIGNAL_OFFSETS),
        "check_coords alone (SparseTensor's check)": lambda: check_coords(coords, shape, 1),
        "torch backend build_plan": lambda: build_plan(coords, shape, 1, GEOMETRY,
                                                       backend="torch"),
        "  torch neighbour map": lambda: submanifold_neighbor_map_torch(coords, shape, 1,
                                                                        GEOMETRY),
        "  torch gray sort + valid_kernel": lambda: gather_map(nmap, PLAN_BLOCK_SIZES,
                                                               backend="torch"),
        "  torch valid_signal": lambda: valid_signal(nmap, "torch", SIGNAL_OFFSETS),
    }
    times.update(spconv_timers(coords, r))
    row = {"R": r, "N": coords.shape[0], "equal": equal}
    for name, fn in times.items():
        try:
            row[name] = bench(fn)
        except Exception as e:  # keep the other rows; report the failure
            row[name] = f"failed: {type(e).__name__}: {e}"[:120]
        print(f"R={r} {name}: {row[name]}", flush=True)
    if isinstance(row.get(THEIRS), float):
        for name, t in alternating({OURS: times[OURS], THEIRS: times[THEIRS]}).items():
            row[f"{name}, {ROUNDS} alternating rounds"] = t
            print(f"R={r} {name}, {ROUNDS} alternating rounds: {t}", flush=True)
    for check in (True, False):
        launches, syncs = device_work(lambda: build_plan(coords, shape, 1, GEOMETRY, check=check))
        row[f"CUDA kernels + memops per build_plan (check={check})"] = launches
        row[f"host syncs per build_plan (check={check})"] = syncs
        print(f"R={r} check={check}: {launches} kernels + memops, {syncs} host syncs", flush=True)
    del nmap
    torch.cuda.empty_cache()
    return row


def write_report(rows, header):
    names = [k for k in rows[0] if k not in ("R", "N", "equal")]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["# bench_planner: submanifold 3x3x3 plan build, flexplan vs spconv 2.3", "", header, "",
             "Sphere shells (flexplan.workloads.sphere_shell, batch 1). Median ms "
             "(triton.testing.do_bench). Indented rows are parts of the row above. Kernels + "
             "memops and host syncs: torch.profiler's CUDA events and cudaStreamSynchronize "
             "calls of one build.", "",
             "| step | " + " | ".join(f"R={r['R']} (N={r['N']})" for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for name in names:
        lines.append(f"| {name.replace('  ', '&nbsp;&nbsp;')} | "
                     + " | ".join(fmt(r.get(name)) for r in rows) + " |")
    lines.append("| Triton plan == torch plan | " + " | ".join(str(r["equal"]) for r in rows) + " |")
    for r in rows:
        ours, theirs = (r.get(f"{name}, {ROUNDS} alternating rounds") for name in (OURS, THEIRS))
        if isinstance(ours, float) and isinstance(theirs, float):
            lines.append(f"- R={r['R']}: spconv / flexplan full plan = {theirs / ours:.2f}x "
                         f"(medians of the {ROUNDS} alternating rounds)")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024])
    args = parser.parse_args()
    try:
        import spconv
        sp_version = spconv.__version__
    except ImportError:
        sp_version = "not installed"
    header = (f"GPU {torch.cuda.get_device_name()} (dense fp16 {dense_tflops():.0f} TFLOPS "
              f"measured); host {host_launch_us():.1f} us per small torch launch; torch "
              f"{torch.__version__}; Triton {triton.__version__}; spconv {sp_version}; date {DATE}.")
    print(header)
    write_report([run_size(r) for r in args.sizes], header)


if __name__ == "__main__":
    main()
