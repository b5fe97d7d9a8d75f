"""Plan cache key and file format: round trips, key sensitivity, corrupt-file detection."""
import dataclasses
import io
import pickle

import pytest
import torch

from flexplan import ConvGeometry, build_plan
from flexplan.cache.format import PlanFileError, read_plan, write_plan
from flexplan.cache.key import coords_digest, plan_key
from flexplan.cache.memory import held_bytes
from flexplan.cache.policy import Policy, parse_bytes
from flexplan.workloads import random_coords

SHAPE = (12, 10, 9)


def assert_same_plan(a, b):
    """Every field equal: scalars, and each tensor's name, dtype, shape and values."""
    for f in dataclasses.fields(a):
        if not f.compare:  # build-time state (pairs_pending), not the plan
            continue
        if f.name not in ("fwd", "bwd") and not isinstance(getattr(a, f.name), torch.Tensor):
            assert getattr(a, f.name) == getattr(b, f.name), f.name
    assert (a.bwd is None) == (b.bwd is None)
    ta, tb = a.tensors(), b.tensors()
    assert list(ta) == list(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert ta[name].shape == tb[name].shape, name
        assert torch.equal(ta[name].cpu(), tb[name].cpu()), name


def make_coords(num=300, seed=0, batch_size=2):
    return random_coords(num, SHAPE, batch_size, generator=torch.Generator().manual_seed(seed))


def round_trip(plan, key="k" * 32):
    buf = io.BytesIO()
    write_plan(buf, plan, key)
    return buf.getvalue()


def load_bytes(tmp_path, data, key="k" * 32, device="cpu"):
    path = tmp_path / "p.fxplan"
    path.write_bytes(data)
    plan, _ = read_plan(path, device, expect_key=key)
    return plan


GEOMETRIES = [ConvGeometry.submanifold_conv(3),
              ConvGeometry.submanifold_conv((3, 1, 5), dilation=(1, 1, 2)),
              ConvGeometry.make(3, stride=2, padding=1, submanifold=False),   # has a bwd map
              ConvGeometry.make(2, stride=2, submanifold=False, transposed=True)]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["subm3", "subm_dilated", "strided", "transposed"])
def test_round_trip_every_field(tmp_path, geometry):
    plan = build_plan(make_coords(), SHAPE, 2, geometry)
    assert (plan.bwd is None) == geometry.submanifold
    assert_same_plan(plan, load_bytes(tmp_path, round_trip(plan)))


def test_round_trip_int64_values_and_empty_plan(tmp_path):
    plan = build_plan(make_coords(), SHAPE, 2, GEOMETRIES[2])
    # int64 tensors keep their dtype; an empty plan round-trips too.
    wide = dataclasses.replace(plan, valid_signal_seg=plan.valid_signal_seg.to(torch.int64))
    assert_same_plan(wide, load_bytes(tmp_path, round_trip(wide)))
    # Values beyond int32 survive the file, but no plan may hold them: refused on load.
    beyond = dataclasses.replace(plan, valid_signal_seg=plan.valid_signal_seg.to(torch.int64) + 2**40)
    with pytest.raises(PlanFileError, match="out of bounds: valid_signal_seg"):
        load_bytes(tmp_path, round_trip(beyond))
    empty = build_plan(torch.zeros((0, 4), dtype=torch.int32), SHAPE, 1, GEOMETRIES[0])
    assert_same_plan(empty, load_bytes(tmp_path, round_trip(empty)))


def test_triton_plan_views_round_trip_and_count_their_buffer(tmp_path, device):
    """The Triton planner's valid_kernel of every block size are views of one buffer sized for the
    worst case: files hold only the views' elements, the memory cache counts the buffer once."""
    plan = build_plan(make_coords().to(device), SHAPE, 2, GEOMETRIES[0], backend="triton")
    kernels = list(plan.fwd.valid_kernel.values())
    buffer = kernels[0].untyped_storage()
    assert all(k.untyped_storage().data_ptr() == buffer.data_ptr() for k in kernels)
    assert buffer.nbytes() > sum(k.numel() * k.element_size() for k in kernels)
    assert_same_plan(plan, load_bytes(tmp_path, round_trip(plan)))
    assert held_bytes(plan) >= buffer.nbytes() + plan.fwd.neighbor_map.numel() * 4


def test_small_values_are_stored_narrow():
    plan = build_plan(make_coords(), SHAPE, 2, ConvGeometry.submanifold_conv(3))
    raw = sum(t.numel() * t.element_size() for t in plan.tensors().values())
    assert len(round_trip(plan)) < 0.6 * raw  # int16 neighbour map, int8 valid_kernel


@pytest.mark.parametrize("damage", ["truncate_payload", "truncate_header", "flip_payload",
                                    "flip_header", "foreign", "empty", "wrong_key"])
