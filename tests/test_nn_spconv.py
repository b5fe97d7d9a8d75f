"""spconv-compatible layers against float64 dense conv3d / conv_transpose3d, gradients included;
indice_key / inverse semantics; spconv-layout state_dicts; SparseConvTensor and SparseSequential."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_strided import active_sites, dense_conv, make_case, read_back, to_dense

import flexplan.nn.spconv as spconv
from flexplan import ConvGeometry, SparseTensorError
from flexplan.planner.generative import output_spatial_shape

F64 = dict(dtype=torch.float64)
TOL = dict(rtol=1e-10, atol=1e-10)


def sparse_input(shape, batch_size=2, channels=3, seed=0, density=0.2):
    coords, _ = make_case(shape, batch_size, density, seed=seed)
    feats = torch.randn(coords.shape[0], channels, generator=torch.Generator().manual_seed(seed + 1),
                        **F64)
    return spconv.SparseConvTensor(feats.requires_grad_(True), coords, shape, batch_size)


def check_layer_against_dense(layer, x, geometry):
    """Forward values, output sites and all gradients of `layer` vs the dense reference."""
    out = layer(x)
    assert out.spatial_shape == output_spatial_shape(x.spatial_shape, geometry)
    assert torch.equal(out.indices.long(), active_sites(x.indices, x.spatial_shape, x.batch_size,
                                                        geometry))
    ref_in = x.features.detach().clone().requires_grad_(True)
    ref_w = layer.weight.detach().clone().requires_grad_(True)
    ref_b = layer.bias.detach().clone().requires_grad_(True)
    dense = dense_conv(to_dense(ref_in, x.indices, x.spatial_shape, x.batch_size), ref_w, geometry)
    ref = read_back(dense, out.indices) + ref_b
    torch.testing.assert_close(out.features, ref, **TOL)
    grad = torch.randn_like(ref)
    out.features.backward(grad)
    ref.backward(grad)
    for got, want in ((x.features.grad, ref_in.grad), (layer.weight.grad, ref_w.grad),
                      (layer.bias.grad, ref_b.grad)):
        torch.testing.assert_close(got, want, **TOL)
    return out


# (kernel, stride, padding, dilation, grid, batch size): the two cases with the most output rows
# (a stride-3 grid, a dilated stride-1 transposed conv) on one batch entry, the others on two.
LAYER_CASES = [(3, 2, 1, 1, (7, 6, 5), 2), (2, 2, 0, 1, (6, 5, 7), 2), (3, 3, 1, 1, (8, 7, 7), 1),
               (2, 1, 1, 1, (5, 6, 5), 2), (3, 1, 0, 2, (7, 6, 6), 1)]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: f"k{c[0]}s{c[1]}p{c[2]}d{c[3]}")
def test_sparse_conv3d_and_transpose_vs_dense(case):
    k, s, p, d, shape, batch = case
    for transposed, cls in ((False, spconv.SparseConv3d), (True, spconv.SparseConvTranspose3d)):
        layer = cls(3, 4, k, s, p, d, **F64)
        geometry = ConvGeometry.make(k, d, s, p, submanifold=False, transposed=transposed)
        # (density 0.12: a transposed layer's outputs are many, up to ~1800 rows here)
        check_layer_against_dense(layer, sparse_input(shape, batch, seed=s + 10 * k,
                                                      density=0.12), geometry)


def test_subm_conv3d_vs_dense():
    x = sparse_input((6, 5, 7), seed=4)
    layer = spconv.SubMConv3d(3, 4, 3, indice_key="subm1", **F64)
    out = layer(x)
    assert torch.equal(out.indices, x.indices) and out.indice_dict["subm1"].is_subm
    dense = F.conv3d(to_dense(x.features, x.indices, x.spatial_shape, 2),
                     layer.weight.permute(0, 4, 1, 2, 3), padding=1)
    torch.testing.assert_close(out.features, read_back(dense, x.indices) + layer.bias, **TOL)


def test_1x1x1_subm_conv_is_planless_and_may_share_a_key():
    """A kernel-size-1 SubMConv3d is each voxel's linear map (no plan built), and may share its
    indice_key with a 3x3x3 one, as in spconv; forward and gradients vs float64 dense."""
    x = sparse_input((6, 5, 7), seed=6)
    wide = spconv.SubMConv3d(3, 4, 3, indice_key="k", **F64)
    point = spconv.SubMConv3d(4, 2, 1, indice_key="k", **F64)
    mid = wide(x)
    out = point(mid)
    assert list(out._plans) == [ConvGeometry.submanifold_conv(3)]  # (the 1x1x1 asked for none)
    assert torch.equal(out.indices, x.indices) and out.indice_dict["k"].plan.kernel_volume == 27
    ref_in = mid.features.detach().clone().requires_grad_(True)
    ref_w = point.weight.detach().clone().requires_grad_(True)
    ref_b = point.bias.detach().clone().requires_grad_(True)
    dense = F.conv3d(to_dense(ref_in, x.indices, x.spatial_shape, 2), ref_w.permute(0, 4, 1, 2, 3))
    ref = read_back(dense, x.indices) + ref_b
    torch.testing.assert_close(out.features, ref, **TOL)
    grad = torch.randn_like(ref)
    out.features.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(point.weight.grad, ref_w.grad, **TOL)
    torch.testing.assert_close(point.bias.grad, ref_b.grad, **TOL)
    with pytest.raises(ValueError, match="input channels"):
        spconv.SubMConv3d(5, 2, 1, **F64)(mid)


@pytest.mark.parametrize("case", [(3, 2, 1, 1, (7, 6, 5)), (2, 2, 0, 1, (7, 6, 5)),
                                  ((3, 3, 2), (2, 1, 2), (1, 1, 0), 1, (6, 5, 8))],
                         ids=["k3s2p1", "k2s2", "mixed"])
def test_inverse_restores_input_coords(case):
    k, s, p, d, shape = case
    x = sparse_input(shape, seed=2)
    down = spconv.SparseConv3d(3, 5, k, s, p, d, indice_key="down", **F64)
    up = spconv.SparseInverseConv3d(5, 4, k, indice_key="down", **F64)
    low = down(x)
    out = up(low)
    assert torch.equal(out.indices, x.indices) and out.spatial_shape == x.spatial_shape
    assert out._plans is x._plans  # later layers at this resolution reuse x's plans
    # Reference: the transposed conv of the down conv's output grid, read at the inputs.
    geometry = ConvGeometry.make(k, d, s, p, submanifold=False, transposed=True)
    lost = tuple(n - t for n, t in zip(shape, output_spatial_shape(low.spatial_shape, geometry)))
    ref_low = low.features.detach().clone().requires_grad_(True)
    ref_w = up.weight.detach().clone().requires_grad_(True)
    dense = F.conv_transpose3d(to_dense(ref_low, low.indices, low.spatial_shape, 2),
                               ref_w.permute(4, 0, 1, 2, 3), stride=geometry.stride,
                               padding=geometry.padding, dilation=geometry.dilation,
                               output_padding=lost)
    ref = read_back(dense, x.indices) + up.bias.detach()
    torch.testing.assert_close(out.features, ref, **TOL)
    grad = torch.randn_like(ref)
    out.features.backward(grad, inputs=[up.weight])
    ref.backward(grad)
    torch.testing.assert_close(up.weight.grad, ref_w.grad, **TOL)


def test_indice_key_errors():
    x = sparse_input((6, 6, 6), seed=5)
    with pytest.raises(KeyError, match="not found"):
        spconv.SparseInverseConv3d(3, 4, 3, indice_key="nope")(x)
    y = spconv.SubMConv3d(3, 3, 3, indice_key="s")(x.replace_feature(x.features.float()))
    with pytest.raises(ValueError, match="submanifold"):
        spconv.SparseInverseConv3d(3, 4, 3, indice_key="s")(y)
    low = spconv.SparseConv3d(3, 3, 3, 2, 1, indice_key="d", **F64)(x)
    with pytest.raises(ValueError, match="kernel"):
        spconv.SparseInverseConv3d(3, 4, 2, indice_key="d", **F64)(low)
    full_res = spconv.SparseConvTensor(x.features, x.indices, x.spatial_shape, 2,
                                       indice_dict=low.indice_dict)
    with pytest.raises(ValueError, match="not the output"):
        spconv.SparseInverseConv3d(3, 4, 3, indice_key="d", **F64)(full_res)
    with pytest.raises(ValueError, match="different convolution"):
        spconv.SparseConv3d(3, 3, 2, 2, indice_key="d", **F64)(full_res)
    with pytest.raises(ValueError, match="input channels"):
        spconv.SparseConv3d(4, 3, 3, 2, **F64)(x)
    with pytest.raises(NotImplementedError, match="groups"):
        spconv.SparseConv3d(4, 4, 3, 2, groups=2)
    with pytest.raises(ValueError, match="stride 1"):
        spconv.SubMConv3d(4, 4, 3, stride=2)
    with pytest.raises(TypeError, match="SparseConvTensor"):
        spconv.SparseConv3d(3, 3, 3)(x.features)
    with pytest.raises(SparseTensorError, match="int32"):
        spconv.SparseConvTensor(x.features, x.indices.long(), x.spatial_shape, 2)


def spconv_state_dict(seed=0):
    """A state_dict as spconv 2.x writes it for the U-Net below (KRSC weights [Co, *K, Ci])."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"0.weight": (4, 3, 3, 3, 3), "0.bias": (4,), "1.weight": (6, 2, 2, 2, 4),
              "1.bias": (6,), "2.weight": (5, 2, 2, 2, 6), "2.bias": (5,)}
    return {k: torch.randn(s, generator=gen, **F64) for k, s in shapes.items()}


