"""torch.autocast: convolutions cast their inputs to the autocast dtype like torch's own
convolutions, against a float64 reference, gradients flowing to fp32 master weights in fp32.
On the CPU autocast is enabled for device type "cpu" (the op follows its inputs' device)."""
from __future__ import annotations

import pytest
import torch

import flexplan.nn.spconv as spconv
from flexplan.workloads import random_coords

SHAPE = (8, 7, 6)
TOL = {torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _net(device):
    torch.manual_seed(0)
    return spconv.SparseSequential(
        spconv.SubMConv3d(3, 8, 3, indice_key="a"),
        torch.nn.BatchNorm1d(8),
        spconv.SparseConv3d(8, 8, 3, 2, 1, indice_key="d"),
        spconv.SparseInverseConv3d(8, 4, 3, indice_key="d"),
    ).to(device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_autocast_forward_backward_against_float64(dtype, device):
    coords = random_coords(80, SHAPE, 2, generator=torch.Generator().manual_seed(1)).to(device)
    feats = torch.randn(coords.shape[0], 3, generator=torch.Generator().manual_seed(2)).to(device)
    net = _net(device)
    ref = _net(device).double()
    ref.load_state_dict(net.state_dict())
    x = feats.clone().requires_grad_(True)
    with torch.autocast(device.type, dtype=dtype):
        out = net(spconv.SparseConvTensor(x, coords, SHAPE, 2))
        assert out.features.dtype == dtype
    x64 = feats.double().requires_grad_(True)
    out64 = ref(spconv.SparseConvTensor(x64, coords, SHAPE, 2))
    assert torch.equal(out.indices, out64.indices)
    assert _rel(out.features, out64.features) < TOL[dtype]
    grad = torch.randn(out64.features.shape, generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64).to(device)
    out.features.backward(grad.to(dtype))
    out64.features.backward(grad)
    assert x.grad.dtype == torch.float32
    assert _rel(x.grad, x64.grad) < TOL[dtype]
    for (name, p), p64 in zip(net.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name  # master weights
        if p.dim() == 5:  # conv weights (biases feeding BatchNorm have ~zero true gradients)
            assert _rel(p.grad, p64.grad) < TOL[dtype], name


def test_mixed_dtypes_outside_autocast_are_an_error(device):
    coords = random_coords(40, SHAPE, 1, generator=torch.Generator().manual_seed(4)).to(device)
    conv = spconv.SubMConv3d(3, 4, 3).to(device)  # fp32 weights
    x = spconv.SparseConvTensor(torch.randn(coords.shape[0], 3, device=device).half(), coords,
                                SHAPE, 1)
    with pytest.raises(TypeError, match="autocast"):
        conv(x)


def test_float64_is_left_alone_under_autocast(device):
    coords = random_coords(40, SHAPE, 1, generator=torch.Generator().manual_seed(5)).to(device)
    conv = spconv.SubMConv3d(3, 4, 3).to(device).double()
    x = spconv.SparseConvTensor(torch.randn(coords.shape[0], 3, device=device).double(), coords,
                                SHAPE, 1)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        assert conv(x).features.dtype == torch.float64


def test_autocast_state_restored_and_no_cast_nodes(device):
    """The op turns autocast off for its own torch ops and back on, also when it raises; the
    weight reaches the op uncast (the cast is inside it: no cast node between them)."""
    coords = random_coords(40, SHAPE, 1, generator=torch.Generator().manual_seed(6)).to(device)
    conv = spconv.SubMConv3d(3, 4, 3).to(device)
    x = spconv.SparseConvTensor(torch.randn(coords.shape[0], 3, device=device), coords, SHAPE, 1)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = conv(x)
        assert torch.is_autocast_enabled(device.type)
        bad = spconv.SubMConv3d(5, 4, 3).to(device)  # channel mismatch: raises inside the op
        with pytest.raises(ValueError, match="channels"):
            bad(x)
        assert torch.is_autocast_enabled(device.type)
    assert not torch.is_autocast_enabled(device.type)
    seen, todo = set(), [out.features.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    names = {type(f).__name__ for f in seen}
    assert not any("ToCopy" in n for n in names), names
    out.features.float().sum().backward()
    assert conv.weight.grad.dtype == torch.float32 and conv.bias.grad.dtype == torch.float32
