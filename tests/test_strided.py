"""Strided, transposed and inverse plans against float64 dense conv3d / conv_transpose3d.

Dense reference: the occupancy indicator convolved with a ones kernel is nonzero exactly at the
output sites spconv creates; features convolved densely and read back there give the values.
The gather references use the plan's own maps; the op (flexplan.ops.sparse_conv) is checked
against the dense values, gradients included.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexplan import ConvGeometry, build_plan
from flexplan.cache import cached_plan
from flexplan.ops import sparse_conv
from flexplan.plan import MISSING
from flexplan.planner.generative import inverse_plan, output_spatial_shape
from flexplan.workloads import random_coords

# (kernel, stride, padding, dilation, in shape)
CASES = [
    (3, 2, 1, 1, (7, 6, 5)),
    (2, 2, 0, 1, (6, 7, 5)),
    (3, 3, 0, 1, (8, 7, 9)),
    (2, 3, 1, 1, (7, 5, 6)),
    (3, 1, 0, 2, (7, 6, 6)),
    ((3, 2, 1), (2, 1, 3), (1, 0, 0), (1, 2, 1), (7, 6, 8)),
    (3, 2, 0, 2, (9, 8, 7)),  # stride and dilation together (spconv 2 allows it)
]
IDS = [f"k{c[0]}-s{c[1]}-p{c[2]}-d{c[3]}" for c in CASES]


def make_case(shape, batch_size=2, density=0.2, channels=(3, 4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    cells = batch_size * shape[0] * shape[1] * shape[2]
    coords = random_coords(int(cells * density), shape, batch_size, generator=gen)
    feats = torch.randn(coords.shape[0], channels[0], generator=gen, dtype=torch.float64)
    return coords, feats


def to_dense(feats, coords, shape, batch_size):
    b, x, y, z = coords.long().unbind(1)
    grid = feats.new_zeros((batch_size, *shape, feats.shape[1]))
    return grid.index_put((b, x, y, z), feats).permute(0, 4, 1, 2, 3)


def dense_conv(grid, weight, geometry, output_padding=0):
    """conv3d / conv_transpose3d with our [Co, Kx, Ky, Kz, Ci] weight (no flip: spconv's rule)."""
    kw = dict(stride=geometry.stride, padding=geometry.padding, dilation=geometry.dilation)
    if geometry.transposed:
        return F.conv_transpose3d(grid, weight.permute(4, 0, 1, 2, 3),
                                  output_padding=output_padding, **kw)
    return F.conv3d(grid, weight.permute(0, 4, 1, 2, 3), **kw)


def active_sites(coords, shape, batch_size, geometry):
    """int64 [M, 4] sites where the dense conv of the occupancy indicator is nonzero, sorted."""
    occ = to_dense(torch.ones(coords.shape[0], 1, dtype=torch.float64), coords, shape, batch_size)
    ones = torch.ones((1, *geometry.kernel_size, 1), dtype=torch.float64)
    return (dense_conv(occ, ones, geometry)[:, 0] > 0).nonzero()


def read_back(grid, coords):
    b, x, y, z = coords.long().unbind(1)
    return grid.permute(0, 2, 3, 4, 1)[b, x, y, z]


def gather_conv(feats, neighbor_map, weight):
    """out[m] = sum_v weight[:, v] @ feats[neighbor_map[m, v]]; weight [Co, V, Ci]."""
    out = feats.new_zeros((neighbor_map.shape[0], weight.shape[0]))
    for v in range(neighbor_map.shape[1]):
        rows = (neighbor_map[:, v] != MISSING).nonzero()[:, 0]
        out = out.index_add(0, rows, feats[neighbor_map[rows, v].long()] @ weight[:, v].t())
    return out


def geometry_of(case, transposed=False):
    k, s, p, d, _ = case
    return ConvGeometry.make(k, dilation=d, stride=s, padding=p, submanifold=False,
                             transposed=transposed)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_plan_matches_dense(case, transposed):
    shape = case[4]
    geometry = geometry_of(case, transposed)
    coords, feats = make_case(shape, seed=hash((case, transposed)) % 1000)
    plan = build_plan(coords, shape, 2, geometry)

    dense_in = to_dense(feats, coords, shape, 2)
    weight = torch.randn(4, *geometry.kernel_size, 3, dtype=torch.float64)
    dense_out = dense_conv(dense_in, weight, geometry)
    assert plan.out_spatial_shape == tuple(dense_out.shape[2:]) == \
        output_spatial_shape(shape, geometry)
    assert torch.equal(plan.out_coords.long(), active_sites(coords, shape, 2, geometry))
    assert plan.num_out == plan.out_coords.shape[0] and plan.num_in == coords.shape[0]

    w = weight.reshape(4, geometry.volume, 3)
    expected = read_back(dense_out, plan.out_coords)
    torch.testing.assert_close(gather_conv(feats, plan.fwd.neighbor_map, w), expected,
                               rtol=1e-12, atol=1e-12)
    # bwd map = the adjoint: input rows gather output rows with the same tap (weight transposed).
    grad_out = torch.randn(plan.num_out, 4, dtype=torch.float64)
    grad_in = gather_conv(grad_out, plan.bwd.neighbor_map, w.transpose(0, 2))
    dense_in.requires_grad_(True)
    dense_conv(dense_in, weight, geometry).backward(
        to_dense(grad_out, plan.out_coords, plan.out_spatial_shape, 2))
    torch.testing.assert_close(grad_in, read_back(dense_in.grad, coords), rtol=1e-12, atol=1e-12)
    # valid_signal: every (input, output) pair once, grouped by tap.
    pairs = torch.stack([plan.valid_signal_i, plan.valid_signal_o], 1)
    taps = torch.repeat_interleave(torch.arange(geometry.volume),
                                   (plan.valid_signal_seg[1:] - plan.valid_signal_seg[:-1]).long())
    assert torch.equal(plan.fwd.neighbor_map[pairs[:, 1].long(), taps], pairs[:, 0])
    assert plan.num_pairs == int((plan.fwd.neighbor_map != MISSING).sum())


@pytest.mark.parametrize("case,algo", [(c, "masked") for c in CASES[:3]] + [(CASES[0], "explicit")],
                         ids=[f"{i}-masked" for i in IDS[:3]] + [f"{IDS[0]}-explicit"])
def test_op_forward_backward_against_dense(case, algo):
    """flexplan.ops.sparse_conv over strided and transposed plans, grads included (float64);
    explicit: its grad-input gathers through the plan's backward map without reversal. (Sparse
    inputs: a transposed conv's outputs are many, 375 to 3200 rows here; explicit sparser
    still, and one batch entry, as its im2col runs a program per 16 rows and offset through the
    interpreter: still 240 output rows of its transposed plan.)"""
    shape = case[4]
    batch = 1 if algo == "explicit" else 2
    for transposed in (False, True):
        geometry = geometry_of(case, transposed)
        coords, feats = make_case(shape, batch, density=0.08 if algo == "explicit" else 0.12,
                                  seed=7)
        plan = build_plan(coords, shape, batch, geometry)
        weight = torch.randn(4, *geometry.kernel_size, 3, dtype=torch.float64)
        bias = torch.randn(4, dtype=torch.float64)
        grad_out = torch.randn(plan.num_out, 4, dtype=torch.float64)

        leaves = [t.clone().requires_grad_(True) for t in (feats, weight, bias)]
        sparse_conv(leaves[0], plan, leaves[1], leaves[2], algo=algo).backward(grad_out)
        ref = [t.clone().requires_grad_(True) for t in (feats, weight, bias)]
        out = read_back(dense_conv(to_dense(ref[0], coords, shape, batch), ref[1], geometry),
                        plan.out_coords) + ref[2]
        out.backward(grad_out)
        with torch.no_grad():
            got = sparse_conv(feats, plan, weight, bias, algo=algo)
        torch.testing.assert_close(got, out.detach(), rtol=1e-10, atol=1e-10)
        for a, b in zip(leaves, ref):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5]], ids=[IDS[0], IDS[1], IDS[5]])
