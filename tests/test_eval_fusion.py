"""fuse_conv_bn (nn/eval_fusion.py): eval-mode BatchNorms folded into the convs before them give
the unfused model's outputs (float64: to rounding; 16-bit: to the dtype's tolerance), only
pairs that can be folded are, and the module tree keeps its indices."""
from __future__ import annotations

import copy

import pytest
import torch

import flexplan.nn.spconv as spconv
from flexplan.nn import FoldedBatchNorm, fuse_conv_bn
from flexplan.workloads import random_coords

SHAPE = (9, 8, 7)


def randomize_bn(bn, gen):
    c = bn.num_features
    if bn.running_mean is None:
        return
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


def fused_and_plain(net, x):
    plain = copy.deepcopy(net)
    with torch.no_grad():
        want = plain(x())
        got = net(x())
    return got, want


def test_fused_equals_unfused_float64(device):
    gen = torch.Generator().manual_seed(0)
    net = network(gen).double().to(device).eval()
    x = inputs(gen, device)
    keys = set(net.state_dict())
    plain = copy.deepcopy(net)
    assert fuse_conv_bn(net) == 4  # every conv -> BN pair of the network
    assert [i for i, m in enumerate(net) if isinstance(m, FoldedBatchNorm)] == [1, 4, 7, 10]
    assert net[0].bias is not None and {k for k in net.state_dict()} < keys | {"0.bias", "9.bias"}
    with torch.no_grad():
        want, got = plain(x()), net(x())
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.features, want.features, rtol=1e-12, atol=1e-12)
    assert (got.features < 0).any()  # the last pair: no ReLU
    assert fuse_conv_bn(net) == 0  # nothing left to fold


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_equals_unfused_low_precision(dtype, device):
    gen = torch.Generator().manual_seed(1)
    net = network(gen).to(device).to(dtype).eval()
    x = inputs(gen, device, dtype)
    plain = copy.deepcopy(net)
    fuse_conv_bn(net)
    with torch.no_grad():
        want, got = plain(x()), net(x())
    tol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    torch.testing.assert_close(got.features.double(), want.features.double(), rtol=tol,
                               atol=tol)


def test_only_foldable_pairs_are_folded(device):
    gen = torch.Generator().manual_seed(2)

    class Shifted(spconv.SubMConv3d):  # a forward of its own: not only conv(x, weight, bias)
        def forward(self, x):
            out = super().forward(x)
            return out.replace_feature(out.features + 1)

    def pair(conv, bn=None):
        bn = bn or torch.nn.BatchNorm1d(4)
        randomize_bn(bn, gen)
        return spconv.SparseSequential(conv, bn).double().eval()

    subm = lambda: spconv.SubMConv3d(5, 4, 3, bias=False)  # noqa: E731
    training = pair(subm())
    training[1].train()
    hooked = pair(subm())
    hooked[1].register_forward_hook(lambda *a: None)
    no_stats = pair(subm(), torch.nn.BatchNorm1d(4, track_running_stats=False))
    other_size = pair(subm(), torch.nn.BatchNorm1d(1))
    class Standardized(spconv.SubMConv3d):  # a conv_weight of its own: not the stored weight
        def conv_weight(self):
            w = super().conv_weight()
            return w / w.norm()

    class Residual(spconv.SparseSequential):  # a forward of its own over its modules
        def forward(self, x):
            return self[1](x.replace_feature(self[0](x).features + 1))

    parametrized = pair(subm())
    torch.nn.utils.parametrize.register_parametrization(parametrized[0], "weight",
                                                        torch.nn.Identity())
    tied = pair(subm())
    holder = torch.nn.Linear(1, 1)
    holder.weight = tied[0].weight  # the same parameter held by another module of the model
    tied.add_module("holder", holder)
    residual = Residual(spconv.SubMConv3d(5, 5, 3, bias=False), torch.nn.BatchNorm1d(5))
    randomize_bn(residual[1], gen)
    overflow = pair(subm()).half()  # fp16: weight / sqrt(1e-9) does not fit
    overflow[1].running_var.fill_(0)
    overflow[1].eps = 1e-12
    before = overflow[0].weight.clone()
    assert fuse_conv_bn(overflow) == 0 and torch.equal(overflow[0].weight, before)
    for net in (training, hooked, no_stats, other_size, pair(Shifted(5, 4, 3, bias=False)),
                pair(Standardized(5, 4, 3, bias=False)), parametrized, tied,
                residual.double().eval()):
        assert fuse_conv_bn(net) == 0 and not isinstance(net[1], FoldedBatchNorm)
    nested = spconv.SparseSequential(pair(subm()), pair(subm(), torch.nn.BatchNorm1d(4)))
    assert fuse_conv_bn(nested) == 2  # both inner pairs; the outer (sequential, sequential) not
    shared = subm()  # one conv in two places, each before its own BatchNorm: folded at neither
    twice = spconv.SparseSequential(pair(shared), pair(shared))
    assert fuse_conv_bn(twice) == 0


def test_autocast_and_2d(device):
    """An fp32 model under autocast; a 2D network; a model made under inference_mode."""
    gen = torch.Generator().manual_seed(5)
    net = network(gen).float().to(device).eval()
    x = inputs(gen, device, torch.float32)
    plain = copy.deepcopy(net)
    fuse_conv_bn(net)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
        want, got = plain(x()), net(x())
    assert got.features.dtype == want.features.dtype == dtype
    tol = 2e-2 if dtype == torch.float16 else 1e-1
    torch.testing.assert_close(got.features.double(), want.features.double(), rtol=tol, atol=tol)

    with torch.inference_mode():
        net2d = spconv.SparseSequential(spconv.SubMConv2d(3, 4, 3, bias=False),
                                        torch.nn.BatchNorm1d(4), torch.nn.ReLU())
        randomize_bn(net2d[1], gen)
        net2d = net2d.double().to(device).eval()
    coords = random_coords(60, (9, 8, 1), 2, generator=gen)[:, :3]
    feats = torch.randn(coords.shape[0], 3, generator=gen, dtype=torch.float64)
    x2 = lambda: spconv.SparseConvTensor(feats.to(device), coords.to(device), (9, 8), 2)  # noqa: E731
    with torch.inference_mode():
        want = net2d(x2()).features.clone()
    assert fuse_conv_bn(net2d) == 1
    with torch.inference_mode():
        got = net2d(x2()).features
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