def unet():
    return spconv.SparseSequential(
        spconv.SubMConv3d(3, 4, 3, indice_key="subm0"),
        spconv.SparseConv3d(4, 6, 2, stride=2, indice_key="down0"),
        spconv.SparseInverseConv3d(6, 5, 2, indice_key="down0")).double()


def test_state_dict_round_trip_spconv_layout():
    state = spconv_state_dict()
    net = unet()
    net.load_state_dict(state)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in state.items())
    x = sparse_input((6, 6, 6), seed=8)
    out = net(x)
    # The down conv with the loaded KRSC weight equals conv3d with weight.permute(0, 4, 1, 2, 3).
    h = read_back(F.conv3d(to_dense(x.features, x.indices, x.spatial_shape, 2),
                           state["0.weight"].permute(0, 4, 1, 2, 3), padding=1), x.indices)
    h = h + state["0.bias"]
    low = F.conv3d(to_dense(h, x.indices, x.spatial_shape, 2),
                   state["1.weight"].permute(0, 4, 1, 2, 3), stride=2) + state["1.bias"][:, None, None, None]
    occupied = to_dense(torch.ones(x.num_voxels, 1, **F64), x.indices, x.spatial_shape, 2)
    low_active = F.max_pool3d(occupied, 2, 2)  # a 2x2x2/stride-2 output exists iff any input
    up = F.conv_transpose3d(low * low_active, state["2.weight"].permute(4, 0, 1, 2, 3), stride=2)
    torch.testing.assert_close(out.features, read_back(up, x.indices) + state["2.bias"], **TOL)
    # Round trip through a fresh module, and spconv's Native layout [*K, Co, Ci] permuted on load.
    again = unet()
    again.load_state_dict(net.state_dict())
    torch.testing.assert_close(again(x).features, out.features, rtol=0, atol=0)
    native = dict(state, **{"1.weight": state["1.weight"].permute(1, 2, 3, 0, 4)})
    native["0.weight"] = state["0.weight"].permute(1, 2, 3, 0, 4)  # SubMConv3d too
    again.load_state_dict(native)
    assert torch.equal(again[0].weight, state["0.weight"])
    assert torch.equal(again[1].weight, state["1.weight"])


