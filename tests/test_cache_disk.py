"""Plan cache layers: memory and disk hits, damaged files, unwritable or full disks, eviction,
the cost policy, shipping plans with a model, and the CLI."""
import dataclasses
import errno
import os
import tempfile
import time
import warnings

import pytest
import torch

import flexplan.cache.disk as disk_module
from flexplan import ConvGeometry, SparseTensor, build_plan, tensor_plan
from flexplan.cache import PlanCache, cli
from flexplan.cache.format import write_plan
from flexplan.cache.key import IDENTITY_FIELD
from flexplan.coords_hash import coords_identity
from flexplan.cache.policy import Policy
from flexplan.ops import sparse_conv
from flexplan.planner.offsets import kernel_offsets
from test_cache_format import SHAPE, assert_same_plan, make_coords

GEOM = ConvGeometry.submanifold_conv(3)


def cache_at(directory, mode="always", **policy):
    return PlanCache(directory, Policy(mode=mode, **policy))


def reference_subm_conv(feats, coords, weight, geometry):
    """float64 out[i] = sum_v W_v feats[j] with coords[j] = coords[i] + offset_v, by dict lookup
    (independent of every planner)."""
    rows = {tuple(c): j for j, c in enumerate(coords.tolist())}
    offsets = kernel_offsets(geometry).tolist()
    w = weight.double().reshape(weight.shape[0], -1, weight.shape[-1])
    out = torch.zeros(coords.shape[0], weight.shape[0], dtype=torch.float64)
    for i, (b, x, y, z) in enumerate(coords.tolist()):
        for v, (dx, dy, dz) in enumerate(offsets):
            j = rows.get((b, x + dx, y + dy, z + dz))
            if j is not None:
                out[i] += w[:, v, :] @ feats[j].double()
    return out


