"""The Triton generative planner (strided / transposed plans, one host sync) against the torch
oracle (flexplan.planner.generative): equal plans, tensor for tensor, under the interpreter on the
CPU and on the GPU."""
from __future__ import annotations

import pytest
import torch

from flexplan import ConvGeometry, build_plan
from flexplan.planner.generative_triton import candidate_slots
from flexplan.workloads import random_coords

# (kernel, stride, padding, dilation, transposed, in shape): the encoder's strided convs, the
# (3, 1, 1) / (2, 1, 1) head, a U-Net's transposed conv, dilation, and odd strides.
CASES = [
    (3, 2, 1, 1, False, (9, 8, 7)),
    (3, 2, (0, 1, 1), 1, False, (9, 8, 7)),
    ((3, 1, 1), (2, 1, 1), 0, 1, False, (9, 8, 7)),
    (2, 2, 0, 1, False, (8, 7, 6)),
    (3, 3, 2, 1, False, (10, 7, 8)),
    (3, 2, 0, 2, False, (9, 8, 7)),
    ((3, 2, 1), (2, 1, 3), (1, 0, 0), (1, 2, 1), False, (7, 6, 8)),
    (3, 2, 1, 1, True, (5, 4, 6)),
    (2, 2, 0, 1, True, (5, 4, 4)),
    (3, 1, 1, 1, False, (6, 5, 6)),
]
IDS = [f"k{c[0]}-s{c[1]}-p{c[2]}-d{c[3]}{'-T' if c[4] else ''}" for c in CASES]


def geometry(case):
    k, s, p, d, transposed, _ = case
    return ConvGeometry.make(k, dilation=d, stride=s, padding=p, submanifold=False,
                             transposed=transposed)


def assert_same_plans(a, b):
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name].cpu(), tb[name].cpu()), name
    assert (a.num_in, a.num_out, a.out_spatial_shape) == (b.num_in, b.num_out, b.out_spatial_shape)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_plan_equals_torch_oracle(case, device):
    shape, geom = case[5], geometry(case)
    gen = torch.Generator().manual_seed(len(str(case)))
    for density in (0.05, 0.3):
        coords = random_coords(int(2 * shape[0] * shape[1] * shape[2] * density), shape, 2,
                               generator=gen)
        oracle = build_plan(coords, shape, 2, geom, backend="torch")
        plan = build_plan(coords.to(device), shape, 2, geom, backend="triton")
        assert_same_plans(oracle, plan)


def test_maps_only_plans_equal_the_torch_oracle(device):
    """A pool's maps-only request (training False, scheduled False): the same plan from both
    backends, with the fwd map in its own row order and no schedule; no outputs and no inputs
    too."""
    geom = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    coords = random_coords(150, (9, 8, 7), 2, generator=torch.Generator().manual_seed(4))
    lone = torch.tensor([[0, 6, 6, 6]], dtype=torch.int32)  # outputs 0..2 cover inputs 0..5
    none = ConvGeometry.make(2, stride=2, submanifold=False)
    for c, g, shape, outputs in ((coords, geom, (9, 8, 7), None), (lone, none, (7, 7, 7), 0),
                                 (lone[:0], none, (7, 7, 7), 0)):
        oracle = build_plan(c, shape, 2, g, backend="torch", training=False, scheduled=False)
        plan = build_plan(c.to(device), shape, 2, g, backend="triton", training=False,
                          scheduled=False)
        assert plan.maps_only and oracle.maps_only and not plan.fwd.block_sizes
        assert outputs is None or plan.num_out == outputs
        assert_same_plans(oracle, plan)
        scheduled = build_plan(c, shape, 2, g, backend="torch", training=False)
        assert torch.equal(plan.fwd.neighbor_map.cpu(), scheduled.fwd.neighbor_map)


def test_kernels_read_valid_kernel_without_a_sync(device):
    """The fwd schedule's valid_kernel lengths stay on the device: the region the kernels read
    starts with the exact run (read later, on demand) and is at least as long."""
    geom = geometry(CASES[0])
    coords = random_coords(150, (9, 8, 7), 2, generator=torch.Generator().manual_seed(3))
    plan = build_plan(coords.to(device), (9, 8, 7), 2, geom, backend="triton")
    for block in plan.fwd.block_sizes:
        region = plan.fwd.kernel_offsets(block)
        exact = plan.fwd.valid_kernel[block]
        assert region.numel() >= exact.numel() > 0
        assert torch.equal(region[:exact.numel()], exact)
        assert int(plan.fwd.valid_kernel_seg[block][-1]) == exact.numel()