def test_inverse_plan_restores_inputs(case):
    shape = case[4]
    geometry = geometry_of(case)
    coords, feats = make_case(shape, seed=3)
    down = build_plan(coords, shape, 2, geometry)
    up = inverse_plan(down, coords)
    assert torch.equal(up.out_coords, coords) and up.out_spatial_shape == shape
    assert (up.num_in, up.num_out) == (down.num_out, down.num_in)
    assert up.geometry.transposed and up.bwd.neighbor_map is down.fwd.neighbor_map
    # = the transposed conv of the down conv's grid, read back at the original inputs.
    low = torch.randn(down.num_out, 3, dtype=torch.float64)
    weight = torch.randn(4, *geometry.kernel_size, 3, dtype=torch.float64)
    w = weight.reshape(4, geometry.volume, 3)
    # The floor in the down conv's shape rule can drop trailing rows; output_padding restores them.
    lost = tuple(n - t for n, t in zip(shape, output_spatial_shape(down.out_spatial_shape,
                                                                    up.geometry)))
    dense = dense_conv(to_dense(low, down.out_coords, down.out_spatial_shape, 2), weight,
                       up.geometry, output_padding=lost)
    expected = read_back(dense, coords)
    torch.testing.assert_close(gather_conv(low, up.fwd.neighbor_map, w), expected,
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="inputs"):
        inverse_plan(down, coords[1:])


