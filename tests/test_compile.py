"""torch.compile runs flexplan networks (the spconv drop-in namespace): the plan provider and the
coordinate check run eagerly behind graph breaks (flexplan/compile_boundary.py); the conv and pool
ops are torch.library custom ops inside the graphs, with the torch code around them; outputs and
gradients equal eager ones. CPU: a small network through AOTAutograd; GPU: the e2e U-Net through
inductor."""
from __future__ import annotations

import gc
import linecache
import os
import sys
import weakref

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

from e2e_networks import LidarUNet  # noqa: E402

import flexplan.nn.spconv as spconv  # noqa: E402
from flexplan import ConvGeometry, build_plan  # noqa: E402
from flexplan.ops import sparse_conv, sparse_pool  # noqa: E402
from flexplan.workloads import lidar_batch, lidar_scans, random_coords  # noqa: E402

SHAPE = (12, 10, 8)


def small_network():
    return spconv.SparseSequential(
        spconv.SubMConv3d(4, 8, 3), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
        spconv.SparseConv3d(8, 8, 3, 2, 1, indice_key="d"), spconv.SparseMaxPool3d(2, indice_key="p"),
        spconv.SparseInverseConv3d(8, 8, 2, indice_key="p"),
        spconv.SparseInverseConv3d(8, 4, 3, indice_key="d"))


def compare(net, compiled, make_input, tolerance):
    outs, grads = [], []
    for model in (net, compiled):
        x = make_input()
        out = model(x)
        out = out.features if isinstance(out, spconv.SparseConvTensor) else out
        out.float().square().sum().backward()
        outs.append(out.detach())
        grads.append([x.features.grad] + [p.grad.clone() for p in net.parameters()])
        net.zero_grad(set_to_none=True)
    torch.testing.assert_close(outs[1], outs[0], rtol=tolerance, atol=tolerance)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_compiled_network_equals_eager(device):
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = small_network().to(device).double()
    compiled = torch.compile(net, backend="aot_eager")  # AOTAutograd: the backward too
    for seed in (0, 1):  # new coordinates: plans are built outside the graphs
        coords = random_coords(60, SHAPE, 2, generator=torch.Generator().manual_seed(seed))
        feats = torch.randn(coords.shape[0], 4, dtype=torch.float64)
        compare(net, compiled, lambda: spconv.SparseConvTensor(
            feats.to(device).requires_grad_(), coords.to(device), SHAPE, 2), 1e-10)


def test_ops_are_in_the_graphs_and_only_planning_breaks(device):
    """The conv and pool ops are custom ops in Dynamo's graphs; every graph break left is a
    layer's plan lookup (planning stays outside the graphs)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = small_network().to(device).double()
    coords = random_coords(60, SHAPE, 2, generator=torch.Generator().manual_seed(3)).to(device)
    feats = torch.randn(coords.shape[0], 4, dtype=torch.float64, device=device)
    net(spconv.SparseConvTensor(feats, coords, SHAPE, 2))  # plans built and cached first
    explanation = torch._dynamo.explain(net)(spconv.SparseConvTensor(feats, coords, SHAPE, 2))
    targets = [str(node.target) for graph in explanation.graphs for node in graph.graph.nodes
               if node.op == "call_function"]
    assert targets.count("flexplan.sparse_conv") == 4  # subm, strided, two inverse
    assert targets.count("flexplan.sparse_pool") == 1
    assert explanation.break_reasons
    for reason in explanation.break_reasons:
        frame = reason.user_stack[-1]
        assert "plan" in linecache.getline(frame.filename, frame.lineno), reason


def test_compiled_functional_ops_keep_their_plans_to_the_backward_only(device):
    """Functional ops under torch.compile (the backward through AOTAutograd) equal eager ones;
    a plan dropped by the caller between the forward and the backward still serves the backward
    (the keeper carries it), and is freed once the graph's tensors are gone (no cycle)."""
    torch._dynamo.reset()
    coords = random_coords(50, SHAPE, 2, generator=torch.Generator().manual_seed(5)).to(device)
    weight = torch.randn(6, 3, 3, 3, 4, dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, device=device, requires_grad=True)

    def f(x, plan_a, plan_b):
        return sparse_pool(sparse_conv(x, plan_a, weight, bias).relu(), plan_b, "avg")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # no break at all
    grads, refs = [], []
    for fn in (f, compiled):
        subm = build_plan(coords, SHAPE, 2, ConvGeometry.make(3, submanifold=True))
        pool = build_plan(coords, SHAPE, 2, ConvGeometry.make(2, stride=2, submanifold=False))
        x = torch.randn(coords.shape[0], 4, dtype=torch.float64, device=device,
                        generator=torch.Generator(device).manual_seed(1)).requires_grad_()
        out = fn(x, subm, pool)
        refs.append((weakref.ref(subm), weakref.ref(pool)))
        del subm, pool
        gc.collect()
        out.square().sum().backward()
        grads.append((out.detach(), x.grad, weight.grad.clone(), bias.grad.clone()))
        weight.grad = bias.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
    del out, x
    gc.collect()
    assert all(ref() is None for pair in refs for ref in pair)


def _conv_pool(weight, bias):
    def f(x, plan_a, plan_b):
        return sparse_pool(sparse_conv(x, plan_a, weight, bias).relu(), plan_b, "max")
    return f


