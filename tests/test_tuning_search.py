"""The tuner: finds the fastest config under fake timers, measures through the ops' launch
path with the config forced, refuses a config whose output differs; one tiny real run
through Triton's interpreter."""
import dataclasses
import math
import random
import time

import pytest
import torch

from flexplan.kernel_configs import (GATHER_GEMM, WGRAD, KernelConfig, Problem, candidate_configs,
                                     heuristic_config)
from flexplan.tuning import dispatch, tuner
from flexplan.tuning.buckets import Bucket
from flexplan.tuning.device import DeviceKey
from flexplan.tuning.cases import Case
from flexplan.tuning.table import TuningTable, read_table, write_table

PROBLEMS = [Problem(200000, 64, 64, 27, "float16", "masked", "fwd"),
            Problem(3000, 256, 256, 27, "tf32", "masked_splitk", "dgrad"),
            Problem(900000, 32, 64, 27, "float16", "masked_splitk", "wgrad")]


def separable_cost(seed):
    """A cost that is a sum over config fields: coordinate descent must find its minimum."""
    rng = random.Random(seed)
    table = {}

    def cost(cfg):
        total = 1.0
        for name, value in vars(cfg).items():
            total += table.setdefault((name, value), rng.uniform(0, 1))
        return total
    return cost


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.part)
def test_search_finds_the_fastest_config_of_a_separable_cost(problem):
    cost = separable_cost(hash(problem) % 1000)
    space = candidate_configs(problem)
    result = tuner.search(problem, cost, max_trials=10_000, rounds=3)
    assert result.best == min(space, key=cost)
    assert result.best_ms == cost(result.best)
    assert len(result.timings) < len(space) // 3  # far fewer measurements than the space


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.part)
def test_search_returns_the_fastest_it_measured_within_budget(problem):
    rng = random.Random(7)
    costs = {}
    result = tuner.search(problem, lambda c: costs.setdefault(c, rng.uniform(1, 2)), max_trials=20)
    heuristic = heuristic_config(problem.family, problem)
    assert result.heuristic == heuristic and heuristic in result.timings
    assert len(result.timings) <= 20
    assert result.best == min(result.timings, key=result.timings.get)
    assert set(result.timings) <= set(candidate_configs(problem)) | {heuristic}


def test_failing_configs_are_never_chosen():
    problem = PROBLEMS[0]
    heuristic = heuristic_config(problem.family, problem)

    def measure(cfg):
        if cfg.num_warps == 8:
            raise RuntimeError("out of resources")  # e.g. shared memory
        return 0.5 if cfg.block_k == 32 and cfg != heuristic else 1.0

    result = tuner.search(problem, measure)
    assert result.best.num_warps == 4 and result.best.block_k == 32 and result.best_ms == 0.5
    assert any(math.isinf(t) for t in result.timings.values())


def _fake_case(problem, cost, wrong=None):
    """A Case whose run() reports the config select_config gave it (as an op would use it)."""
    seen = []

    def run():
        cfg = dispatch.select_config(problem.family, problem)
        seen.append(cfg)
        out = torch.arange(6.0)
        return out + 1 if cfg == wrong else out

    def bench(fn):
        fn()
        return cost(seen[-1])
    return Case(problem, run), bench


def test_tune_cases_measures_through_forced_configs():
    problem = PROBLEMS[1]
    cost = separable_cost(3)
    case, bench = _fake_case(problem, cost)
    [tuned] = tuner.tune_cases([case], bench=bench, max_trials=1000, log=lambda m: None)
    assert tuned.result.best == tuner.search(problem, cost, max_trials=1000).best
    entry = tuned.entry()
    assert entry.config == tuned.result.best and entry.trials == len(tuned.result.timings)
    assert entry.ms <= entry.heuristic_ms


def test_config_with_a_different_output_is_not_kept():
    problem = PROBLEMS[0]
    cost = separable_cost(5)
    fastest = tuner.search(problem, cost, max_trials=1000).best
    case, bench = _fake_case(problem, cost, wrong=fastest)
    logs = []
    [tuned] = tuner.tune_cases([case], bench=bench, max_trials=1000, log=logs.append)
    assert tuned.result.best == heuristic_config(problem.family, problem)
    assert any("disagrees" in m for m in logs)


def test_explicit_problems_are_not_tuned():
    problem = dataclasses.replace(PROBLEMS[0], algo="explicit")
    case, bench = _fake_case(problem, separable_cost(1))
    assert tuner.tune_cases([case], bench=bench, log=lambda m: None) == []


def test_deadline_stops_tuning():
    cases = [_fake_case(p, separable_cost(1))[0] for p in PROBLEMS]
    logs = []
    done = tuner.tune_cases(cases, bench=lambda fn: 1.0, deadline=time.monotonic() - 1,
                            log=logs.append)
    assert done == [] and "3 of 3" in logs[0]


def test_tiny_real_tuning_run_through_the_interpreter(tmp_path):
    """Real kernels, real plan (a shell of a few hundred voxels), wall-clock timer."""
    from flexplan.tuning.cases import part_case, shell_workload

    work = shell_workload(8, 16, 16, "float32", torch.device("cpu"))
    cases = [part_case(work, part) for part in ("fwd", "wgrad")]

    def bench(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    tuned = tuner.tune_cases(cases, bench=bench, max_trials=3, log=lambda m: None)
    assert [t.problem.family for t in tuned] == [GATHER_GEMM, WGRAD]
    assert tuned[0].problem.n == work.plan.num_out and tuned[1].problem.n == work.plan.num_pairs
    key = DeviceKey("cpu", "none", 1, "0")
    path = write_table(TuningTable(key, {Bucket.of(t.problem): t.entry() for t in tuned}),
                       tmp_path / "t.json")
    assert {b: e.config for b, e in read_table(path).entries.items()} == {
        Bucket.of(t.problem): t.result.best for t in tuned}
