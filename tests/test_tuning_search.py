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


def test_a_float32_case_tries_and_keeps_only_configs_it_launches_as_they_are():
    """float32's grad-weight runs 3xTF32 with shallower tiles than tf32's bucket selects
    (precision_config): tuning it in that bucket tries, times and stores only configs a float32
    run launches unchanged, so the stored config is the one timed, and a tf32 call given it
    runs a config that was measured, not a deeper untimed one."""
    from flexplan.kernel_configs import precision_config

    problem = Problem(900000, 64, 128, 27, "tf32", "masked_splitk", "wgrad")
    seen = []

    def run():
        seen.append(dispatch.select_config(problem.family, problem))
        return torch.arange(6.0)

    def cost(cfg):  # deeper tiles look faster: a search without the rule would pick them
        return 1.0 / (cfg.block_k * cfg.num_stages) + cfg.block_m * 1e-6

    def bench(fn):
        fn()
        return cost(seen[-1])

    case = Case(problem, run, "float32")
    [tuned] = tuner.tune_cases([case], bench=bench, max_trials=1000, log=lambda m: None)
    launch = lambda cfg: precision_config(cfg, WGRAD, "float32", False)  # noqa: E731
    assert seen and all(launch(cfg) == cfg for cfg in seen)
    assert launch(tuned.result.best) == tuned.result.best
    assert all(launch(cfg) == cfg for cfg in tuned.result.timings)
    # a tf32 case (its own dtype) is searched over tf32's whole set, deeper tiles included
    seen.clear()
    [deep] = tuner.tune_cases([Case(problem, run)], bench=bench, max_trials=1000,
                              log=lambda m: None)
    assert launch(deep.result.best) != deep.result.best


def test_outputs_are_compared_at_the_run_dtypes_tolerance():
    """A float32 case in a tf32 bucket computes 3xTF32 (fp32-grade): two configs whose outputs
    differ by 1e-3 agree for a tf32 run, not for a float32 one."""
    problem = Problem(3000, 64, 64, 27, "tf32", "masked", "fwd")
    a, b = (KernelConfig(64, 64, 32, 1, 4, 2), KernelConfig(128, 64, 32, 1, 4, 2))

    def run():
        out = torch.ones(8)
        return out * 1.001 if dispatch.select_config(problem.family, problem) == b else out

    assert tuner.outputs_agree(Case(problem, run), a, b)
    assert tuner.outputs_agree(Case(problem, run, "tf32"), a, b)
    assert not tuner.outputs_agree(Case(problem, run, "float32"), a, b)
