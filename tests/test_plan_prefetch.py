"""Plan prefetch (flexplan/plan_prefetch.py): after two steps asking for the same plans, a step's
first request builds all of them; layers get the plans they would have got, and a network that
changes what it asks, or a failing prefetch, falls back to building at the layer."""
from __future__ import annotations

import pytest
import torch
from test_nn_spconv import sparse_input

import flexplan.nn.spconv as spconv
from flexplan import plan_prefetch


def network():
    torch.manual_seed(0)
    return spconv.SparseSequential(
        spconv.SubMConv3d(3, 4, 3, indice_key="subm0"),
        spconv.SparseConv3d(4, 5, 3, stride=2, padding=1, indice_key="down0"),
        spconv.SubMConv3d(5, 5, 3, indice_key="subm1"),
        spconv.SparseConv3d(5, 6, 2, stride=2, indice_key="down1"),
        spconv.SubMConv3d(6, 6, 3, indice_key="subm2"),
        spconv.SparseInverseConv3d(6, 5, 2, indice_key="down1"),
        spconv.SparseInverseConv3d(5, 4, 3, indice_key="down0")).double()


class _Log(list):
    """The requests, and per request whether it asked for a scheduled plan (a pool does not);
    clear() forgets both."""

    def __init__(self):
        super().__init__()
        self.scheduled = []

    def clear(self):
        super().clear()
        self.scheduled.clear()


@pytest.fixture
def log(monkeypatch):
    """Every plan build or cache lookup of plan_prefetch, in order: (rows, geometry) per call,
    and a marker where the layers' first request arrived."""
    plan_prefetch.clear()
    calls = _Log()
    real = plan_prefetch._cached

    def cached(coords, grid_shape, batch_size, geometry, identity, training, scheduled=True):
        calls.append((coords.shape[0], geometry, training))
        calls.scheduled.append(scheduled)
        return real(coords, grid_shape, batch_size, geometry, identity, training, scheduled)

    monkeypatch.setattr(plan_prefetch, "_cached", cached)
    yield calls
    plan_prefetch.clear()


def run(net, seed, grad=True, backward=False):
    """A step on fresh coordinates (seed); training plans where grad (the backward only where
    asked: the plans are the same without it). One batch entry (~25 voxels, 1 at the coarsest
    level): the plans' sequence is what these tests are about, and the kernels' programs, each a
    round through the interpreter, scale with the rows."""
    x = sparse_input((5, 6, 5), batch_size=1, seed=seed)
    with torch.set_grad_enabled(grad):
        out = net(x)
    if backward:
        out.features.square().sum().backward()
    return out


def reference(seed, grad=True, monkeypatch=None):
    """The same step with prefetch off: what every layer got before it existed."""
    monkeypatch.setenv(plan_prefetch.PREFETCH_ENV, "0")
    try:
        net = network()
        out = run(net, seed, grad, backward=grad)
        return out.features.detach(), out.indices, [p.grad for p in net.parameters()] if grad else []
    finally:
        monkeypatch.delenv(plan_prefetch.PREFETCH_ENV)


