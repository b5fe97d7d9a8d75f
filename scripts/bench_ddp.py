"""Data-parallel training throughput: the bench_e2e encoder (or U-Net) under
DistributedDataParallel with SyncBatchNorm on 1 and 2 GPUs, fresh coordinates every step on
every rank, flexplan and spconv in the same run (scripts/ddp_train.py runs the ranks).

Usage (GPU machine with 2 GPUs): python3 scripts/bench_ddp.py [--network encoder]
       [--world-sizes 1,2] [--libraries flexplan,spconv] [--steps 30] [--warmup 10]
       [--sync-bn-impl torch|flexplan|torch,flexplan] [--timing step|window] [--no-ddp]
       [--pin-cpus]
--sync-bn-impl picks whose SyncBatchNorm the flexplan runs use (torch's nn.SyncBatchNorm, the
default, or flexplan.nn.SyncBatchNorm, which never syncs with the host; both: a row each);
spconv runs always use torch's, so the library comparison stays the one its users get.
Results: scripts/results/bench_ddp.jsonl (one JSON line per library and world size, with a
world_size field) and bench_ddp.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import ddp_train  # noqa: E402

RESULTS = SCRIPTS / "results" / "bench_ddp.md"


def step_times(results: list[dict]) -> list[float]:
    """Per step, the slowest rank's time (the ranks start each step together)."""
    return [max(ts) for ts in zip(*(r["times"] for r in results))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", default="encoder", choices=("encoder", "unet"))
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--libraries", default="flexplan,spconv")
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "fp32"))
    parser.add_argument("--scans-per-rank", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-sync-bn", action="store_true",
                        help="plain BatchNorm (per-rank statistics) instead of SyncBatchNorm")
    parser.add_argument("--sync-bn-impl", default="torch",
                        help="the flexplan runs' SyncBatchNorm: torch, flexplan, or both "
                             "(torch,flexplan); spconv runs always use torch's")
    parser.add_argument("--timing", default="step", choices=("step", "window"),
                        help="step: ranks aligned and GPUs drained around every timed step; "
                             "window: once around all of them, as a training job runs "
                             "(scripts/ddp_train.py, Job.timing)")
    parser.add_argument("--no-ddp", action="store_true",
                        help="each rank trains alone (no DDP, per-rank BatchNorm): what the "
                             "processes cost each other, with no collective")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="each rank on its own share of the CPUs (Job.pin_cpus)")
    parser.add_argument("--no-broadcast-buffers", action="store_true",
                        help="DistributedDataParallel(broadcast_buffers=False), as mmengine "
                             "(mmdet3d) runs it; default torch's True, as OpenPCDet")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every (library, world size) this many times, in turn (world "
                             "sizes alternating): each round's scaling is against the same "
                             "round's 1-GPU run, minutes apart at most; the medians over rounds "
                             "are reported too (runs of one configuration minutes apart have "
                             "differed by 20-40% on the same machine)")
    parser.add_argument("--profile", default="",
                        help="a file prefix: rank 0's timed window of each run under "
                             "torch.profiler (CPU side), its table in "
                             "PREFIX-<library>-<batchnorm>-<world>[-r<round>].txt (window timing; "
                             "its step times include the profiler's cost)")
    parser.add_argument("--trace", default="",
                        help="a file prefix: every rank's timed window of each run under "
                             "torch.profiler with CUDA activity only, a Chrome trace per rank "
                             "PREFIX-<library>-<batchnorm>-<world>[-r<round>]-rank<r>.json "
                             "(window timing; summarize with scripts/trace_summary.py)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.no_ddp:
        args.no_sync_bn = True
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    if (args.profile or args.trace) and args.timing != "window":
        parser.error("--profile / --trace record the timed window: use them with --timing window")
    if args.profile and args.trace:
        parser.error("--profile and --trace: one profiler at a time")
    sizes = [int(w) for w in args.world_sizes.split(",")]
    impls = args.sync_bn_impl.split(",")
    if not impls or set(impls) - {"torch", "flexplan"}:
        parser.error(f"--sync-bn-impl {args.sync_bn_impl}: torch, flexplan or torch,flexplan")
    if max(sizes) > torch.cuda.device_count():
        parser.error(f"--world-sizes {args.world_sizes}: only {torch.cuda.device_count()} GPUs")
    import triton

    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "triton": triton.__version__,
            "network": args.network, "dtype": args.dtype, "scans_per_rank": args.scans_per_rank,
            "steps": args.steps, "warmup": args.warmup, "sync_bn": not args.no_sync_bn,
            "timing": args.timing, "ddp": not args.no_ddp, "pin_cpus": args.pin_cpus,
            "broadcast_buffers": not args.no_broadcast_buffers,
            **({"profiled": True} if args.profile or args.trace else {})}
    rows = []
    runs = [(library, impl) for library in args.libraries.split(",")
            for impl in (impls if library == "flexplan" and not args.no_sync_bn else ["torch"])]
    schedule = [(rnd, library, impl, world) for rnd in range(1, args.rounds + 1)
                for library, impl in runs for world in sizes]
    for rnd, library, impl, world in schedule:
        # which BatchNorm ran, for the row: per-rank BatchNorm, or whose SyncBatchNorm
        bn = "no DDP" if args.no_ddp else "per-rank" if args.no_sync_bn else impl
        run_name = (f"{library}-{bn.replace(' ', '_')}-{world}"
                    f"{f'-r{rnd}' if args.rounds > 1 else ''}")
        job = ddp_train.Job(library=library, network=args.network, dtype=args.dtype,
                            scans_per_rank=args.scans_per_rank, steps=args.steps,
                            warmup=args.warmup, sync_bn=not args.no_sync_bn,
                            sync_bn_impl=impl, timing=args.timing, ddp=not args.no_ddp,
                            pin_cpus=args.pin_cpus,
                            broadcast_buffers=not args.no_broadcast_buffers,
                            profile=(f"{args.profile}-{run_name}.txt" if args.profile else ""),
                            trace=f"{args.trace}-{run_name}" if args.trace else "")
        try:
            results = ddp_train.run(world, job)
        except Exception as exc:  # noqa: BLE001 - a peer that fails is a row, not a stop
            rows.append({**meta, "library": library, "batchnorm": bn, "world_size": world,
                         "round": rnd, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"{library} ({bn}) world_size={world}: {rows[-1]['error']}", flush=True)
            continue
        times = step_times(results)
        ms = statistics.median(times) * 1e3
        row = {**meta, "library": library, "batchnorm": bn, "world_size": world,
               "round": rnd, "step_ms": round(ms, 2),
               "scans_per_s": round(world * args.scans_per_rank / (ms / 1e3), 1),
               "voxels_per_rank": round(statistics.mean(r["voxels"] for r in results)),
               "compiles": sum(r["compiles"] for r in results),
               # per rank, host ms per step: making the input tensor (its check waits for the
               # GPU to finish the step before: a lagging GPU shows here), and the rest
               "input_ms": [round(statistics.mean(r["input_s"]) * 1e3, 2) for r in results],
               "rest_ms": [round(statistics.mean(r["rest_s"]) * 1e3, 2) for r in results]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = summary(rows, meta)
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        with out.with_suffix(".jsonl").open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


def host_split(row: dict) -> str:
    """"input / rest" host ms per rank (rows from before they were recorded: -)."""
    if "input_ms" not in row:
        return "-"
    return ", ".join(f"{a:.1f} / {b:.1f}" for a, b in zip(row["input_ms"], row["rest_ms"]))


def summary(rows: list[dict], meta: dict) -> list[str]:
    lines = [f"# DDP training throughput ({meta['date']})", "",
             f"{meta['gpu']}; torch {meta['torch']}, Triton {meta['triton']}. Network "
             f"{meta['network']}, {meta['dtype']}, {meta['scans_per_rank']} scans per rank per "
             f"step, fresh coordinates every step on every rank; "
             f"{'SyncBatchNorm' if meta['sync_bn'] else 'BatchNorm (per rank)'}, NCCL; "
             f"{meta['warmup']} warm-up steps, then " + (
                 f"the median of {meta['steps']} (the slowest rank's time per step, ranks aligned "
                 "and GPUs drained around each)" if meta.get("timing", "step") == "step" else
                 f"{meta['steps']} steps in one window (ranks aligned once before, GPUs drained "
                 "once after; step ms: the slowest rank's window / steps)") + ". BatchNorm column: whose SyncBatchNorm ran (torch: "
             "nn.SyncBatchNorm; flexplan: flexplan.nn.SyncBatchNorm, no host syncs), "
             "per-rank BatchNorm, or no DDP (each rank trains alone). DistributedDataParallel's "
             f"broadcast_buffers {meta.get('broadcast_buffers', True)}." + (
                 " Profiled (--profile: rank 0's steps under torch.profiler, CPU side; --trace: "
                 "every rank's, CUDA activity): their times include its cost."
                 if meta.get("profiled") else ""), "",
             "Host ms: each rank's host time per step (mean) making the input tensor, whose "
             "coordinate check (flexplan's; spconv checks nothing) waits for the GPU to finish "
             "the step before (with window timing a GPU lagging its host shows there), and "
             "running the rest of the step.", "",
             "| library | BatchNorm | GPUs | step ms | scans/s | scaling vs 1 GPU "
             "| voxels per rank | compiles | host ms: input / rest, by rank |",
             "|---|---|---|---|---|---|---|---|---|"]

    def key(r):  # rows from before the BatchNorm column ran torch's SyncBatchNorm or per-rank
        return r["library"], r.get("batchnorm", "torch" if meta["sync_bn"] else "per-rank")

    rounds = max(r.get("round", 1) for r in rows) if rows else 1
    if rounds > 1:
        lines[-2:] = ["| round | library | BatchNorm | GPUs | step ms | scans/s "
                      "| scaling vs 1 GPU | voxels per rank | compiles "
                      "| host ms: input / rest, by rank |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
    one = {(*key(r), r.get("round", 1)): r.get("scans_per_s") for r in rows
           if r["world_size"] == 1 and "error" not in r}
    for r in rows:
        library, bn = key(r)
        first = f"| {r.get('round', 1)} " if rounds > 1 else ""
        if "error" in r:
            lines.append(f"{first}| {library} | {bn} | {r['world_size']} | error | | | | | |")
            continue
        base = one.get((*key(r), r.get("round", 1)))
        scale = f"{r['scans_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"{first}| {library} | {bn} | {r['world_size']} | {r['step_ms']:.1f} | "
                     f"{r['scans_per_s']:.1f} | {scale} | {r['voxels_per_rank']} | "
                     f"{r['compiles']} | {host_split(r)} |")
    if rounds > 1:
        lines += ["", f"Medians over the {rounds} rounds (scaling: the median of each round's "
                  "own ratio):", "", "| library | BatchNorm | GPUs | step ms | scaling vs 1 GPU |",
                  "|---|---|---|---|---|"]
        groups: dict = {}
        for r in rows:
            if "error" not in r:
                groups.setdefault((*key(r), r["world_size"]), []).append(r)
        for (library, bn, world), group in groups.items():
            ratios = [r["scans_per_s"] / one[(library, bn, r.get("round", 1))] for r in group
                      if one.get((library, bn, r.get("round", 1)))]
            scale = f"{statistics.median(ratios):.2f}x" if ratios else "-"
            lines.append(f"| {library} | {bn} | {world} | "
                         f"{statistics.median(r['step_ms'] for r in group):.1f} | {scale} |")
    by: dict = {}
    for r in rows:  # (per configuration: the median over rounds)
        if "error" not in r:
            by.setdefault((*key(r), r["world_size"]), []).append(r["scans_per_s"])
    by = {k: statistics.median(v) for k, v in by.items()}
    for world in sorted({r["world_size"] for r in rows}):
        sp = next((v for (lib, _, w), v in by.items() if lib == "spconv" and w == world), None)
        for (lib, bn, w), fx in by.items():
            if lib == "flexplan" and w == world and fx and sp:
                what = "per-rank BatchNorm" if bn == "per-rank" else f"{bn}'s SyncBatchNorm"
                lines.append(f"\n{world} GPU(s): flexplan ({what}) / spconv throughput "
                             f"{fx / sp:.2f}x")
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "Errors:"] + [f"- {key(r)[0]} ({key(r)[1]}) x{r['world_size']}: {r['error']}"
                                    for r in errors]
    return lines


if __name__ == "__main__":
    sys.exit(main())