def test_no_output_and_no_input(device):
    """Inputs whose every tap misses the grid give an empty plan; no inputs too."""
    geom = ConvGeometry.make(3, stride=2, padding=0, submanifold=False)
    coords = torch.tensor([[0, 6, 6, 6]], dtype=torch.int32)  # (7 - 3) // 2 + 1 = 3: 6 -> none
    for c in (coords, coords[:0]):
        oracle = build_plan(c, (7, 7, 7), 1, geom, backend="torch")
        plan = build_plan(c.to(device), (7, 7, 7), 1, geom, backend="triton")
        assert plan.num_out == oracle.num_out
        assert_same_plans(oracle, plan)


@pytest.mark.parametrize("kernel, stride, dilation, transposed, slots", [
    (3, 2, 1, False, 8), ((3, 1, 1), (2, 1, 1), 1, False, 2), (2, 2, 1, False, 1),
    (3, 2, 2, False, 27), (3, 3, 1, False, 1), (3, 2, 1, True, 27)])
def test_candidate_slots(kernel, stride, dilation, transposed, slots):
    """Slots per input row: the taps that can share one input (a tight bound)."""
    geom = ConvGeometry.make(kernel, dilation=dilation, stride=stride, submanifold=False,
                             transposed=transposed)
    assert candidate_slots(geom) == slots


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[7]], ids=[IDS[0], IDS[2], IDS[7]])
def test_inference_plans(case, device):
    """training=False: the forward parts of the training plan, no bwd map, no pairs; the op
    refuses to differentiate through it; an inverse conv on it makes its own gather map."""
    from flexplan.ops import sparse_conv
    from flexplan.planner.generative import inverse_plan

    shape, geom = case[5], geometry(case)
    coords = random_coords(int(shape[0] * shape[1] * shape[2] * 0.2), shape, 2,
                           generator=torch.Generator().manual_seed(7)).to(device)
    full = build_plan(coords, shape, 2, geom)
    for backend in ("torch", "triton"):
        plan = build_plan(coords, shape, 2, geom, backend=backend, training=False)
        assert not plan.for_training and plan.bwd is None and plan.valid_signal_i.numel() == 0
        assert torch.equal(plan.out_coords, full.out_coords)
        for name in ("neighbor_map", "sorted_idx"):
            assert torch.equal(getattr(plan.fwd, name), getattr(full.fwd, name))
        for block in full.fwd.block_sizes:
            assert torch.equal(plan.fwd.valid_kernel[block], full.fwd.valid_kernel[block])
        inv, inv_full = inverse_plan(plan, coords), inverse_plan(full, coords)
        assert torch.equal(inv.fwd.neighbor_map, inv_full.fwd.neighbor_map)
        # (the inference plan's inverse map is unscheduled: rows in their own order, no blocks;
        # planner.segments.SCHEDULE_BWD_MAPS)
        assert torch.equal(inv.fwd.sorted_idx.long(), torch.arange(inv.num_out, device=device))
        assert not inv.fwd.block_sizes
        feats = torch.randn(coords.shape[0], 2, dtype=torch.float64, device=device)
        weight = torch.randn(3, *geom.kernel_size, 2, dtype=torch.float64, device=device)
        torch.testing.assert_close(sparse_conv(feats, plan, weight), sparse_conv(feats, full, weight))
        out_feats = torch.randn(plan.num_out, 3, dtype=torch.float64, device=device)
        inv_weight = torch.randn(2, *geom.kernel_size, 3, dtype=torch.float64, device=device)
        torch.testing.assert_close(sparse_conv(out_feats, inv, inv_weight),
                                   sparse_conv(out_feats, inv_full, inv_weight))
        with pytest.raises(RuntimeError, match="inference plan"):
            sparse_conv(feats.requires_grad_(True), plan, weight).sum().backward()


@pytest.mark.parametrize("case, schedule", [(CASES[0], False), (CASES[7], False), (CASES[0], True)],
                         ids=[IDS[0], IDS[7], f"{IDS[0]}-scheduled"])