def test_tensor_api_and_sequential():
    x = sparse_input((5, 6, 7), channels=4, seed=9)
    dense = x.dense()
    assert dense.shape == (2, 4, 5, 6, 7)
    assert torch.equal(x.dense(channels_first=False), dense.permute(0, 2, 3, 4, 1))
    back = spconv.SparseConvTensor.from_dense(x.dense(channels_first=False).detach())
    assert torch.equal(back.dense(), dense.detach())
    assert x.spatial_size == 210 and abs(x.sparity - x.num_voxels / 420) < 1e-12
    y = x.replace_feature(x.features * 2)
    assert y.indice_dict is x.indice_dict and y._plans is x._plans and y.indices is x.indices
    with pytest.raises(SparseTensorError, match="shape"):
        x.replace_feature(x.features[1:])
    net = spconv.SparseSequential(spconv.SubMConv3d(4, 4, 3, **F64), torch.nn.BatchNorm1d(4, **F64),
                                  torch.nn.ReLU(), relu2=torch.nn.ReLU())
    out = net(x)
    assert (out.features >= 0).all() and torch.equal(out.indices, x.indices)
    empty = spconv.SparseConvTensor(x.features[:0], x.indices[:0], x.spatial_shape, 2)
    assert net(empty).num_voxels == 0  # BatchNorm skipped on 0 rows, as in spconv
    assert spconv.ToDense()(out).shape == (2, 4, 5, 6, 7)
