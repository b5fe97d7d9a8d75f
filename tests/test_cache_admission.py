"""Disk admission on the second sighting (mode auto): a key seen once costs no disk I/O and no
lock; seen again (here, or by another process through the journal of seen keys) it is written;
the next process loads it. The journal: batched appends, garbage ignored, bounded, concurrent
appenders, unwritable directories; mode never; callers' keys (no hashing)."""
import errno
import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flexplan.cache.admission as admission
import flexplan.cache.disk as disk_module
import flexplan.cache.key as key_module
from flexplan import ConvGeometry, build_plan
from flexplan.cache import PlanCache, cached_plan, cli, plan_cache
from flexplan.cache.admission import JOURNAL_NAME, SeenKeys
from flexplan.cache.policy import Policy
from test_cache_disk import check_conv
from test_cache_format import SHAPE, assert_same_plan, make_coords

GEOM = ConvGeometry.submanifold_conv(3)
plan_cache_module = sys.modules["flexplan.cache.plan_cache"]  # flexplan.cache.plan_cache: the instance
REPO = Path(__file__).resolve().parents[1]


class DiskPays(Policy):
    """Mode auto whose cost model always finds the disk worth it: admission alone decides."""

    def worth_storing(self, *args):
        return True

    def worth_loading(self, *args):
        return True

    def build_beats_any_load(self, *args):
        return False


def auto_cache(directory, policy=None):
    return PlanCache(directory, policy or DiskPays(mode="auto"))


def journal_lines(directory):
    path = Path(directory) / JOURNAL_NAME
    text = path.read_bytes().decode(errors="replace") if path.exists() else ""
    return [line for line in text.splitlines() if line]


def check_plan(plan, coords):
    assert_same_plan(plan, build_plan(coords, SHAPE, 2, GEOM))


@pytest.fixture
def no_timed_flush(monkeypatch):
    """Appends only by batch size or explicit flush, so tests see exactly when files appear."""
    monkeypatch.setattr(admission, "FLUSH_SECONDS", 1e9)


def test_first_sighting_touches_no_file_second_writes(tmp_path, monkeypatch, no_timed_flush):
    coords = make_coords(seed=1)
    cache = auto_cache(tmp_path)
    key = cache.key(coords, SHAPE, 2, GEOM)

    def forbidden(*args, **kwargs):
        raise AssertionError("first sighting touched the disk")

    with monkeypatch.context() as m:
        m.setattr(cache.disk, "load", forbidden)
        m.setattr(cache.disk, "store", forbidden)
        m.setattr(disk_module.filelock.FileLock, "acquire", forbidden)
        plan = cache.get_or_build(coords, SHAPE, 2, GEOM)
        assert len(cache.memory) == 0  # a first sighting stays out of the LRU (in the ring)
        assert cache.get_or_build(coords, SHAPE, 2, GEOM) is plan  # memory hit, now in the LRU
        assert len(cache.memory) == 1
    check_conv(plan, coords, 1)
    assert not any(tmp_path.iterdir())  # no plan file, no lock file, the journal still buffered
    stats = cache.stats()
    assert stats["first_sightings"] == 1 and stats["builds"] == 1 and stats["memory_hits"] == 1
    assert stats["seen_keys"] == 1 and stats["journal_bytes"] == 0
    cache.admission.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == [JOURNAL_NAME]
    assert journal_lines(tmp_path) == [key]

    cache.memory.clear()  # evicted, then back: the second sighting goes to disk
    again = cache.get_or_build(coords, SHAPE, 2, GEOM)
    assert_same_plan(plan, again)
    stats = cache.stats()
    assert stats["first_sightings"] == 1 and stats["builds"] == 2 and stats["disk_writes"] == 1
    assert cache.disk.path(key).exists() and (tmp_path / "locks").is_dir()
    fresh = auto_cache(tmp_path)  # another process: the key is in the journal, the file loads
    assert_same_plan(plan, fresh.get_or_build(coords, SHAPE, 2, GEOM))
    assert fresh.stats()["disk_hits"] == 1 and fresh.stats().get("builds", 0) == 0


