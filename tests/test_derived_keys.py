"""Plan keys without reading coordinates back: user coordinates are hashed once per tensor
(not again for the same unmodified tensor), and the outputs of strided, transposed and inverse
convolutions are named from their input's identity, never hashed."""
from __future__ import annotations

import pytest
import torch

import flexplan.nn.spconv as spconv
from flexplan import ConvGeometry, tensor_plan
import flexplan.coords_hash as coords_hash
import flexplan.planner.hashmap as hashmap
import flexplan.sparse_tensor as sparse_tensor
from flexplan.cache import key as key_module
from flexplan.cache import plan_cache
from flexplan.workloads import random_coords

SHAPE = (9, 8, 7)


def _count_digests(monkeypatch) -> list:
    """Row counts of the coordinate sets hashed: by the plan cache's key, or (CUDA) by the
    coordinate check, which hashes in the same host sync as its verdict."""
    calls = []
    real = coords_hash.digest_lanes

    def counting(coords, *args, **kwargs):
        calls.append(coords.shape[0])
        return real(coords, *args, **kwargs)

    monkeypatch.setattr(coords_hash, "digest_lanes", counting)
    real_flags = hashmap.coords_problem_flags

    def counting_check(coords, *args, lanes=False, **kwargs):  # (the check's own hash pass)
        if lanes:
            calls.append(coords.shape[0])
        return real_flags(coords, *args, lanes=lanes, **kwargs)

    monkeypatch.setattr(hashmap, "coords_problem_flags", counting_check)
    return calls


def _net(device, dtype=torch.float64):
    torch.manual_seed(0)
    return spconv.SparseSequential(
        spconv.SubMConv3d(2, 4, 3, indice_key="s1"),
        spconv.SparseConv3d(4, 4, 3, 2, 1, indice_key="down"),
        spconv.SubMConv3d(4, 4, 3, indice_key="s2"),
        spconv.SparseConvTranspose3d(4, 4, 3, 2, 1),
        spconv.SubMConv3d(4, 4, 3),
    ).to(device, dtype)


def _input(coords, seed=1, dtype=torch.float64):
    feats = torch.randn(coords.shape[0], 2, generator=torch.Generator().manual_seed(seed),
                        dtype=dtype).to(coords.device)
    return spconv.SparseConvTensor(feats, coords, SHAPE, 2)


def test_only_user_coords_are_hashed(monkeypatch, device):
    # float32: this test counts hashes, not values (float64 convs cost the interpreter twice).
    plan_cache.configure(mode="never")
    try:
        calls = _count_digests(monkeypatch)
        coords = random_coords(40, SHAPE, 2, generator=torch.Generator().manual_seed(0))
        coords = coords.to(device)
        f32 = torch.float32
        net = _net(device, f32)
        out = net(_input(coords, dtype=f32))
        down = spconv.SparseSequential(spconv.SubMConv3d(2, 4, 3, indice_key="a"),
                                       spconv.SparseConv3d(4, 4, 3, 2, 1, indice_key="b"),
                                       spconv.SparseInverseConv3d(4, 4, 3, indice_key="b")
                                       ).to(device)
        back = down(_input(coords, dtype=f32))
        assert calls == [coords.shape[0]]  # one hash, for the user's tensor, reused by both nets
        assert torch.equal(back.indices, coords)
        # A modified tensor is hashed again, and plans follow the new coordinates.
        coords[0, 1] = (coords[0, 1] + 1) % SHAPE[0]
        if (coords[1:] == coords[0]).all(1).any():
            coords[0, 1] = (coords[0, 1] + 1) % SHAPE[0]
        out2 = net(_input(coords, dtype=f32))
        assert len(calls) == 2
        assert out2.features.shape[0] == out2.indices.shape[0]
        assert out.features.shape[1] == out2.features.shape[1]
    finally:
        plan_cache.configure(mode="auto")


def test_derived_plans_equal_hashed_plans(device):
    """A plan found by a derived key is the plan of those coordinates: the same as the plan
    of a fresh tensor with the same coordinates (hashed)."""
    plan_cache.configure(mode="never")
    try:
        coords = random_coords(150, SHAPE, 2, generator=torch.Generator().manual_seed(4))
        coords = coords.to(device)
        conv = spconv.SparseConv3d(2, 4, 3, 2, 1).double().to(device)
        sub = spconv.SubMConv3d(4, 3, 3).double().to(device)
        mid = conv(_input(coords))
        derived = sub(mid)
        fresh = sub(_input(mid.indices.clone(), seed=2).replace_feature(mid.features))
        torch.testing.assert_close(derived.features, fresh.features, rtol=0, atol=0)
        geom = ConvGeometry.submanifold_conv(3)
        assert mid.coords_identity() != _input(mid.indices.clone()).coords_identity()
        assert torch.equal(tensor_plan(mid, geom).fwd.neighbor_map,
                           tensor_plan(_input(mid.indices.clone()), geom).fwd.neighbor_map)
    finally:
        plan_cache.configure(mode="auto")


def test_derived_identity_depends_on_everything():
    parent = bytes(range(16))
    geom = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    base = key_module.derived_identity(parent, SHAPE, 2, geom)
    assert len(base) == 16
    others = [key_module.derived_identity(bytes(16), SHAPE, 2, geom),
              key_module.derived_identity(parent, (9, 8, 8), 2, geom),
              key_module.derived_identity(parent, SHAPE, 3, geom),
              key_module.derived_identity(parent, SHAPE, 2, ConvGeometry.make(
                  3, stride=2, padding=0, submanifold=False))]
    assert len({base, *others}) == 5
    assert key_module.derived_identity(parent, SHAPE, 2, geom) == base


@pytest.mark.gpu
def test_the_coordinate_check_records_the_identity():
    """On CUDA the check hashes the coordinates in its own host sync: the identity it leaves is
    the plan cache's digest of them, and a duplicate still raises."""
    coords = random_coords(500, SHAPE, 2, generator=torch.Generator().manual_seed(3)).cuda()
    assert coords_hash.known_identity(coords) is None
    _input(coords)
    assert coords_hash.known_identity(coords) == coords_hash.digest_identity(
        coords_hash.coords_digest(coords))
    with pytest.raises(sparse_tensor.SparseTensorError, match="duplicate"):
        _input(torch.cat([coords, coords[:1]]))


@pytest.mark.parametrize("shape", [SHAPE, (3000, 3000, 300)])  # int32 keys, int64 keys
def test_the_check_pass_hashes_the_identity(device, shape):
    """The input check's hash insert pass also sums the identity's two lanes (atomic adds from
    -1, program 0 adding the 1 back): the plan cache's digest, bit for bit, for a row count
    that is no multiple of the insert's block."""
    coords = random_coords(77, shape, 2, generator=torch.Generator().manual_seed(7)).to(device)
    flags = hashmap.coords_problem_flags(coords, shape, 2, spare_slots=2, lanes=True)
    assert flags[:2].tolist() == [-1, -1]
    assert flags[2:].tolist() == coords_hash.digest_lanes(coords.cpu(), use_triton=False).tolist()


def test_the_check_pass_hashes_no_rows_to_zero(device):
    """No rows, no launch: the lanes read the sums over nothing, as digest_lanes gives them."""
    coords = torch.empty((0, 4), dtype=torch.int32, device=device)
    flags = hashmap.coords_problem_flags(coords, SHAPE, 2, spare_slots=2, lanes=True)
    assert flags.tolist() == [-1, -1, 0, 0]
    assert coords_hash.digest_lanes(coords.cpu(), use_triton=False).tolist() == [0, 0]
