"""CUDA graphs (GPU): with its plans built (the same coordinates as the warm-up), a network's
inference forward and a training step are captured with torch.cuda.graph and replayed on new
features, giving the eager results: no host sync and no data-dependent allocation inside the
conv and pool ops once the plans and their views exist."""
from __future__ import annotations

import pytest
import torch

import flexplan.nn.spconv as spconv
from flexplan.workloads import random_coords

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
SHAPE = (48, 40, 16)


def network():
    return spconv.SparseSequential(
        spconv.SubMConv3d(4, 32, 3, indice_key="s1"), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
        spconv.SparseConv3d(32, 64, 3, 2, 1, indice_key="d1"), torch.nn.ReLU(),
        spconv.SubMConv3d(64, 64, 3, indice_key="s2"),
        spconv.SparseMaxPool3d(2, indice_key="p"),
        spconv.SparseInverseConv3d(64, 64, 2, indice_key="p"),
        spconv.SparseInverseConv3d(64, 16, 3, indice_key="d1"))


def test_inference_forward_captured_and_replayed():
    gen = torch.Generator().manual_seed(0)
    coords = random_coords(20000, SHAPE, 2, generator=gen).cuda()
    net = network().cuda().half().eval()
    static = torch.randn(coords.shape[0], 4, generator=gen).cuda().half()
    x = spconv.SparseConvTensor(static, coords, SHAPE, 2)  # checked here, outside the graph
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):  # plans, their views, the configs: made before capture
            net(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = net(x)
    for seed in (1, 2):
        new = torch.randn(coords.shape[0], 4, generator=torch.Generator().manual_seed(seed))
        static.copy_(new.cuda().half())
        graph.replay()
        with torch.no_grad():
            eager = net(spconv.SparseConvTensor(static.clone(), coords, SHAPE, 2)).features
        assert torch.equal(out.features, eager)


def test_training_step_captured_and_replayed():
    gen = torch.Generator().manual_seed(3)
    coords = random_coords(20000, SHAPE, 2, generator=gen).cuda()
    torch.manual_seed(0)
    net = network().cuda()
    static = torch.randn(coords.shape[0], 4, generator=gen).cuda()
    x = spconv.SparseConvTensor(static.requires_grad_(), coords, SHAPE, 2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            net(x).features.square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    for p in net.parameters():
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = net(x).features.square().sum()
        loss.backward()
    graph.replay()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    eager = net(spconv.SparseConvTensor(static.detach().clone().requires_grad_(), coords, SHAPE,
                                        2)).features.square().sum()
    eager.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-5)
    for g, p in zip(grads, net.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [300, 20000], ids=["gray-chunk-order", "chunk-order-kernel"])
def test_views_first_made_under_capture_are_not_kept(rows):
    """A plan whose gather views are first asked for inside a capture: the capture gets views
    of its own and the plan keeps none, so an eager call after the capture (no replay: the
    captured kernels never ran) derives real ones and is right; the graph's replay is too."""
    from flexplan import graph_capture
    from flexplan.geometry import ConvGeometry
    from flexplan.ops import sparse_conv
    from flexplan.planner import build_plan

    gen = torch.Generator().manual_seed(4)
    coords = random_coords(rows, SHAPE, 2, generator=gen).cuda()
    geometry = ConvGeometry.submanifold_conv(3)
    plan = build_plan(coords, SHAPE, 2, geometry, training=False)
    twin = build_plan(coords, SHAPE, 2, geometry, training=False)  # same plan, its own views
    feats = torch.randn(coords.shape[0], 16, generator=gen).cuda().half()
    weight = torch.randn(16, 3, 3, 3, 16, generator=gen).cuda().half()
    want = sparse_conv(feats, twin, weight, algo="masked")  # compiles, warms the configs
    torch.cuda.synchronize()
    graph_capture._PER_DEVICE.clear()  # the per-device constants too: first made in the capture
    built = dict(plan.fwd.derived_views)  # the build's own (its schedule wrote sorted_map_t)
    assert set(built) <= {"sorted_map_t"}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sparse_conv(feats, plan, weight, algo="masked")
    # nothing made in the capture kept
    assert set(plan.fwd.derived_views) == set(built) and all(
        plan.fwd.derived_views[k] is v for k, v in built.items())
    assert not graph_capture._PER_DEVICE
    assert torch.equal(sparse_conv(feats, plan, weight, algo="masked"), want)
    graph.replay()
    assert torch.equal(captured, want)