def test_auto_cost_model_still_decides_after_admission(tmp_path):
    coords = make_coords(seed=2)
    cache = auto_cache(tmp_path, Policy(mode="auto"))
    cache.policy.load_s_per_byte["cpu"] = 1.0  # loads this slow never pay off
    for _ in range(3):
        cache.memory.clear()
        cache.get_or_build(coords, SHAPE, 2, GEOM)
    assert cache.stats()["first_sightings"] == 1 and cache.stats()["builds"] == 3
    assert not cache.disk.entries()


def test_memory_hits_do_no_admission_work(tmp_path, monkeypatch):
    coords = make_coords(seed=3)
    cache = auto_cache(tmp_path)
    plan = cache.get_or_build(coords, SHAPE, 2, GEOM)

    def forbidden(*args, **kwargs):
        raise AssertionError("admission work on a memory hit")

    monkeypatch.setattr(cache.admission, "seen_before", forbidden)
    monkeypatch.setattr(cache.admission, "record", forbidden)
    monkeypatch.setattr(admission, "_append", forbidden)
    for _ in range(3):
        assert cache.get_or_build(coords, SHAPE, 2, GEOM) is plan


def test_appends_are_batched(tmp_path, monkeypatch, no_timed_flush):
    appends = []
    real_append = admission._append
    monkeypatch.setattr(admission, "_append", lambda path, data: appends.append(data) or real_append(path, data))
    seen = SeenKeys(tmp_path)
    keys = [f"{i:032x}" for i in range(admission.FLUSH_KEYS + 10)]
    assert not any(seen.seen_before(k) for k in keys[:100])
    assert not appends  # 100 new keys, no write
    assert not any(seen.seen_before(k) for k in keys[100:])
    assert len(appends) == 1 and appends[0].count(b"\n") == admission.FLUSH_KEYS + 1
    seen.flush()  # the rest (also done at exit)
    assert len(appends) == 2 and journal_lines(tmp_path) == keys
    assert all(seen.seen_before(k) for k in keys) and len(appends) == 2
    monkeypatch.setattr(admission, "FLUSH_SECONDS", 0.0)  # time passed: the next new key appends
    assert not seen.seen_before("f" * 32) and len(appends) == 3


def test_journal_is_reread_when_it_changes(tmp_path, monkeypatch):
    reader, writer = SeenKeys(tmp_path), SeenKeys(tmp_path)
    a, b, c, d = "a" * 32, "b" * 32, "c" * 32, "d" * 32
    writer.record(a)
    writer.flush()
    assert reader.seen_before(a)  # first need: the journal is read
    writer.record(b)
    writer.flush()
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *args, **kw: reads.append(args[0]) or real_open(*args, **kw))
    reader.seen_before(c)  # within REREAD_SECONDS of the last look: not read again
    assert not reads
    monkeypatch.setattr(admission, "REREAD_SECONDS", 0.0)
    assert reader.seen_before(c)  # its own sighting, from memory
    assert reader.seen_before(b) and len(reads) == 1  # only the new bytes were read
    reader.seen_before(a)
    assert len(reads) == 1  # unchanged size: no read
    # Replaced (compacted elsewhere): read again from the start, not from the old offset.
    (tmp_path / "new").write_text(f"{d}\n{a}\n{b}\n{a}\n")
    os.replace(tmp_path / "new", tmp_path / JOURNAL_NAME)
    assert reader.seen_before(d) and len(reads) == 2


