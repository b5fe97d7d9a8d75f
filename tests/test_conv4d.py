"""spconv's 4D layers ([N, 5] indices, [Co, K0, K1, K2, K3, Ci] weights) against float64 dense
references: a 4D convolution is a sum over its time taps k0 of 3D convolutions (torch's conv3d /
conv_transpose3d) of the time slices those taps read. Forward, input and weight gradients;
output coordinates against the dense grid's hits. Small sizes: the CPU suite runs the kernels in
Triton's interpreter, whose cost grows with the kernel volume (3^4 = 81 taps)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flexplan.nn.spconv as spconv
from flexplan.nn.sparse_conv_tensor import SparseTensorError

SHAPE4 = (3, 5, 4, 5)  # odd sizes
BATCH = 3              # entry 1 left empty


def coords4d(n, seed, shape=SHAPE4, batch=BATCH):
    """[<=n, 5] int32 unique (batch, d0, d1, d2, d3), none in batch entry 1."""
    gen = torch.Generator().manual_seed(seed)
    cells = torch.randperm(batch * shape[0] * shape[1] * shape[2] * shape[3], generator=gen)[:n]
    rows = []
    for size in reversed(shape):
        rows.append(cells % size)
        cells = cells // size
    idx = torch.stack([cells, *rows[::-1]], dim=1)
    return idx[idx[:, 0] != 1].to(torch.int32).contiguous()


def _put(out, idx, feats):
    """out with feats written at the idx sites (a copy)."""
    b, *sites = idx.long().unbind(1)
    out = out.clone()
    out[(b, slice(None), *sites)] = feats
    return out


def dense_of(feats, idx, shape=SHAPE4, batch=BATCH):
    """[B, C, D0, D1, D2, D3], zeros off the sites."""
    return _put(feats.new_zeros((batch, feats.shape[1], *shape)), idx, feats)


def at(dense, idx):
    b, *sites = idx.long().unbind(1)
    return dense[(b, slice(None), *sites)]


def conv4d(x, w, stride, padding, dilation):
    """torch's conv4d, were there one: x [B, Ci, T, D1, D2, D3], w spconv's [Co, K0..K3, Ci]."""
    s0, p0, d0, k0s = stride[0], padding[0], dilation[0], w.shape[1]
    xp = F.pad(x, (0, 0, 0, 0, 0, 0, p0, p0))
    t_out = (x.shape[2] + 2 * p0 - d0 * (k0s - 1) - 1) // s0 + 1
    out = 0
    for k0 in range(k0s):
        slab = xp[:, :, k0 * d0:k0 * d0 + (t_out - 1) * s0 + 1:s0]       # [B, Ci, To, ...]
        b, ci, to = slab.shape[:3]
        y = F.conv3d(slab.transpose(1, 2).reshape(b * to, ci, *slab.shape[3:]),
                     w[:, k0].permute(0, 4, 1, 2, 3), None, stride[1:], padding[1:], dilation[1:])
        out = out + y.reshape(b, to, *y.shape[1:]).transpose(1, 2)
    return out


def conv_transpose4d(x, w, stride, padding, dilation, size):
    """torch's conv_transpose4d with output grid `size`: output o = i * s - p + k * d, sites
    past the uncropped grid read nothing."""
    s0, d0, k0s = stride[0], dilation[0], w.shape[1]
    b, ci, t = x.shape[:3]
    full = None
    for k0 in range(k0s):
        y = F.conv_transpose3d(x.transpose(1, 2).reshape(b * t, ci, *x.shape[3:]),
                               w[:, k0].permute(4, 0, 1, 2, 3), None, stride[1:], 0, 0, 1,
                               dilation[1:])
        y = y.reshape(b, t, *y.shape[1:]).transpose(1, 2)                 # [B, Co, T, F...]
        if full is None:
            full = y.new_zeros((b, y.shape[1], (t - 1) * s0 + d0 * (k0s - 1) + 1, *y.shape[3:]))
        full = full.index_add(2, torch.arange(t) * s0 + k0 * d0, y)
    # crop p on the low side, pad with zeros past the high side, to `size`
    pads = []
    for axis in reversed(range(4)):
        n, p = full.shape[2 + axis], padding[axis]
        pads += [-p, size[axis] + p - n]
    return F.pad(full, pads)


def _layer_out(layer, feats, idx, device, shape=SHAPE4):
    """(input tensor, layer output) on device (the kernels: the GPU's, else the interpreter's)."""
    x = spconv.SparseConvTensor(feats.to(device).requires_grad_(), idx.to(device), shape, BATCH)
    return x, layer.to(device)(x)


def _check_grads(x, out, ref, dense_in, weights, gen):
    """Backprop one random output gradient through the layer and the dense reference; compare
    the input gradient at the input sites and each weight's gradient."""
    grad = torch.randn(out.features.shape, dtype=torch.float64, generator=gen)
    out.features.backward(grad.to(out.features.device))
    ref_grads = torch.autograd.grad(ref, [dense_in, *(r for _, r in weights)],
                                    _put(torch.zeros_like(ref), out.indices.cpu(), grad))
    torch.testing.assert_close(x.features.grad.cpu(), at(ref_grads[0], x.indices.cpu()))
    for (param, _), want in zip(weights, ref_grads[1:]):
        torch.testing.assert_close(param.grad.cpu(), want)