def test_third_fresh_step_prefetches_every_plan_and_equals_the_layer_built_step(log, monkeypatch):
    net = network()
    run(net, seed=1)
    run(net, seed=2)
    per_step = len(log) // 2
    assert per_step == 5  # 3 submanifold geometries over 3 coordinate sets, 2 strided
    log.clear()
    # Step 3: the first layer's request builds the step's 5 plans before the layer's conv runs.
    first_layer = net[0]
    seen_at_first_conv = []
    hook = first_layer.register_forward_hook(lambda *a: seen_at_first_conv.append(len(log)))
    out = run(net, seed=3, backward=True)
    hook.remove()
    assert seen_at_first_conv == [per_step]
    assert len(log) == per_step  # nothing asked twice: the layers found the prefetched plans
    feats, indices, grads = reference(3, monkeypatch=monkeypatch)
    assert torch.equal(out.indices, indices)
    torch.testing.assert_close(out.features, feats, rtol=0, atol=0)
    for p, g in zip(net.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def first_conv_after(log, net, step):
    """How many plan requests of the step came before its first conv ran."""
    log.clear()
    hook = net[0].register_forward_hook(lambda *a: log.append("first conv"))
    step()
    hook.remove()
    return log.index("first conv")


def test_new_sequence_builds_at_the_layers_and_others_stay_kept(log):
    net = network()
    for seed in (1, 2, 3):
        run(net, seed)
    # Inference asks for inference plans: a sequence not seen before, built layer by layer.
    assert first_conv_after(log, net, lambda: run(net, 4, grad=False)) == 1
    assert [training for *_, training in log if _ != "first conv"].count(False) == 5
    # Training again: its sequence, kept under its own first request, is prefetched at once.
    assert first_conv_after(log, net, lambda: run(net, 5)) == 5
    # A network asking for a different sequence from the same first request: its first step
    # gets the old sequence's 5 plans (2 of them unused: work spent, nothing wrong), its second
    # builds at the layers, its third prefetches its own 3.
    shorter = spconv.SparseSequential(*list(net)[:3])
    assert [first_conv_after(log, shorter, lambda: run(shorter, s)) for s in (6, 7, 8)] == [5, 1, 3]


def test_prefetch_that_fails_falls_back_to_the_layers(log, monkeypatch):
    net = network()
    run(net, 1, grad=False)
    run(net, 2, grad=False)
    real = plan_prefetch._cached
    fail = {"armed": True}

    def flaky(coords, grid_shape, batch_size, geometry, identity, training, scheduled=True):
        if fail["armed"] and not geometry.submanifold:
            fail["armed"] = False
            raise RuntimeError("prefetch failure")
        return real(coords, grid_shape, batch_size, geometry, identity, training, scheduled)

    monkeypatch.setattr(plan_prefetch, "_cached", flaky)
    with pytest.warns(RuntimeWarning, match="prefetching a step's plans failed"):
        out = run(net, 3, grad=False)
    assert not fail["armed"]  # the prefetch ran, and failed
    feats, indices, _ = reference(3, grad=False, monkeypatch=monkeypatch)
    torch.testing.assert_close(out.features, feats, rtol=0, atol=0)
    assert torch.equal(out.indices, indices)


def test_repeated_coordinates_keep_one_sequence(log):
    """The same input every step: a step begins at the repeat of its first request."""
    net = network()
    x = sparse_input((5, 6, 5), batch_size=1, seed=1)
    for _ in range(4):  # a new tensor every step (new plan memo), as a data loader makes them
        net(spconv.SparseConvTensor(x.features, x.indices, x.spatial_shape, x.batch_size))
    steps = plan_prefetch._steps
    assert len(steps.recipes) == 1
    (recipe, confirmed), = steps.recipes.values()
    assert confirmed and len(recipe) == 5


def test_same_rows_under_another_grid_get_their_own_plan(log, monkeypatch):
    """The cache tells the same coordinate rows apart by grid and batch size (a strided
    output's border and grid depend on them): so does the prefetch."""
    net = spconv.SparseSequential(spconv.SubMConv3d(3, 3, 3, indice_key="s"),
                                  spconv.SparseConv3d(3, 4, 2, stride=2, indice_key="d")).double()
    down = net[1]
    for seed in (1, 2):
        net(sparse_input((5, 6, 5), seed=seed))
    x = sparse_input((5, 6, 5), seed=3)
    net[0](x)  # the step's first request: both plans prefetched, the strided one on (5, 6, 5)
    wider = spconv.SparseConvTensor(x.features, x.indices, (6, 6, 6), x.batch_size)
    got = down(wider)  # the same rows in a (6, 6, 6) grid: not the prefetched plan
    monkeypatch.setenv(plan_prefetch.PREFETCH_ENV, "0")
    want = down(spconv.SparseConvTensor(x.features, x.indices, (6, 6, 6), x.batch_size))
    assert got.spatial_shape == want.spatial_shape == (3, 3, 3)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.features, want.features, rtol=0, atol=0)


def test_failed_prefetch_warns_once_and_is_not_retried(log, monkeypatch):
    net = network()
    run(net, 1, grad=False)
    run(net, 2, grad=False)
    monkeypatch.setattr(plan_prefetch, "_prefetch", lambda *a: 1 / 0)
    with pytest.warns(RuntimeWarning, match="prefetching a step's plans failed"):
        run(net, 3, grad=False)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in (4, 5, 6):
            run(net, seed, grad=False)