def check_conv(plan, coords, seed=0):
    """The plan a cache served computes the conv (float64, against the dict-lookup reference).
    Masked: it reads every part of the plan's forward gather map, and is the algorithm that
    costs the interpreter least here (explicit's im2col runs a program per 16 rows and offset)."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(coords.shape[0], 4, generator=g, dtype=torch.float64)
    weight = torch.randn(5, 3, 3, 3, 4, generator=g, dtype=torch.float64)
    out = sparse_conv(feats, plan, weight, algo="masked")
    torch.testing.assert_close(out, reference_subm_conv(feats, coords, weight, GEOM))


@pytest.mark.parametrize("geometry", [GEOM, ConvGeometry.make(3, stride=2, submanifold=False)],
                         ids=["submanifold", "strided"])
def test_memory_then_disk_then_build(tmp_path, geometry):
    coords = make_coords()
    cache = cache_at(tmp_path)
    plan = cache.get_or_build(coords, SHAPE, 2, geometry)
    assert cache.get_or_build(coords, SHAPE, 2, geometry) is plan
    assert cache.stats()["builds"] == 1 and cache.stats()["memory_hits"] == 1
    fresh = cache_at(tmp_path)  # another process: empty memory, same directory
    loaded = fresh.get_or_build(coords.clone(), SHAPE, 2, geometry)
    assert fresh.stats().get("builds", 0) == 0 and fresh.stats()["disk_hits"] == 1
    assert_same_plan(plan, loaded)
    if geometry.submanifold:
        check_conv(loaded, coords)


def test_sparse_tensor_uses_the_cache(tmp_path, monkeypatch):
    from flexplan.cache import plan_cache

    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plan_cache.policy, "mode", "always")
    coords = make_coords(seed=5)
    before = plan_cache.stats().get("builds", 0)
    for _ in range(2):  # two tensors over the same coords: one build
        st = SparseTensor(torch.randn(coords.shape[0], 2), coords, SHAPE, 2)
        assert_same_plan(tensor_plan(st, GEOM), build_plan(coords, SHAPE, 2, GEOM))
    assert plan_cache.stats()["builds"] == before + 1
    assert len(list((tmp_path / "plans").glob("*.fxplan"))) == 1


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "foreign"])
def test_damaged_file_warns_once_is_removed_and_rebuilt(tmp_path, damage):
    coords = make_coords()
    cache = cache_at(tmp_path)
    plan = cache.get_or_build(coords, SHAPE, 2, GEOM)
    path = cache.disk.path(cache.key(coords, SHAPE, 2, GEOM))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "bitflip":
        data[len(data) - 333] ^= 0x04
    else:
        data = bytearray(os.urandom(len(data)))
    path.write_bytes(bytes(data))
    fresh = cache_at(tmp_path)
    with pytest.warns(RuntimeWarning, match="unusable") as caught:
        rebuilt = fresh.get_or_build(coords, SHAPE, 2, GEOM)
    assert len([w for w in caught if "plan cache" in str(w.message)]) == 1
    assert fresh.stats()["corrupt"] == 1 and fresh.stats()["builds"] == 1
    assert_same_plan(plan, rebuilt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten file is sound: no more warnings
        assert_same_plan(plan, cache_at(tmp_path).get_or_build(coords, SHAPE, 2, GEOM))


def _identity_field(coords) -> dict:
    return {IDENTITY_FIELD: coords_identity(coords).hex()}


def test_file_of_other_coords_under_this_key_is_not_used(tmp_path):
    """A (simulated) key collision: a sound file whose scalars and recorded identity check out,
    under this key, but whose coordinates differ -> rebuilt."""
    coords, other = make_coords(seed=1), make_coords(seed=2)
    n = min(coords.shape[0], other.shape[0])
    coords, other = coords[:n].contiguous(), other[:n].contiguous()
    cache = cache_at(tmp_path)
    key = cache.key(coords, SHAPE, 2, GEOM)
    with open(cache.disk.path(key), "wb") as out:  # (claims this key's identity: binds)
        write_plan(out, build_plan(other, SHAPE, 2, GEOM), key, _identity_field(coords))
    plan = cache.get_or_build(coords, SHAPE, 2, GEOM)
    assert cache.stats()["collisions"] >= 1 and cache.stats()["builds"] == 1
    assert_same_plan(plan, build_plan(coords, SHAPE, 2, GEOM))


STRIDED = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)


@pytest.mark.parametrize("binding", ["other coordinates", "none (an older file)"])
def test_strided_plan_of_other_coordinates_with_the_same_rows_is_refused(tmp_path, binding):
    """A strided plan keeps only its output coordinates, so a plan of other input coordinates
    with the same row count, filed under this key, passes every shape check; the identity its
    writer recorded does not hash to this key: refused with one warning, rebuilt, and flagged by
    `cache verify`. The answer equals a fresh build's."""
    a, b = make_coords(seed=11), make_coords(seed=12)
    n = min(a.shape[0], b.shape[0])
    a, b = a[:n].contiguous(), b[:n].contiguous()
    cache = cache_at(tmp_path)
    key = cache.key(a, SHAPE, 2, STRIDED)
    forged = build_plan(b, SHAPE, 2, STRIDED)
    with open(cache.disk.path(key), "wb") as out:
        write_plan(out, forged, key, _identity_field(b) if binding != "none (an older file)" else {})
    assert disk_module.verify_file(cache.disk.path(key)) is not None
    with pytest.warns(RuntimeWarning, match="identity") as caught:
        plan = cache.get_or_build(a, SHAPE, 2, STRIDED)
    assert len(caught) == 1
    assert cache.stats()["corrupt"] == 1 and cache.stats()["builds"] == 1
    assert_same_plan(plan, build_plan(a, SHAPE, 2, STRIDED))
    # Equal, field for field and tensor for tensor, to the torch planner's plan (the oracle) of
    # the same coordinates, so a convolution through it is the oracle plan's (the kernels read
    # nothing else; two interpreted convs compared their outputs here, seconds for no more).
    assert_same_plan(plan, build_plan(a, SHAPE, 2, STRIDED, backend="torch"))
    assert disk_module.verify_file(cache.disk.path(key)) is None  # rewritten, bound
    assert_same_plan(cache_at(tmp_path).get_or_build(a, SHAPE, 2, STRIDED), plan)