def test_damaged_files_are_detected(tmp_path, damage):
    data = bytearray(round_trip(build_plan(make_coords(), SHAPE, 2, ConvGeometry.submanifold_conv(3))))
    if damage == "truncate_payload":
        data = data[:-100]
    elif damage == "truncate_header":
        data = data[:40]
    elif damage == "flip_payload":
        data[-77] ^= 0x10
    elif damage == "flip_header":
        data[30] ^= 0x01
    elif damage == "foreign":
        data = bytearray(b'{"not": "a plan"}' * 10)
    elif damage == "empty":
        data = bytearray()
    with pytest.raises(PlanFileError):
        load_bytes(tmp_path, bytes(data), key="x" * 32 if damage == "wrong_key" else "k" * 32)


def test_plan_pickles_for_dataloader_workers():
    plan = build_plan(make_coords(), SHAPE, 2, GEOMETRIES[2])
    assert_same_plan(plan, pickle.loads(pickle.dumps(plan)))


def test_key_depends_on_every_input():
    coords = make_coords()
    geom = ConvGeometry.submanifold_conv(3)
    base = plan_key(coords, SHAPE, 2, geom)
    assert base == plan_key(coords.clone(), SHAPE, 2, geom)
    # A non-contiguous view with the same rows names the same plan.
    wide = torch.cat([coords, coords], 1)[:, :4]
    assert not wide.is_contiguous() and plan_key(wide, SHAPE, 2, geom) == base
    variants = set()
    for row in (0, 150, len(coords) - 1):
        for col in range(4):
            c = coords.clone()
            c[row, col] += 1
            variants.add(plan_key(c, SHAPE, 2, geom))
    swapped = coords.clone()
    swapped[[3, 4]] = coords[[4, 3]]
    variants.add(plan_key(swapped, SHAPE, 2, geom))
    variants.add(plan_key(coords[:-1], SHAPE, 2, geom))
    variants.add(plan_key(coords, SHAPE, 3, geom))
    variants.add(plan_key(coords, (12, 10, 10), 2, geom))
    for field, value in [("kernel_size", (3, 3, 5)), ("dilation", (1, 2, 1)), ("stride", (2, 1, 1)),
                         ("padding", (0, 0, 1)), ("submanifold", False), ("transposed", True)]:
        variants.add(plan_key(coords, SHAPE, 2, dataclasses.replace(geom, **{field: value})))
    assert base not in variants and len(variants) == 12 + 1 + 1 + 2 + 6


@pytest.mark.parametrize("num", [0, 1, 300, 5000])
def test_key_kernel_matches_torch_path(num, device):
    """The Triton hash (GPU path) and the torch hash (CPU path) give the same bits, so plans
    built on either device are found from the other."""
    coords = make_coords(num=num).to(device)
    assert coords_digest(coords, use_triton=True) == coords_digest(coords.cpu(), use_triton=False)


def test_policy_decisions_and_settings(monkeypatch):
    assert parse_bytes("8G") == 8 << 30 and parse_bytes("500MiB") == 500 << 20 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError):
        parse_bytes("lots")
    monkeypatch.setenv("FLEXPLAN_PLAN_CACHE", "sometimes")
    with pytest.warns(RuntimeWarning, match="sometimes"):  # a typo must not break the import
        assert Policy().mode == "auto"
    with pytest.raises(ValueError, match="sometimes"):  # an explicit bad mode does raise
        Policy(mode="sometimes")
    monkeypatch.setenv("FLEXPLAN_PLAN_CACHE", "auto")
    monkeypatch.setenv("FLEXPLAN_PLAN_CACHE_MAX_BYTES", "1M")
    policy = Policy()
    assert policy.max_disk_bytes == 1 << 20
    # Store when the build took well over the modelled load time, not otherwise.
    assert policy.worth_storing("cpu", build_seconds=1.0, nbytes=1 << 20)
    assert not policy.worth_storing("cpu", build_seconds=1e-4, nbytes=1 << 20)
    # Load when the header's same-device build time beats the modelled load time.
    assert policy.worth_loading("cpu", 1000, 1 << 20, {"built_on": "cpu", "build_seconds": 1.0})
    assert not policy.worth_loading("cpu", 1000, 1 << 20, {"built_on": "cpu", "build_seconds": 1e-4})
    # Another device type's build time does not count; this process's own rate does.
    assert policy.worth_loading("cuda", 1000, 1 << 20, {"built_on": "cpu", "build_seconds": 1e-4})
    policy.record_build("cuda", 1000, 1e-5)
    assert not policy.worth_loading("cuda", 1000, 1 << 20, {"built_on": "cpu", "build_seconds": 9.0})
    assert Policy(mode="always").worth_loading("cpu", 1, 1 << 30, {})
    assert not Policy(mode="never").worth_storing("cpu", 100.0, 1)


