"""spconv 2.x's 4D layers: SubMConv4d, SparseConv4d, SparseConvTranspose4d, SparseInverseConv4d,
SparseMaxPool4d, SparseAvgPool4d, with spconv's constructors and weight layout.

Tensors: SparseConvTensor(features, indices int32 [N, 5] (batch, d0, d1, d2, d3), spatial_shape
of 4, batch_size). Weights: [Co, K0, K1, K2, K3, Ci], bias [Co] (spconv's; Native-algorithm
checkpoints' [K0, K1, K2, K3, Co, Ci] are permuted on load). Tap k of an axis links output o and
input i by i = o * s - p + k * d (transposed: o = i * s - p + k * d), the 3D layers' rule per
axis; output grids and coordinates follow spconv's rules as in 3D.

The layers are the 3D ones over 4D plans (flexplan/planner/plan4d.py: the same ConvPlan, with
K0 K1 K2 K3 columns per map), run by the same ops and kernels. Plans are kept with the tensor's
coordinates (plan_provider.tensor_plan_4d), shared by every layer over them, not in the plan
cache (3D only).
"""
from __future__ import annotations

import torch

from ..geometry4d import ConvGeometry4d, quad
from ..plan_provider import tensor_plan_4d
from ..sparse_tensor import Plans
from .sparse_conv_tensor import IndiceData, SparseConvTensor
from .spconv_layers import (SparseConvolution, _InverseNd, _record, _StridedNd, algo_name,
                             keep_spconv_options)
from .spconv_pool import SparseAvgPool, SparseMaxPool, SparsePool, _PoolNd


def _plan_and_record(layer, x: SparseConvTensor):
    """(plan, the output's Plans, the output's indice_dict) of a 4D conv or pool over x (not an
    inverse conv): a submanifold layer's output shares x's coordinates and so its Plans; a
    strided or transposed one's has new coordinates, with Plans of their own, and is recorded
    under the layer's indice_key for an inverse conv."""
    plan = tensor_plan_4d(x, layer.geometry, training=torch.is_grad_enabled())
    if layer.subm:
        # A 1x1x1x1 conv pairs each voxel with itself only: spconv's shortcut for it ignores the
        # key, which may then name a larger conv (as SubMConv3d).
        if layer.indice_key is None or layer.geometry.volume == 1:
            return plan, x._plans, x.indice_dict
        return plan, x._plans, _record(x.indice_dict, layer.indice_key, layer.geometry, x.coords,
                                       lambda: IndiceData(
            x.coords, x.coords, x._spatial_shape, x._spatial_shape, is_subm=True, plan=plan,
            in_plans=x._plans))
    return plan, Plans(), _record(x.indice_dict, layer.indice_key, layer.geometry, x.coords,
                                  lambda: IndiceData(
        plan.out_coords, x.coords, x._spatial_shape, plan.out_spatial_shape, is_subm=False,
        plan=plan, in_plans=x._plans))