def test_compiled_autocast_gives_master_weights_the_eager_gradients(device):
    """Under autocast the compiled op casts weight and bias inside, as the eager one does: fp32
    master weights get the same fp32 gradients, from the fp32 sums (not through a 16-bit
    round trip of a cast in the graph)."""
    torch._dynamo.reset()
    dtype = torch.bfloat16
    coords = random_coords(50, SHAPE, 2, generator=torch.Generator().manual_seed(6)).to(device)
    subm = build_plan(coords, SHAPE, 2, ConvGeometry.make(3, submanifold=True))
    pool = build_plan(coords, SHAPE, 2, ConvGeometry.make(2, stride=2, submanifold=False))
    weight = torch.randn(6, 3, 3, 3, 4, device=device, requires_grad=True)
    bias = torch.randn(6, device=device, requires_grad=True)
    f = _conv_pool(weight, bias)
    results = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        x = torch.randn(coords.shape[0], 4, device=device,
                        generator=torch.Generator(device).manual_seed(2)).requires_grad_()
        with torch.autocast(device.type, dtype):
            out = fn(x, subm, pool)
        assert out.dtype == dtype
        out.float().square().sum().backward()
        assert weight.grad.dtype == bias.grad.dtype == x.grad.dtype == torch.float32
        results.append((out.float(), x.grad, weight.grad.clone(), bias.grad.clone()))
        weight.grad = bias.grad = None
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_compiled_ops_over_plans_with_no_outputs(device):
    """Plans with no output rows (all of whose maps are empty) are told apart: each compiled
    call gets its own plan's shapes."""
    torch._dynamo.reset()
    geometry = ConvGeometry.make(2, stride=2, submanifold=False)
    weight = torch.randn(3, 2, 2, 2, 4, dtype=torch.float64, device=device, requires_grad=True)
    compiled = torch.compile(lambda x, p: sparse_conv(x, p, weight), backend="aot_eager")
    # Coordinates on the grid's last odd row: no stride-2 window without padding reaches them.
    for rows in (1, 2):
        coords = torch.tensor([[0, 4, 4, 4], [1, 4, 4, 4]][:rows], dtype=torch.int32,
                              device=device)
        plan = build_plan(coords, (5, 5, 5), 2, geometry)
        assert plan.num_out == 0
        x = torch.randn(rows, 4, dtype=torch.float64, device=device, requires_grad=True)
        out = compiled(x, plan)
        assert out.shape == (0, 3)
        out.sum().backward()
        assert x.grad.shape == (rows, 4) and not x.grad.any()


def test_compiled_backward_without_its_plan_is_a_clear_error(device):
    """A saved-tensor hook that copies what autograd saves separates the backward op from the
    plan its keeper carried: a clear error, not a wrong answer."""
    torch._dynamo.reset()
    coords = random_coords(40, SHAPE, 2, generator=torch.Generator().manual_seed(7)).to(device)
    plan = build_plan(coords, SHAPE, 2, ConvGeometry.make(3, submanifold=True))
    weight = torch.randn(5, 3, 3, 3, 4, dtype=torch.float64, device=device, requires_grad=True)
    compiled = torch.compile(lambda x: sparse_conv(x, plan, weight), backend="aot_eager")
    x = torch.randn(coords.shape[0], 4, dtype=torch.float64, device=device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out = compiled(x)
    with pytest.raises(LookupError, match="saved-tensor hook"):
        out.sum().backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compiled_e2e_unet_equals_eager():
    torch._dynamo.reset()
    scans = lidar_scans(2, 0, "cuda")
    torch.manual_seed(0)
    net = LidarUNet(spconv).cuda()
    compiled = torch.compile(net)  # inductor
    for step in range(2):
        batch = lidar_batch(step, 2, 0, "cuda", scans=scans)
        compare(net, compiled, lambda: spconv.SparseConvTensor(
            batch.features.clone().requires_grad_(), batch.indices, list(batch.spatial_shape), 2),
            2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_e2e_unet_under_autocast_equals_eager(dtype):
    """Under torch.autocast the graph casts the inputs and weights before the conv op, as the
    eager op does inside: the same kernels on the same values."""
    torch._dynamo.reset()
    scans = lidar_scans(2, 0, "cuda")
    torch.manual_seed(0)
    net = LidarUNet(spconv).cuda()
    compiled = torch.compile(net)
    batch = lidar_batch(0, 2, 0, "cuda", scans=scans)
    outs, grads = [], []
    for model in (net, compiled):
        x = spconv.SparseConvTensor(batch.features.clone().requires_grad_(), batch.indices,
                                    list(batch.spatial_shape), 2)
        with torch.autocast("cuda", dtype):
            out = model(x)
        assert out.dtype == dtype
        out.float().square().mean().backward()
        outs.append(out.detach().float())
        grads.append([p.grad.clone() for p in net.parameters()])
        net.zero_grad(set_to_none=True)
    scale = outs[0].abs().max()
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=3e-2 * scale)
    for a, b in zip(grads[1], grads[0]):
        assert a.dtype == torch.float32  # the fp32 master weights' gradients
        torch.testing.assert_close(a, b, rtol=0, atol=5e-2 * b.abs().max() + 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compiled_reduce_overhead_unet_equals_eager():
    """mode="reduce-overhead" (inductor's CUDA graphs): the sparse ops are tagged
    cudagraph_unsafe, so no recorded graph replays a plan lookup it skipped; results equal
    eager ones over two batches of new coordinates, inference."""
    torch._dynamo.reset()
    scans = lidar_scans(2, 0, "cuda")
    torch.manual_seed(0)
    net = LidarUNet(spconv).cuda().eval()
    compiled = torch.compile(net, mode="reduce-overhead")
    with torch.no_grad():
        for step in range(3):
            batch = lidar_batch(step, 2, 0, "cuda", scans=scans)
            outs = [model(spconv.SparseConvTensor(batch.features, batch.indices,
                                                  list(batch.spatial_shape), 2))
                    for model in (net, compiled)]
            torch.testing.assert_close(outs[1], outs[0], rtol=2e-3, atol=2e-3)