def test_training_bwd_map_unscheduled(case, device, monkeypatch, schedule):
    """A training build's bwd map (planner.segments.SCHEDULE_BWD_MAPS False, the default): the
    fwd map transposed, rows in their own order, no blocks, its gather layout made with it
    (no launch at its first conv); the strided conv's grad-input (masked kernels over every
    offset) and the inverse conv's forward over it equal the explicit GEMMs over the torch
    planner's maps, gradients included; scheduled (True) as before."""
    from flexplan.ops import sparse_conv
    from flexplan.planner import segments
    from flexplan.planner.generative import inverse_plan

    monkeypatch.setattr(segments, "SCHEDULE_BWD_MAPS", schedule)
    shape, geom = case[5], geometry(case)
    gen = torch.Generator().manual_seed(21 + schedule)
    coords = random_coords(int(shape[0] * shape[1] * shape[2] * 0.1), shape, 2, generator=gen)
    oracle = build_plan(coords, shape, 2, geom, backend="torch")
    plan = build_plan(coords.to(device), shape, 2, geom, backend="triton")
    assert_same_plans(oracle, plan)
    assert bool(plan.bwd.block_sizes) == schedule and bool(plan.fwd.block_sizes)
    if not schedule:
        assert torch.equal(plan.bwd.sorted_idx.long().cpu(), torch.arange(plan.num_in))
        assert torch.equal(plan.bwd.derived_views["sorted_map_t"].cpu(),
                           oracle.bwd.neighbor_map.t())
    weight = torch.randn(3, *geom.kernel_size, 2, dtype=torch.float64, generator=gen)
    feats = torch.randn(plan.num_in, 2, dtype=torch.float64, generator=gen)
    low = torch.randn(plan.num_out, 3, dtype=torch.float64, generator=gen)
    inv_weight = torch.randn(2, *geom.kernel_size, 3, dtype=torch.float64, generator=gen)
    grads = {}
    for name, p, algo in (("ref", oracle, "explicit"), ("got", plan, "masked")):
        on = p.out_coords.device
        leaves = [t.clone().to(on).requires_grad_(True) for t in (feats, weight, low, inv_weight)]
        inv = inverse_plan(p, coords.to(on))
        down = sparse_conv(leaves[0], p, leaves[1], algo=algo)
        up = sparse_conv(leaves[2], inv, leaves[3], algo=algo)
        (down * down.detach().flip(0)).sum().backward(retain_graph=True)
        (up * up.detach().flip(0)).sum().backward()
        grads[name] = [down.detach(), up.detach()] + [t.grad for t in leaves]
    for got, ref in zip(grads["got"], grads["ref"]):
        torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=1e-10, atol=1e-10)


def test_layers_build_inference_plans_under_no_grad(device):
    import flexplan.nn.spconv as spconv

    coords = random_coords(120, (9, 8, 7), 2, generator=torch.Generator().manual_seed(8)).to(device)
    net = spconv.SparseSequential(spconv.SubMConv3d(2, 3, 3), spconv.SparseConv3d(
        3, 3, 3, 2, 1, indice_key="d"), spconv.SparseInverseConv3d(3, 2, 3, indice_key="d"))
    net = net.double().to(device)
    feats = torch.randn(coords.shape[0], 2, dtype=torch.float64, device=device)
    x = spconv.SparseConvTensor(feats, coords, (9, 8, 7), 2)
    with torch.no_grad():
        ref = net(x)
    assert not any(p.for_training for p in x._plans.values() if hasattr(p, "for_training"))
    out = net(x)  # the same tensor with grad: its plans are upgraded to training plans
    out.features.sum().backward()
    assert all(p.for_training for p in x._plans.values() if hasattr(p, "for_training"))
    torch.testing.assert_close(out.features, ref.features)


