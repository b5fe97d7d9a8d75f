"""Inference fusion of conv -> BatchNorm (-> ReLU) runs in SparseSequential (nn/eval_fusion.py):
the fused network gives the unfused one's outputs (float64: to rounding; 16-bit: to the
dtype's tolerance), fuses only where nothing can tell, and follows changes to its parameters."""
from __future__ import annotations

import pytest
import torch

import flexplan.nn.spconv as spconv
from flexplan.nn import eval_fusion
from flexplan.workloads import random_coords

SHAPE = (9, 8, 7)


def randomize_bn(bn, gen):
    c = bn.num_features
    bn.running_mean.copy_(torch.randn(c, generator=gen, dtype=torch.float64))
    bn.running_var.copy_(torch.rand(c, generator=gen, dtype=torch.float64) + 0.5)
    if bn.affine:
        bn.weight.data.copy_(torch.randn(c, generator=gen, dtype=torch.float64))
        bn.bias.data.copy_(torch.randn(c, generator=gen, dtype=torch.float64))


def network(gen):
    """post_act_block-style blocks: submanifold, strided (with bias), a BN without affine
    parameters, a 1x1 submanifold conv (the linear path), an inverse conv, and a conv -> BN
    without ReLU."""
    net = spconv.SparseSequential(
        spconv.SubMConv3d(5, 8, 3, bias=False, indice_key="s1"),
        torch.nn.BatchNorm1d(8, eps=1e-3), torch.nn.ReLU(),
        spconv.SparseConv3d(8, 12, 3, stride=2, padding=1, bias=True, indice_key="d1"),
        torch.nn.BatchNorm1d(12, affine=False), torch.nn.ReLU(inplace=True),
        spconv.SubMConv3d(12, 12, 1, bias=True),
        spconv.SparseBatchNorm(12), spconv.SparseReLU(),
        spconv.SparseInverseConv3d(12, 6, 3, indice_key="d1", bias=False),
        torch.nn.BatchNorm1d(6))
    for m in net:
        if isinstance(m, torch.nn.BatchNorm1d):
            randomize_bn(m, gen)
    return net


def inputs(gen, device, dtype=torch.float64):
    coords = random_coords(150, SHAPE, 2, generator=gen)
    feats = torch.randn(coords.shape[0], 5, generator=gen, dtype=torch.float64).to(dtype)
    return lambda: spconv.SparseConvTensor(feats.to(device), coords.to(device), SHAPE, 2)


def unfused(net, x, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv(eval_fusion.FUSE_ENV, "0")
        return net(x())


def count_fused(monkeypatch):
    calls = []
    real = eval_fusion.run_fused
    monkeypatch.setattr(eval_fusion, "run_fused", lambda *a: calls.append(a) or real(*a))
    return calls


def test_fused_equals_unfused_float64(device, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    net = network(gen).double().to(device).eval()
    x = inputs(gen, device)
    calls = count_fused(monkeypatch)
    with torch.no_grad():
        want = unfused(net, x, monkeypatch)
        assert not calls
        got = net(x())
    assert len(calls) == 4  # every conv -> BN run of the network
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.features, want.features, rtol=1e-12, atol=1e-12)
    assert got.features.abs().sum() > 0 and (got.features < 0).any()  # the last run: no ReLU


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_equals_unfused_low_precision(dtype, device, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    net = network(gen).to(device).to(dtype).eval()
    x = inputs(gen, device, dtype)
    with torch.no_grad():
        want = unfused(net, x, monkeypatch)
        got = net(x())
    tol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    torch.testing.assert_close(got.features.double(), want.features.double(), rtol=tol,
                               atol=tol)


def test_not_fused_where_it_could_show(device, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    net = network(gen).double().to(device).eval()
    x = inputs(gen, device)
    conv, bn, relu = eval_fusion.fusion_run(list(net), 0)
    assert eval_fusion.fusion_run(list(net), 1) is None  # a BN does not start a run
    probe = x()
    with torch.no_grad():
        assert eval_fusion.fusable(conv, bn, relu, probe)
    # gradients wanted: parameters that require grad, in grad mode
    assert not eval_fusion.fusable(conv, bn, relu, probe)
    bn.train()  # training: batch statistics
    with torch.no_grad():
        assert not eval_fusion.fusable(conv, bn, relu, probe)
    bn.eval()
    calls = count_fused(monkeypatch)
    handle = relu.register_forward_hook(lambda *a: None)
    with torch.no_grad():
        out = net(x())  # a hook on the first ReLU: its run unfused, the others fused
    handle.remove()
    assert len(calls) == 3 and all(c[0] is not conv for c in calls)
    monkeypatch.setenv(eval_fusion.FUSE_ENV, "0")
    with torch.no_grad():
        torch.testing.assert_close(net(x()).features, out.features, rtol=1e-12, atol=1e-12)
    assert len(calls) == 3


def test_folded_parameters_follow_changes(device, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    net = spconv.SparseSequential(*list(network(gen))[:6]).double().to(device).eval()
    x = inputs(gen, device)
    with torch.no_grad():
        first = net(x()).features
        net[1].running_mean.add_(0.5)  # in place: a new version
        net[0].weight.mul_(2)
        net[4].running_var.fill_(2.0)
        got = net(x())
        want = unfused(net, x, monkeypatch)
    assert not torch.allclose(got.features, first)
    torch.testing.assert_close(got.features, want.features, rtol=1e-12, atol=1e-12)


def test_2d_network_fuses(device, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    net = spconv.SparseSequential(spconv.SubMConv2d(3, 4, 3, bias=False),
                                  torch.nn.BatchNorm1d(4), torch.nn.ReLU())
    randomize_bn(net[1], gen)
    net = net.double().to(device).eval()
    coords = random_coords(60, (9, 8, 1), 2, generator=gen)[:, :3]
    feats = torch.randn(coords.shape[0], 3, generator=gen, dtype=torch.float64)
    x = lambda: spconv.SparseConvTensor(feats.to(device), coords.to(device), (9, 8), 2)
    calls = count_fused(monkeypatch)
    with torch.no_grad():
        got, want = net(x()), unfused(net, x, monkeypatch)
    assert len(calls) == 1
    torch.testing.assert_close(got.features, want.features, rtol=1e-12, atol=1e-12)


def test_fused_under_autocast(device, monkeypatch):
    """An fp32 model under autocast: the folded parameters are kept in the autocast dtype (no
    cast per call) and the outputs match the unfused autocast run."""
    gen = torch.Generator().manual_seed(5)
    net = network(gen).float().to(device).eval()
    x = inputs(gen, device, torch.float32)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    calls = count_fused(monkeypatch)
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
        want = unfused(net, x, monkeypatch)
        got = net(x())
    assert len(calls) == 4 and got.features.dtype == want.features.dtype == dtype
    assert eval_fusion.folded(net[0], net[1], dtype)[0].dtype == dtype
    assert "_flexplan_folded" not in net[0].__dict__ and not any(
        "folded" in k for k in net.state_dict())
    tol = 2e-2 if dtype == torch.float16 else 1e-1
    torch.testing.assert_close(got.features.double(), want.features.double(), rtol=tol, atol=tol)
