"""Eval-mode conv -> BatchNorm -> ReLU blocks in one kernel (ops.conv.BatchNormReLU, applied by
SparseSequential: nn/conv_epilogue.py): the fused block against the three modules run in float64,
for every dtype and both BatchNorm dtypes; which blocks fuse and which run module by module."""
from __future__ import annotations

import collections

import copy
import re

import pytest
import torch

import flexplan.nn.spconv as spconv
import flexplan.ops.conv as conv_ops
from flexplan import launcher
from flexplan.nn import conv_epilogue
from flexplan.ops import BatchNormReLU, sparse_conv
from flexplan.planner import build_plan
from flexplan.geometry import ConvGeometry
from flexplan.workloads import random_coords

SHAPE = (9, 8, 7)
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def randomize_bn(bn, gen):
    c = bn.num_features
    bn.running_mean.copy_(torch.randn(c, generator=gen, dtype=torch.float64))
    bn.running_var.copy_(torch.rand(c, generator=gen, dtype=torch.float64) + 0.5)
    if bn.affine:
        bn.weight.data.copy_(torch.rand(c, generator=gen, dtype=torch.float64) + 0.5)
        bn.bias.data.copy_(torch.randn(c, generator=gen, dtype=torch.float64))


def blocks(gen):
    """post_act_blocks: submanifold, strided, inverse (the U-Net's three kinds)."""
    net = spconv.SparseSequential(
        spconv.SubMConv3d(5, 8, 3, bias=False, indice_key="s1"),
        torch.nn.BatchNorm1d(8, eps=1e-3), torch.nn.ReLU(),
        spconv.SparseConv3d(8, 12, 3, stride=2, padding=1, bias=False, indice_key="d1"),
        spconv.SparseBatchNorm(12), spconv.SparseReLU(),
        spconv.SparseInverseConv3d(12, 6, 3, indice_key="d1", bias=False),
        torch.nn.BatchNorm1d(6), torch.nn.ReLU(inplace=True))
    for m in net:
        if isinstance(m, torch.nn.BatchNorm1d):
            randomize_bn(m, gen)
    return net


def inputs(gen, device, dtype=torch.float64, channels=5, rows=150):
    coords = random_coords(rows, SHAPE, 2, generator=gen)
    feats = torch.randn(coords.shape[0], channels, generator=gen, dtype=torch.float64).to(dtype)
    return lambda: spconv.SparseConvTensor(feats.to(device), coords.to(device), SHAPE, 2)


@pytest.fixture
def fused_launches(monkeypatch):
    """The gather-GEMM launches that carried the BatchNormReLU epilogue: their epilogue codes
    (BN_RELU_EPILOGUE, or BN_RELU_F32_EPILOGUE for float32 norms under 16-bit features)."""
    seen = []
    real = launcher.launch

    def spy(kernel, grid, *args, **constexprs):
        if kernel is conv_ops.conv_gather_gemm_kernel and args[16] in (
                conv_ops.BN_RELU_EPILOGUE, conv_ops.BN_RELU_F32_EPILOGUE):
            assert type(args[15]) is float  # eps: fp32 whatever the BatchNorm holds
            seen.append(args[16])
        return real(kernel, grid, *args, **constexprs)

    monkeypatch.setattr(conv_ops, "launch", spy)
    return seen


def run_unfused(net, x):
    old = conv_epilogue.FUSE_BN_RELU
    conv_epilogue.FUSE_BN_RELU = False
    try:
        with torch.no_grad():
            return net(x())
    finally:
        conv_epilogue.FUSE_BN_RELU = old


