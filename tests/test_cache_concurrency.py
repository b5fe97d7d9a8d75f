"""Many processes on one cache directory: each plan built once, every file valid, plans equal;
and plans built in DataLoader workers handed to the main process (and to the GPU, pinned)."""
import hashlib
import multiprocessing as mp
import time

import pytest
import torch

from flexplan import ConvGeometry, build_plan
from flexplan.cache import PlanCache, plan_cache
from flexplan.cache.disk import verify_file
from flexplan.cache.policy import Policy
from test_cache_format import SHAPE, assert_same_plan, make_coords

GEOM = ConvGeometry.submanifold_conv(3)
# 4 processes on this suite's 2 cores: more than run at once, every one inside the race window
# of the shared keys (slow_builds), ranks of both parities (two request orders). Each process
# costs seconds of imports and of plan-file checks through the interpreter.
WORKERS = 4
SHARED_SEEDS = (100, 101)  # every process asks for these; each process also has its own


def fingerprint(plan) -> dict:
    return {name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
            for name, t in plan.tensors().items()}


def slow_builds():
    """Make every build take 0.3 s more, so that all processes are inside the race window."""
    import flexplan.planner

    build = flexplan.planner.build_plan

    def slow_build(*args, **kwargs):
        time.sleep(0.3)
        return build(*args, **kwargs)

    flexplan.planner.build_plan = slow_build


def hammer(rank, directory, barrier, results):
    torch.set_num_threads(1)
    slow_builds()
    cache = PlanCache(directory, Policy(mode="always"))
    seeds = [*SHARED_SEEDS, rank, *SHARED_SEEDS[::-1]] if rank % 2 else [rank, *SHARED_SEEDS] * 2
    barrier.wait()  # start together, so the shared keys are requested at the same moment
    built, prints = [], {}
    for seed in seeds:
        cache.memory.clear()  # every call goes to disk or builds
        before = cache.stats().get("builds", 0)
        plan = cache.get_or_build(make_coords(seed=seed), SHAPE, 2, GEOM)
        if cache.stats().get("builds", 0) > before:
            built.append(seed)
        prints[seed] = fingerprint(plan)
    results.put((rank, built, prints))


def test_processes_build_each_plan_once(tmp_path):
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [ctx.Process(target=hammer, args=(r, str(tmp_path), barrier, results)) for r in range(WORKERS)]
    for p in procs:
        p.start()
    out = [results.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    builds = [seed for _, built, _ in out for seed in built]
    assert sorted(builds) == sorted([*SHARED_SEEDS, *range(WORKERS)])  # once per key
    for seed in [*SHARED_SEEDS, *range(WORKERS)]:
        expected = fingerprint(build_plan(make_coords(seed=seed), SHAPE, 2, GEOM))
        for _, _, prints in out:
            if seed in prints:
                assert prints[seed] == expected
    files = list(tmp_path.glob("*.fxplan"))
    assert len(files) == WORKERS + len(SHARED_SEEDS)
    assert all(verify_file(f) is None for f in files)
    assert not list(tmp_path.glob(".tmp-*"))


class ShellDataset(torch.utils.data.Dataset):
    """Each item: its coords and their plan, from the shared cache (built by whichever worker
    gets there first), and whether this worker had to build it."""

    def __len__(self):
        return 6

    def __getitem__(self, index):
        coords = make_coords(seed=200 + index)
        before = plan_cache.stats().get("builds", 0)
        plan = plan_cache.get_or_build(coords, SHAPE, 2, GEOM, check=False)
        return coords, plan, plan_cache.stats().get("builds", 0) > before


def run_epochs(device, pin):
    loader = torch.utils.data.DataLoader(ShellDataset(), batch_size=None, num_workers=2,
                                         pin_memory=pin)
    epochs = []
    for _ in range(2):
        built = []
        for coords, plan, was_built in loader:
            if pin:
                assert plan.fwd.neighbor_map.is_pinned() and plan.valid_signal_i.is_pinned()
            plan = plan.to(device, non_blocking=True)
            assert_same_plan(plan, build_plan(coords, SHAPE, 2, GEOM))
            assert plan.device.type == torch.device(device).type
            built.append(was_built)
        epochs.append(built)
    return epochs


def test_dataloader_workers_build_then_load(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path))  # inherited by the workers
    monkeypatch.setenv("FLEXPLAN_PLAN_CACHE", "always")  # spawned workers read it
    monkeypatch.setattr(plan_cache.policy, "mode", "always")  # forked workers copy it
    first, second = run_epochs("cpu", pin=False)
    assert all(first) and not any(second)  # epoch 2: new workers, every plan from disk


@pytest.mark.gpu
def test_dataloader_pinned_plans_to_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLEXPLAN_PLAN_CACHE", "always")  # spawned workers read it
    monkeypatch.setattr(plan_cache.policy, "mode", "always")  # forked workers copy it
    first, second = run_epochs("cuda", pin=True)
    assert all(first) and not any(second)


@pytest.mark.gpu
def test_key_is_the_same_on_gpu_and_cpu(tmp_path):
    from flexplan.cache.key import plan_key

    coords = make_coords(num=5000)
    assert plan_key(coords, SHAPE, 2, GEOM) == plan_key(coords.cuda(), SHAPE, 2, GEOM)
    cache = PlanCache(tmp_path, Policy(mode="always"))
    cpu_plan = cache.get_or_build(coords, SHAPE, 2, GEOM)
    fresh = PlanCache(tmp_path, Policy(mode="always"))
    gpu_plan = fresh.get_or_build(coords.cuda(), SHAPE, 2, GEOM)  # the CPU build, loaded to GPU
    assert fresh.stats()["disk_hits"] == 1 and gpu_plan.device.type == "cuda"
    assert_same_plan(cpu_plan, gpu_plan)
