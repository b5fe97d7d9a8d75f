"""spconv.pytorch.utils in flexplan.nn.spconv.utils: PointToVoxel against a plain-Python loop over
the points that follows spconv 2.3.8's CPU voxelizer step by step (float32 arithmetic emulated
exactly), and gather_features_by_pc_voxel_id."""
from __future__ import annotations

import math
import struct

import pytest
import torch

import flexplan.nn.spconv as spconv
from flexplan.nn.spconv.utils import PointToVoxel, gather_features_by_pc_voxel_id


def f32(x: float) -> float:
    """Round to float32. Rounding the double result of one +, -, / of float32 values gives the
    float32 operation's result exactly (double has more than 2 * 24 + 2 bits)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def reference(pc, vsize_xyz, range_xyz, max_voxels, max_points, empty_mean=False):
    """spconv's Point2VoxelCPU::point_to_voxel_static as a loop over the points (the mean: the
    stored points' float32 sum in slot order over their count, as spconv's CUDA kernel)."""
    ndim = len(vsize_xyz)
    vs = [f32(v) for v in vsize_xyz][::-1]
    lo = [f32(v) for v in range_xyz[:ndim]][::-1]
    hi = [f32(v) for v in range_xyz[ndim:]][::-1]
    grid = [math.floor(f32(f32(h - l) / v) + 0.5) for h, l, v in zip(hi, lo, vs)]
    double = pc.dtype == torch.float64
    voxel_of, points, coords, ids = {}, [], [], []
    for p in pc.tolist():
        coord = []
        for j in range(ndim):
            x = p[ndim - 1 - j]
            c = (x - lo[j]) / vs[j] if double else f32(f32(x - lo[j]) / vs[j])
            if not 0 <= c < grid[j]:  # floor(c) outside [0, grid); NaN fails too
                break
            coord.append(math.floor(c))
        if len(coord) < ndim:
            ids.append(-1)
            continue
        v = voxel_of.get(tuple(coord))
        if v is None:
            if len(points) >= max_voxels:
                ids.append(-1)
                continue
            v = voxel_of[tuple(coord)] = len(points)
            points.append([])
            coords.append(coord)
        ids.append(v)
        if len(points[v]) < max_points:
            points[v].append([f32(x) for x in p])
    nf = pc.shape[1]
    voxels = torch.zeros(len(points), max_points, nf, dtype=torch.float32)
    for v, rows in enumerate(points):
        if rows:
            voxels[v, :len(rows)] = torch.tensor(rows, dtype=torch.float32)
        if empty_mean and rows:
            mean = []
            for k in range(nf):
                total = rows[0][k]
                for row in rows[1:]:
                    total = f32(total + row[k])
                mean.append(f32(total / len(rows)))
            voxels[v, len(rows):] = torch.tensor(mean, dtype=torch.float32)
    return (voxels, torch.tensor(coords, dtype=torch.int32).view(-1, ndim),
            torch.tensor([len(r) for r in points], dtype=torch.int32),
            torch.tensor(ids, dtype=torch.int64))


def cloud(seed, n, vsize_xyz, range_xyz, features, dtype=torch.float32, on_edges=False):
    """n points about the range (10% outside each side), half again as many exact duplicates,
    shuffled; on_edges puts the coordinates on voxel boundaries (where floor is touchy)."""
    gen = torch.Generator().manual_seed(seed)
    ndim = len(vsize_xyz)
    cols = []
    for d in range(ndim):
        lo, hi, vs = range_xyz[d], range_xyz[d + ndim], vsize_xyz[d]
        if on_edges:
            k = torch.randint(-2, round((hi - lo) / vs) + 3, (n,), generator=gen)
            cols.append((k.double() * vs + lo).to(dtype))
        else:
            u = torch.rand(n, generator=gen, dtype=torch.float64)
            cols.append((lo + (u * 1.2 - 0.1) * (hi - lo)).to(dtype))
    xyz = torch.stack(cols, 1)
    extra = torch.randn(n, features - ndim, generator=gen, dtype=torch.float64).to(dtype)
    pc = torch.cat([xyz, extra], 1)
    pc = torch.cat([pc, pc[torch.randint(0, max(n, 1), (n // 2,), generator=gen)]])
    return pc[torch.randperm(pc.shape[0], generator=gen)].contiguous()


def check(pc, vsize, crange, max_voxels, max_points, empty_mean, device):
    gen = PointToVoxel(vsize, crange, pc.shape[1], max_voxels, max_points, device)
    got = gen.generate_voxel_with_id(pc.to(device), empty_mean=empty_mean)
    want = reference(pc, vsize, crange, max_voxels, max_points, empty_mean)
    for name, g, w in zip(("voxels", "indices", "num_points", "pc_voxel_id"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        assert torch.equal(g.cpu(), w), name
    return got


CASES = {  # name: (vsize_xyz, coors_range_xyz, features, max_voxels, max_points, dtype, on_edges)
    "3d": ([0.1, 0.2, 0.3], [-1.0, -1.2, -0.5, 0.6, 0.8, 0.7], 4, 1000, 3, torch.float32, False),
    "3d_edges": ([0.25, 0.5, 0.1], [-1.0, 0.0, -0.3, 1.0, 2.0, 0.3], 5, 1000, 4, torch.float32,
                 True),
    "3d_full_voxels": ([0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 1.0, 1.5, 1.0], 3, 1000, 2,
                       torch.float32, False),
    "3d_voxel_cap": ([0.1, 0.1, 0.2], [0.0, 0.0, 0.0, 1.0, 1.0, 0.6], 4, 25, 5, torch.float32,
                     False),
    "3d_float64": ([0.1, 0.05, 0.3], [-0.7, 0.1, 0.0, 0.3, 0.6, 0.9], 4, 60, 2, torch.float64,
                   True),
    "1d": ([0.3], [-1.0, 2.0], 2, 1000, 3, torch.float32, False),
    "2d": ([0.2, 0.15], [0.0, -1.0, 1.0, 0.5], 3, 30, 4, torch.float32, True),
    "4d": ([0.5, 0.3, 0.25, 1.0], [0, 0, 0, 0, 1.5, 0.9, 1.0, 3.0], 5, 1000, 3, torch.float32,
           False),
}


@pytest.mark.parametrize("empty_mean", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_point_to_voxel_matches_reference(case, empty_mean, device):
    vsize, crange, features, max_voxels, max_points, dtype, on_edges = CASES[case]
    pc = cloud(len(case), 400, vsize, crange, features, dtype, on_edges)
    voxels, indices, num, ids = check(pc, vsize, crange, max_voxels, max_points, empty_mean,
                                      device)
    # The case exercises what its name says.
    assert (ids == -1).any()  # points out of range (or past the voxel cap)
    assert num.max() >= 1
    if case == "3d_full_voxels":
        assert (num == max_points).sum() > 1 and len(ids) > int(num.sum()) + int((ids == -1).sum())
    if case == "3d_voxel_cap":
        assert voxels.shape[0] == max_voxels


def test_small_cloud_by_hand(device):
    """Voxels in order of their first point, zyx indices, full voxel: later point not stored but
    still labelled; out of range: -1; voxel past the cap: -1."""
    pc = torch.tensor([[2.5, 0.5, 0.5, 1.0], [0.5, 0.5, 3.5, 2.0], [2.6, 0.5, 0.5, 3.0],
                       [2.7, 0.5, 0.5, 5.0], [4.0, 0.5, 0.5, 7.0], [0.5, 1.5, 0.5, 8.0],
                       [-0.1, 0.5, 0.5, 9.0]], device=device)
    gen = PointToVoxel([1, 1, 1], [0, 0, 0, 4, 4, 4], 4, 2, 2, device=device)
    voxels, indices, num, ids = gen.generate_voxel_with_id(pc)
    assert indices.tolist() == [[0, 0, 2], [3, 0, 0]]
    assert num.tolist() == [2, 1]
    assert ids.tolist() == [0, 1, 0, 0, -1, -1, -1]
    assert voxels[0].tolist() == pc[[0, 2]].tolist()
    assert voxels[1].tolist() == [pc[1].tolist(), [0.0] * 4]
    voxels, *_ = gen(pc, empty_mean=True)
    assert voxels[1].tolist() == [pc[1].tolist()] * 2


def test_outputs_and_attributes():
    """spconv's attributes (zyx; its values for these arguments, float32-rounded sizes)."""
    gen = spconv.utils.PointToVoxel([0.1, 0.2, 0.3], [0, -1, -2, 10, 1, 2], 4, 100, 5)
    assert gen.ndim == 3
    assert gen.grid_size == [13, 10, 100]
    assert gen.grid_stride == [1000, 100, 1]
    assert gen.vsize == [0.30000001192092896, 0.20000000298023224, 0.10000000149011612]
    assert gen.coors_range == [-2.0, -1.0, 0.0, 2.0, 1.0, 10.0]
    pc = torch.tensor([[1.0, 0.0, 0.0, 5.0]])
    out = gen(pc)
    assert len(out) == 3 and [t.dtype for t in out] == [torch.float32, torch.int32, torch.int32]
    assert out[1].tolist() == [[6, 5, 10]]
    assert not any(t.requires_grad for t in gen(pc.requires_grad_()))
    assert PointToVoxel([0.5, 0.5], [0, 0, 2.25, 1.25], 2, 10, 1).grid_size == [3, 5]  # round
    assert spconv.utils.gather_features_by_pc_voxel_id is gather_features_by_pc_voxel_id
    assert "utils" in spconv.__all__


