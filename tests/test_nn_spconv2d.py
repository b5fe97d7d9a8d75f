"""spconv's 2D layers ([N, 3] indices, [Co, K0, K1, Ci] weights) against float64 dense torch
references (conv2d / conv_transpose2d on the zero-filled grid), forward and gradients, and the
2D tensor's API."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flexplan.nn.spconv as spconv
from flexplan.workloads import random_coords

SHAPE2 = (11, 9)


def coords2d(n, seed, batch=2):
    """[N, 3] int32 unique (batch, d0, d1)."""
    c = random_coords(n, (*SHAPE2, 1), batch, generator=torch.Generator().manual_seed(seed))
    return c[:, :3].contiguous()


def dense_of(feats, idx, shape, batch):
    out = torch.zeros(batch, feats.shape[1], *shape, dtype=feats.dtype)
    b, y, x = idx.long().unbind(1)
    out[b, :, y, x] = feats
    return out


def at(dense, idx):
    b, y, x = idx.long().unbind(1)
    return dense[b, :, y, x]


def _run(layer, feats, idx, batch=2):
    x = spconv.SparseConvTensor(feats.clone().requires_grad_(), idx, SHAPE2, batch)
    out = layer(x)
    return x, out


@pytest.mark.parametrize("kind", ["subm", "strided", "transposed"])
def test_2d_convs_match_dense(kind, device):
    gen = torch.Generator().manual_seed(3)
    idx = coords2d(60, 1)
    feats = torch.randn(idx.shape[0], 3, dtype=torch.float64, generator=gen)
    if kind == "subm":
        layer = spconv.SubMConv2d(3, 4, 3, indice_key="s")
    elif kind == "strided":
        layer = spconv.SparseConv2d(3, 4, 3, 2, 1)
    else:
        layer = spconv.SparseConvTranspose2d(3, 4, 3, 2, 1)
    layer = layer.double()
    assert layer.weight.shape == (4, 3, 3, 3)  # spconv's 2D layout [Co, K0, K1, Ci]
    x, out = _run(layer.to(device), feats.to(device), idx.to(device))
    assert out.indices.shape[1] == 3 and len(out.spatial_shape) == 2 and out.ndim == 2
    w = layer.weight.detach().cpu()
    dense_in = dense_of(feats, idx, SHAPE2, 2).requires_grad_()
    if kind == "transposed":
        ref = F.conv_transpose2d(dense_in, w.permute(3, 0, 1, 2), layer.bias.detach().cpu(), 2, 1)
    else:
        ref = F.conv2d(dense_in, w.permute(0, 3, 1, 2), layer.bias.detach().cpu(),
                       1 if kind == "subm" else 2, 1)
    out_idx = out.indices.cpu()
    assert tuple(ref.shape[2:]) == tuple(out.spatial_shape)
    want = at(ref, out_idx)
    torch.testing.assert_close(out.features.detach().cpu(), want)
    if kind == "subm":
        assert torch.equal(out_idx, idx)
    elif kind == "strided":  # outputs: the sites whose window holds an input
        hit = F.conv2d(dense_of(torch.ones(idx.shape[0], 1, dtype=torch.float64), idx, SHAPE2, 2),
                       torch.ones(1, 1, 3, 3, dtype=torch.float64), None, 2, 1)
        assert out_idx.shape[0] == int((hit > 0).sum())
    grad = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    out.features.backward(grad.to(device))
    dense_grad = torch.zeros_like(ref)
    b, y, z = out_idx.long().unbind(1)
    dense_grad[b, :, y, z] = grad
    ref.backward(dense_grad)
    torch.testing.assert_close(x.features.grad.cpu(), at(dense_in.grad, idx))
    w_ref = torch.autograd.grad(
        (F.conv_transpose2d(dense_in.detach(), (wr := w.clone().requires_grad_()).permute(3, 0, 1, 2),
                            None, 2, 1) if kind == "transposed" else
         F.conv2d(dense_in.detach(), (wr := w.clone().requires_grad_()).permute(0, 3, 1, 2), None,
                  1 if kind == "subm" else 2, 1)).mul(dense_grad).sum(), wr)[0]
    torch.testing.assert_close(layer.weight.grad.cpu(), w_ref)


def test_2d_inverse_pools_and_tensor_api(device):
    idx = coords2d(70, 2).to(device)
    feats = torch.randn(idx.shape[0], 4, dtype=torch.float64, device=device)
    x = spconv.SparseConvTensor(feats, idx, SHAPE2, 2)
    assert x.indices.shape == idx.shape and x.spatial_shape == SHAPE2 and x.spatial_size == 99
    dense = x.dense()
    assert dense.shape == (2, 4, *SHAPE2) and x.dense(channels_first=False).shape == (2, *SHAPE2, 4)
    back = spconv.SparseConvTensor.from_dense(x.dense(channels_first=False))
    assert back.ndim == 2 and back.num_voxels == x.num_voxels
    net = spconv.SparseSequential(spconv.SparseConv2d(4, 8, 3, 2, 1, indice_key="d"),
                                  spconv.SparseInverseConv2d(8, 4, 3, indice_key="d")).double().to(device)
    y = net(x)
    assert torch.equal(y.indices, idx) and y.spatial_shape == SHAPE2
    pooled = spconv.SparseMaxPool2d(2)(x)  # stride = kernel
    lifted = spconv.SparseConvTensor(feats, torch.nn.functional.pad(idx, (0, 1)), (*SHAPE2, 1), 2)
    ref = spconv.SparseMaxPool3d((2, 2, 1))(lifted)
    torch.testing.assert_close(pooled.features, ref.features)
    assert torch.equal(pooled.indices, ref.indices[:, :3])
    avg = spconv.SparseAvgPool2d(3, 2, 1)(x)
    assert avg.ndim == 2 and avg.features.shape[1] == 4
    with pytest.raises(ValueError, match="2D layer"):
        spconv.SubMConv2d(4, 4, 3).double().to(device)(lifted)
    with pytest.raises(ValueError, match="3D layer"):
        spconv.SubMConv3d(4, 4, 3).double().to(device)(x)
    with pytest.raises(ValueError, match="2 entries"):
        spconv.SparseConv2d(4, 4, (3, 3, 3))


def test_2d_weights_load_from_spconv_native_layout():
    conv = spconv.SubMConv2d(3, 5, 3)
    native = torch.randn(3, 3, 5, 3)  # spconv Native: [K0, K1, Co, Ci]
    conv.load_state_dict({"weight": native, "bias": torch.zeros(5)})
    assert torch.equal(conv.weight.detach(), native.permute(2, 0, 1, 3))


@pytest.mark.parametrize("kind", ["subm", "strided"])
def test_1d_convs_match_dense(kind, device):
    gen = torch.Generator().manual_seed(4)
    length = 23
    idx = random_coords(30, (length, 1, 1), 2, generator=gen)[:, :2].contiguous()
    feats = torch.randn(idx.shape[0], 3, dtype=torch.float64, generator=gen)
    layer = (spconv.SubMConv1d(3, 4, 3) if kind == "subm" else spconv.SparseConv1d(3, 4, 3, 2, 1))
    layer = layer.double()
    assert layer.weight.shape == (4, 3, 3)  # spconv's 1D layout [Co, K0, Ci]
    x = spconv.SparseConvTensor(feats.to(device), idx.to(device), (length,), 2)
    out = layer.to(device)(x)
    assert out.ndim == 1 and out.indices.shape[1] == 2 and len(out.spatial_shape) == 1
    dense = torch.zeros(2, 3, length, dtype=torch.float64)
    dense[idx[:, 0].long(), :, idx[:, 1].long()] = feats
    ref = F.conv1d(dense, layer.weight.detach().cpu().permute(0, 2, 1), layer.bias.detach().cpu(),
                   1 if kind == "subm" else 2, 1)
    o = out.indices.cpu().long()
    torch.testing.assert_close(out.features.detach().cpu(), ref[o[:, 0], :, o[:, 1]])
    assert out.dense().shape == (2, 4, ref.shape[2])
    pooled = spconv.SparseMaxPool1d(2)(x)
    assert pooled.ndim == 1 and pooled.spatial_shape == ((length - 2) // 2 + 1,)
