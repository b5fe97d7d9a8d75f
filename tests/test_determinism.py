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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("splits", [3, 8])
def test_split_k_tiles_sum_every_split(splits, monkeypatch):
    """Split-K's last split of each tile reads the partials the other splits stored
    (kernels_src/conv_common.py, split_tile_ticket): with thousands of tiles whose splits finish
    in any order, every one of 20 launches of the forward (with bias) and of grad-weight equals
    the first bitwise and a float64 reference within fp16 / fp32 rounding. A partial read
    before its split stored it, or a counter left raised, shows as a mismatch."""
    import importlib

    from flexplan import ConvGeometry, build_plan
    from flexplan.kernel_configs import KernelConfig

    ops = importlib.import_module("flexplan.ops.conv")
    monkeypatch.setattr(ops, "select_config",
                        lambda family, problem: KernelConfig(64, 32, 32, splits))
    gen = torch.Generator().manual_seed(splits)
    shape = (96, 96, 24)
    coords = random_coords(60000, shape, 2, generator=gen).cuda()
    plan = build_plan(coords, shape, 2, ConvGeometry.submanifold_conv(3))
    m, ci, co = coords.shape[0], 32, 64
    feats = torch.randn(m, ci, generator=gen).half().cuda()
    weight = torch.randn(co, 27, ci, generator=gen).half().cuda()
    bias = torch.randn(co, generator=gen).half().cuda()
    grad_out = torch.randn(m, co, generator=gen).half().cuda()
    nmap = plan.fwd.neighbor_map.long()
    cols = feats.double()[nmap.clamp(min=0)] * (nmap >= 0)[..., None]  # [m, V, Ci]
    ref_out = torch.einsum("mvc,ovc->mo", cols, weight.double()) + bias.double()
    ref_wgrad = torch.einsum("mo,mvc->ovc", grad_out.double(), cols)
    runs = [(ops.gather_gemm(feats, weight, bias, plan.fwd, False, "fwd", "masked_splitk", False),
             ops.wgrad(grad_out, feats, plan, weight.shape, "masked_splitk", False,
                       out_dtype=torch.float32)) for _ in range(20)]
    first_out, first_wgrad = runs[0]
    for out, grad_w in runs[1:]:
        assert torch.equal(out, first_out) and torch.equal(grad_w, first_wgrad)
    scale = lambda ref: ref.abs().max()  # noqa: E731
    assert (first_out.double() - ref_out).abs().max() < 2e-3 * scale(ref_out)
    # (fp32 sums of ~2000 products per offset and split: a missing split errs by tens of %)
    assert (first_wgrad.double() - ref_wgrad).abs().max() < 1e-4 * scale(ref_wgrad)