def assert_as_the_modules(net, x, error):
    """net(x()) in inference does what its modules one by one do: the same error (of type
    `error`), or the same features."""
    try:
        want = run_unfused(net, x)
    except error as exc:
        with pytest.raises(error, match=re.escape(str(exc)[:20])), torch.no_grad():
            net(x())
    else:
        with torch.no_grad():
            got = net(x())
        torch.testing.assert_close(got.features, want.features, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_fused_blocks_against_float64(dtype, device, fused_launches):
    gen = torch.Generator().manual_seed(0)
    net = blocks(gen).double().to(device).eval()
    x64 = inputs(gen, device)
    want = run_unfused(net, x64)
    assert not fused_launches
    low = copy.deepcopy(net).to(dtype)
    x = lambda: spconv.SparseConvTensor(x64().features.to(dtype), x64().indices, SHAPE, 2)  # noqa: E731
    with torch.no_grad():
        got = low(x())
    # Each block one launch with the epilogue (float64: torch's ops after the conv, the
    # kernel's eps being a float32).
    assert fused_launches == ([] if dtype == torch.float64 else [conv_ops.BN_RELU_EPILOGUE] * 3)
    assert got.features.dtype == dtype and torch.equal(got.indices, want.indices)
    assert (want.features == 0).any() and (want.features > 0).any()  # the ReLU bites
    tol = TOL[dtype]
    torch.testing.assert_close(got.features.double(), want.features, rtol=tol, atol=tol)
    # Not less accurate than the modules one by one in the same dtype (one rounding fewer).
    plain = run_unfused(low, x)
    err = (got.features.double() - want.features).abs().max()
    assert err <= 2 * (plain.features.double() - want.features).abs().max() + 1e-12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_with_float32_batchnorm(dtype, device, fused_launches):
    """An fp32 model under autocast: the conv in the autocast dtype, the BatchNorm's fp32
    tensors read as they are (the kernel's float32 norm variant)."""
    if device.type == "cpu" and dtype == torch.float16:
        pytest.skip("CPU autocast is bf16")
    gen = torch.Generator().manual_seed(1)
    net = blocks(gen).float().to(device).eval()
    x64 = inputs(gen, device)
    want = run_unfused(copy.deepcopy(net).double(), x64)
    x = lambda: spconv.SparseConvTensor(x64().features.float(), x64().indices, SHAPE, 2)  # noqa: E731
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
        got = net(x())
    assert fused_launches == [conv_ops.BN_RELU_F32_EPILOGUE] * 3
    assert got.features.dtype == dtype
    torch.testing.assert_close(got.features.double(), want.features, rtol=TOL[dtype],
                               atol=TOL[dtype])


def test_op_epilogue_and_its_gradients(device, fused_launches):
    """sparse_conv(bn_relu=...): the kernel's epilogue without grad; with grad (through the
    BatchNorm's parameters too) torch ops after the conv, gradients as the modules'."""
    gen = torch.Generator().manual_seed(2)
    coords = random_coords(120, SHAPE, 1, generator=gen).to(device)
    geometry = ConvGeometry.make(3, 1, 1, 0, submanifold=True)
    plan = build_plan(coords, SHAPE, 1, geometry)
    feats = torch.randn(coords.shape[0], 4, generator=gen, dtype=torch.float64).to(device)
    weight = torch.randn(6, 3, 3, 3, 4, generator=gen, dtype=torch.float64).to(device)
    bn = torch.nn.BatchNorm1d(6).double().to(device).eval()
    randomize_bn(bn, gen)
    norm = BatchNormReLU(bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)
    want = torch.relu(bn(sparse_conv(feats, plan, weight)))
    with torch.no_grad():
        got = sparse_conv(feats, plan, weight, bn_relu=norm)
        assert not fused_launches  # float64: torch's epilogue
        norm32 = BatchNormReLU(*(t.float() for t in norm[:4]), norm.eps)
        got32k = sparse_conv(feats.float(), plan, weight.float(), bn_relu=norm32)
    assert len(fused_launches) == 1
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got32k.double(), want.detach(), rtol=1e-5, atol=1e-5)
    # float64 norms over float32 features: what torch's batch norm does with them (an error,
    # or its answer), not the kernel's
    with torch.no_grad():
        plain = sparse_conv(feats.float(), plan, weight.float())
        try:
            expected = torch.relu(torch.nn.functional.batch_norm(
                plain, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps))
        except RuntimeError as exc:
            with pytest.raises(RuntimeError, match=re.escape(str(exc)[:20])):
                sparse_conv(feats.float(), plan, weight.float(), bn_relu=norm)
        else:
            torch.testing.assert_close(
                sparse_conv(feats.float(), plan, weight.float(), bn_relu=norm), expected)
    assert len(fused_launches) == 1
    # gather_gemm itself (the tuner's entry) judges the epilogue it is given: with a conv bias
    # torch's ops after the kernel, as the op does
    with torch.no_grad():
        f32, w32 = feats.float(), weight.float().reshape(6, 27, 4)
        bias = torch.randn(6, generator=gen).to(device)
        biased = conv_ops.gather_gemm(f32, w32, bias, plan.fwd, False, "fwd", "masked", False)
        got_b = conv_ops.gather_gemm(f32, w32, bias, plan.fwd, False, "fwd", "masked", False,
                                     norm32)
    torch.testing.assert_close(got_b, conv_ops.bn_relu_torch(biased, norm32))
    assert len(fused_launches) == 1

    f, w = feats.clone().requires_grad_(), weight.clone().requires_grad_()
    out = sparse_conv(f, plan, w, bn_relu=norm)
    f2, w2 = feats.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = torch.relu(bn(sparse_conv(f2, plan, w2)))
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
    grads = torch.autograd.grad(out, (f, w, bn.weight, bn.bias), g)
    ref_grads = torch.autograd.grad(ref, (f2, w2, bn.weight, bn.bias), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="bn_relu.mean"):
        sparse_conv(feats, plan, weight, bn_relu=norm._replace(mean=bn.running_mean[:3]))
    with pytest.raises(TypeError, match="BatchNormReLU"):
        sparse_conv(feats, plan, weight, bn_relu=bn)


