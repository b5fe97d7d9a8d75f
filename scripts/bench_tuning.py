"""Tune this GPU's table on the kernels' grid, then compare in the same run: tuned-table dispatch
vs the heuristic defaults vs Triton's own @triton.autotune over the same configs. One GPU call.

Grid: sphere shells (R, C) = (16,1024) (32,1024) (64,1024) (128,512) (256,256) and R = 256, 512
with C in {32, 64, 128}; 3x3x3 submanifold; fp16 and tf32; forward, grad-input, grad-weight,
each with the algorithm "auto" runs. Per workload: tune its three parts (flexplan.tuning), then
time each part on fresh inputs through select_config with the new table entries and with the
heuristic forced. For a few problems, @triton.autotune over the configs our tuner tried: its
first call (the tuning it does at run time) and its steady-state time.

Writes the table (flexplan/tuning/tables/<gpu>.json, to ship), scripts/results/bench_tuning.md
and, if $OUT is set, copies of both there. --smoke: a tiny CPU run (Triton interpreter,
wall-clock timer, no autotune) that checks the script end to end.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import timeit

os.environ.setdefault("FLEXPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="flexplan-bench-tuning-"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flexplan.kernel_configs import heuristic_config, runtime_is_hip  # noqa: E402
from flexplan.kernels_src.conv_gather_gemm import conv_gather_gemm_kernel  # noqa: E402
from flexplan.kernels_src.conv_wgrad import conv_wgrad_kernel  # noqa: E402
from flexplan.launch_spec import UNREAD_ADDRESS  # noqa: E402
from flexplan.ops.conv import (NO_EPILOGUE, dgrad_map, gather_gemm_constexprs,  # noqa: E402
                               gather_gemm_weight, split_tile_counts, wgrad_constexprs)
from flexplan.tuning import dispatch  # noqa: E402
from flexplan.tuning.buckets import Bucket  # noqa: E402
from flexplan.tuning.cases import part_case, shell_workload, torch_dtype  # noqa: E402
from flexplan.tuning.cli import DEFAULT_DTYPES, DEFAULT_SHELLS  # noqa: E402
from flexplan.tuning.device import DeviceKey, device_key  # noqa: E402
from flexplan.paths import shipped_tables_dir  # noqa: E402
from flexplan.plan_views import chunk_order, sorted_map_t  # noqa: E402
from flexplan.tuning.table import TuningTable, read_table, write_table  # noqa: E402
from flexplan.tuning.tuner import do_bench_median, tune_cases  # noqa: E402

from bench_common import today  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "bench_tuning.md")
DATE = today()
PARTS = ("fwd", "dgrad", "wgrad")
# (R, C, dtype, part) compared with @triton.autotune.
AUTOTUNE_PROBLEMS = ((256, 64, "float16", "fwd"), (128, 512, "tf32", "dgrad"),
                     (512, 32, "float16", "wgrad"), (32, 1024, "float16", "fwd"))


# @triton.autotune needs the split count in the config: these wrappers take it as an extra
# constexpr (SPLITS, read by the grid) and run the very same kernel.
# (the epilogue and the BatchNorm's addresses run-time arguments, as the ops' launches pass them)
@triton.jit(do_not_specialize=["bn_mean_addr", "bn_var_addr", "bn_weight_addr", "bn_bias_addr",
                               "epilogue"])
def gather_gemm_splits(src_ptr, weight_ptr, bias_ptr, map_ptr, order_ptr, chunk_order_ptr,
                       valid_kernel_ptr, valid_kernel_seg_ptr, out_ptr, partials_ptr,
                       tile_counts_ptr, bn_mean_addr, bn_var_addr, bn_weight_addr, bn_bias_addr,
                       bn_eps, epilogue, M, K, N, V,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT: tl.constexpr, MASKED: tl.constexpr, REVERSE_V: tl.constexpr,
                       PRECISION: tl.constexpr, CHUNK: tl.constexpr, WEIGHT_KVN: tl.constexpr,
                       SPLITS: tl.constexpr):
    conv_gather_gemm_kernel(src_ptr, weight_ptr, bias_ptr, map_ptr, order_ptr, chunk_order_ptr,
                            valid_kernel_ptr, valid_kernel_seg_ptr, out_ptr, partials_ptr,
                            tile_counts_ptr, bn_mean_addr, bn_var_addr, bn_weight_addr,
                            bn_bias_addr, bn_eps, epilogue, M, K, N, V,
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT=SPLIT,
                            MASKED=MASKED, REVERSE_V=REVERSE_V, PRECISION=PRECISION, CHUNK=CHUNK,
                            WEIGHT_KVN=WEIGHT_KVN)


@triton.jit
def wgrad_splits(grad_out_ptr, src_ptr, pair_out_ptr, pair_in_ptr, pair_seg_ptr, out_ptr,
                 partials_ptr, tile_counts_ptr, CO, CI, V, S, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                 PRECISION: tl.constexpr, SPLITS: tl.constexpr):
    conv_wgrad_kernel(grad_out_ptr, src_ptr, pair_out_ptr, pair_in_ptr, pair_seg_ptr, out_ptr,
                      partials_ptr, tile_counts_ptr, CO, CI, V, S, BLOCK_M=BLOCK_M,
                      BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT=SPLIT, PRECISION=PRECISION)


def fixed_constexprs(constexprs: dict, cfg) -> dict:
    """An op launch's constexprs less those of its config (autotune's triton.Config sets them)."""
    return {k: v for k, v in constexprs.items() if k not in cfg.launch_kwargs()}


def wrapper_launch(work, part, max_splits):
    """(kernel, grid, args, consts, pre_hook, out) of the split-count wrapper for one part: the
    case's algorithm, map and constexprs as ops.conv launches them (the same functions); the
    kernel writes out, summing max_splits-sized partials under split-K itself (its tile
    counters: ops.conv.split_tile_counts, left zeroed).
    The masked schedule depends on BLOCK_M: the pre-hook copies that block size's schedule into
    the buffers the kernel reads (a few KB)."""
    plan, w = work.plan, work.weight
    dtype, _ = torch_dtype(work.dtype)
    co, v, ci = w.shape
    hip = runtime_is_hip()
    problem = part_case(work, part).problem
    algo, cfg = problem.algo, heuristic_config(problem.family, problem)
    if part == "wgrad":
        dest = torch.empty((max_splits, co, v, ci), dtype=torch.float32, device=w.device)
        out = torch.empty((co, v, ci), dtype=dtype, device=w.device)
        # (the smallest tiles any config has: 16 x 16)
        counts = split_tile_counts(w.device, triton.cdiv(co, 16) * triton.cdiv(ci, 16) * v)
        args = (work.grad_out, work.feats, plan.valid_signal_o, plan.valid_signal_i,
                plan.valid_signal_seg, out, dest, counts, co, ci, v, plan.signal_offsets)

        def grid(meta):
            return (triton.cdiv(co, meta["BLOCK_M"]) * triton.cdiv(ci, meta["BLOCK_N"]), v,
                    meta["SPLITS"])
        consts = fixed_constexprs(wgrad_constexprs(cfg, work.dtype, hip), cfg)
        return wgrad_splits, grid, args, consts, None, out
    gmap, reverse = (plan.fwd, False) if part == "fwd" else dgrad_map(plan)
    src = work.feats if part == "fwd" else work.grad_out
    w_read, kvn = gather_gemm_weight(w, part, work.dtype)
    m, k, n = gmap.num_rows, (ci if part == "fwd" else co), (co if part == "fwd" else ci)
    masked = algo.startswith("masked")
    dest = torch.empty((max_splits, m, n), dtype=torch.float32, device=w.device)
    out = torch.empty((m, n), dtype=dtype, device=w.device)
    counts = split_tile_counts(w.device, triton.cdiv(m, 16) * triton.cdiv(n, 16))
    hook = None
    vk = seg = gmap.sorted_idx  # unused unless masked
    if masked:
        vk = torch.empty(max(t.numel() for t in gmap.valid_kernel.values()), dtype=torch.int32,
                         device=w.device)
        seg = torch.empty(max(t.numel() for t in gmap.valid_kernel_seg.values()),
                          dtype=torch.int32, device=w.device)

        def hook(nargs):
            bm = nargs["BLOCK_M"]
            vk[:gmap.valid_kernel[bm].numel()].copy_(gmap.valid_kernel[bm])
            seg[:gmap.valid_kernel_seg[bm].numel()].copy_(gmap.valid_kernel_seg[bm])
    # (no epilogue: bias and BatchNorm not read)
    args = (src, w_read, w_read, sorted_map_t(gmap), gmap.sorted_idx, chunk_order(gmap), vk, seg,
            out, dest, counts, *[UNREAD_ADDRESS] * 4, 0.0, NO_EPILOGUE, m, k, n, v)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), meta["SPLITS"])
    consts = fixed_constexprs(gather_gemm_constexprs(cfg, masked, reverse, work.dtype, hip, kvn), cfg)
    return gather_gemm_splits, grid, args, consts, hook, out


def config_kwargs(c) -> dict:
    return dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT=c.splitk > 1,
                SPLITS=c.splitk)


def autotuned_runner(work, part, configs):
    """(run, autotuner): run() = the autotuned kernel (its split-K sums in it), like the op."""
    kernel, grid, args, consts, hook, out = wrapper_launch(work, part,
                                                           max(c.splitk for c in configs))
    key = ["CO", "CI", "V"] if part == "wgrad" else ["M", "K", "N"]
    tconfigs = [triton.Config(config_kwargs(c), num_warps=c.num_warps, num_stages=c.num_stages,
                              pre_hook=hook) for c in configs]
    tuner = triton.autotune(configs=tconfigs, key=key)(kernel)

    def run():
        tuner[grid](*args, **consts)
        return out
    return run, tuner


def fmt_cfg(c) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k} s{c.splitk} w{c.num_warps} st{c.num_stages}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=200, help="tuning + comparison time")
    p.add_argument("--autotune-s", type=float, default=90, help="time for the autotune part")
    p.add_argument("--max-trials", type=int, default=14)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run through the interpreter")
    args = p.parse_args()
    t_start = time.monotonic()
    out_dir = os.environ.get("OUT")
    if args.smoke:
        device = torch.device("cpu")
        shells, autotune_problems = ((8, 16),), ()
        args.max_trials = 4
        key = DeviceKey("cpu-interpreter", "none", 1, triton.__version__)

        def bench(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        table_path = os.path.join(tempfile.mkdtemp(), "smoke.json")
        results_path = os.path.join(tempfile.mkdtemp(), "bench_tuning.md")
    else:
        device = torch.device("cuda")
        shells, autotune_problems = DEFAULT_SHELLS, AUTOTUNE_PROBLEMS
        key = device_key(torch.cuda.current_device())

        def bench(fn):
            return do_bench_median(fn, warmup_ms=5, rep_ms=20)
        table_path = str(shipped_tables_dir() / f"{key.slug}.json")
        results_path = RESULTS
    index = None if args.smoke else torch.cuda.current_device()
    table = TuningTable(key, {})
    rows, auto_rows = [], []
    deadline = time.monotonic() + args.budget_s
    autotune_deadline = deadline + args.autotune_s
    for resolution, channels in shells:
        for dtype in DEFAULT_DTYPES:
            if time.monotonic() >= deadline:
                print(f"budget spent: R={resolution} C={channels} {dtype} not tuned", flush=True)
                continue
            work = shell_workload(resolution, channels, channels, dtype, device)
            cases = {part: part_case(work, part) for part in PARTS}
            tuned = tune_cases(list(cases.values()), bench=bench, max_trials=args.max_trials,
                               deadline=deadline, log=lambda m: print(m, flush=True))
            for t in tuned:
                table.entries[Bucket.of(t.problem)] = t.entry()
            if not args.smoke:
                dispatch.add_configs(index, {b: e.config for b, e in table.entries.items()})
            fresh = shell_workload(resolution, channels, channels, dtype, device, seed=1)
            for t in tuned:
                case = part_case(fresh, t.problem.part)
                heur = heuristic_config(case.problem.family, case.problem)
                with dispatch.forced_config(heur):
                    heur_ms = bench(case.run)
                if args.smoke:  # no GPU: the dispatch path of device 0 is faked
                    with dispatch.forced_config(table.entries[Bucket.of(case.problem)].config):
                        table_ms = bench(case.run)
                else:
                    got = dispatch.select_config(case.problem.family, case.problem)
                    if got != t.result.best:
                        print(f"DISPATCH MISMATCH {case.problem}: {got} != {t.result.best}")
                    table_ms = bench(case.run)
                rows.append((resolution, channels, t, heur_ms, table_ms))
            for (r, c, dt, part) in autotune_problems:
                if (r, c, dt) != (resolution, channels, dtype):
                    continue
                if time.monotonic() >= autotune_deadline - 30:
                    print(f"no time left for autotune on {r} {c} {dt} {part}", flush=True)
                    continue
                t = next((t for t in tuned if t.problem.part == part), None)
                if t is None:
                    continue
                configs = sorted((cfg for cfg, ms in t.result.timings.items() if math.isfinite(ms)),
                                 key=repr)
                try:
                    run, at = autotuned_runner(fresh, part, configs)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    run()
                    torch.cuda.synchronize()
                    first_s = time.perf_counter() - t0
                    auto_ms = bench(run)
                    ref = part_case(fresh, part).run().double()
                    diff = ((run().double() - ref).abs().max().item()
                            / (ref.abs().max().item() + 1e-9))
                except Exception as err:  # the comparison must not cost the tuned table
                    print(f"autotune {r} {c} {dt} {part} failed: {str(err)[-400:]}", flush=True)
                    continue
                kw = at.best_config.kwargs
                chosen = next(cf for cf in configs if config_kwargs(cf) == kw
                              and (cf.num_warps, cf.num_stages) == (at.best_config.num_warps,
                                                                    at.best_config.num_stages))
                row = next(rw for rw in rows if rw[2] is t)
                auto_rows.append((r, c, t, len(configs), first_s, auto_ms, chosen, row[3], row[4],
                                  diff))
                print(f"autotune {r} {c} {dt} {part}: first call {first_s:.2f} s, "
                      f"{auto_ms:.4f} ms ({fmt_cfg(chosen)}) vs table {row[4]:.4f} ms", flush=True)
            del work, fresh, cases
            # Write as we go: a run cut short still returns what it tuned.
            write_table(table, table_path)
            if out_dir:
                shutil.copy(table_path, out_dir)
    # The file round trip: dispatch loading the written table gives the tuned configs.
    dispatch.reset()
    loaded = read_table(table_path)
    assert {b: e.config for b, e in loaded.entries.items()} == \
        {b: e.config for b, e in table.entries.items()}
    lookup_us = select_cost_us(table) if not args.smoke else float("nan")
    report(results_path, key, rows, auto_rows, lookup_us, table_path,
           time.monotonic() - t_start, args)
    if out_dir:
        shutil.copy(results_path, out_dir)
    print(open(results_path).read())
    return 0


def select_cost_us(table) -> float:
    """select_config on a table hit, table loaded from disk (the path every op call takes)."""
    bucket = next(iter(table.entries))
    problem = bucket.representative()
    dispatch.select_config(problem.family, problem)
    n = 20000
    return timeit.timeit(lambda: dispatch.select_config(problem.family, problem), number=n) / n * 1e6


def report(path, key, rows, auto_rows, lookup_us, table_path, total_s, args):
    speedups = [h / t for *_, h, t in rows if t > 0 and math.isfinite(h)]
    geo = math.exp(statistics.fmean(math.log(s) for s in speedups)) if speedups else float("nan")
    tune_s = sum(t.seconds for _, _, t, _, _ in rows)
    lines = [
        f"# Tuned tables vs heuristic vs @triton.autotune ({DATE})",
        "",
        f"Device: {key.name} ({key.arch}, {key.sms} SMs); torch {torch.__version__}, "
        f"Triton {triton.__version__}. `python scripts/bench_tuning.py"
        f"{' --smoke' if args.smoke else ''}` (one GPU call, {total_s:.0f} s in all).",
        "",
        "Sphere shells (R, C = Ci = Co), 3x3x3 submanifold, algorithm `auto`. Tuning: coordinate "
        f"descent from the heuristic, <= {args.max_trials} configs per problem, do_bench median "
        "(warm-up 5 ms, 20 ms of runs, L2 flushed); a tuned config must reproduce the heuristic's "
        "output. Then, on fresh inputs: each part timed through `select_config` with the tuned "
        "entries (table ms) and with the heuristic forced (heuristic ms); times include the "
        "split-K reduction, as in the op.",
        "",
        f"Table: `{os.path.relpath(table_path, os.path.dirname(HERE))}` "
        f"({len(rows)} buckets). Tuning took {tune_s:.0f} s (compilation included). "
        f"Geometric-mean speed-up of the table over the heuristic: **{geo:.2f}x** "
        f"(min {min(speedups, default=float('nan')):.2f}x, max {max(speedups, default=float('nan')):.2f}x). "
        f"Run-time cost with the table: one `select_config` lookup, {lookup_us:.2f} us per call; "
        "no benchmarking.",
        "",
        "| R | C | dtype | part | algo | n | heuristic ms | table ms | speed-up | tuned config | "
        "configs tried | tune s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, c, t, h, tm in rows:
        pb = t.problem
        lines.append(f"| {r} | {c} | {pb.dtype} | {pb.part} | {pb.algo} | {pb.n:,} | {h:.4f} | "
                     f"{tm:.4f} | {h / tm:.2f}x | {fmt_cfg(t.result.best)} | "
                     f"{len(t.result.timings)} | {t.seconds:.1f} |")
    lines += ["", "## @triton.autotune over the same configs", "",
              "Triton's run-time autotuner given the configs our tuner tried for the problem "
              "(the same kernel called from a wrapper whose extra constexpr carries the split "
              "count to the grid). First call: what autotune spends at run time before the "
              "first result: compiling every config (the wrapper is new to Triton's caches) and "
              "benchmarking each with Triton's defaults. Steady state includes the split-K "
              "reduction (autotune times the kernel alone when it chooses). rel diff: max "
              "|autotune - op| / max |op| of the results.", "",
              "| R | C | dtype | part | configs | autotune first call s | autotune ms | "
              "autotune choice | table ms | table config | heuristic ms | rel diff |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, c, t, ncfg, first_s, auto_ms, chosen, h, tm, diff in auto_rows:
        lines.append(f"| {r} | {c} | {t.problem.dtype} | {t.problem.part} | {ncfg} | "
                     f"{first_s:.2f} | {auto_ms:.4f} | {fmt_cfg(chosen)} | {tm:.4f} | "
                     f"{fmt_cfg(t.result.best)} | {h:.4f} | {diff:.1e} |")
    if not auto_rows:
        lines.append("| (not run) | | | | | | | | | | | |")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