@pytest.mark.parametrize("case", [CASES[0], CASES[7]], ids=[IDS[0], IDS[7]])
def test_transposed_map_kernel_equals_torch_and_training_bwd(case, device):
    """The inverse conv's bwd map of an inference plan, made by one launch, is the map a training
    plan builds, and the torch version's; a map with no entries gives an all-missing map."""
    from flexplan.planner.generative import transposed_map_torch
    from flexplan.planner.generative_triton import transposed_map_triton

    shape, geom = case[5], geometry(case)
    coords = random_coords(int(shape[0] * shape[1] * shape[2] * 0.3), shape, 2,
                           generator=torch.Generator().manual_seed(11)).to(device)
    full = build_plan(coords, shape, 2, geom)
    fwd = full.fwd.neighbor_map
    expected = full.bwd.neighbor_map
    assert torch.equal(transposed_map_torch(fwd, full.num_in), expected)
    assert torch.equal(transposed_map_triton(fwd, full.num_in), expected)
    empty = torch.full((0, geom.volume), -1, dtype=torch.int32, device=device)
    assert torch.equal(transposed_map_triton(empty, 5), torch.full((5, geom.volume), -1,
                                                                    dtype=torch.int32, device=device))


def test_inverse_conv_makes_an_inference_plans_bwd_map_once(device, monkeypatch):
    """Inference over coordinates that come back: the paired plan comes from the cache's
    memory, with the bwd map its inverse conv made the first time (not remade per call)."""
    import flexplan.nn.spconv as spconv
    from flexplan.nn import sparse_conv_tensor

    made = []
    real = sparse_conv_tensor.bwd_from_fwd
    monkeypatch.setattr(sparse_conv_tensor, "bwd_from_fwd", lambda plan: made.append(1) or real(plan))
    coords = random_coords(150, (9, 8, 7), 2, generator=torch.Generator().manual_seed(12)).to(device)
    net = spconv.SparseSequential(spconv.SparseConv3d(2, 3, 3, 2, 1, indice_key="r"),
                                  spconv.SparseInverseConv3d(3, 2, 3, indice_key="r"))
    net = net.double().to(device)
    feats = torch.randn(coords.shape[0], 2, dtype=torch.float64, device=device)
    with torch.no_grad():
        outs = [net(spconv.SparseConvTensor(feats, coords.clone(), (9, 8, 7), 2)).features
                for _ in range(3)]
    assert len(made) == 1
    ref = net(spconv.SparseConvTensor(feats, coords, (9, 8, 7), 2)).features  # a training plan
    for out in outs:
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("schedule", [False, True])
@pytest.mark.parametrize("algo", ["auto", "masked", "masked_splitk"])
def test_inference_inverse_conv_over_an_unscheduled_map(device, monkeypatch, tmp_path,
                                                        schedule, algo):
    """An inference plan's inverse conv reads a bwd map made without the masked schedule
    (planner.segments.SCHEDULE_BWD_MAPS False, the default): the masked kernels then run
    every offset of every block, whatever masked algorithm was asked, and give the explicit
    GEMMs' result over the training plan (whose bwd map is unscheduled too); with the schedule
    (True) as before. A refined plan holding such a map saves and loads."""
    import flexplan.nn.spconv as spconv
    from flexplan import cached_plan, load_plans, save_plans
    from flexplan.planner import segments

    monkeypatch.setattr(segments, "SCHEDULE_BWD_MAPS", schedule)
    # (no step prefetch: it would hand these inference layers the training plans other cases'
    # steps recorded, which serve inference too)
    monkeypatch.setenv("FLEXPLAN_PLAN_PREFETCH", "0")
    # (coordinates of their own per case: no plan cached by another case)
    seed = 13 + 2 * ("auto", "masked", "masked_splitk").index(algo) + schedule
    coords = random_coords(160, (9, 8, 7), 2, generator=torch.Generator().manual_seed(seed))
    coords = coords.to(device)
    net = spconv.SparseSequential(spconv.SparseConv3d(3, 4, 3, 2, 1, indice_key="q"),
                                  spconv.SparseInverseConv3d(4, 3, 3, indice_key="q", algo=algo))
    net = net.double().to(device)
    feats = torch.randn(coords.shape[0], 3, dtype=torch.float64, device=device)
    with torch.no_grad():
        x = net[0](spconv.SparseConvTensor(feats, coords.clone(), (9, 8, 7), 2))
        out = net[1](x).features
        inverse = x.find_indice_pair("q").inverse_plan
    assert bool(inverse.fwd.block_sizes) == schedule
    for layer in net:  # (the reference: im2col GEMMs over the maps, no schedule read)
        layer.algo = "explicit"
    ref = net(spconv.SparseConvTensor(feats, coords, (9, 8, 7), 2)).features  # a training plan
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    # the cache now hands out the paired plan with the bwd map its inverse made
    refined = cached_plan(coords, (9, 8, 7), 2, net[0].geometry, training=False)
    assert refined.bwd is not None and bool(refined.bwd.block_sizes) == schedule
    keys = save_plans(tmp_path, [refined])
    loaded = load_plans(tmp_path, device)
    assert keys and all(torch.equal(loaded[key].bwd.neighbor_map, refined.bwd.neighbor_map)
                        for key in keys)