def test_cached_and_edge_cases():
    geometry = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    coords, _ = make_case((6, 6, 6), seed=1)
    plan = cached_plan(coords, (6, 6, 6), 2, geometry)
    assert cached_plan(coords, (6, 6, 6), 2, geometry) is plan
    assert torch.equal(plan.out_coords, build_plan(coords, (6, 6, 6), 2, geometry).out_coords)
    empty = build_plan(coords[:0], (6, 6, 6), 2, geometry)
    assert empty.num_out == 0 and empty.fwd.neighbor_map.shape == (0, 27)
    with pytest.raises(ValueError, match="empty grid"):
        build_plan(coords, (6, 6, 6), 2, ConvGeometry.make(9, stride=2, submanifold=False))
    with pytest.raises(ValueError, match="backend"):
        build_plan(coords, (6, 6, 6), 2, geometry, backend="bogus")
    with pytest.raises(ValueError, match="submanifold"):
        inverse_plan(build_plan(coords, (6, 6, 6), 2, ConvGeometry.make(3)), coords)


@pytest.mark.gpu
def test_gpu_plans_equal_cpu_and_layers_match_dense():
    """On the GPU: the same plans as on the CPU; fp32 / fp16 layers against float64 dense."""
    import flexplan.nn.spconv as spconv

    for case in CASES:
        shape = case[4]
        for transposed in (False, True):
            geometry = geometry_of(case, transposed)
            coords, _ = make_case(shape, seed=11)
            cpu = build_plan(coords, shape, 2, geometry)
            gpu = build_plan(coords.cuda(), shape, 2, geometry)
            for name, t in cpu.tensors().items():
                assert torch.equal(gpu.tensors()[name].cpu(), t), name
    coords, feats = make_case((24, 20, 22), density=0.1, seed=12)
    weight = torch.randn(8, 3, 3, 3, 3, dtype=torch.float64)
    geometry = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    out_coords = build_plan(coords, (24, 20, 22), 2, geometry).out_coords
    for dtype, tol in ((torch.float32, 2e-5), (torch.float16, 3e-3)):
        # The reference sees the inputs rounded to dtype: the error left is the kernel's.
        rounded = [t.to(dtype).double() for t in (feats, weight)]
        ref = read_back(dense_conv(to_dense(rounded[0], coords, (24, 20, 22), 2), rounded[1],
                                   geometry), out_coords)
        layer = spconv.SparseConv3d(3, 8, 3, 2, 1, bias=False).cuda().to(dtype)
        layer.weight.data.copy_(weight)
        x = spconv.SparseConvTensor(feats.cuda().to(dtype), coords.cuda(), (24, 20, 22), 2)
        out = layer(x).features.double().cpu()
        assert (out - ref).abs().max() / ref.abs().max() < tol