def test_prefetch_builds_strided_plans_before_submanifold_ones(log, monkeypatch):
    """Each strided build waits for the GPU (its output count): built first, it waits for its
    own kernels, not for submanifold builds queued before it. The layers still get the plans
    they would have got."""
    net = network()
    run(net, seed=1)
    run(net, seed=2)
    log.clear()
    out = run(net, seed=3, backward=True)
    kinds = [geometry.submanifold for _, geometry, _ in log]
    assert kinds == sorted(kinds) and kinds.count(False) == 2 and kinds.count(True) == 3
    feats, indices, grads = reference(3, monkeypatch=monkeypatch)
    assert torch.equal(out.indices, indices)
    torch.testing.assert_close(out.features, feats, rtol=0, atol=0)
    for p, g in zip(net.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    # The recorded order, where asked (the A/B switch).
    monkeypatch.setattr(plan_prefetch, "STRIDED_FIRST", False)
    log.clear()
    run(net, seed=4)
    assert [g.submanifold for _, g, _ in log] == [True, False, True, False, True]


def test_prefetch_keeps_a_pools_maps_only_request(log, monkeypatch):
    """A pool asks for a maps-only plan (no fwd schedule); the prefetch builds the same kind,
    and the step equals the one the layers build."""
    torch.manual_seed(0)
    net = spconv.SparseSequential(spconv.SubMConv3d(3, 4, 3, indice_key="subm0"),
                                  spconv.SparseMaxPool3d(3, 2, 1),
                                  spconv.SubMConv3d(4, 4, 3, indice_key="subm1")).double()
    run(net, seed=1, grad=False)
    run(net, seed=2, grad=False)
    log.clear()
    plans = []
    hook = net[1].register_forward_hook(lambda m, inputs, out: plans.append(
        inputs[0]._plans.get(m.geometry)))
    out = run(net, seed=3, grad=False)
    hook.remove()
    assert [(g.submanifold, s) for (_, g, _), s in zip(log, log.scheduled)] == [
        (False, False), (True, True), (True, True)]
    assert plans[0].maps_only
    monkeypatch.setenv(plan_prefetch.PREFETCH_ENV, "0")
    want = run(net, seed=3, grad=False)
    assert torch.equal(out.indices, want.indices)
    torch.testing.assert_close(out.features, want.features, rtol=0, atol=0)


def test_a_pool_and_a_conv_of_one_geometry_share_one_prefetched_plan(log, monkeypatch):
    """A pool and a conv of the same geometry over the same coordinates: one plan (the conv's,
    scheduled) per step, prefetched every step from the third on, and the same outputs as the
    layers' own builds."""
    torch.manual_seed(0)

    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = spconv.SubMConv3d(3, 4, 3, indice_key="subm0")
            self.pool = spconv.SparseMaxPool3d(3, 2, 1)
            self.down = spconv.SparseConv3d(4, 3, 3, 2, 1)

        def forward(self, x):
            y = self.sub(x)
            return self.pool(y), self.down(y)

    net = Branches().double()
    sub = net.sub
    per_step = []
    for seed in range(1, 7):
        log.clear()
        first_conv = []
        hook = sub.register_forward_hook(lambda *a: first_conv.append(len(log)))
        with torch.no_grad():
            pooled, convolved = net(sparse_input((5, 6, 5), batch_size=1, seed=seed))
        hook.remove()
        per_step.append((len(log), first_conv[0]))
    # Steps 1-2: each layer asks as it runs (the submanifold conv before the hook fires; the
    # pool its maps-only plan, the conv a scheduled one); from step 3 the step's two plans are
    # prefetched at its first request, the conv's serving the pool too.
    assert per_step[:2] == [(3, 1), (3, 1)] and per_step[2:] == [(2, 2)] * 4, per_step
    monkeypatch.setenv(plan_prefetch.PREFETCH_ENV, "0")
    with torch.no_grad():
        want = net(sparse_input((5, 6, 5), batch_size=1, seed=6))
    for got, ref in zip((pooled, convolved), want):
        assert torch.equal(got.indices, ref.indices)
        torch.testing.assert_close(got.features, ref.features, rtol=0, atol=0)