def test_subm_4d_matches_dense_and_shares_by_key(device):
    gen = torch.Generator().manual_seed(0)
    idx = coords4d(70, 1)
    feats = torch.randn(idx.shape[0], 2, dtype=torch.float64, generator=gen)
    layer = spconv.SubMConv4d(2, 4, 3, indice_key="s", algo="masked").double()
    assert layer.weight.shape == (4, 3, 3, 3, 3, 2)  # spconv's [Co, K0, K1, K2, K3, Ci]
    x, out = _layer_out(layer, feats, idx, device)
    assert out.indices is x.indices and out.spatial_shape == SHAPE4 and out.ndim == 4
    dense_in = dense_of(feats, idx).requires_grad_()
    w = layer.weight.detach().cpu().requires_grad_()
    b = layer.bias.detach().cpu().requires_grad_()
    ref = conv4d(dense_in, w, (1,) * 4, (1,) * 4, (1,) * 4) + b[:, None, None, None, None]
    torch.testing.assert_close(out.features.cpu(), at(ref, idx))
    _check_grads(x, out, ref, dense_in, [(layer.weight, w), (layer.bias, b)], gen)
    # indice_key: recorded as spconv does; a second layer of the key shares the plan
    data = out.find_indice_pair("s")
    assert data.is_subm and data.indices is x.indices
    with torch.no_grad():
        out2 = spconv.SubMConv4d(4, 2, 3, indice_key="s", algo="masked").double().to(device)(out)
    assert out2.indice_dict["s"] is data and out2.coords is x.coords
    with pytest.raises(ValueError, match="submanifold"):
        spconv.SparseInverseConv4d(2, 3, 3, indice_key="s").to(device)(out2)


def test_strided_then_inverse_4d_match_dense(device):
    """SparseConv4d (stride, padding, odd kernel per axis) then SparseInverseConv4d on its key:
    the inverse lands on the input coords in their order; both layers' gradients."""
    gen = torch.Generator().manual_seed(2)
    idx = coords4d(60, 3)
    feats = torch.randn(idx.shape[0], 3, dtype=torch.float64, generator=gen)
    kernel, stride, padding, dilation = (3, 2, 1, 2), (2, 1, 2, 2), (1, 0, 0, 1), (1, 2, 1, 1)
    down = spconv.SparseConv4d(3, 4, kernel, stride, padding, dilation, indice_key="d",
                               algo="masked").double()
    up = spconv.SparseInverseConv4d(4, 3, kernel, indice_key="d", algo="masked").double()
    assert down.weight.shape == (4, *kernel, 3)
    x, mid = _layer_out(down, feats, idx, device)
    out = up.to(device)(mid)
    # Output grid and coords: spconv's rules, the sites whose window holds an input
    dense_in = dense_of(feats, idx).requires_grad_()
    hits = conv4d(dense_of(torch.ones(idx.shape[0], 1, dtype=torch.float64), idx),
                  torch.ones(1, *kernel, 1, dtype=torch.float64), stride, padding, dilation)
    assert tuple(hits.shape[2:]) == mid.spatial_shape == tuple(
        spconv.ops.get_conv_output_size(SHAPE4, kernel, stride, padding, dilation))
    b, *sites = (hits[:, 0] > 0).nonzero().unbind(1)
    assert torch.equal(mid.indices.cpu(), torch.stack([b, *sites], 1).to(torch.int32))  # sorted
    assert torch.equal(out.indices.cpu(), idx) and out.spatial_shape == SHAPE4
    w1, b1, w2, b2 = (p.detach().cpu().requires_grad_() for p in
                      (down.weight, down.bias, up.weight, up.bias))
    ref_mid = conv4d(dense_in, w1, stride, padding, dilation) + b1[:, None, None, None, None]
    torch.testing.assert_close(mid.features.cpu(), at(ref_mid, mid.indices.cpu()))
    mid_sparse = ref_mid * (hits > 0)  # the inverse conv reads the active sites only
    ref = conv_transpose4d(mid_sparse, w2, stride, padding, dilation, SHAPE4) + \
        b2[:, None, None, None, None]
    torch.testing.assert_close(out.features.cpu(), at(ref, idx))
    _check_grads(x, out, ref, dense_in, [(down.weight, w1), (down.bias, b1), (up.weight, w2),
                                         (up.bias, b2)], gen)


