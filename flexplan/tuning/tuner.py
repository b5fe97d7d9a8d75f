"""The search: which config of a problem's candidate space runs fastest.

Coordinate descent from the heuristic default over groups of config fields (split-K, K block,
warps, pipeline stages, tile shape): each step measures every candidate that differs from the
best so far only in one group, and keeps the fastest. Few measurements (tens, not the hundreds
of the full space) and, since neighbouring problems walk through the same configs, few
compilations. `measure` is injected, so the search is tested with a fake timer.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from ..kernel_configs import (KernelConfig, Problem, candidate_configs, heuristic_config,
                             precision_config, runtime_is_hip)

# Cheapest first: the split count is a grid size (no new compilation); the tile shape, the
# largest group, last.
AXIS_GROUPS = (("splitk",), ("block_k",), ("num_warps",), ("num_stages",), ("block_m", "block_n"))


@dataclass
class SearchResult:
    problem: Problem
    best: KernelConfig
    best_ms: float
    heuristic: KernelConfig
    heuristic_ms: float
    timings: dict = field(default_factory=dict)  # KernelConfig -> ms (inf: failed to run)


def search(problem: Problem, measure: Callable[[KernelConfig], float], *,
           max_trials: int = 32, rounds: int = 2, start: KernelConfig | None = None,
           launched: Callable[[KernelConfig], KernelConfig] | None = None) -> SearchResult:
    """Fastest config found for `problem`; measure(config) -> ms (inf or an exception: unusable).
    launched: the config a run of this problem's dtype launches for a selected one
    (kernel_configs.precision_config): the search then tries, and returns, only configs that
    launch as they are (look-alikes would spend trials on one kernel, and a stored config
    would not be the one timed)."""
    candidates = set(candidate_configs(problem))
    heuristic = start or heuristic_config(problem.family, problem)
    if launched is not None:
        candidates = {launched(c) for c in candidates}
        heuristic = launched(heuristic)
    timings: dict[KernelConfig, float] = {}

    def timed(cfg: KernelConfig) -> float:
        if cfg not in timings:
            try:
                ms = float(measure(cfg))
            except Exception:  # out of shared memory, too many registers...: not a candidate
                ms = math.inf
            timings[cfg] = ms if ms > 0 else math.inf
        return timings[cfg]

    best, best_ms = heuristic, timed(heuristic)
    for _ in range(rounds):
        improved = False
        for group in AXIS_GROUPS:
            for cfg in _neighbours(best, group, candidates):
                if len(timings) >= max_trials:
                    break
                if cfg not in timings and timed(cfg) < best_ms:
                    best, best_ms, improved = cfg, timings[cfg], True
        if not improved or len(timings) >= max_trials:
            break
    return SearchResult(problem, best, best_ms, heuristic, timings[heuristic], timings)


def _neighbours(center: KernelConfig, group, candidates) -> list[KernelConfig]:
    """Candidates equal to `center` outside `group`, in a fixed order."""
    fixed = {k: v for k, v in vars(center).items() if k not in group}
    found = [c for c in candidates if all(getattr(c, k) == v for k, v in fixed.items())]
    return sorted(found, key=lambda c: tuple(getattr(c, k) for k in group))


# ------------------------------------------------------------------ measuring real kernels

def do_bench_median(fn, warmup_ms: float = 5, rep_ms: float = 25) -> float:
    """Median time of fn() in ms (Triton's do_bench: warm-up, L2 flush between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def launched_config(case) -> Callable[[KernelConfig], KernelConfig] | None:
    """For a case whose run dtype launches other configs than its problem's dtype selects
    (float32's 3xTF32 grad-weight, in tf32's buckets): selected config -> launched config."""
    run_dtype = case.run_dtype
    if not run_dtype or run_dtype == case.problem.dtype:
        return None
    family, hip = case.problem.family, runtime_is_hip()
    return lambda cfg: precision_config(cfg, family, run_dtype, hip)


def measure_case(case, bench=do_bench_median) -> Callable[[KernelConfig], float]:
    """measure(config) for a Case: runs its op part with `config` forced."""
    from .dispatch import forced_config

    def measure(cfg: KernelConfig) -> float:
        def run():
            with forced_config(cfg):
                return case.run()
        return bench(run)
    return measure


def outputs_agree(case, a: KernelConfig, b: KernelConfig) -> bool:
    """Do two configs compute the same result (to the dtype's accumulation-order noise)?"""
    import torch

    from .dispatch import forced_config

    with forced_config(a):
        x = case.run().double()
    with forced_config(b):
        y = case.run().double()
    dtype = case.run_dtype or case.problem.dtype  # (3xTF32: float32's)
    rtol = 1e-2 if dtype in ("float16", "bfloat16", "tf32") else 1e-4
    scale = x.abs().max().item() + 1e-6
    return bool(torch.isfinite(y).all()) and (x - y).abs().max().item() <= rtol * scale


@dataclass
class Tuned:
    problem: Problem
    result: SearchResult
    seconds: float  # wall time of the search, compilation included

    def entry(self):
        from .table import Entry

        r = self.result
        return Entry(r.best, r.best_ms, r.heuristic_ms, len(r.timings))


def tune_cases(cases, *, bench=do_bench_median, max_trials: int = 32, deadline: float | None = None,
               log: Callable[[str], None] = print) -> list[Tuned]:
    """Search every case in order (stopping at time.monotonic() >= deadline). A best config whose
    output differs from the heuristic's is dropped (the heuristic is kept) and logged."""
    done = []
    cases = [c for c in cases if c.problem.algo != "explicit"]  # torch ops: no config to tune
    for i, case in enumerate(cases):
        if deadline is not None and time.monotonic() >= deadline:
            log(f"time budget spent: {len(cases) - i} of {len(cases)} problems left untuned")
            break
        t0 = time.monotonic()
        result = search(case.problem, measure_case(case, bench), max_trials=max_trials,
                        launched=launched_config(case))
        if result.best != result.heuristic and not outputs_agree(case, result.heuristic, result.best):
            log(f"{case.problem}: {result.best} disagrees with the heuristic's output; not used")
            result = replace(result, best=result.heuristic, best_ms=result.heuristic_ms)
        seconds = time.monotonic() - t0
        done.append(Tuned(case.problem, result, seconds))
        log(f"[{i + 1}/{len(cases)}] {case.problem.part} {case.problem.algo} {case.problem.dtype} "
            f"n={case.problem.n} ci={case.problem.ci} co={case.problem.co}: "
            f"{result.heuristic_ms:.4f} -> {result.best_ms:.4f} ms "
            f"({len(result.timings)} configs, {seconds:.1f} s)")
    return done