class SparseConvolution4d(SparseConvolution):
    """spconv's SparseConvolution with ndim=4: submanifold (subm=True), strided, transposed or
    inverse. SparseConvolution's constructor arguments; its checks, over 4 axes.

    A SparseConvolution (isinstance, reset_parameters, the inverse conv's pairing checks,
    extra_repr) whose geometry is a ConvGeometry4d and whose plans are 4D."""

    def __init__(self, ndim: int, in_channels: int, out_channels: int, kernel_size=3, stride=1,
                 padding=0, dilation=1, groups=1, bias: bool = True, subm: bool = False,
                 output_padding=0, transposed: bool = False, inverse: bool = False,
                 indice_key=None, algo=None, fp32_accum=None, record_voxel_count: bool = False,
                 act_type=None, act_alpha: float = 0, act_beta: float = 0,
                 large_kernel_fast_algo: bool = False, name=None, device=None, dtype=None, *,
                 allow_tf32: bool | None = False):
        # SparseConvolution's constructor, with 4-tuples (its own lifts to 3D): not called.
        super(SparseConvolution, self).__init__(name)
        keep_spconv_options(self, fp32_accum, record_voxel_count, act_type, act_alpha, act_beta,
                            large_kernel_fast_algo)
        if ndim != 4:
            raise ValueError(f"SparseConvolution4d is 4D (ndim=4), got ndim={ndim}")
        if groups != 1:
            raise NotImplementedError("grouped sparse convolution is not supported (groups=1)")
        if quad(output_padding, "output_padding") != (0, 0, 0, 0):
            raise NotImplementedError("output_padding is not supported")
        if inverse and indice_key is None:
            raise ValueError("an inverse convolution needs the indice_key of its paired conv")
        if subm:
            if quad(stride, "stride") != (1, 1, 1, 1):
                raise ValueError(f"submanifold convolution has stride 1, got {stride}")
            padding = 0  # moot: submanifold outputs are the input sites (spconv ignores it too)
        self.geometry = ConvGeometry4d.make(kernel_size, dilation, stride, padding,
                                            submanifold=subm, transposed=transposed)
        self.ndim, self.in_channels, self.out_channels = 4, int(in_channels), int(out_channels)
        self.kernel_size, self.stride = self.geometry.kernel_size, self.geometry.stride
        self.padding, self.dilation = self.geometry.padding, self.geometry.dilation
        self.transposed, self.inverse, self.subm = transposed, inverse, bool(subm)
        self.indice_key, self.algo, self.allow_tf32 = indice_key, algo_name(algo), allow_tf32
        factory = dict(device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(
            torch.empty((out_channels, *self.kernel_size, in_channels), **factory))
        self.bias = torch.nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        self.reset_parameters()

    def conv_weight(self) -> torch.Tensor:
        return self.weight  # [Co, K0, K1, K2, K3, Ci], as the op takes a 4D plan's weight

    def _plan_and_record(self, x: SparseConvTensor):  # (forward: SparseConvolution's)
        return _plan_and_record(self, x)


class SubMConv4d(SparseConvolution4d):
    """spconv's SubMConv4d: indices [N, 5], weight [Co, K0, K1, K2, K3, Ci]; outputs on the
    input sites."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, indice_key=None, algo=None, fp32_accum=None,
                 large_kernel_fast_algo: bool = False, name=None, **kwargs):
        super().__init__(4, in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, subm=True, indice_key=indice_key, algo=algo,
                         fp32_accum=fp32_accum, large_kernel_fast_algo=large_kernel_fast_algo,
                         name=name, **kwargs)


class SparseConv4d(_StridedNd, SparseConvolution4d):
    _NDIM = 4


class SparseConvTranspose4d(_StridedNd, SparseConvolution4d):
    _NDIM, _TRANSPOSED = 4, True


class SparseInverseConv4d(_InverseNd, SparseConvolution4d):
    _NDIM = 4


class SparsePool4d(SparsePool):
    """spconv's SparseMaxPool / SparseAvgPool with ndim=4 (the mode from the SparseMaxPool /
    SparseAvgPool base listed after this one): SparsePool's arguments and rules over 4 axes."""

    def __init__(self, ndim: int, kernel_size=3, stride=1, padding=0, dilation=1,
                 indice_key=None, subm: bool = False, algo=None, record_voxel_count: bool = False,
                 name=None):
        # SparsePool's constructor, with 4-tuples (its own lifts to 3D): not called.
        super(SparsePool, self).__init__(name)
        if ndim != 4:
            raise ValueError(f"SparsePool4d is 4D (ndim=4), got ndim={ndim}")
        stride = kernel_size if stride is None else stride
        self.geometry = ConvGeometry4d.make(kernel_size, dilation, stride, padding,
                                            submanifold=subm)
        if subm and self.geometry.padding != (0, 0, 0, 0):
            raise ValueError("a submanifold pool keeps each voxel: stride 1, padding 0")
        self.ndim = 4
        self.kernel_size, self.stride = self.geometry.kernel_size, self.geometry.stride
        self.padding, self.dilation = self.geometry.padding, self.geometry.dilation
        self.indice_key, self.subm, self.algo = indice_key, subm, algo
        self.record_voxel_count = record_voxel_count

    def _plan_and_record(self, x: SparseConvTensor):  # (forward: SparsePool's)
        return _plan_and_record(self, x)


class SparseMaxPool4d(_PoolNd, SparsePool4d, SparseMaxPool):
    _NDIM = 4


class SparseAvgPool4d(_PoolNd, SparsePool4d, SparseAvgPool):
    _NDIM = 4
