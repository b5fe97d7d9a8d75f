"""Sparse max / average pooling and the global pools against float64 brute-force references
(every output's window found from the coordinates alone, not from the plan), forward and
gradients, every dtype; the spconv-compatible layers."""
from __future__ import annotations

import itertools

import pytest
import torch

import flexplan.nn.spconv as spconv
from flexplan import ConvGeometry, build_plan
from flexplan.ops.pool import global_pool, sparse_pool
from flexplan.planner.generative import output_spatial_shape
from flexplan.workloads import random_coords

SHAPE = (7, 6, 5)
# (kernel, stride, padding, dilation, submanifold)
CASES = [
    (2, 2, 0, 1, False),
    (3, 2, 1, 1, False),
    ((3, 1, 1), (2, 1, 1), 0, 1, False),
    (3, 1, 0, 2, False),
    (3, 1, 0, 1, True),
]
IDS = ["k2s2", "k3s2p1", "k311s211", "k3d2", "subm3"]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def geometry(case) -> ConvGeometry:
    k, s, p, d, subm = case
    return ConvGeometry.make(k, d, s, p, submanifold=subm)


def window_mask(in_coords, out_coords, geom: ConvGeometry) -> torch.Tensor:
    """[N_out, N_in] bool: input i lies in output o's window, from the coordinates alone."""
    i = in_coords.long()[None, :, :]
    o = out_coords.long()[:, None, :]
    inside = i[..., 0] == o[..., 0]
    for axis in range(3):
        k, s, d = geom.kernel_size[axis], geom.stride[axis], geom.dilation[axis]
        # submanifold windows are centred on the voxel; strided ones start at o * s - p
        start = o[..., axis + 1] - d * (k // 2) if geom.submanifold else \
            o[..., axis + 1] * s - geom.padding[axis]
        offset = i[..., axis + 1] - start
        inside &= (offset >= 0) & (offset % d == 0) & (offset // d < k)
    return inside


def reference(feats, mask, mode):
    if mode == "max":
        return torch.where(mask[:, :, None], feats[None], float("-inf")).amax(1)
    return (mask.to(feats.dtype) @ feats) / mask.sum(1, keepdim=True).to(feats.dtype)


def expected_outputs(coords, geom, out_shape, batch_size):
    """The output coordinates with at least one input in their window (the whole grid scanned)."""
    grid = torch.tensor(list(itertools.product(range(batch_size), *map(range, out_shape))),
                        dtype=torch.int32)
    return grid[window_mask(coords, grid, geom).any(1)]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("kind", ["training", "inference", "maps"])
def test_pool_matches_float64_reference(case, mode, kind, device):
    """Forward and gradient on every kind of plan: an inference plan's backward map is its fwd
    map transposed (ops.pool.backward_map); a maps-only one (the pool layers' own, strided
    geometries) has no schedule of its fwd map either."""
    geom = geometry(case)
    gen = torch.Generator().manual_seed(hash((IDS[CASES.index(case)], mode)) % 2**31)
    coords = random_coords(70, SHAPE, 2, generator=gen)
    plan = build_plan(coords.to(device), SHAPE, 2, geom, training=kind == "training",
                      scheduled=kind != "maps")
    assert plan.maps_only == (kind == "maps" and not geom.submanifold)
    out_shape = SHAPE if geom.submanifold else output_spatial_shape(SHAPE, geom)
    want = coords if geom.submanifold else expected_outputs(coords, geom, out_shape, 2)
    got = plan.out_coords.cpu()
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))
    mask = window_mask(coords, got, geom)
    feats = torch.randn(coords.shape[0], 37, dtype=torch.float64, generator=gen)  # 37: odd C
    ref_in = feats.clone().requires_grad_()
    ref = reference(ref_in, mask, mode)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    ref.backward(grad)
    x = feats.to(device).requires_grad_()
    out = sparse_pool(x, plan, mode)
    out.backward(grad.to(device))
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad.cpu(), ref_in.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["max", "avg"])
def test_pool_dtypes(dtype, mode, device):
    geom = geometry(CASES[1])
    gen = torch.Generator().manual_seed(5)
    coords = random_coords(60, SHAPE, 2, generator=gen)
    plan = build_plan(coords.to(device), SHAPE, 2, geom)
    # Distinct values per channel, exact in every dtype (k / 8, k < 64): a max has no ties,
    # whose gradient the reference would split (amax) where the kernel picks the first.
    n = coords.shape[0]
    feats = torch.stack([torch.randperm(n, generator=gen) for _ in range(16)], 1).to(dtype) / 8 - 4
    mask = window_mask(coords, plan.out_coords.cpu(), geom)
    ref_in = feats.double().requires_grad_()
    ref = reference(ref_in, mask, mode)
    ref.backward(torch.ones_like(ref))
    x = feats.to(device).requires_grad_()
    out = sparse_pool(x, plan, mode)
    out.float().sum().backward()
    assert out.dtype == dtype and x.grad.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.cpu().double(), ref_in.grad, rtol=tol, atol=tol)