def test_strided_plans_ship_through_save_and_load_plans(tmp_path):
    """A strided plan the cache built from the coordinates alone (no identity given) is bound
    by the identity the cache hashed, saved, loaded elsewhere and served from memory."""
    coords = make_coords(seed=13)
    builder = cache_at(tmp_path / "cache")
    plan = builder.get_or_build(coords, SHAPE, 2, STRIDED)
    keys = builder.save_plans(tmp_path / "shipped", [plan])
    server = cache_at(tmp_path / "server", mode="never")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(server.load_plans(tmp_path / "shipped", device="cpu")) == keys
    assert_same_plan(server.get_or_build(coords, SHAPE, 2, STRIDED), plan)
    assert server.stats().get("builds", 0) == 0


def test_a_header_with_scalars_of_the_wrong_type_is_refused(tmp_path):
    """A sound payload whose header's batch size is not a number: refused like any corrupt
    file (one warning, rebuilt), never an exception into the caller."""
    coords = make_coords(seed=14)
    cache = cache_at(tmp_path)
    key = cache.key(coords, SHAPE, 2, STRIDED)
    forged = dataclasses.replace(build_plan(coords, SHAPE, 2, STRIDED), batch_size="two")
    with open(cache.disk.path(key), "wb") as out:
        write_plan(out, forged, key, _identity_field(coords))
    with pytest.warns(RuntimeWarning, match="unusable") as caught:
        plan = cache.get_or_build(coords, SHAPE, 2, STRIDED)
    assert len(caught) == 1 and cache.stats()["builds"] == 1
    assert_same_plan(plan, build_plan(coords, SHAPE, 2, STRIDED))


def test_save_plans_refuses_a_plan_it_cannot_bind(tmp_path):
    builder = cache_at(tmp_path / "cache")
    a, b = make_coords(seed=7), make_coords(seed=8)
    plan_b = builder.get_or_build(b, SHAPE, 2, STRIDED)
    with pytest.raises(ValueError, match="cannot be bound"):
        builder.save_plans(tmp_path / "shipped", {builder.key(a, SHAPE, 2, STRIDED): plan_b})


def test_unwritable_directory_degrades_to_memory(recwarn):
    cache = cache_at("/proc/flexplan-cannot-exist/plans")
    for seed in range(3):
        coords = make_coords(seed=seed)
        check_conv(cache.get_or_build(coords, SHAPE, 2, GEOM), coords, seed)
    messages = [str(w.message) for w in recwarn if "plan cache" in str(w.message)]
    assert len(messages) == 1 and "memory only" in messages[0]
    assert cache.stats()["builds"] == 3 and not cache.stats()["disk_writable"]


def test_read_only_directory_still_serves_its_plans(tmp_path, monkeypatch, recwarn):
    old = make_coords(seed=3)
    cache_at(tmp_path).get_or_build(old, SHAPE, 2, GEOM)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)  # (atomic_write makes the temp files)
    monkeypatch.setattr(disk_module.filelock.FileLock, "acquire", read_only)
    cache = cache_at(tmp_path)
    check_conv(cache.get_or_build(old, SHAPE, 2, GEOM), old, 3)
    assert cache.stats()["disk_hits"] == 1
    for seed in (4, 5):
        coords = make_coords(seed=seed)
        check_conv(cache.get_or_build(coords, SHAPE, 2, GEOM), coords, seed)
    assert len([w for w in recwarn if "plan cache" in str(w.message)]) == 1
    assert cache.stats()["builds"] == 2 and len(cache.disk.entries()) == 1