@pytest.mark.parametrize("defer", [True, False])
def test_submanifold_inference_schedule_deferred_to_second_sighting(device, monkeypatch, defer):
    """A submanifold inference plan's first sighting is built without the masked schedule
    (plan_cache.DEFER_FIRST_SCHEDULE): rows in their own order, no blocks, convs through the
    implicit kernel, the same outputs as over training plans. The same coordinates asked again
    get the plan scheduled, equal to a scheduled build's; switched off, scheduled at once."""
    import importlib

    import flexplan.nn.spconv as spconv
    from flexplan.cache import plan_cache as cache

    # (the module, not the package's PlanCache instance of the same name)
    monkeypatch.setattr(importlib.import_module("flexplan.cache.plan_cache"),
                        "DEFER_FIRST_SCHEDULE", defer)
    monkeypatch.setenv("FLEXPLAN_PLAN_PREFETCH", "0")
    coords = random_coords(250, (12, 11, 10), 2, generator=torch.Generator().manual_seed(20 + defer))
    coords = coords.to(device)
    net = spconv.SparseSequential(
        spconv.SubMConv3d(3, 4, 3, indice_key="s1"), spconv.SparseConv3d(4, 5, 3, 2, 1, indice_key="d"),
        spconv.SubMConv3d(5, 5, 3, indice_key="s2"), spconv.SparseInverseConv3d(5, 3, 3, indice_key="d"),
        spconv.SubMConv3d(3, 2, 3, indice_key="s1")).double().to(device)
    feats = torch.randn(coords.shape[0], 3, dtype=torch.float64, device=device)
    ref = net(spconv.SparseConvTensor(feats, coords, (12, 11, 10), 2))  # training plans
    before = cache.stats().get("deferred_schedules", 0)
    plans = []
    for sighting in range(3):
        with torch.no_grad():
            out = net(spconv.SparseConvTensor(feats, coords, (12, 11, 10), 2))
        torch.testing.assert_close(out.features, ref.features, rtol=1e-10, atol=1e-10)
        subm_plan = out.find_indice_pair("s1").plan
        strided_plan = out.find_indice_pair("d").plan
        assert not subm_plan.for_training and not strided_plan.for_training
        assert strided_plan.fwd.block_sizes
        assert bool(subm_plan.fwd.block_sizes) == (sighting > 0 or not defer)
        assert subm_plan.schedule_deferred == (sighting == 0 and defer)
        plans.append(subm_plan)
    # scheduled once (the second sighting), kept for the third: s1's plan and s2's (over the
    # strided conv's output coordinates, a derived key)
    assert cache.stats().get("deferred_schedules", 0) - before == (2 if defer else 0)
    assert plans[2] is plans[1]
    built = build_plan(coords, (12, 11, 10), 2, plans[1].geometry, training=False)
    assert torch.equal(plans[1].fwd.sorted_idx, built.fwd.sorted_idx)
    assert plans[1].fwd.block_sizes == built.fwd.block_sizes
    for block in built.fwd.block_sizes:
        seg = built.fwd.valid_kernel_seg[block]
        assert torch.equal(plans[1].fwd.valid_kernel_seg[block], seg)
        # (kernel_offsets may have room past the offsets' end)
        ends = int(seg[-1])
        assert torch.equal(plans[1].fwd.kernel_offsets(block)[:ends],
                           built.fwd.kernel_offsets(block)[:ends])


