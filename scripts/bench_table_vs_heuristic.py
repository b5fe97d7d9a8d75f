"""The shipped tuned table against the heuristic defaults on the kernels' grid, in one GPU run.

For every sphere shell of the tuner's grid (flexplan.tuning.cli.DEFAULT_SHELLS), dtype and part
(fwd / grad-input / grad-weight, with the algorithm "auto" runs): the part timed through the op's
own dispatch (the table's config where its bucket is tuned) and with the heuristic config forced,
on fresh inputs; the table's lookups cost no benchmarking. (scripts/bench_tuning.py tunes a
table from scratch and compares it with @triton.autotune.) Writes
scripts/results/bench_table_vs_heuristic.md.

Usage: python scripts/bench_table_vs_heuristic.py
"""
from __future__ import annotations

import math
import os
import statistics
import sys

import torch
import triton

from bench_common import today
from flexplan.kernel_configs import heuristic_config
from flexplan.tuning import dispatch
from flexplan.tuning.buckets import Bucket
from flexplan.tuning.cases import part_case, shell_workload
from flexplan.tuning.cli import DEFAULT_DTYPES, DEFAULT_SHELLS
from flexplan.tuning.device import device_key
from flexplan.tuning.tuner import do_bench_median

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "bench_table_vs_heuristic.md")


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_table_vs_heuristic needs a GPU")
        return 1
    key = device_key(torch.cuda.current_device())
    tuned = dispatch.load_configs(key)
    rows = []
    for resolution, channels in DEFAULT_SHELLS:
        for dtype in DEFAULT_DTYPES:
            work = shell_workload(resolution, channels, channels, dtype, torch.device("cuda"), seed=1)
            for part in ("fwd", "dgrad", "wgrad"):
                case = part_case(work, part)
                problem = case.problem
                if problem.algo == "explicit":
                    continue
                heur = heuristic_config(problem.family, problem)
                with dispatch.forced_config(heur):
                    heur_ms = do_bench_median(case.run)
                table_ms = do_bench_median(case.run)
                in_table = Bucket.of(problem) in tuned
                rows.append((resolution, channels, problem, in_table, heur_ms, table_ms))
                print(f"R={resolution} C={channels} {dtype} {part} {problem.algo}: heuristic "
                      f"{heur_ms:.4f} ms, table {table_ms:.4f} ms"
                      f"{'' if in_table else ' (bucket not tuned)'}", flush=True)
            del work
            torch.cuda.empty_cache()
    hits = [h / t for *_, in_table, h, t in rows if in_table]
    geo = math.exp(statistics.fmean(math.log(x) for x in hits)) if hits else float("nan")
    lines = [f"# Shipped tuned table vs heuristic defaults ({today()})", "",
             f"Device: {key.name} ({key.arch}, {key.sms} SMs); torch {torch.__version__}, Triton "
             f"{triton.__version__}. Table entries for this GPU: {len(tuned)}. Sphere shells, 3x3x3, "
             "fresh inputs; do_bench median ms (L2 flushed), split-K reductions included.", "",
             f"Tuned buckets: {len(hits)} of {len(rows)} parts; geometric-mean speed-up of the table "
             f"over the heuristic on them: **{geo:.2f}x** (min {min(hits, default=float('nan')):.2f}x, "
             f"max {max(hits, default=float('nan')):.2f}x). Untuned buckets run the heuristic.", "",
             "| R | C | dtype | part | algo | n | tuned | heuristic ms | table ms | speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r, c, pb, in_table, h, t in rows:
        lines.append(f"| {r} | {c} | {pb.dtype} | {pb.part} | {pb.algo} | {pb.n:,} | "
                     f"{'yes' if in_table else 'no'} | {h:.4f} | {t:.4f} | {h / t:.2f}x |")
    with open(RESULTS, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:6]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