def test_blocks_that_do_not_fuse(device, fused_launches):
    """Each block below runs module by module (and gives what the modules give)."""
    gen = torch.Generator().manual_seed(3)

    class Shifted(spconv.SubMConv3d):  # a forward of its own
        def forward(self, x, **kwargs):
            out = super().forward(x, **kwargs)
            return out.replace_feature(out.features + 1)

    class MyNorm(torch.nn.BatchNorm1d):  # a subclass may compute something else
        pass

    def block(conv=None, bn=None, act=None):
        bn = bn if bn is not None else torch.nn.BatchNorm1d(4)
        if bn.running_mean is not None:
            randomize_bn(bn, gen)
        conv = conv if conv is not None else spconv.SubMConv3d(5, 4, 3, bias=False)
        return spconv.SparseSequential(conv, bn, act or torch.nn.ReLU()).double().to(device).eval()

    training = block()
    training[1].train()
    no_bias = block()
    no_bias[1].bias = None  # (BatchNorm1d(bias=False) in newer torch)
    relu_of_its_own = block()
    relu_of_its_own[2].forward = lambda t: torch.nn.functional.leaky_relu(t, 0.5)
    hooked_conv, hooked_bn, hooked_relu = block(), block(), block()
    hooked_conv[0].register_forward_hook(lambda *a: None)
    hooked_bn[1].register_forward_hook(lambda *a: None)
    hooked_relu[2].register_forward_pre_hook(lambda *a: None)
    nets = [training, no_bias, relu_of_its_own, hooked_conv, hooked_bn, hooked_relu,
            block(spconv.SubMConv3d(5, 4, 3, bias=True)),  # a bias (no variant: not fused)
            block(bn=torch.nn.BatchNorm1d(4, affine=False)),
            block(bn=torch.nn.BatchNorm1d(4, track_running_stats=False)),
            block(bn=MyNorm(4)), block(act=torch.nn.LeakyReLU()),
            block(Shifted(5, 4, 3, bias=False)),
            block(spconv.SparseConv3d(5, 4, 3, bias=False, act_type="ReLU"))]
    x = inputs(gen, device, rows=40)  # (thirteen networks: small ones)
    for i, net in enumerate(nets):
        want = run_unfused(net, x)
        with torch.no_grad():
            got = net(x())
        torch.testing.assert_close(got.features, want.features, rtol=1e-12, atol=1e-12,
                                   msg=str(i))  # (the second sighting: scheduled)
    assert not fused_launches
    # Grad mode on (eval): nothing fuses either (float32: the kernel's epilogue otherwise).
    net = block().float()
    x32 = lambda: spconv.SparseConvTensor(x().features.float(), x().indices, SHAPE, 2)  # noqa: E731
    with torch.enable_grad():
        net(x32())
    assert not fused_launches
    with torch.no_grad():
        net(x32())
    assert len(fused_launches) == 1