@pytest.mark.parametrize("n", [0, 5])
def test_empty_or_all_outside(n, device):
    pc = torch.full((n, 4), 100.0, device=device)
    gen = PointToVoxel([0.1, 0.1, 0.1], [0, 0, 0, 1, 1, 1], 4, 50, 3, device)
    for empty_mean in (False, True):
        voxels, indices, num, ids = gen.generate_voxel_with_id(pc, empty_mean=empty_mean)
        assert voxels.shape == (0, 3, 4) and voxels.dtype == torch.float32
        assert indices.shape == (0, 3) and indices.dtype == torch.int32
        assert num.shape == (0,) and num.dtype == torch.int32
        assert ids.tolist() == [-1] * n and ids.dtype == torch.int64


def test_nonfinite_points_dropped(device):
    pc = torch.tensor([[0.5, 0.5, 0.5], [float("nan"), 0.5, 0.5], [0.5, float("inf"), 0.5],
                       [0.5, 0.5, -float("inf")], [1e30, 0.5, 0.5], [0.5, 0.5, 0.5]])
    gen = PointToVoxel([1, 1, 1], [0, 0, 0, 2, 2, 2], 3, 10, 4)
    _, _, num, ids = gen.generate_voxel_with_id(pc.to(device))
    assert ids.tolist() == [0, -1, -1, -1, -1, 0] and num.tolist() == [2]