def test_transposed_4d_matches_dense(device):
    gen = torch.Generator().manual_seed(4)
    shape = (2, 3, 3, 2)
    idx = coords4d(14, 5, shape)
    feats = torch.randn(idx.shape[0], 3, dtype=torch.float64, generator=gen)
    kernel, stride, padding = (2, 1, 3, 2), (2, 1, 2, 1), (0, 0, 1, 1)
    layer = spconv.SparseConvTranspose4d(3, 2, kernel, stride, padding, algo="masked").double()
    x, out = _layer_out(layer, feats, idx, device, shape)
    out_shape = tuple((n - 1) * s - 2 * p + k for n, s, p, k in zip(shape, stride, padding, kernel))
    assert out.spatial_shape == out_shape
    dense_in = dense_of(feats, idx, shape).requires_grad_()
    hits = conv_transpose4d(dense_of(torch.ones(idx.shape[0], 1, dtype=torch.float64), idx, shape),
                            torch.ones(1, *kernel, 1, dtype=torch.float64), stride, padding,
                            (1,) * 4, out_shape)
    b, *sites = (hits[:, 0] > 0).nonzero().unbind(1)
    assert torch.equal(out.indices.cpu(), torch.stack([b, *sites], 1).to(torch.int32))
    w = layer.weight.detach().cpu().requires_grad_()
    ref = conv_transpose4d(dense_in, w, stride, padding, (1,) * 4, out_shape) + \
        layer.bias.detach().cpu()[:, None, None, None, None]
    torch.testing.assert_close(out.features.cpu(), at(ref, out.indices.cpu()))
    _check_grads(x, out, ref, dense_in, [(layer.weight, w)], gen)


def test_pools_4d_match_dense(device):
    """SparseMaxPool4d (spconv's max: floored at 0) and SparseAvgPool4d (over the voxels
    present): dense max / sum over each time tap's 3D windows; the avg's input gradient."""
    gen = torch.Generator().manual_seed(6)
    idx = coords4d(60, 7)
    feats = torch.randn(idx.shape[0], 2, dtype=torch.float64, generator=gen)
    leaf = feats.to(device).requires_grad_()
    x = spconv.SparseConvTensor(leaf, idx.to(device), SHAPE4, BATCH)
    with torch.no_grad():  # inference plans: the inverse conv makes its map from the pool's
        mx = spconv.SparseMaxPool4d(2, indice_key="p")(x)
        back = spconv.SparseInverseConv4d(2, 1, 2, indice_key="p").double().to(device)(mx)
    assert torch.equal(back.indices.cpu(), idx)  # a pool's key inverts like a conv's
    dense = dense_of(feats, idx)
    # kernel 2, stride 2: one time window (t 0..1), 2^3 spatial windows; zero-filled absent
    # sites make the dense max max(0, window max) where a site is absent, and relu does elsewhere
    windows = dense[:, :, :2].unfold(3, 2, 2).unfold(4, 2, 2).unfold(5, 2, 2)
    ref = windows.amax(dim=(2, -3, -2, -1)).unsqueeze(2).relu()        # [B, C, 1, 2, 2, 2]
    assert mx.spatial_shape == (1, 2, 2, 2)
    torch.testing.assert_close(mx.features.cpu(), at(ref, mx.indices.cpu()))
    kernel, stride, padding = (3, 1, 3, 1), (2, 1, 2, 1), (1, 0, 1, 0)
    avg = spconv.SparseAvgPool4d(kernel, stride, padding)(x)
    eye = torch.eye(2, dtype=torch.float64).reshape(2, 1, 1, 1, 1, 2).expand(2, *kernel, 2)
    dense_in = dense.clone().requires_grad_()
    count = conv4d(dense_of(torch.ones(idx.shape[0], 1, dtype=torch.float64), idx),
                   torch.ones(1, *kernel, 1, dtype=torch.float64), stride, padding, (1,) * 4)
    ref = conv4d(dense_in, eye, stride, padding, (1,) * 4) / count.clamp(min=1)
    assert torch.equal((count[:, 0] > 0).nonzero().to(torch.int32), avg.indices.cpu())
    torch.testing.assert_close(avg.features.cpu(), at(ref, avg.indices.cpu()))
    grad = torch.randn(avg.features.shape, dtype=torch.float64, generator=gen)
    avg.features.backward(grad.to(device))
    (want,) = torch.autograd.grad(ref, dense_in, _put(torch.zeros_like(ref), avg.indices.cpu(), grad))
    torch.testing.assert_close(leaf.grad.cpu(), at(want, idx))


