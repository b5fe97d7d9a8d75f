"""The rest of spconv's public names in flexplan.nn.spconv: feature-wise wrappers, tables,
sparse_add (float64 references), ConvAlgo accepted by layers."""
from __future__ import annotations

import pytest
import torch

import flexplan.nn.spconv as spconv
from flexplan.nn.spconv import functional as Fsp
from flexplan.workloads import random_coords

SHAPE = (9, 8, 7)


def tensor(seed, n=60, channels=3, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    coords = random_coords(n, SHAPE, 2, generator=gen)
    feats = torch.randn(coords.shape[0], channels, dtype=torch.float64, generator=gen)
    return spconv.SparseConvTensor(feats.to(device), coords.to(device), SHAPE, 2)


def test_spconv_names_present():
    for name in ("SparseBatchNorm", "SparseSyncBatchNorm", "SparseReLU", "SparseIdentity",
                 "Identity", "RemoveGrid", "AddTable", "AddTableMisaligned", "ConcatTable",
                 "JoinTable", "ConvAlgo", "assign_name_for_sparse_modules", "SubMConv2d",
                 "SparseConv2d", "SparseMaxPool2d", "SparseGlobalMaxPool"):
        assert hasattr(spconv, name), name
    assert Fsp.sparse_add is spconv.functional.sparse_add


def test_feature_wise_modules_and_tables(device):
    x = tensor(0, device=device)
    bn = spconv.SparseBatchNorm(3).double().to(device)
    y = bn(x)
    torch.testing.assert_close(y.features, torch.nn.functional.batch_norm(
        x.features, None, None, bn.weight, bn.bias, training=True))
    assert torch.equal(spconv.SparseReLU()(x).features, x.features.relu())
    assert spconv.SparseIdentity()(x).features is x.features
    assert spconv.Identity()(x) is x
    assert spconv.SparseReLU()(x.features).shape == x.features.shape  # plain tensors too
    branches = spconv.ConcatTable().add(spconv.SparseReLU()).add(spconv.SparseIdentity())
    a, b = branches(x)
    added = spconv.AddTable()([a, b])
    torch.testing.assert_close(added.features, x.features.relu() + x.features)
    joined = spconv.JoinTable()([a, b])
    assert joined.features.shape == (x.num_voxels, 6) and torch.equal(joined.indices, x.indices)
    # the same count of voxels in another row order (spconv would add mismatched rows): refused
    reordered = spconv.SparseConvTensor(x.features, x.indices.flip(0).contiguous(), SHAPE, 2)
    with pytest.raises(ValueError, match="same coordinates"):
        spconv.AddTable()([x, reordered])
    assert spconv.RemoveGrid()(x).grid is None


def test_sparse_add_is_the_union(device):
    x, y = tensor(2, device=device), tensor(3, n=40, device=device)
    out = Fsp.sparse_add(x, y)
    dense = x.dense() + y.dense()
    torch.testing.assert_close(out.dense(), dense)
    present = (x.dense().abs().sum(1) + y.dense().abs().sum(1)) > 0
    assert out.num_voxels == int(present.sum()) and out.indice_dict == {}
    same = Fsp.sparse_add(x, x.replace_feature(x.features * 2))
    assert torch.equal(same.indices, x.indices)
    torch.testing.assert_close(same.features, x.features * 3)
    with pytest.raises(ValueError, match="channel"):
        Fsp.sparse_add(x, tensor(4, channels=5, device=device))


def test_layers_accept_conv_algo(device):
    conv = spconv.SubMConv3d(3, 4, 3, algo=spconv.ConvAlgo.MaskImplicitGemm).double().to(device)
    assert conv.algo == "auto"
    assert conv(tensor(5, device=device)).features.shape[1] == 4


def test_ops_output_sizes_match_the_planner_and_spconv_formulas():
    from flexplan import ConvGeometry
    from flexplan.nn.spconv import ops
    from flexplan.planner.generative import output_spatial_shape

    for shape, k, s, p, d in (((41, 1504, 1504), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1)),
                              ((11, 188, 188), (3, 3, 3), (2, 2, 2), (0, 1, 1), (1, 1, 1)),
                              ((9, 8, 7), (3, 1, 1), (2, 1, 1), (0, 0, 0), (1, 1, 1)),
                              ((9, 8, 7), (3, 3, 3), (1, 1, 1), (2, 2, 2), (2, 2, 2))):
        geom = ConvGeometry.make(k, d, s, p, submanifold=False)
        assert tuple(ops.get_conv_output_size(shape, k, s, p, d)) == output_spatial_shape(shape, geom)
        # spconv's closed form, written out: (size + 2p - d(k - 1) - 1) // s + 1
        assert ops.get_conv_output_size(shape, k, s, p, d) == [
            (n + 2 * pp - dd * (kk - 1) - 1) // ss + 1 for n, kk, ss, pp, dd in zip(shape, k, s, p, d)]
    assert ops.get_conv_output_size([10, 7], [-1, 3], [1, 2], [0, 1], [1, 1]) == [1, 4]
    geom = ConvGeometry.make(2, 1, 2, 0, submanifold=False, transposed=True)
    assert tuple(ops.get_deconv_output_size((5, 6, 7), (2,) * 3, (2,) * 3, (0,) * 3, (1,) * 3,
                                            (0,) * 3)) == output_spatial_shape((5, 6, 7), geom)
    with pytest.raises(ValueError):
        ops.get_deconv_output_size([4], [-1], [1], [0], [1], [0])
    with pytest.raises(NotImplementedError, match="SparseMaxPool3d"):
        ops.indice_maxpool  # noqa: B018
    with pytest.raises(AttributeError):
        ops.no_such_function  # noqa: B018


# spconv 2.3's constructor parameters, in order (spconv/pytorch/conv.py): code passing them
# positionally must mean the same thing here.
_STRIDED = ["in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
            "groups", "bias", "indice_key", "algo", "fp32_accum", "record_voxel_count",
            "large_kernel_fast_algo", "name"]
_SUBM = ["in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
         "bias", "indice_key", "algo", "fp32_accum", "large_kernel_fast_algo", "name"]
_INVERSE = ["in_channels", "out_channels", "kernel_size", "indice_key", "bias", "algo",
            "fp32_accum", "large_kernel_fast_algo", "name"]
_BASE = ["ndim", "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
         "groups", "bias", "subm", "output_padding", "transposed", "inverse", "indice_key", "algo",
         "fp32_accum", "record_voxel_count", "act_type", "act_alpha", "act_beta",
         "large_kernel_fast_algo", "name", "device", "dtype"]


@pytest.mark.parametrize("names, expected", [
    (("SparseConv1d", "SparseConv2d", "SparseConv3d", "SparseConv4d", "SparseConvTranspose1d",
      "SparseConvTranspose2d", "SparseConvTranspose3d", "SparseConvTranspose4d"), _STRIDED),
    (("SubMConv1d", "SubMConv2d", "SubMConv3d", "SubMConv4d"), _SUBM),
    (("SparseInverseConv1d", "SparseInverseConv2d", "SparseInverseConv3d",
      "SparseInverseConv4d"), _INVERSE),
    (("SparseConvolution",), _BASE)])
def test_conv_constructors_take_spconvs_parameters_in_order(names, expected):
    import inspect

    for name in names:
        params = [p for p in inspect.signature(getattr(spconv, name).__init__).parameters
                  if p not in ("self", "kwargs")]
        assert params[:len(expected)] == expected, name


def test_spconv_options_are_accepted(device):
    """fp32_accum, record_voxel_count and large_kernel_fast_algo change nothing here (flexplan
    accumulates in fp32 and picks its own kernels): the same outputs."""
    x = tensor(3, device=device)
    torch.manual_seed(0)
    plain = spconv.SparseConv3d(3, 4, 3, stride=2, padding=1).double().to(device)
    torch.manual_seed(0)
    options = spconv.SparseConv3d(3, 4, 3, 2, 1, 1, 1, True, None, None, True, True,
                                  True).double().to(device)
    assert options.fp32_accum and options.record_voxel_count and options.large_kernel_fast_algo
    torch.testing.assert_close(options(x).features, plain(x).features, rtol=0, atol=0)
    sub = spconv.SubMConv3d(3, 4, 3, fp32_accum=False, large_kernel_fast_algo=True)
    assert sub.fp32_accum is False and sub.large_kernel_fast_algo


class _Activation:
    """Stands for cumm's tv.gemm.Activation members (pybind enums with a .name)."""

    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("act, reference", [
    (_Activation("None_"), lambda t: t),
    (_Activation("ReLU"), torch.relu),
    ("Activation.Sigmoid", torch.sigmoid),
    (_Activation("LeakyReLU"), lambda t: torch.nn.functional.leaky_relu(t, 0.25))])
def test_fused_activation_applies_to_the_output(device, act, reference):
    """spconv's act_type (SparseConvolution) applies its activation to the conv's output."""
    x = tensor(4, device=device)
    torch.manual_seed(1)
    conv = spconv.SparseConvolution(3, 3, 4, 3, stride=2, padding=1).double().to(device)
    torch.manual_seed(1)
    fused = spconv.SparseConvolution(3, 3, 4, 3, stride=2, padding=1, act_type=act,
                                     act_alpha=0.25).double().to(device)
    out = fused(x).features
    torch.testing.assert_close(out, reference(conv(x).features), rtol=0, atol=0)
    out.sum().backward()  # gradients flow through the activation


def test_unknown_activation_is_refused():
    with pytest.raises(NotImplementedError, match="act_type"):
        spconv.SparseConvolution(3, 3, 4, 3, act_type=_Activation("GELU"))