def test_garbage_journal_is_ignored(tmp_path, no_timed_flush):
    seen_coords, unseen_coords = make_coords(seed=4), make_coords(seed=5)
    probe = auto_cache(tmp_path / "probe")
    seen_key = probe.key(seen_coords, SHAPE, 2, GEOM)
    unseen_key = probe.key(unseen_coords, SHAPE, 2, GEOM)
    junk = [os.urandom(5000), unseen_key.upper().encode(), unseen_key[:31].encode(),
            (unseen_key + "0").encode(), b"x" + unseen_key.encode(), unseen_key.encode() + b"\0",
            seen_key.encode(), os.urandom(300).replace(b"\n", b""), b"\xff" * 40]
    (tmp_path / JOURNAL_NAME).write_bytes(b"\n".join(junk) + b"\n" + unseen_key[:20].encode())
    cache = auto_cache(tmp_path)
    check_plan(cache.get_or_build(unseen_coords, SHAPE, 2, GEOM), unseen_coords)
    assert cache.stats()["first_sightings"] == 1 and not cache.disk.entries()
    cache.get_or_build(seen_coords, SHAPE, 2, GEOM)  # its one good line counts
    assert cache.stats()["first_sightings"] == 1 and cache.disk.entries()
    cache.admission.flush()  # appends after the torn line: the torn line is lost, not the key
    assert unseen_key in journal_lines(tmp_path)
    assert auto_cache(tmp_path).admission.seen_before(unseen_key)


def test_journal_is_compacted_to_the_newest_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(admission, "FLUSH_KEYS", 7)
    seen = SeenKeys(tmp_path, keep=50)
    keys = [f"{i:032x}" for i in range(400)]
    for k in keys:
        seen.seen_before(k)
    seen.flush()
    lines = journal_lines(tmp_path)
    assert len(lines) <= 2 * 50 + 7 and lines == keys[-len(lines):] and len(lines) >= 50
    assert len(seen) <= 2 * 50 and seen.seen_before(keys[-1])
    assert not list(tmp_path.glob(".tmp-*"))


def _append_keys(directory, rank, count, keep):
    seen = SeenKeys(directory, keep=keep)
    for i in range(count):
        seen.seen_before(f"{rank:08x}{i:024x}")
    # no flush here: the rest goes at exit, through multiprocessing's exit hook


def test_concurrent_appenders_never_corrupt_the_journal(tmp_path, monkeypatch):
    monkeypatch.setattr(admission, "FLUSH_KEYS", 5)  # many small appends, racing
    ctx = mp.get_context("fork")  # children inherit the patched batch size
    for keep, directory in ((10_000, tmp_path / "big"), (300, tmp_path / "compacted")):
        procs = [ctx.Process(target=_append_keys, args=(directory, r, 1003, keep)) for r in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        raw = (directory / JOURNAL_NAME).read_bytes()
        lines = [line for line in raw.decode().splitlines() if line]
        assert raw.endswith(b"\n") and all(len(k) == 32 and int(k, 16) >= 0 for k in lines)
        if keep == 10_000:  # never compacted: every key of every process, the tails at exit
            assert sorted(lines) == sorted(f"{r:08x}{i:024x}" for r in range(4) for i in range(1003))
        else:  # compacted while others appended: bounded, some keys may be lost
            assert len(lines) <= 2 * keep + 50 and len(set(lines)) >= keep // 2


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.EFBIG, errno.EACCES])
def test_journal_write_errors_keep_sightings_in_memory(tmp_path, monkeypatch, recwarn, code):
    def refuse(path, data):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(admission, "_append", refuse)
    monkeypatch.setattr(admission, "FLUSH_SECONDS", 0.0)  # every new key tries to append
    cache = auto_cache(tmp_path)
    sets = [make_coords(seed=s) for s in range(3)]
    for coords in sets * 2:
        cache.memory.clear()
        check_plan(cache.get_or_build(coords, SHAPE, 2, GEOM), coords)
    cache.admission.flush()
    # (caches of earlier tests collected meanwhile flush too, and warn about their own paths)
    mine = str(cache.admission.path)
    warned = [str(w.message) for w in recwarn if "journal" in str(w.message) and mine in str(w.message)]
    assert len(warned) == 1 and not cache.stats()["journal_writable"]
    assert cache.stats()["first_sightings"] == 3 and cache.stats()["disk_writes"] == 3