def test_4d_tensor_api_and_checks():
    idx = coords4d(30, 8)
    feats = torch.randn(idx.shape[0], 2)
    x = spconv.SparseConvTensor(feats, idx, SHAPE4, BATCH)
    assert x.ndim == 4 and x.indices is idx and x.spatial_shape == SHAPE4
    assert x.dense().shape == (BATCH, 2, *SHAPE4)
    assert torch.equal(at(x.dense(), idx), feats)
    back = spconv.SparseConvTensor.from_dense(x.dense(channels_first=False))
    assert back.ndim == 4 and torch.equal(back.dense(), x.dense())
    bad = idx.clone()
    bad[0, 1] = SHAPE4[0]  # t past the grid: would fold into the next batch entry
    with pytest.raises(SparseTensorError, match="outside"):
        spconv.SparseConvTensor(feats, bad, SHAPE4, BATCH)
    with pytest.raises(SparseTensorError, match="duplicate"):
        spconv.SparseConvTensor(feats[:2], idx[[0, 0]], SHAPE4, BATCH)
    with pytest.raises(SparseTensorError, match="4 entries"):
        spconv.SparseConvTensor(feats, idx, SHAPE4[:3], BATCH)
    # 3D layers refuse 4D tensors and the reverse; 4D constructor checks
    with pytest.raises(ValueError, match="4D tensor"):
        spconv.SubMConv3d(2, 2, 3)(x)
    x3 = spconv.SparseConvTensor(feats, idx[:, [0, 2, 3, 4]].contiguous(), SHAPE4[1:], BATCH,
                                 check=False)
    with pytest.raises(ValueError, match="4D layer"):
        spconv.SubMConv4d(2, 2, 3)(x3)
    with pytest.raises(ValueError, match="stride 1"):
        spconv.SubMConv4d(2, 2, 3, stride=2)
    with pytest.raises(ValueError, match="4 entries"):
        spconv.SparseConv4d(2, 2, (3, 3, 3))
    with pytest.raises(NotImplementedError):
        spconv.SparseConv4d(2, 2, 3, groups=2)
    # sparse_add over two 4D coordinate sets: their union, shared sites summed
    idx2 = coords4d(10, 9)
    other = spconv.SparseConvTensor(torch.randn(idx2.shape[0], 2), idx2, SHAPE4, BATCH)
    total = spconv.functional.sparse_add(x, other)
    assert total.ndim == 4
    torch.testing.assert_close(total.dense(), x.dense() + other.dense())
    # spconv's Native-algorithm layout [K0, K1, K2, K3, Co, Ci] loads permuted
    layer = spconv.SparseConv4d(2, 3, (1, 2, 3, 1))
    native = torch.randn(1, 2, 3, 1, 3, 2)
    layer.load_state_dict({"weight": native, "bias": torch.zeros(3)})
    assert torch.equal(layer.weight.detach(), native.permute(4, 0, 1, 2, 3, 5))
    assert isinstance(layer, spconv.SparseConvolution)