def test_the_shipped_bundles_hold_the_fused_variants():
    """The AOT variants of a forward gather-GEMM serve the epilogue: one binary per config for
    no epilogue, a bias and the BatchNormReLU in either dtype (run-time arguments, never
    specialized: the epilogue and the BatchNorm tensors' addresses); every recorded launch
    passes a float eps the launcher can key."""
    from flexplan.aot import variants

    kernel = conv_ops.conv_gather_gemm_kernel
    key = launcher._call_key(kernel, 0, (torch.empty(4), 1e-3, 7), {})
    assert key is not None and 16 in key
    spec = launcher.arg_specialization(kernel)
    names = [p.name for p in launcher.jit_function(kernel).params]
    run_time = ("bn_mean_addr", "bn_var_addr", "bn_weight_addr", "bn_bias_addr", "epilogue")
    assert [names.index(name) for name in run_time] == [11, 12, 13, 14, 16]
    assert all(spec[names.index(name)] == launcher.NOT_SPECIALIZED for name in run_time)
    every = variants.conv_variants("sm_90", channels=(16, 32))
    forward = [v for v in every if v.kernel == variants.GATHER_GEMM
               and not dict(v.constexprs)["REVERSE_V"]]
    assert {v.args[0][1] for v in forward} >= {"float16", "bfloat16", "float32"}
    # one binary per forward config and dtype: nothing but the config tells two apart
    configs = collections.Counter((v.args[0][1], v.args[17:21], v.constexprs) for v in forward)
    assert max(configs.values()) == 1
    assert all(v.args[15] == ("float", 0.0) for v in forward)
    assert not any("HAS_BIAS" in dict(v.constexprs) or "BN_RELU" in dict(v.constexprs)
                   for v in forward)


def test_nan_and_odd_numbers_as_the_modules_give_them(device, fused_launches):
    """NaN features stay NaN through the fused ReLU (as torch.relu keeps them); an int eps
    reaches the kernel as a float; a BatchNorm of another dtype than the features raises
    (or not) as the modules do."""
    gen = torch.Generator().manual_seed(4)
    net = blocks(gen).float().to(device).eval()
    net[1].eps = 1  # (an int)
    x64 = inputs(gen, device)
    feats = x64().features.float()
    feats[::7] = float("nan")
    x = lambda: spconv.SparseConvTensor(feats, x64().indices, SHAPE, 2)  # noqa: E731
    want = run_unfused(net, x)
    with torch.no_grad():
        got = net(x())
    assert len(fused_launches) == 3
    assert torch.equal(got.features.isnan(), want.features.isnan()) and got.features.isnan().any()
    ok = ~want.features.isnan()
    torch.testing.assert_close(got.features[ok], want.features[ok], rtol=1e-5, atol=1e-5)
    odd = blocks(gen).to(device).eval()  # float32 features, a float64 BatchNorm
    odd[1].double()
    x32 = lambda: spconv.SparseConvTensor(x64().features.float(), x64().indices, SHAPE, 2)  # noqa: E731
    assert_as_the_modules(odd, x32, RuntimeError)


def test_a_batchnorm_of_eps_zero_runs_as_torch_judges_it(device, fused_launches):
    """eps 0: some torch versions refuse it, others compute: the block runs module by module,
    so whatever torch does is what the user gets."""
    gen = torch.Generator().manual_seed(6)
    net = blocks(gen).float().to(device).eval()
    net[1].eps = 0.0
    x64 = inputs(gen, device)
    x = lambda: spconv.SparseConvTensor(x64().features.float(), x64().indices, SHAPE, 2)  # noqa: E731
    assert_as_the_modules(net, x, ValueError)
    assert len(fused_launches) <= 2  # (the first block did not fuse)