def test_pool_inference_plan_and_bad_input(device):
    geom = geometry(CASES[0])
    coords = random_coords(50, SHAPE, 2, generator=torch.Generator().manual_seed(6)).to(device)
    plan = build_plan(coords, SHAPE, 2, geom, training=False)
    full = build_plan(coords, SHAPE, 2, geom)
    feats = torch.randn(coords.shape[0], 8, dtype=torch.float64, device=device)
    torch.testing.assert_close(sparse_pool(feats, plan), sparse_pool(feats, full))
    grads = []
    for p in (plan, plan, full):  # the inference plan twice: its derived map kept and reused
        x = feats.clone().requires_grad_()
        sparse_pool(x, p).backward(torch.arange(float(p.num_out * 8), dtype=torch.float64,
                                                device=device).view(-1, 8))
        grads.append(x.grad)
    assert "transposed_map" in plan.fwd.derived_views and plan.bwd is None
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[2])
    torch.testing.assert_close(grads[1], grads[2])
    with pytest.raises(ValueError, match="rows"):
        sparse_pool(feats[1:], full)
    with pytest.raises(ValueError, match="mode"):
        sparse_pool(feats, full, "min")
    with pytest.raises(TypeError, match="float16"):
        sparse_pool(feats.long(), full)


def test_global_pools_with_an_empty_batch_entry(device):
    gen = torch.Generator().manual_seed(7)
    coords = random_coords(40, SHAPE, 2, generator=gen)  # entries 0 and 1; entry 2 empty
    feats = torch.randn(coords.shape[0], 5, dtype=torch.float64, generator=gen)
    x = spconv.SparseConvTensor(feats.to(device).requires_grad_(), coords.to(device), SHAPE, 3)
    for module, reduce in ((spconv.SparseGlobalMaxPool(), "amax"),
                           (spconv.SparseGlobalAvgPool(), "mean")):
        out = module(x)
        assert out.shape == (3, 5)
        for b in range(2):
            rows = feats[coords[:, 0] == b]
            want = rows.amax(0) if reduce == "amax" else rows.mean(0)
            torch.testing.assert_close(out[b].cpu(), want)
        assert torch.equal(out[2].cpu(), torch.zeros(5, dtype=torch.float64))
        (grad,) = torch.autograd.grad(out.sum(), x.features)
        counts = torch.bincount(coords[:, 0].long(), minlength=3).double()
        if reduce == "mean":
            torch.testing.assert_close(grad.cpu(), (1 / counts[coords[:, 0].long()])[:, None]
                                       .expand(-1, 5))
        else:
            assert torch.equal(grad.cpu().sum(0), torch.full((5,), 2.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="mode"):
        global_pool(feats, coords[:, 0], 2, "sum")


def test_spconv_pool_layers(device):
    gen = torch.Generator().manual_seed(8)
    coords = random_coords(80, SHAPE, 2, generator=gen).to(device)
    feats = torch.randn(coords.shape[0], 4, dtype=torch.float64, generator=gen).to(device)
    x = spconv.SparseConvTensor(feats, coords, SHAPE, 2)
    pool = spconv.SparseMaxPool3d(2, indice_key="p")  # stride None: the kernel size
    assert pool.stride == (2, 2, 2)
    net = spconv.SparseSequential(pool, spconv.SparseInverseConv3d(4, 3, 2, indice_key="p"))
    net = net.double().to(device)
    y = net(x)
    assert torch.equal(y.indices, coords) and y.features.shape == (coords.shape[0], 3)
    down = pool(x)
    plan = build_plan(coords, SHAPE, 2, ConvGeometry.make(2, 1, 2, 0, submanifold=False))
    assert torch.equal(down.indices, plan.out_coords)
    assert down.spatial_shape == output_spatial_shape(SHAPE, plan.geometry)
    # spconv's max starts at 0: relu of the plain max, forward and gradient
    torch.testing.assert_close(down.features, sparse_pool(feats, plan).relu())
    avg = spconv.SparseAvgPool3d(3, 2, 1)(x)
    torch.testing.assert_close(avg.features, sparse_pool(feats, build_plan(
        coords, SHAPE, 2, ConvGeometry.make(3, 1, 2, 1, submanifold=False)), "avg"))
    # Training without an indice_key: an inference plan (the pool's backward needs no more);
    # with one, a training plan, which the paired inverse conv's own backward needs.
    xg = spconv.SparseConvTensor(feats.clone().requires_grad_(), coords, SHAPE, 2)
    free = spconv.SparseMaxPool3d(2)
    free(xg).features.sum().backward()
    assert not xg._plans.get(free.geometry).for_training
    torch.testing.assert_close(xg.features.grad, torch.autograd.grad(
        sparse_pool(xg.features, plan).relu().sum(), xg.features)[0])
    xk = spconv.SparseConvTensor(feats.clone().requires_grad_(), coords, SHAPE, 2)
    y = net(xk)
    y.features.sum().backward()
    assert xk._plans.get(pool.geometry).for_training
    assert xk.features.grad.abs().sum() > 0 and net[1].weight.grad.abs().sum() > 0
    subm = spconv.SparseMaxPool(3, 3, 1, subm=True)(x)
    assert torch.equal(subm.indices, coords)
    with torch.no_grad():
        torch.testing.assert_close(pool(x).features, down.features)
    with pytest.raises(NotImplementedError, match="1D, 2D or 3D"):
        spconv.SparseMaxPool(4, 2)
    with pytest.raises(ValueError, match="submanifold"):
        spconv.SparseMaxPool(3, 3, 2, subm=True)
    assert "kernel_size=(2, 2, 2)" in repr(pool)


def test_zero_floor_max_is_relu_of_max(device):
    """spconv's SparseMaxPool: max(0, window max); windows of negative values give 0 and pass
    no gradient (as relu's does at 0)."""
    geom = geometry(CASES[1])
    gen = torch.Generator().manual_seed(9)
    coords = random_coords(60, SHAPE, 2, generator=gen).to(device)
    plan = build_plan(coords, SHAPE, 2, geom)
    feats = torch.randn(coords.shape[0], 6, dtype=torch.float64, generator=gen).to(device)
    feats[:, 0] = -feats[:, 0].abs() - 0.1  # channel 0: every window negative
    a, b = feats.clone().requires_grad_(), feats.clone().requires_grad_()
    out = sparse_pool(a, plan, "max", zero_floor=True)
    ref = sparse_pool(b, plan, "max").relu()
    grad = torch.randn(out.shape, dtype=torch.float64, generator=gen).to(device)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert torch.equal(a.grad[:, 0], torch.zeros_like(a.grad[:, 0]))


def test_max_pool_propagates_nan_like_torch(device):
    geom = geometry(CASES[0])
    coords = random_coords(50, SHAPE, 2, generator=torch.Generator().manual_seed(10)).to(device)
    plan = build_plan(coords, SHAPE, 2, geom)
    feats = torch.randn(coords.shape[0], 3, dtype=torch.float64, device=device)
    feats[5, 1] = float("nan")
    out = sparse_pool(feats, plan, "max")
    row = (plan.fwd.neighbor_map == 5).any(1)
    assert torch.isnan(out[row, 1]).all() and not torch.isnan(out[~row]).any()
    assert not torch.isnan(out[:, 0]).any() and not torch.isnan(out[:, 2]).any()


def test_pool_layers_build_maps_only_plans(device, tmp_path):
    """A strided pool asks for a maps-only plan (no fwd schedule, its own cache key): equal to
    the torch oracle's, on either backend; a conv of the same geometry over the same tensor gets
    a scheduled plan instead (which then serves the pool too); a pool with an indice_key under
    no_grad pairs with an inverse conv; the plan ships through save_plans / load_plans."""
    from flexplan.cache import PlanCache
    from flexplan.planner.segments import unscheduled_map

    gen = torch.Generator().manual_seed(21)
    coords = random_coords(90, SHAPE, 2, generator=gen).to(device)
    feats = torch.randn(coords.shape[0], 5, dtype=torch.float64, generator=gen).to(device)
    geom = ConvGeometry.make(3, 1, 2, 1, submanifold=False)
    maps = build_plan(coords, SHAPE, 2, geom, training=False, scheduled=False)
    oracle = build_plan(coords, SHAPE, 2, geom, backend="torch", training=False)
    assert maps.maps_only and not oracle.maps_only and not maps.fwd.valid_kernel
    assert torch.equal(maps.out_coords, oracle.out_coords)
    assert torch.equal(maps.fwd.neighbor_map, oracle.fwd.neighbor_map)
    assert torch.equal(maps.fwd.sorted_idx, unscheduled_map(oracle.fwd.neighbor_map).sorted_idx)
    # What a request gets: training and transposed requests stay scheduled; a submanifold
    # inference one has its schedule deferred (no maps-only plan: its key is a scheduled one's).
    up = ConvGeometry.make(2, 1, 2, 0, submanifold=False, transposed=True)
    for g, training in ((geom, True), (up, False)):
        assert build_plan(coords, SHAPE, 2, g, training=training, scheduled=False).fwd.block_sizes
    deferred = build_plan(coords, SHAPE, 2, ConvGeometry.submanifold_conv(3), training=False,
                          scheduled=False)
    assert deferred.schedule_deferred and not deferred.maps_only and not deferred.fwd.block_sizes
    # An inverse conv's plan over an inference plan of a transposed conv has an unscheduled fwd
    # map (the paired bwd map, SCHEDULE_BWD_MAPS off) and is no maps-only plan.
    from flexplan.planner.generative import inverse_plan

    paired = build_plan(coords, SHAPE, 2, up, training=False)
    inverse = inverse_plan(paired, coords)
    assert not inverse.fwd.block_sizes and not inverse.maps_only
    assert maps.serves(False, scheduled=False) and not maps.serves(False) and not maps.serves(True)
    assert oracle.serves(False, scheduled=False)

    pool = spconv.SparseMaxPool3d(3, 2, 1)
    x = spconv.SparseConvTensor(feats, coords, SHAPE, 2)
    with torch.no_grad():
        down = pool(x)
    assert x._plans.get(geom).maps_only
    torch.testing.assert_close(down.features, sparse_pool(feats, oracle).relu(), rtol=0, atol=0)
    conv = spconv.SparseConv3d(5, 4, 3, 2, 1).double().to(device)
    with torch.no_grad():
        y = conv(x)
        want = conv(spconv.SparseConvTensor(feats, coords, SHAPE, 2))
    assert not x._plans.get(geom).maps_only
    torch.testing.assert_close(y.features, want.features, rtol=0, atol=0)
    with torch.no_grad():
        again = pool(x)  # the scheduled plan serves the pool's request
    assert not x._plans.get(geom).maps_only
    torch.testing.assert_close(again.features, down.features, rtol=0, atol=0)

    keyed = spconv.SparseSequential(spconv.SparseMaxPool3d(3, 2, 1, indice_key="p"),
                                    spconv.SparseInverseConv3d(5, 3, 3, indice_key="p"))
    keyed = keyed.double().to(device)
    fresh = spconv.SparseConvTensor(feats, coords, SHAPE, 2)
    with torch.no_grad():
        inferred = keyed(fresh)
    assert fresh._plans.get(geom).maps_only
    trained = keyed(spconv.SparseConvTensor(feats, coords, SHAPE, 2))  # a training plan
    assert torch.equal(inferred.indices, coords)
    torch.testing.assert_close(inferred.features, trained.features.detach())

    # The cache keeps the kinds apart, and a maps-only plan ships like any other.
    cache = PlanCache(tmp_path / "cache")
    got = cache.get_or_build(coords, SHAPE, 2, geom, training=False, scheduled=False)
    scheduled = cache.get_or_build(coords, SHAPE, 2, geom, training=False)
    assert got.maps_only and not scheduled.maps_only
    assert cache.key(coords, SHAPE, 2, geom, False, maps_only=True) != cache.key(
        coords, SHAPE, 2, geom, False)
    keys = cache.save_plans(tmp_path / "shipped", [got, scheduled])
    server = PlanCache(tmp_path / "server")
    loaded = server.load_plans(tmp_path / "shipped", device=coords.device)
    assert [loaded[k].maps_only for k in keys] == [True, False]
    served = server.get_or_build(coords, SHAPE, 2, geom, training=False, scheduled=False)
    assert served is loaded[keys[0]] and server.stats().get("builds", 0) == 0