def test_unwritable_directory_works(recwarn, monkeypatch):
    monkeypatch.setattr(admission, "FLUSH_SECONDS", 0.0)
    cache = auto_cache("/proc/flexplan-cannot-exist/plans")
    for seed in (0, 1, 2, 0, 1, 2):
        cache.memory.clear()
        coords = make_coords(seed=seed)
        check_plan(cache.get_or_build(coords, SHAPE, 2, GEOM), coords)
    cache.admission.flush()
    messages = [str(w.message) for w in recwarn if "plan cache" in str(w.message)]
    assert len([m for m in messages if "journal" in m]) == 1  # and one for the plan files
    assert len([m for m in messages if "memory only" in m]) == 1
    stats = cache.stats()
    assert stats["first_sightings"] == 3 and stats["builds"] == 6 and not stats["disk_writable"]


def test_mode_never_writes_no_journal(tmp_path):
    cache = PlanCache(tmp_path, Policy(mode="never"))
    for _ in range(2):
        cache.memory.clear()
        cache.get_or_build(make_coords(seed=6), SHAPE, 2, GEOM)
    cache.admission.flush()
    assert not any(tmp_path.iterdir()) and cache.stats().get("first_sightings", 0) == 0


def test_mode_always_journals_what_it_stores(tmp_path, no_timed_flush):
    coords = make_coords(seed=7)
    writer = PlanCache(tmp_path, Policy(mode="always"))
    writer.get_or_build(coords, SHAPE, 2, GEOM)
    assert writer.stats()["disk_writes"] == 1 and writer.stats().get("first_sightings", 0) == 0
    writer.admission.flush()
    reader = auto_cache(tmp_path)  # an auto process loads what an always process prepared
    reader.get_or_build(coords, SHAPE, 2, GEOM)
    assert reader.stats()["disk_hits"] == 1 and reader.stats().get("first_sightings", 0) == 0


def _see_once(directory, seed):
    torch.set_num_threads(1)
    auto_cache(directory).get_or_build(make_coords(seed=seed), SHAPE, 2, GEOM)


def test_forked_worker_flushes_at_exit(tmp_path, no_timed_flush):
    """DataLoader-style workers end with os._exit: their sightings still reach the journal."""
    parent = auto_cache(tmp_path)
    parent.get_or_build(make_coords(seed=8), SHAPE, 2, GEOM)  # pending in the parent at fork
    worker = mp.get_context("fork").Process(target=_see_once, args=(tmp_path, 9))
    worker.start()
    worker.join(timeout=60)
    assert worker.exitcode == 0
    key = parent.key(make_coords(seed=9), SHAPE, 2, GEOM)
    assert journal_lines(tmp_path) == [key]  # the worker's key, not a copy of the parent's
    parent.admission.flush()
    assert len(journal_lines(tmp_path)) == 2


CHILD = r"""
import json, sys, torch, warnings
warnings.simplefilter("always")
from flexplan import ConvGeometry
from flexplan.cache import cached_plan, plan_cache
from flexplan.workloads import random_coords

policy = plan_cache.policy  # mode from the environment; the cost model always finds disk worth it
policy.worth_storing = policy.worth_loading = lambda *args: True
policy.build_beats_any_load = lambda *args: False
for seed in (0, 1, 2):
    coords = random_coords(200, (8, 8, 8), 1, generator=torch.Generator().manual_seed(seed))
    cached_plan(coords, (8, 8, 8), 1, ConvGeometry.submanifold_conv(3), backend="torch")
print(json.dumps(plan_cache.stats()))
"""