# ENOSPC: a full disk; EFBIG: a process file-size limit (RLIMIT_FSIZE). Either turns writes off.
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG], ids=["ENOSPC", "EFBIG"])
def test_disk_full_mid_write_leaves_no_partial_file(tmp_path, monkeypatch, recwarn, code):
    real_write = disk_module.write_plan

    def write_then_fill(out, plan, key, extra=None):
        out.write(b"\0" * 1000)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disk_module, "write_plan", write_then_fill)
    cache = cache_at(tmp_path)
    for seed in range(3):
        coords = make_coords(seed=seed)
        check_conv(cache.get_or_build(coords, SHAPE, 2, GEOM), coords, seed)
    assert len([w for w in recwarn if "plan cache" in str(w.message)]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locks"]  # no temp file left
    assert not cache.stats()["disk_writable"]
    monkeypatch.setattr(disk_module, "write_plan", real_write)
    assert cache.stats()["builds"] == 3 and cache.stats().get("disk_writes", 0) == 0


def test_disk_eviction_keeps_the_cap_and_the_recently_used(tmp_path):
    sets = [make_coords(seed=s) for s in range(6)]
    probe = cache_at(tmp_path / "probe")
    probe.get_or_build(sets[0], SHAPE, 2, GEOM)
    size = probe.disk.total_bytes()
    cache = cache_at(tmp_path, max_disk_bytes=int(3.5 * size))
    keys = [cache.key(c, SHAPE, 2, GEOM) for c in sets]
    for i, coords in enumerate(sets):
        cache.get_or_build(coords, SHAPE, 2, GEOM)
        time.sleep(0.02)  # distinct mtimes
        if i >= 2:  # hits from another process keep plan 0 recent
            assert cache_at(tmp_path).get(sets[0], SHAPE, 2, GEOM) is not None
            time.sleep(0.02)
        assert cache.disk.total_bytes() <= cache.policy.max_disk_bytes
    kept = {p.name.removesuffix(".fxplan") for p, _, _ in cache.disk.entries()}
    assert kept == {keys[0], keys[4], keys[5]}


def test_memory_layer_is_bounded_by_bytes(tmp_path):
    cache = cache_at(tmp_path, mode="never")
    sets = [make_coords(seed=s) for s in range(4)]

    def kept(coords):  # a first sighting stays in the ring of recent plans; its repeat: the LRU
        cache.get_or_build(coords, SHAPE, 2, GEOM)
        return cache.get_or_build(coords, SHAPE, 2, GEOM)

    plans = [kept(c) for c in sets[:1]]
    cache.configure(max_memory_bytes=int(2.5 * cache.memory.nbytes))
    plans += [kept(c) for c in sets[1:]]
    assert len(cache.memory) == 2 and cache.memory.nbytes <= cache.policy.max_memory_bytes
    assert cache.get(sets[3], SHAPE, 2, GEOM) is plans[3]
    assert cache.get(sets[0], SHAPE, 2, GEOM) is None  # mode never: no disk either
    assert not list(tmp_path.iterdir())


def test_auto_policy_skips_disk_where_rebuilding_is_faster(tmp_path):
    coords = make_coords()
    cache = cache_at(tmp_path, mode="auto")
    cache.policy.load_s_per_byte["cpu"] = 1.0  # a disk this slow never pays off
    for _ in range(2):  # the second sighting may go to disk, but the cost model says no
        cache.memory.clear()
        cache.get_or_build(coords, SHAPE, 2, GEOM)
    assert cache.stats()["first_sightings"] == 1 and cache.stats()["builds"] == 2
    assert cache.stats().get("disk_writes", 0) == 0 and not cache.disk.entries()
    writer = cache_at(tmp_path)
    writer.get_or_build(coords, SHAPE, 2, GEOM)  # mode always: written, its key journaled
    writer.admission.flush()  # as at its exit: the caches below find the key seen
    slow_disk = cache_at(tmp_path, mode="auto")
    slow_disk.policy.load_s_per_byte["cpu"] = 1.0
    slow_disk.get_or_build(coords, SHAPE, 2, GEOM)
    assert slow_disk.stats()["disk_skipped"] == 1 and slow_disk.stats()["builds"] == 1
    fast_disk = cache_at(tmp_path, mode="auto")
    fast_disk.get_or_build(coords, SHAPE, 2, GEOM)
    assert fast_disk.stats()["disk_hits"] == 1


def test_auto_policy_does_not_touch_the_disk_where_any_load_is_slower(tmp_path, monkeypatch):
    coords = make_coords()
    cache_at(tmp_path).get_or_build(coords, SHAPE, 2, GEOM)  # a file is there
    cache = cache_at(tmp_path, mode="auto")
    work = coords.shape[0] * GEOM.volume
    cache.policy.record_build("cpu", work, 1e-6)  # builds here beat a load's fixed latency
    assert cache.policy.build_beats_any_load("cpu", work)

    def no_disk(*args, **kwargs):
        raise AssertionError("the disk was read")

    monkeypatch.setattr(cache.disk, "load", no_disk)
    cache.get_or_build(coords, SHAPE, 2, GEOM)
    assert cache.stats()["builds"] == 1 and cache.stats().get("disk_writes", 0) == 0
    cache.policy.record_build("cpu", work, 10.0)  # slow builds: the disk is worth a look again
    assert not cache.policy.build_beats_any_load("cpu", work)


def test_save_and_load_plans_for_a_server(tmp_path):
    builder = cache_at(tmp_path / "cache")
    sets = [make_coords(seed=s) for s in range(3)]
    plans = [builder.get_or_build(c, SHAPE, 2, GEOM) for c in sets]
    keys = builder.save_plans(tmp_path / "model_plans", plans)
    (tmp_path / "model_plans" / "junk.fxplan").write_bytes(b"junk")
    server = cache_at(tmp_path / "server_cache", mode="never", max_memory_bytes=1)
    with pytest.warns(RuntimeWarning, match="junk"):
        loaded = server.load_plans(tmp_path / "model_plans", device="cpu")
    assert sorted(loaded) == sorted(keys)
    for coords, plan in zip(sets, plans):  # found in memory although the cap is 1 byte
        got = server.get_or_build(coords, SHAPE, 2, GEOM)
        assert got is loaded[builder.key(coords, SHAPE, 2, GEOM)]
        assert_same_plan(plan, got)
    assert server.stats().get("builds", 0) == 0
    with pytest.raises(ValueError, match="mapping"):
        server.save_plans(tmp_path / "x", [build_plan(sets[0], SHAPE, 2, GEOM)])


def test_cli_commands(tmp_path, capsys):
    cache = cache_at(tmp_path)
    for seed in range(3):
        cache.get_or_build(make_coords(seed=seed), SHAPE, 2, GEOM)
    run = lambda *args: (cli.main(["--dir", str(tmp_path), *args]), capsys.readouterr().out)  # noqa: E731
    code, out = run("info")
    assert code == 0 and "3 files" in out
    code, out = run("ls")
    assert code == 0 and len(out.strip().splitlines()) == 3 and "N=" in out
    assert run("verify") == (0, "3 ok, 0 bad\n")
    victim = cache.disk.entries()[0][0]
    victim.write_bytes(victim.read_bytes()[:-8])
    code, out = run("verify")
    assert code == 1 and "1 bad" in out
    code, out = run("verify", "--fix")
    assert code == 0 and not victim.exists()
    code, out = run("prune", "--max-bytes", "1")
    assert code == 0 and "removed 2 files" in out
    cache.get_or_build(make_coords(seed=9), SHAPE, 2, GEOM)
    code, out = run("clear")
    assert code == 0 and "removed 1 files" in out and not cache.disk.entries()


def test_foreign_entries_under_plan_names_are_skipped(tmp_path):
    """A directory or a FIFO named like a plan file: eviction, clear, ls and verify pass them
    by, and a FIFO under a requested key's name is unusable, not a hang."""
    cache = cache_at(tmp_path)
    coords = make_coords(seed=5)
    key = cache.key(coords, SHAPE, 2, GEOM)
    (tmp_path / f"{'d' * 32}.fxplan").mkdir()
    os.mkfifo(cache.disk.path(key))
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        plan = cache.get_or_build(coords, SHAPE, 2, GEOM)  # the FIFO is replaced by the plan
    check_conv(plan, coords, 5)
    assert cache.disk.path(key).is_file()
    cache.disk.evict(0)
    assert (tmp_path / f"{'d' * 32}.fxplan").is_dir() and not cache.disk.entries()
    os.mkfifo(cache.disk.path(key))
    assert disk_module.verify_file(cache.disk.path(key)) is not None
    assert cache.disk.clear() == 0


def test_eviction_skips_files_it_may_not_remove(tmp_path, monkeypatch):
    cache = cache_at(tmp_path)
    for seed in range(3):
        cache.get_or_build(make_coords(seed=seed), SHAPE, 2, GEOM)
    real_unlink = disk_module.Path.unlink
    first = cache.disk.entries()[0][0]

    def unlink(self, *args, **kwargs):
        if self == first:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(disk_module.Path, "unlink", unlink)
    with pytest.warns(RuntimeWarning, match="cannot write") as caught:
        removed = cache.disk.evict(0)
    assert len(caught) == 1  # said once; the directory takes no more writes
    assert first not in removed and len(removed) == 2
    assert [e[0] for e in cache.disk.entries()] == [first]
    coords = make_coords(seed=9)
    check_conv(cache.get_or_build(coords, SHAPE, 2, GEOM), coords, 9)
    assert len(cache.disk.entries()) == 1 and not cache.disk.writable


def test_a_directory_other_users_can_write_is_not_used(tmp_path):
    """Like ssh's StrictModes: a plan directory writable by group or others is not read (a
    plan planted there would be served) nor written; said once; plans stay in memory."""
    coords = make_coords(seed=3)
    cache_at(tmp_path).get_or_build(coords, SHAPE, 2, GEOM)  # a sound file, written by us
    files = cache_at(tmp_path).disk.entries()
    assert len(files) == 1
    os.chmod(tmp_path, 0o777)
    try:
        cache = cache_at(tmp_path)
        with pytest.warns(RuntimeWarning, match="other users can write it") as caught:
            plan = cache.get_or_build(coords, SHAPE, 2, GEOM)
            cache.get_or_build(make_coords(seed=4), SHAPE, 2, GEOM)
        assert len(caught) == 1
        assert cache.stats().get("disk_hits", 0) == 0 and cache.stats()["builds"] == 2
        assert cache.disk.entries() == files  # nothing written
        check_conv(plan, coords, 3)
    finally:
        os.chmod(tmp_path, 0o700)


def test_a_plan_file_other_users_can_write_is_refused(tmp_path):
    coords = make_coords(seed=5)
    cache_at(tmp_path).get_or_build(coords, SHAPE, 2, GEOM)
    (path, _, _), = cache_at(tmp_path).disk.entries()
    os.chmod(path, 0o666)
    assert "other users can write it" in disk_module.verify_file(path)
    cache = cache_at(tmp_path)
    with pytest.warns(RuntimeWarning, match="other users can write it"):
        plan = cache.get_or_build(coords, SHAPE, 2, GEOM)
    assert cache.stats()["builds"] == 1
    check_conv(plan, coords, 5)
    assert disk_module.verify_file(path) is None  # replaced by our own (0600) file


def test_a_stuck_builder_is_named_and_then_passed_by(tmp_path, monkeypatch):
    """Another process holding a plan's build lock: the wait is said once (with the lock's
    path), and after LOCK_TIMEOUT_S this process builds without it."""
    import subprocess
    import sys

    monkeypatch.setattr(disk_module, "LOCK_NOTICE_S", 0.2)
    monkeypatch.setattr(disk_module, "LOCK_TIMEOUT_S", 1.0)
    cache = cache_at(tmp_path)
    coords = make_coords(seed=6)
    key = cache.key(coords, SHAPE, 2, GEOM)
    lock_path = tmp_path / "locks" / f"{key[:2]}.lock"
    lock_path.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import filelock, sys, time; l = filelock.FileLock(sys.argv[1]); l.acquire(); "
        "print('held', flush=True); time.sleep(30)"), str(lock_path)], stdout=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.time()
        with pytest.warns(RuntimeWarning, match="another process has been building"):
            plan = cache.get_or_build(coords, SHAPE, 2, GEOM)
        assert time.time() - start < 10
        check_conv(plan, coords, 6)
    finally:
        holder.kill()
        holder.wait()


def test_load_plans_refuses_a_plan_under_another_coordinates_key(tmp_path):
    """A shipped submanifold plan saved under the key of other coordinates (same row count) is
    skipped with a warning, never served for them."""
    builder = cache_at(tmp_path / "cache")
    a, b = make_coords(seed=7), make_coords(seed=8)
    n = min(a.shape[0], b.shape[0])
    a, b = a[:n].contiguous(), b[:n].contiguous()  # same row count: only the key tells them apart
    plan_b = builder.get_or_build(b, SHAPE, 2, GEOM)
    key_a = builder.key(a, SHAPE, 2, GEOM)
    (tmp_path / "shipped").mkdir()
    with open(tmp_path / "shipped" / f"{key_a}.fxplan", "wb") as out:  # lies about its identity
        write_plan(out, plan_b, key_a, _identity_field(a))
    server = cache_at(tmp_path / "server", mode="never")
    with pytest.warns(RuntimeWarning, match="do not hash to its key"):
        assert server.load_plans(tmp_path / "shipped", device="cpu") == {}
    check_conv(server.get_or_build(a, SHAPE, 2, GEOM), a, 7)