@pytest.mark.parametrize("big", [True, False])
def test_big_convolution_schedules_a_deferred_map(device, monkeypatch, big):
    """A convolution over a map without its schedule (a first sighting's submanifold inference
    map) that reaches ops.conv.SCHEDULE_WORK_MIN has the schedule made (kept with the map) and
    runs the masked kernel; a smaller one runs the implicit kernel. Same result either way, equal
    to the float64 result over a scheduled plan."""
    from flexplan.ops import conv as conv_ops
    from flexplan.ops.conv import sparse_conv

    geometry = ConvGeometry.make(3)
    coords = random_coords(300, (10, 9, 8), 2, generator=torch.Generator().manual_seed(31)).to(device)
    deferred = build_plan(coords, (10, 9, 8), 2, geometry, training=False, scheduled=False,
                          check=False)
    scheduled = build_plan(coords, (10, 9, 8), 2, geometry, training=False)
    assert deferred.schedule_deferred and not scheduled.schedule_deferred
    monkeypatch.setattr(conv_ops, "SCHEDULE_WORK_MIN", 1 if big else 1 << 62)
    feats = torch.randn(coords.shape[0], 5, dtype=torch.float64, device=device)
    weight = torch.randn(6, 3, 3, 3, 5, dtype=torch.float64, device=device)
    with torch.no_grad():
        out = sparse_conv(feats, deferred, weight, algo="masked")
        ref = sparse_conv(feats, scheduled, weight, algo="masked")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    made = deferred.fwd.derived_views.get("masked_schedule")
    assert (made is not None) == big
    if big:
        assert made.block_sizes == scheduled.fwd.block_sizes
        assert torch.equal(made.sorted_idx, scheduled.fwd.sorted_idx)
    # A checked build defers too (the check's flags read alone).
    checked = build_plan(coords, (10, 9, 8), 2, geometry, training=False, scheduled=False)
    assert checked.schedule_deferred and torch.equal(checked.fwd.neighbor_map,
                                                     scheduled.fwd.neighbor_map)


def test_deferred_plan_of_a_kept_tensor_is_scheduled_on_its_next_forward(device, monkeypatch):
    """A tensor kept across forwards (a benchmark loop, a server holding a scene, the warm-up
    before a CUDA graph capture) finds its plans in its own memo, never asking the cache: the
    same layer asking again for a deferred plan is the coordinates' second sighting, answered
    with the scheduled plan. Other layers over the same tensor in one forward are not."""
    import flexplan.nn.spconv as spconv

    monkeypatch.setenv("FLEXPLAN_PLAN_PREFETCH", "0")
    coords = random_coords(200, (9, 9, 9), 2, generator=torch.Generator().manual_seed(41)).to(device)
    feats = torch.randn(coords.shape[0], 3, dtype=torch.float64, device=device)
    first, second = spconv.SubMConv3d(3, 3, 3).double().to(device), spconv.SubMConv3d(3, 3, 3).double().to(device)
    x = spconv.SparseConvTensor(feats, coords, (9, 9, 9), 2)
    seen = []
    with torch.no_grad():
        for _ in range(3):
            y = first(x)
            seen.append(x._plans[first.geometry].schedule_deferred)
            second(y)  # a second layer over the same coordinates in the same forward
            seen.append(x._plans[first.geometry].schedule_deferred)
    assert seen == [True, True, False, False, False, False]


def test_deferred_schedule_edge_cases(device, monkeypatch, tmp_path):
    """No upgrade while a CUDA graph is being captured (a schedule made there would be kept
    unwritten); save_plans ships a deferred plan scheduled; a training request is never
    deferred; a first sighting's key counts as seen for the memory's own admission."""
    import importlib

    from flexplan.cache import PlanCache

    cache_module = importlib.import_module("flexplan.cache.plan_cache")
    cache = PlanCache(directory=tmp_path / "cache")
    geometry = ConvGeometry.make(3)
    coords = random_coords(150, (8, 8, 8), 2, generator=torch.Generator().manual_seed(42)).to(device)
    deferred = cache.get_or_build(coords, (8, 8, 8), 2, geometry, training=False)
    assert deferred.schedule_deferred
    key = cache.key_of(deferred)
    assert cache.memory.was_seen(key, deferred.device)
    monkeypatch.setattr(cache_module, "capturing", lambda device: True)
    assert cache.get_or_build(coords, (8, 8, 8), 2, geometry, training=False) is deferred
    monkeypatch.setattr(cache_module, "capturing", lambda device: False)
    (saved_key,) = cache.save_plans(tmp_path / "shipped", [deferred])
    assert saved_key == key
    shipped = PlanCache(directory=tmp_path / "other").load_plans(tmp_path / "shipped", device)
    assert not shipped[key].schedule_deferred and shipped[key].fwd.block_sizes
    scheduled = cache.get_or_build(coords, (8, 8, 8), 2, geometry, training=False)
    assert not scheduled.schedule_deferred and scheduled.fwd.block_sizes
    fresh = random_coords(150, (8, 8, 8), 2, generator=torch.Generator().manual_seed(43)).to(device)
    trained = cache.get_or_build(fresh, (8, 8, 8), 2, geometry, training=True)
    assert trained.for_training and trained.fwd.block_sizes and not trained.schedule_deferred