def run_child(cache_root, mode):
    env = dict(os.environ, FLEXPLAN_CACHE_DIR=str(cache_root), FLEXPLAN_PLAN_CACHE=mode,
               PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_second_run_writes_third_loads(tmp_path):
    plans = tmp_path / "plans"
    # Run A (with a bad FLEXPLAN_PLAN_CACHE: a warning, mode auto): each key seen once.
    stats, stderr = run_child(tmp_path, "bad")
    assert "FLEXPLAN_PLAN_CACHE='bad'" in stderr and stats["mode"] == "auto"
    assert stats["first_sightings"] == 3 and stats.get("disk_writes", 0) == 0
    assert sorted(p.name for p in plans.iterdir()) == [JOURNAL_NAME]  # flushed at exit; no lock
    assert len(journal_lines(plans)) == 3
    # Run B: the journal says these keys came before: built once more and written.
    stats, _ = run_child(tmp_path, "auto")
    assert stats.get("first_sightings", 0) == 0 and stats["builds"] == 3 and stats["disk_writes"] == 3
    # Run C: loaded.
    stats, _ = run_child(tmp_path, "auto")
    assert stats.get("builds", 0) == 0 and stats["disk_hits"] == 3
    assert len(set(journal_lines(plans))) == 3


def test_given_key_skips_hashing(tmp_path, monkeypatch):
    coords = make_coords(seed=10)
    cache = PlanCache(tmp_path, Policy(mode="always"))
    key = cache.key(coords, SHAPE, 2, GEOM)

    def no_hashing(*args, **kwargs):
        raise AssertionError("the coordinates were hashed")

    monkeypatch.setattr(plan_cache_module, "plan_key", no_hashing)
    monkeypatch.setattr(key_module, "coords_digest", no_hashing)
    plan = cache.get_or_build(coords, SHAPE, 2, GEOM, key=key)
    assert_same_plan(plan, build_plan(coords, SHAPE, 2, GEOM))
    assert cache.get_or_build(coords, SHAPE, 2, GEOM, key=key) is plan
    assert cache.get(coords, SHAPE, 2, GEOM, key=key) is plan
    assert cache.key_of(plan) == key and cache.disk.path(key).exists()
    fresh = PlanCache(tmp_path, Policy(mode="always"))
    assert_same_plan(plan, fresh.get(coords, SHAPE, 2, GEOM, key=key))  # from disk
    monkeypatch.setattr(plan_cache, "_directory", tmp_path / "global")
    assert_same_plan(plan, cached_plan(coords, SHAPE, 2, GEOM, key=key, check=False))
    for bad in ("A" * 32, "a" * 31, "../" + "a" * 29, 12):
        with pytest.raises(ValueError, match="32 lowercase hex"):
            cache.get_or_build(coords, SHAPE, 2, GEOM, key=bad)


def test_configure_rejects_a_bad_mode_and_keeps_the_old_one(tmp_path):
    cache = PlanCache(tmp_path, Policy(mode="never"))
    with pytest.raises(ValueError, match="bad"):
        cache.configure(mode="bad")
    assert cache.policy.mode == "never"


def test_stats_cli_and_clear_know_the_journal(tmp_path, capsys, monkeypatch, no_timed_flush):
    monkeypatch.setattr(plan_cache, "_directory", plan_cache._directory)  # --dir sets it: undo
    cache = auto_cache(tmp_path)
    sets = [make_coords(seed=s) for s in range(3)]
    for coords in sets + sets[:1]:
        cache.memory.clear()
        cache.get_or_build(coords, SHAPE, 2, GEOM)
    cache.admission.flush()
    stats = cache.stats()
    assert stats["first_sightings"] == 3 and stats["seen_keys"] == 3
    assert stats["journal_bytes"] == 1 + 3 * 33 and stats["disk_writes"] == 1
    run = lambda *args: (cli.main(["--dir", str(tmp_path), *args]), capsys.readouterr().out)  # noqa: E731
    code, out = run("info")
    assert code == 0 and "1 files" in out and "seen keys  3 in seen-keys.log" in out
    assert len(run("ls")[1].strip().splitlines()) == 1
    assert run("verify") == (0, "1 ok, 0 bad\n")
    code, out = run("clear")
    assert code == 0 and "removed 1 files and the journal" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locks"]
    cache.clear(disk=True)
    assert cache.stats()["seen_keys"] == 0


def test_first_sightings_keep_a_bounded_ring(tmp_path, monkeypatch):
    """A stream of coordinates seen once holds at most RECENT_PLANS plans and never grows the
    LRU; the oldest are dropped first."""
    from flexplan.cache import memory as memory_module

    monkeypatch.setattr(memory_module, "RECENT_PLANS", 2)
    cache = auto_cache(tmp_path)
    sets = [make_coords(seed=s) for s in range(3)]
    plans = [cache.get_or_build(c, SHAPE, 2, GEOM) for c in sets]
    assert len(cache.memory) == 0 and len(cache.memory._recent) == 2
    assert cache.get_or_build(sets[2], SHAPE, 2, GEOM) is plans[2]  # recent: a hit
    assert cache.get_or_build(sets[0], SHAPE, 2, GEOM) is not plans[0]  # dropped: rebuilt


def test_a_plan_the_ring_drops_is_released_at_the_next_host_wait(tmp_path, monkeypatch):
    """The ring's dropped plan is not freed at the drop (a host-bound step's time) but handed to
    host_waits, which frees it at the next release_now (a build's or check's host sync)."""
    import gc
    import weakref

    from flexplan import host_waits
    from flexplan.cache import memory as memory_module

    monkeypatch.setattr(memory_module, "RECENT_PLANS", 1)
    host_waits.release_now()
    cache = auto_cache(tmp_path)
    first = weakref.ref(cache.get_or_build(make_coords(seed=0), SHAPE, 2, GEOM))
    cache.get_or_build(make_coords(seed=1), SHAPE, 2, GEOM)  # drops the first from the ring
    gc.collect()
    assert first() is not None and host_waits.pending() == 1
    assert host_waits.release_now() == 1
    gc.collect()
    assert first() is None and host_waits.pending() == 0
    second = weakref.ref(cache.get_or_build(make_coords(seed=2), SHAPE, 2, GEOM))
    cache.get_or_build(make_coords(seed=3), SHAPE, 2, GEOM)  # (drops seed 1's, then seed 2's)
    assert host_waits.pending() == 2 and second() is not None
    cache.clear()  # (frees what waits too)
    gc.collect()
    assert second() is None and host_waits.pending() == 0


def test_memory_without_disk_keeps_a_key_that_comes_back(tmp_path, monkeypatch):
    """Mode never (and builds that beat any load): a first sighting goes to the ring, a key built
    again after the ring dropped it goes to the LRU, and stays there."""
    from flexplan.cache import memory as memory_module

    monkeypatch.setattr(memory_module, "RECENT_PLANS", 2)
    cache = PlanCache(tmp_path, Policy(mode="never"))
    sets = [make_coords(seed=s) for s in range(4)]
    plans = [cache.get_or_build(c, SHAPE, 2, GEOM) for c in sets]
    assert len(cache.memory) == 0 and len(cache.memory._recent) == 2
    again = cache.get_or_build(sets[0], SHAPE, 2, GEOM)  # dropped from the ring: rebuilt, kept
    assert again is not plans[0] and len(cache.memory) == 1
    for c in sets[1:]:
        cache.get_or_build(c, SHAPE, 2, GEOM)
    assert cache.get_or_build(sets[0], SHAPE, 2, GEOM) is again
    assert cache.stats()["misses"] == 5 + 1  # sets[1] was dropped too: its second build
    assert not any(tmp_path.glob("*.plan"))