def test_grid_too_large_for_int64_keys(device):
    """prod(grid_size) >= 2**62: voxels numbered by their distinct coordinate rows instead."""
    vsize, crange = [1e-4] * 4, [0.0] * 4 + [6.5536] * 4
    gen = PointToVoxel(vsize, crange, 4, 100, 2)
    assert math.prod(gen.grid_size) >= 2 ** 62
    pc = torch.rand(30, 4, generator=torch.Generator().manual_seed(3)) * 6.5536
    pc = torch.cat([pc, pc[:10], torch.full((2, 4), -1.0)])
    check(pc, vsize, crange, 100, 2, False, device)


def test_bad_arguments():
    with pytest.raises(ValueError, match="1 to 4 axes"):
        PointToVoxel([0.1] * 5, [0] * 5 + [1] * 5, 5, 10, 1)
    with pytest.raises(ValueError, match="coors_range_xyz"):
        PointToVoxel([0.1] * 3, [0, 0, 0, 1, 1], 3, 10, 1)
    with pytest.raises(ValueError, match="empty voxel grid"):
        PointToVoxel([0.1] * 3, [0, 0, 0, 1, 1, 0], 3, 10, 1)
    with pytest.raises(ValueError, match="bad voxel grid"):
        PointToVoxel([0.1, 0.0, 0.1], [0, 0, 0, 1, 1, 1], 3, 10, 1)
    with pytest.raises(ValueError, match="num_point_features"):
        PointToVoxel([0.1] * 3, [0, 0, 0, 1, 1, 1], 4, 10, 1)(torch.zeros(3, 3))


def test_gather_features_by_pc_voxel_id(device):
    ids = torch.tensor([2, -1, 0, 0, -1, 1], device=device)
    feats = torch.arange(12, dtype=torch.float64, device=device).view(3, 2, 2)
    out = gather_features_by_pc_voxel_id(feats, ids)
    assert out.shape == (6, 2, 2) and out.dtype == torch.float64
    assert torch.equal(out[[0, 2, 3, 5]], feats[[2, 0, 0, 1]])
    assert (out[[1, 4]] == 0).all()
    labels = gather_features_by_pc_voxel_id(torch.tensor([7, 8, 9], device=device), ids.cpu(),
                                            invalid_value=-1)
    assert labels.tolist() == [9, -1, 7, 7, -1, 8] and labels.device == ids.device


def test_gather_after_voxelize_labels_every_kept_point(device):
    """The segmentation round trip: each point gets its voxel's result, dropped-because-full
    points too; out-of-range points get the invalid value."""
    vsize, crange = [0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 1.0, 1.5, 1.0]
    pc = cloud(7, 300, vsize, crange, 3).to(device)
    _, indices, _, ids = PointToVoxel(vsize, crange, 3, 1000, 2).generate_voxel_with_id(pc)
    per_point = gather_features_by_pc_voxel_id(indices, ids, invalid_value=-1)
    gen_ref = reference(pc.cpu(), vsize, crange, 1000, 10 ** 6)  # nothing dropped but range
    assert torch.equal(per_point.cpu(), torch.where(gen_ref[3][:, None] >= 0,
                                                    gen_ref[1][gen_ref[3]], -1))


def test_matches_installed_spconv():
    """Cross-check against spconv itself where it is installed (its CPU path; not empty_mean:
    spconv 2.3.8's CPU mean adds the previous voxel's mean in, see the module docstring)."""
    sp_utils = pytest.importorskip("spconv.pytorch.utils")
    for case, (vsize, crange, features, max_voxels, max_points, dtype, on_edges) in CASES.items():
        pc = cloud(len(case), 400, vsize, crange, features, dtype, on_edges)
        theirs = sp_utils.PointToVoxel(vsize, crange, features, max_voxels, max_points)
        ours = PointToVoxel(vsize, crange, features, max_voxels, max_points)
        assert theirs.grid_size == ours.grid_size and list(theirs.grid_stride) == ours.grid_stride
        for a, b in zip(theirs.generate_voxel_with_id(pc), ours.generate_voxel_with_id(pc)):
            assert a.dtype == b.dtype and torch.equal(a, b), case