@pytest.mark.parametrize("check", ["kernel", "torch"])
@pytest.mark.parametrize("damage", ["map_row", "map_last", "sorted_idx", "pair", "seg",
                                    "seg_start", "seg_end", "seg_empty", "shape"])
def test_checksummed_file_with_unsound_contents_is_refused(tmp_path, monkeypatch, damage, check):
    """A file whose checksum is valid but whose indices point outside the plan (written by a
    buggy or hostile writer) is refused on load instead of reaching a kernel: by the one-launch
    check (kernels_src/plan_check.py, through the interpreter here) and by its torch oracle."""
    import flexplan.cache.format as format_module

    if check == "torch":
        monkeypatch.setattr(format_module, "_check_kernel_runs_on", lambda tensors: False)
    else:  # small programs: the map spans many, and a defect may sit in any of them
        monkeypatch.setattr(format_module, "PLAN_CHECK_LAUNCH", dict(BLOCK=32, ITERS=2, num_warps=4))
    # 40 voxels: a grid of 32 x 23 programs (the longest tensor, the forward map of 74 x 27
    # entries, x the tensors checked), each a round through the interpreter.
    plan = build_plan(make_coords(num=40), SHAPE, 2, GEOMETRIES[2])
    assert format_module.plan_problem(plan) is None
    fwd = plan.fwd
    if damage in ("map_row", "map_last"):  # map_last: past the check's first block of entries
        nmap = fwd.neighbor_map.clone()
        assert nmap.numel() > 4 * 32 * 2
        nmap[0 if damage == "map_row" else -1, 0] = plan.num_in + 5
        bad = dataclasses.replace(plan, fwd=dataclasses.replace(fwd, neighbor_map=nmap))
    elif damage == "sorted_idx":
        idx = fwd.sorted_idx.clone()
        idx[-1] = -3
        bad = dataclasses.replace(plan, fwd=dataclasses.replace(fwd, sorted_idx=idx))
    elif damage == "pair":
        pairs = plan.valid_signal_o.clone()
        pairs[0] = plan.num_out
        bad = dataclasses.replace(plan, valid_signal_o=pairs)
    elif damage == "seg":
        seg = plan.valid_signal_seg.clone()
        seg[1] = seg[2] + 1  # then seg decreases
        bad = dataclasses.replace(plan, valid_signal_seg=seg)
    elif damage == "seg_empty":  # no offsets at all: would make num_pairs negative
        empty = plan.valid_signal_seg[:0]
        bad = dataclasses.replace(plan, valid_signal_i=empty, valid_signal_o=empty,
                                  valid_signal_seg=empty)
    elif damage in ("seg_start", "seg_end"):
        block = fwd.block_sizes[0]
        seg = fwd.valid_kernel_seg[block].clone()
        seg[0 if damage == "seg_start" else -1] += 1
        segs = {b: (seg if b == block else fwd.valid_kernel_seg[b]) for b in fwd.block_sizes}
        bad = dataclasses.replace(plan, fwd=dataclasses.replace(
            fwd, valid_kernel=dict(fwd.valid_kernel), valid_kernel_seg=segs))
    else:
        bad = dataclasses.replace(plan, num_out=plan.num_out + 1)
    with pytest.raises(PlanFileError, match="out of bounds"):
        load_bytes(tmp_path, round_trip(bad))
    from flexplan.cache.disk import verify_file
    path = tmp_path / f"{'k' * 32}.fxplan"
    path.write_bytes(round_trip(bad))
    assert "out of bounds" in verify_file(path)


@pytest.mark.gpu
def test_load_check_kernel_on_the_gpu_finds_what_the_torch_check_finds(monkeypatch):
    """The one-launch check on CUDA tensors against its torch oracle, sound and damaged plans."""
    import flexplan.cache.format as format_module

    plan = build_plan(make_coords().cuda(), SHAPE, 2, GEOMETRIES[2])
    nmap = plan.fwd.neighbor_map.clone()
    nmap[-1, -1] = plan.num_in
    seg = plan.valid_signal_seg.clone()
    seg[-1] -= 1
    damaged = [dataclasses.replace(plan, fwd=dataclasses.replace(
                   plan.fwd, valid_kernel=dict(plan.fwd.valid_kernel),
                   valid_kernel_seg=dict(plan.fwd.valid_kernel_seg), neighbor_map=nmap)),
               dataclasses.replace(plan, valid_signal_seg=seg)]
    assert format_module._check_kernel_runs_on([nmap])
    found = [format_module.plan_problem(p) for p in [plan, *damaged]]
    monkeypatch.setattr(format_module, "_check_kernel_runs_on", lambda tensors: False)
    assert found == [format_module.plan_problem(p) for p in [plan, *damaged]]
    assert found[0] is None and all(found[1:])
