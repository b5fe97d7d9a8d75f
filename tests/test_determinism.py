"""Bitwise reproducibility on the GPU: flexplan's kernels use no floating-point atomics (split-K
partial sums are reduced in a fixed order, pooling gathers), so a network's outputs and every
gradient are bitwise equal run to run, plans rebuilt from scratch each time, also under
torch.use_deterministic_algorithms(True). (On the CPU interpreter everything runs in order, so
these tests would prove nothing there: GPU only.)"""
from __future__ import annotations

import pytest
import torch

import flexplan.nn.spconv as spconv
from flexplan.cache import plan_cache
from flexplan.workloads import random_coords

pytestmark = pytest.mark.gpu
SHAPE = (40, 36, 12)


def network(algo: str) -> spconv.SparseSequential:
    return spconv.SparseSequential(
        spconv.SubMConv3d(8, 32, 3, algo=algo, indice_key="s1"), torch.nn.ReLU(),
        spconv.SparseConv3d(32, 64, 3, 2, 1, algo=algo, indice_key="d1"), torch.nn.ReLU(),
        spconv.SubMConv3d(64, 64, 3, algo=algo, indice_key="s2"),
        spconv.SparseMaxPool3d(2, indice_key="p"),
        spconv.SparseInverseConv3d(64, 64, 2, algo=algo, indice_key="p"),
        spconv.SparseAvgPool(3, 3, 1, subm=True),
        spconv.SparseInverseConv3d(64, 16, 3, algo=algo, indice_key="d1"))


def run_once(net, feats, coords):
    plan_cache.clear()  # every plan rebuilt: the planner's atomics must not change results
    x = spconv.SparseConvTensor(feats.clone().requires_grad_(), coords, SHAPE, 2)
    out = net(x)
    out.features.float().square().sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    return out.features.detach(), x.features.grad, grads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("algo", ["auto", "masked_splitk", "implicit_splitk"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bitwise_equal_runs(algo, dtype):
    gen = torch.Generator().manual_seed(0)
    coords = random_coords(6000, SHAPE, 2, generator=gen).cuda()
    feats = torch.randn(coords.shape[0], 8, generator=gen).to("cuda", dtype)
    torch.manual_seed(0)
    net = network(algo).to("cuda", dtype)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = run_once(net, feats, coords), run_once(net, feats, coords)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)
    assert first[1].abs().sum() > 0  # the gradients reached the input
