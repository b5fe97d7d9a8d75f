"""Tuned tables: buckets, file round trip, lookup, rejection of foreign / corrupt tables,
heuristic fallback, run-time tuning modes and their hook, the layering of selection below the
ops and tuning above them, the AOT config set. CPU only: the GPU is faked (device index and
key), benchmarks are fake timers."""
import ast
import importlib.util
import json
import pathlib
import warnings

import pytest

from flexplan import paths
import torch

from flexplan.kernel_configs import (GATHER_GEMM, WGRAD, KernelConfig, Problem, candidate_configs,
                                     heuristic_config)
from flexplan.tuning import aot, dispatch, online, table
from flexplan.tuning.buckets import Bucket, pow2_ceil
from flexplan.tuning.device import DeviceKey
from flexplan.tuning.table import Entry, TableError, TuningTable

GPU = DeviceKey("NVIDIA H100 80GB HBM3", "sm_90", 132, "3.6.0")
FWD = Problem(3000, 64, 64, 27, "float16", "masked", "fwd")
TUNED = KernelConfig(32, 64, 32, 1, 4, 3)


def _heuristic(problem):
    return heuristic_config(problem.family, problem)


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A GPU that is 'GPU', an empty cache dir and no shipped tables."""
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(dispatch.TUNE_ENV, raising=False)
    monkeypatch.setattr(dispatch, "current_device_index", lambda: 0)
    monkeypatch.setattr(dispatch, "device_key", lambda index: GPU)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(paths, "shipped_tables_dir", lambda: shipped)
    dispatch.reset()
    yield shipped
    dispatch.reset()


def _table(device=GPU, problem=FWD, config=TUNED):
    return TuningTable(device, {Bucket.of(problem): Entry(config, 0.5, 0.7, 12)})


def _select_warnings(problem=FWD):
    """select_config twice; returns (config, warnings raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = dispatch.select_config(problem.family, problem)
        dispatch._memo.clear()  # a second resolve must not warn again
        assert dispatch.select_config(problem.family, problem) == first
    return first, [w for w in caught if issubclass(w.category, RuntimeWarning)]


# ------------------------------------------------------------------ buckets

def test_bucket_rounds_sizes_up_to_powers_of_two_and_round_trips():
    b = Bucket.of(Problem(3000, 48, 64, 27, "tf32", "masked_splitk", "dgrad"))
    assert (b.n, b.ci, b.co, b.v) == (4096, 64, 64, 27)
    assert Bucket.parse(b.key) == b and b.family == GATHER_GEMM
    assert Bucket.of(Problem(4096, 64, 64, 27, "tf32", "masked_splitk", "dgrad")) == b
    assert Bucket.of(Problem(4097, 64, 64, 27, "tf32", "masked_splitk", "dgrad")) != b
    assert [pow2_ceil(x) for x in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]


@pytest.mark.parametrize("key", ["", "fwd/masked/float16/v27/ci64/co64", "fwd/nope/float16/v27/ci64/co64/n8",
                                 "fwd/masked/float16/v27/ci48/co64/n8", "fwd/masked/float16/27/ci64/co64/n8",
                                 "sideways/masked/float16/v27/ci64/co64/n8"])
def test_bad_bucket_keys_are_rejected(key):
    with pytest.raises(ValueError):
        Bucket.parse(key)


# ------------------------------------------------------------------ table files

def test_table_round_trip_and_merge(tmp_path):
    path = tmp_path / "t.json"
    wgrad = Problem(50000, 32, 64, 27, "float16", "masked_splitk", "wgrad")
    first = _table()
    table.write_table(first, path)
    assert table.read_table(path) == first
    merged = table.merge_into(path, _table(problem=wgrad, config=KernelConfig(64, 32, 64, 4, 4, 2)))
    assert table.read_table(path) == merged and len(merged.entries) == 2
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []
    # Entries of another device's table at that path are dropped, not mixed in.
    other = DeviceKey("AMD Instinct MI300X", "gfx942", 304, "3.6.0")
    assert len(table.merge_into(path, _table(device=other)).entries) == 1


@pytest.mark.parametrize("mutate", [
    lambda d: "{not json",
    lambda d: {**d, "schema": 99},
    lambda d: {**d, "device": {"name": "x"}},
    lambda d: {**d, "entries": {"fwd/masked/float16/v27/ci64/co64/n4096": {"config": {"block_m": 32}}}},
    lambda d: {**d, "entries": {k: {**e, "config": {**e["config"], "block_m": 17}}
                                for k, e in d["entries"].items()}},
    lambda d: {**d, "entries": {k: {**e, "config": {**e["config"], "splitk": 4}}  # algo masked
                                for k, e in d["entries"].items()}},
])
def test_corrupt_tables_raise_table_error(tmp_path, mutate):
    path = tmp_path / "t.json"
    data = mutate(_table().to_json())
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(TableError):
        table.read_table(path)


# ------------------------------------------------------------------ dispatch

def test_lookup_by_bucket(fake_gpu):
    table.write_table(_table(), table.user_table_path(GPU))
    same_bucket = Problem(2100, 64, 64, 27, "float16", "masked", "fwd")
    other_bucket = Problem(3000, 32, 64, 27, "float16", "masked", "fwd")  # (another shape)
    assert dispatch.select_config(GATHER_GEMM, FWD) == TUNED
    assert dispatch.select_config(GATHER_GEMM, same_bucket) == TUNED
    assert dispatch.select_config(GATHER_GEMM, other_bucket) == _heuristic(other_bucket)


def test_a_missing_bucket_takes_the_tuned_config_of_its_neighbour_rows_bucket(fake_gpu):
    """A layer whose rows cross a bucket boundary keeps the tuned config on both sides (the
    heuristic there would be a second binary to compile mid-job), the nearest tuned bucket
    of the shape at any distance (at equal distance the one of more rows); other shapes and a
    config whose split-K workspace would not fit keep the heuristic; the AOT build's rule (config_from) agrees; a config tuned later
    for the neighbour itself takes over from the borrowed one."""
    table.write_table(_table(), table.user_table_path(GPU))  # FWD: 3000 rows, bucket 4096
    def fwd(rows, ci=64):
        return Problem(rows, ci, 64, 27, "float16", "masked", "fwd")
    other_shape = fwd(5000, ci=32)
    for problem in (fwd(5000), fwd(1500), fwd(9000), fwd(1000), fwd(40000), fwd(3)):
        assert Bucket.of(problem) != Bucket.of(FWD)
        assert dispatch.select_config(GATHER_GEMM, problem) == TUNED
        assert dispatch.config_from({Bucket.of(FWD): TUNED}, GATHER_GEMM, problem) == TUNED
    for problem in (other_shape,):
        assert dispatch.select_config(GATHER_GEMM, problem) == _heuristic(problem)
        assert (dispatch.config_from({Bucket.of(FWD): TUNED}, GATHER_GEMM, problem)
                == _heuristic(problem))
    mine = KernelConfig(64, 64, 32, 1, 4, 2)
    assert dispatch.select_config(GATHER_GEMM, fwd(20000)) == TUNED  # (memoized)
    dispatch.add_configs(0, {Bucket.of(fwd(5000)): mine})
    assert dispatch.select_config(GATHER_GEMM, fwd(5000)) == mine
    assert dispatch.select_config(GATHER_GEMM, fwd(20000)) == mine  # (32768: nearer 8192)
    assert dispatch.select_config(GATHER_GEMM, fwd(1000)) == TUNED  # (1024: nearer 4096)
    # at equal distance the bucket of more rows lends: 4096 between 2048 and 8192 (mine);
    # a bucket's own entry beats any neighbour
    few = KernelConfig(16, 64, 32, 1, 4, 2)
    dispatch.add_configs(0, {Bucket.of(fwd(1500)): few})
    assert dispatch.select_config(GATHER_GEMM, FWD) == TUNED
    assert dispatch.select_config(GATHER_GEMM, fwd(700)) == few  # (1024: nearer 2048 now)
    lone = KernelConfig(32, 32, 32, 1, 4, 2)
    dispatch.add_configs(0, {Bucket.of(fwd(1500, ci=128)): lone,
                             Bucket.of(fwd(6000, ci=128)): mine})
    assert dispatch.select_config(GATHER_GEMM, fwd(3000, ci=128)) == mine
    assert dispatch.select_config(GATHER_GEMM, fwd(700, ci=128)) == lone
    # split-K (a real table's: masked_splitk, 16 splits of 256 rows) whose fp32 partials
    # would pass the workspace cap at 2^16 rows (1 GiB): not lent there, the heuristic runs
    def splitk(rows):
        return Problem(rows, 256, 256, 27, "float16", "masked_splitk", "fwd")
    split = KernelConfig(64, 64, 32, 16, 4, 2)
    dispatch.add_configs(0, {Bucket.of(splitk(200)): split})
    assert dispatch.select_config(GATHER_GEMM, splitk(500)) == split
    assert dispatch.select_config(GATHER_GEMM, splitk(1 << 16)) == _heuristic(splitk(1 << 16))
    assert dispatch.select_config(GATHER_GEMM, fwd(9000)) == mine  # (the nearer one)
    assert dispatch.select_config(GATHER_GEMM, FWD) == TUNED


def test_shipped_table_used_and_user_table_overrides_it(fake_gpu):
    table.write_table(_table(), fake_gpu / f"{GPU.slug}.json")
    assert dispatch.select_config(GATHER_GEMM, FWD) == TUNED
    mine = KernelConfig(64, 64, 32, 1, 4, 2)
    table.write_table(_table(config=mine), table.user_table_path(GPU))
    dispatch.reset()
    assert dispatch.select_config(GATHER_GEMM, FWD) == mine


def test_heuristic_fallback_without_tables_and_without_gpu(fake_gpu, monkeypatch):
    config, caught = _select_warnings()
    assert config == _heuristic(FWD) and caught == []
    monkeypatch.setattr(dispatch, "current_device_index", lambda: None)  # CPU: no table at all
    wgrad = Problem(70000, 16, 32, 27, "tf32", "masked_splitk", "wgrad")
    assert dispatch.select_config(WGRAD, wgrad) == _heuristic(wgrad)


def test_forced_config_wins_and_is_thread_local(fake_gpu):
    import threading

    seen = []
    with dispatch.forced_config(TUNED):
        assert dispatch.select_config(GATHER_GEMM, FWD) == TUNED
        t = threading.Thread(target=lambda: seen.append(dispatch.select_config(GATHER_GEMM, FWD)))
        t.start()
        t.join()
    assert seen == [_heuristic(FWD)]
    assert dispatch.select_config(GATHER_GEMM, FWD) == _heuristic(FWD)


@pytest.mark.parametrize("foreign", [
    DeviceKey("NVIDIA A100-SXM4-80GB", "sm_80", 108, "3.6.0"),   # other GPU
    DeviceKey(GPU.name, GPU.arch, GPU.sms, "3.9.0"),             # other Triton version
])
def test_foreign_user_table_ignored_with_one_warning(fake_gpu, foreign):
    table.write_table(_table(device=foreign), table.user_table_path(GPU))
    config, caught = _select_warnings()
    assert config == _heuristic(FWD)
    assert len(caught) == 1 and "belongs to" in str(caught[0].message)


def test_shipped_tables_of_other_gpus_unused_silently_other_triton_warned_once(fake_gpu):
    table.write_table(_table(device=DeviceKey("NVIDIA A100", "sm_80", 108, "3.6.0")),
                      fake_gpu / "a100.json")
    config, caught = _select_warnings()
    assert config == _heuristic(FWD) and caught == []
    table.write_table(_table(device=DeviceKey(GPU.name, GPU.arch, GPU.sms, "3.5.0")),
                      fake_gpu / "h100-old.json")
    dispatch.reset()
    config, caught = _select_warnings()
    assert config == _heuristic(FWD)
    assert len(caught) == 1 and "Triton 3.5.0" in str(caught[0].message)


@pytest.mark.parametrize("text", ["{\"schema\": 1, \"device\": ", "[]", "\x00\xff garbage"])
def test_corrupt_user_table_ignored_with_one_warning(fake_gpu, text):
    path = table.user_table_path(GPU)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    config, caught = _select_warnings()
    assert config == _heuristic(FWD)
    assert len(caught) == 1 and "unusable tuning table" in str(caught[0].message)


def test_lookup_is_memoized(fake_gpu, monkeypatch):
    calls = []
    real = dispatch.load_configs
    monkeypatch.setattr(dispatch, "load_configs", lambda key: calls.append(key) or real(key))
    for n in range(1025, 1125):
        dispatch.select_config(GATHER_GEMM, Problem(n, 64, 64, 27, "float16", "masked", "fwd"))
    assert len(calls) == 1 and len(dispatch._memo) == 1


def test_repeated_call_is_answered_from_memory(fake_gpu, monkeypatch):
    resolved = []
    real = dispatch._config_for
    monkeypatch.setattr(dispatch, "_config_for", lambda *key: resolved.append(key) or real(*key))
    answers = [dispatch.select_config(GATHER_GEMM, FWD) for _ in range(3)]
    assert answers == [_heuristic(FWD)] * 3 and len(resolved) == 1
    dispatch.add_configs(resolved[0][2], {Bucket.of(FWD): TUNED})  # new tables: asked again
    assert dispatch.select_config(GATHER_GEMM, FWD) == TUNED and len(resolved) == 2


# ------------------------------------------------------------------ run-time tuning modes

def test_ondemand_tunes_the_missing_bucket_once(fake_gpu, monkeypatch):
    asked = []
    monkeypatch.setenv(dispatch.TUNE_ENV, "ondemand")
    monkeypatch.setattr(online, "_tune", lambda index, bucket: asked.append(bucket) or TUNED)
    assert dispatch.select_config(GATHER_GEMM, FWD) == TUNED
    assert dispatch.select_config(GATHER_GEMM, FWD) == TUNED
    assert asked == [Bucket.of(FWD)]


def test_background_answers_at_once_then_uses_the_result(fake_gpu, monkeypatch):
    import contextlib
    import threading

    release = threading.Event()

    def slow_tune(index, bucket):
        release.wait(10)
        dispatch.add_configs(index, {bucket: TUNED})
        return TUNED

    monkeypatch.setenv(dispatch.TUNE_ENV, "background")
    monkeypatch.setattr(online, "_tune", slow_tune)
    monkeypatch.setattr(online, "_on_side_stream", lambda index: contextlib.nullcontext())
    assert dispatch.select_config(GATHER_GEMM, FWD) == _heuristic(FWD)  # not waiting
    release.set()
    online._queue.join()
    assert dispatch.select_config(GATHER_GEMM, FWD) == TUNED


def test_failed_runtime_tuning_warns_and_falls_back(fake_gpu, monkeypatch):
    def broken(index, bucket):
        raise RuntimeError("no luck")

    monkeypatch.setenv(dispatch.TUNE_ENV, "ondemand")
    monkeypatch.setattr(online, "_tune", broken)
    monkeypatch.setattr(online, "_failed", set())
    with pytest.warns(RuntimeWarning, match="no luck"):
        assert dispatch.select_config(GATHER_GEMM, FWD) == _heuristic(FWD)


def test_unknown_tune_mode_warns_and_stays_off(fake_gpu, monkeypatch):
    monkeypatch.setenv(dispatch.TUNE_ENV, "sometimes")
    with pytest.warns(RuntimeWarning, match="sometimes"):
        assert dispatch.select_config(GATHER_GEMM, FWD) == _heuristic(FWD)


def test_a_missing_bucket_goes_to_the_tuning_hook_when_tuning_is_on(fake_gpu, monkeypatch):
    # flexplan/tuning/__init__.py installs the run-time tuner: importing dispatch ran it.
    assert dispatch._tuning_hook is online.tune_missing
    asked = []
    previous = dispatch.set_tuning_hook(lambda *args: asked.append(args) or TUNED)
    try:
        assert dispatch.select_config(GATHER_GEMM, FWD) == _heuristic(FWD) and asked == []
        monkeypatch.setenv(dispatch.TUNE_ENV, "ondemand")  # read on each miss, not at import
        dispatch.reset()
        assert dispatch.select_config(GATHER_GEMM, FWD) == TUNED
        assert asked == [(0, Bucket.of(FWD), "ondemand")]
        dispatch.set_tuning_hook(None)  # no tuner installed: the heuristic, nothing raised
        dispatch.reset()
        assert dispatch.select_config(GATHER_GEMM, FWD) == _heuristic(FWD)
    finally:
        dispatch.set_tuning_hook(previous)


# ------------------------------------------------------------------ layering

SELECTION = ("dispatch", "table", "buckets", "device", "aot")
ABOVE_OPS = ("flexplan.ops", "flexplan.nn", "flexplan.tuning.online", "flexplan.tuning.tuner",
             "flexplan.tuning.cases", "flexplan.tuning.cli")


def _imports(module: str) -> set:
    """Every module (or module.name) `module` imports, inside functions too."""
    tree = ast.parse(pathlib.Path(importlib.util.find_spec(module).origin).read_text())
    package, found = module.rpartition(".")[0], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("name", SELECTION)
def test_selection_imports_neither_the_ops_nor_the_tuner(name):
    assert not {m for m in _imports(f"flexplan.tuning.{name}") if m.startswith(ABOVE_OPS)}


def test_ops_import_only_the_selection_modules_of_tuning():
    """Not the package either: its __init__ wires in the run-time tuner, which runs the ops."""
    tuning = {m for m in _imports("flexplan.ops.conv") if m.startswith("flexplan.tuning")}
    assert tuning and all(m.split(".")[2:3] and m.split(".")[2] in SELECTION for m in tuning)


# ------------------------------------------------------------------ AOT config set

def test_configs_for_aot_cover_shipped_tables_and_every_heuristic_pick(fake_gpu):
    shipped_cfg = KernelConfig(16, 16, 16, 1, 8, 4)
    table.write_table(_table(config=shipped_cfg), fake_gpu / "some-gpu.json")
    narrow = dict(dtypes=("float16",), volumes=(27,), channels=(16, 64), rows=(1 << 10, 1 << 16))
    configs = aot.configs_for_aot(**narrow)
    assert shipped_cfg in configs[GATHER_GEMM]
    # Whatever dispatch returns (no table for this GPU) for problems in those buckets is listed,
    # up to the split count (a grid size, not compiled in).
    dispatch.reset()
    compiled = {f: {tuple(sorted(c.launch_kwargs().items())) for c in cs} for f, cs in configs.items()}
    for n in (700, 1024, 40000, 65536):
        for part in ("fwd", "dgrad", "wgrad"):
            for algo in aot.KERNEL_ALGORITHMS:
                p = Problem(n, 64, 16, 27, "float16", algo, part)
                cfg = dispatch.select_config(p.family, p)
                assert tuple(sorted(cfg.launch_kwargs().items())) in compiled[p.family]


def test_dispatch_rows_keep_the_bucket_and_stay_within_an_eighth():
    import random

    from flexplan.kernel_configs import dispatch_rows

    rng = random.Random(0)
    for n in list(range(1, 4096)) + [rng.randrange(1, 10**8) for _ in range(20000)]:
        r = dispatch_rows(n)
        assert n <= r <= n + n / 8 and pow2_ceil(r) == pow2_ceil(n), (n, r)


def test_new_row_counts_every_call_ask_dispatch_few_questions():
    """Fresh coordinates: a layer's row count is new every call (here 500 counts within +-5% of
    100k). The questions the op asks the algorithm choice and the config heuristic are few,
    so their caches answer after the first calls (they would grow by one entry per call on
    exact counts)."""
    from flexplan.kernel_configs import choose_algo, heuristic_config
    from flexplan.ops.conv import resolve_algo

    choose_algo.cache_clear()
    heuristic_config.cache_clear()
    for n in range(95_000, 105_000, 20):
        for part in ("fwd", "dgrad", "wgrad"):
            resolve_algo("auto", part, n if part != "wgrad" else 9 * n, 32, 32, 27, "float16")
    assert choose_algo.cache_info().currsize <= 3 * 3
    assert heuristic_config.cache_info().currsize <= 3 * 3


def test_tune_cli_takes_shells_with_their_channels_in_and_out():
    """--shells R:C means C channels in and out, R:Ci:Co a shell of Ci -> Co (a decoder's
    merge, a strided conv's widening); anything else is refused."""
    import argparse

    from flexplan.tuning.cli import _shells, _shells_of

    assert _shells("150:32:16,92:64") == ((150, 32, 16), (92, 64, 64))
    assert _shells_of(((16, 1024), (150, 32, 16))) == ((16, 1024, 1024), (150, 32, 16))
    for bad in ("", "1:2:3:4", "64", "a:b", "64:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            _shells(bad)


def test_a_float32_case_is_tuned_in_its_config_dtypes_bucket():
    """Dispatch asks for float32 problems in their config dtype (tf32 on NVIDIA: one config
    serves both), so a float32 case's problem is labelled so and its entry lands where
    dispatch looks; its run stays float32's."""
    from flexplan.kernel_configs import config_dtype
    from flexplan.tuning.cases import part_case, shell_workload

    work = shell_workload(6, 4, 8, "float32", torch.device("cpu"))
    for part in ("fwd", "dgrad", "wgrad"):
        case = part_case(work, part)
        assert case.problem.dtype == config_dtype("float32", False) == "tf32"
        assert case.run_dtype == "float32" and case.run().dtype == torch.float32