@pytest.mark.parametrize("full", [True, False])
def test_unscheduled_maps_run_a_full_schedule(device, monkeypatch, full):
    """A convolution over a map without a schedule runs the masked kernel over the schedule of
    every offset in every block (plan_views.full_schedule: rows in their own order, views of
    shared constants) or, FULL_SCHEDULES off, the implicit kernel: the float64 result of a
    scheduled plan either way, for row counts on and off the block sizes."""
    from flexplan import plan_views
    from flexplan.ops import conv as conv_ops
    from flexplan.ops.conv import sparse_conv

    monkeypatch.setattr(conv_ops, "FULL_SCHEDULES", full)
    geometry = ConvGeometry.make(3)
    for seed, num in ((50, 37), (51, 300)):
        coords = random_coords(num, (9, 8, 7), 2, generator=torch.Generator().manual_seed(seed))
        coords = coords.to(device)
        deferred = build_plan(coords, (9, 8, 7), 2, geometry, training=False, scheduled=False)
        scheduled = build_plan(coords, (9, 8, 7), 2, geometry, training=False)
        feats = torch.randn(coords.shape[0], 4, dtype=torch.float64, device=device)
        weight = torch.randn(5, 3, 3, 3, 4, dtype=torch.float64, device=device)
        bias = torch.randn(5, dtype=torch.float64, device=device)
        with torch.no_grad():
            out = sparse_conv(feats, deferred, weight, bias, algo="masked")
            ref = sparse_conv(feats, scheduled, weight, bias, algo="masked")
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        made = deferred.fwd.derived_views.get("full_schedule")
        assert (made is not None) == full
        if full:
            m, v = deferred.fwd.neighbor_map.shape
            for block in made.block_sizes:
                blocks = -(-m // block)
                assert made.kernel_offsets(block).tolist() == list(range(v)) * blocks
                assert made.valid_kernel_seg[block].tolist() == list(range(0, (blocks + 1) * v, v))
            assert plan_views.full_schedule(deferred.fwd) is made


def test_a_layer_applied_twice_in_one_forward_keeps_the_deferred_plan(device, monkeypatch):
    """A weight-shared layer applied twice in one forward (to another tensor the second time)
    is no second sighting: the plan stays deferred, the cache schedules nothing. And the bytes
    the memory counts for a deferred plan do not grow when its first conv makes its views (the
    map's transpose was counted ahead; the full schedule's constants are shared)."""
    import flexplan.nn.spconv as spconv
    from flexplan.cache import plan_cache as cache
    from flexplan.cache.memory import held_bytes

    monkeypatch.setenv("FLEXPLAN_PLAN_PREFETCH", "0")
    shared = spconv.SubMConv3d(3, 3, 3).double().to(device)
    before = cache.stats().get("deferred_schedules", 0)
    for seed in (60, 61):
        coords = random_coords(200, (9, 9, 9), 2, generator=torch.Generator().manual_seed(seed))
        x = spconv.SparseConvTensor(torch.randn(coords.shape[0], 3, dtype=torch.float64,
                                                device=device), coords.to(device), (9, 9, 9), 2)
        with torch.no_grad():
            plan = tensor_plan_of(x, shared)
            counted = held_bytes(plan)
            shared(shared(x))
        assert x._plans[shared.geometry] is plan and plan.schedule_deferred
        assert held_bytes(plan) <= counted + (64 << 10)
    assert cache.stats().get("deferred_schedules", 0) == before


def tensor_plan_of(x, layer):
    from flexplan import tensor_plan

    return tensor_plan(x, layer.geometry, training=False)
