"""spconv 2.x convolution layers over flexplan plans: same constructors, same weight layout.

Weights are [Co, K0, K1, K2, Ci] with bias [Co]: spconv 2.x's default (KRSC, its implicit-GEMM
layout), so an spconv state_dict loads unchanged. Checkpoints of spconv's Native algorithm
(kernel volume > 32, CPU-only builds) store [K0, K1, K2, Co, Ci]; such a weight is permuted on
load when its shape tells it apart.

Kernel tap k of an axis links output o and input i by i = o * s - p + k * d (transposed:
o = i * s - p + k * d), spconv's rule, equal to torch's conv3d / conv_transpose3d with weight
W.permute(0, 4, 1, 2, 3) / W.permute(4, 0, 1, 2, 3).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..geometry import ConvGeometry, triple
from ..kernel_configs import ALGORITHMS
from ..cache.key import derived_identity
from ..ops.conv import BatchNormReLU, sparse_conv
from ..plan_provider import tensor_plan
from ..sparse_tensor import Plans
from .sparse_conv_tensor import IndiceData, SparseConvTensor
from .submconv import SubMConv3d as _SubMConv3d


class SparseModule(torch.nn.Module):
    """Marker of modules that take and return a SparseConvTensor (spconv.SparseModule)."""

    def __init__(self, name=None):
        super().__init__()
        self.name = name


class _LoadsNativeLayout(torch.nn.Module):
    """Loads spconv Native-algorithm weights [K0, K1, K2, Co, Ci] by permuting them to
    [Co, K0, K1, K2, Ci], when the shape tells the two layouts apart."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        weight = state_dict.get(prefix + "weight")
        co, *kernel, ci = self.weight.shape  # [Co, K..., Ci]: 3D or 2D
        native = (*kernel, co, ci)
        if weight is not None and tuple(weight.shape) == native != tuple(self.weight.shape):
            nk = len(kernel)
            state_dict[prefix + "weight"] = weight.permute(nk, *range(nk), nk + 1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def lift(value, ndim: int, name: str, unit: int):
    """A 3D layer argument from an ndim-D one: 3D as is; 2D / 1D (spconv's 2D / 1D layers,
    whose tensors have unit axes inside) gets `unit` on the missing axes (kernel, stride,
    dilation 1; padding 0)."""
    if ndim == 3:
        return value
    if ndim not in (1, 2):
        raise NotImplementedError(f"flexplan's 3D path takes 1D, 2D or 3D layers; got "
                                  f"ndim={ndim} (4D: the *4d layers)")
    given = (value,) * ndim if isinstance(value, int) else tuple(value)
    if len(given) != ndim:
        raise ValueError(f"{name} of a {ndim}D layer needs {ndim} entries, got {value}")
    return (*given, *(unit,) * (3 - ndim))


def op_weight(weight: torch.Tensor, geometry: ConvGeometry) -> torch.Tensor:
    """The weight as the 3D op takes it: [Co, K0, K1, K2, Ci] (a 2D / 1D layer's
    [Co, K0, K1, Ci] / [Co, K0, Ci] viewed with unit kernel axes)."""
    return weight.view(weight.shape[0], *geometry.kernel_size, weight.shape[-1])


def check_ndim(module, x) -> None:
    if x.ndim != module.ndim:
        raise ValueError(f"{type(module).__name__} is a {module.ndim}D layer; got a {x.ndim}D "
                         f"tensor ([N, {x.ndim + 1}] indices)")


def algo_name(algo) -> str:
    """flexplan algorithm for an `algo` argument: one of its names, or "auto" for None and for
    spconv ConvAlgo values (flexplan picks its own kernels)."""
    if isinstance(algo, str):
        if algo != "auto" and algo not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algo!r}; choose 'auto' or one of {ALGORITHMS}")
        return algo
    return "auto"


def _check_input(module, x) -> None:
    if not isinstance(x, SparseConvTensor):
        raise TypeError(f"{type(module).__name__} expects a SparseConvTensor, got "
                        f"{type(x).__name__}")
    if x.num_channels != module.in_channels:
        raise ValueError(f"{type(module).__name__} expects {module.in_channels} input channels, "
                         f"got features of shape {tuple(x.features.shape)}")


def _record(indice_dict: dict, key, geometry: ConvGeometry, indices: torch.Tensor,
            make: Callable[[], IndiceData]) -> dict:
    """indice_dict plus `key` -> make() (the layer's IndiceData, over input `indices`); a key
    already taken must name the same convolution. (make: called only for a new key, as every
    later layer of a submanifold key finds it taken.)"""
    if key is None:
        return indice_dict
    old = indice_dict.get(key)
    if old is not None:
        if old.plan.geometry != geometry or old.indices.shape != indices.shape:
            raise ValueError(f"indice_key {key!r} already names a different convolution "
                             f"({old.plan.geometry}); give this layer its own key")
        return indice_dict
    return {**indice_dict, key: make()}


def strided_plan_and_record(layer, x: SparseConvTensor, training: bool | None = None,
                            scheduled: bool = True):
    """(plan, the output's Plans, the output's indice_dict) of a strided or transposed conv or
    pool over x: new output coordinates, named from the input's (never hashed), recorded under
    the layer's indice_key for an inverse conv. training, scheduled: the plan's kind
    (tensor_plan; training defaults to whether autograd records)."""
    if training is None:
        training = torch.is_grad_enabled()
    plan = tensor_plan(x, layer.geometry, training=training, scheduled=scheduled)
    plans = Plans(derived_identity(x.coords_identity(), x._spatial_shape, x.batch_size,
                                   layer.geometry))
    indice_dict = _record(x.indice_dict, layer.indice_key, layer.geometry, x.coords,
                          lambda: IndiceData(plan.out_coords, x.coords, x._spatial_shape,
                                             plan.out_spatial_shape, is_subm=False, plan=plan,
                                             in_plans=x._plans))
    return plan, plans, indice_dict


def activation_name(act_type) -> str | None:
    """spconv's fused activation (a tv.gemm.Activation, or its name) as flexplan applies it
    after the convolution: None, "ReLU", "Sigmoid" or "LeakyReLU" (slope act_alpha)."""
    if act_type is None:
        return None
    name = getattr(act_type, "name", None) or str(act_type).rsplit(".", 1)[-1]
    if name in ("None_", "None"):
        return None
    if name not in ("ReLU", "Sigmoid", "LeakyReLU"):
        raise NotImplementedError(f"act_type {act_type!r}: spconv's activations are None_, "
                                  "ReLU, Sigmoid and LeakyReLU")
    return name


def apply_activation(feats: torch.Tensor, name: str | None, alpha: float) -> torch.Tensor:
    """spconv's _apply_act: the activation activation_name named, on the output features."""
    if name is None:
        return feats
    if name == "ReLU":
        return torch.relu(feats)
    if name == "Sigmoid":
        return torch.sigmoid(feats)
    return torch.nn.functional.leaky_relu(feats, alpha)


def keep_spconv_options(layer, fp32_accum, record_voxel_count, act_type, act_alpha, act_beta,
                        large_kernel_fast_algo) -> None:
    """spconv's SparseConvolution options, kept as its attributes: fp32_accum (flexplan always
    accumulates in fp32), record_voxel_count and large_kernel_fast_algo (flexplan picks its own
    kernels) change nothing; act_type is applied to the output (apply_activation)."""
    layer.fp32_accum, layer.record_voxel_count = fp32_accum, record_voxel_count
    layer.large_kernel_fast_algo = large_kernel_fast_algo
    layer.act_type, layer.act_alpha, layer.act_beta = activation_name(act_type), act_alpha, act_beta


class SparseConvolution(_LoadsNativeLayout, SparseModule):
    """Strided, transposed or inverse sparse convolution (spconv's SparseConvolution, ndim=3).

    subm=True is SubMConv3d's job; groups and output_padding other than 1 / 0 are unsupported.
    spconv's fp32_accum (flexplan always accumulates in fp32), record_voxel_count and
    large_kernel_fast_algo are accepted and kept; act_type (with act_alpha) applies its
    activation to the output, as spconv's fused one does.
    allow_tf32 (flexplan's addition): float32 convolutions on TF32 tensor cores.
    """

    def __init__(self, ndim: int, in_channels: int, out_channels: int, kernel_size=3, stride=1,
                 padding=0, dilation=1, groups=1, bias: bool = True, subm: bool = False,
                 output_padding=0, transposed: bool = False, inverse: bool = False,
                 indice_key=None, algo=None, fp32_accum=None, record_voxel_count: bool = False,
                 act_type=None, act_alpha: float = 0, act_beta: float = 0,
                 large_kernel_fast_algo: bool = False, name=None, device=None, dtype=None, *,
                 allow_tf32: bool | None = False):
        super().__init__(name)
        keep_spconv_options(self, fp32_accum, record_voxel_count, act_type, act_alpha, act_beta,
                            large_kernel_fast_algo)
        kernel_size, stride = lift(kernel_size, ndim, "kernel_size", 1), lift(stride, ndim, "stride", 1)
        padding, dilation = lift(padding, ndim, "padding", 0), lift(dilation, ndim, "dilation", 1)
        output_padding = lift(output_padding, ndim, "output_padding", 0)
        if subm:
            raise ValueError("use SubMConv3d for submanifold convolutions")
        if groups != 1:
            raise NotImplementedError("grouped sparse convolution is not supported (groups=1)")
        if triple(output_padding, "output_padding") != (0, 0, 0):
            raise NotImplementedError("output_padding is not supported")
        if inverse and indice_key is None:
            raise ValueError("an inverse convolution needs the indice_key of its paired conv")
        self.geometry = ConvGeometry.make(kernel_size, dilation, stride, padding,
                                          submanifold=False, transposed=transposed)
        self.ndim, self.in_channels, self.out_channels = ndim, int(in_channels), int(out_channels)
        self.kernel_size, self.stride = self.geometry.kernel_size, self.geometry.stride
        self.padding, self.dilation = self.geometry.padding, self.geometry.dilation
        self.transposed, self.inverse, self.subm = transposed, inverse, False
        self.indice_key, self.algo, self.allow_tf32 = indice_key, algo_name(algo), allow_tf32
        factory = dict(device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(
            torch.empty((out_channels, *self.kernel_size[:ndim], in_channels), **factory))
        self.bias = torch.nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        self.reset_parameters()

    reset_parameters = _SubMConv3d.reset_parameters  # +-1/sqrt(fan_in), like flexplan's own

    def conv_weight(self) -> torch.Tensor:
        return op_weight(self.weight, self.geometry)

    def forward(self, x: SparseConvTensor, *,
                bn_relu: BatchNormReLU | None = None) -> SparseConvTensor:
        """bn_relu: an eval BatchNorm and ReLU applied to the output, before the layer's
        activation (nn/conv_epilogue.py passes it only without one)."""
        _check_input(self, x)
        check_ndim(self, x)
        # (below, the tensor's 3D coords and grid: a 2D tensor's have a unit third axis)
        if self.inverse:
            data = self._paired(x)
            plan, plans, indice_dict = data.inverse_plan, data.in_plans, x.indice_dict
        else:
            plan, plans, indice_dict = self._plan_and_record(x)
        feats = sparse_conv(x.features, plan, self.conv_weight(), self.bias, self.algo,
                            self.allow_tf32, bn_relu)
        feats = apply_activation(feats, self.act_type, self.act_alpha)
        return x._derived(feats, plan.out_coords, plan.out_spatial_shape, indice_dict, plans)

    def _plan_and_record(self, x: SparseConvTensor):
        """(plan, the output's Plans, the output's indice_dict) over x (the 4D layers ask their
        own planner)."""
        return strided_plan_and_record(self, x)

    def _paired(self, x: SparseConvTensor) -> IndiceData:
        """An inverse conv's paired conv, as recorded under its indice_key on x's path."""
        data = x.find_indice_pair(self.indice_key)
        if data is None:
            raise KeyError(f"indice_key {self.indice_key!r} not found: the paired conv must "
                           "run on this tensor's path first")
        if data.is_subm:
            raise ValueError(f"indice_key {self.indice_key!r} names a submanifold conv; an "
                             "inverse conv pairs with a strided or transposed one")
        if data.plan.geometry.kernel_size != self.kernel_size:
            raise ValueError(f"inverse conv kernel {self.kernel_size} differs from its paired "
                             f"conv's {data.plan.geometry.kernel_size}")
        if x.num_voxels != data.plan.num_out or x._spatial_shape != data.out_spatial_shape:
            raise ValueError(f"inverse conv input ({x.num_voxels} voxels, grid "
                             f"{x.spatial_shape}) is not the output of the conv of "
                             f"indice_key {self.indice_key!r}")
        return data

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}"
        if not self.inverse:  # an inverse conv takes the rest from its paired conv
            s += f", stride={self.stride}, padding={self.padding}, dilation={self.dilation}"
        return s + f", bias={self.bias is not None}, indice_key={self.indice_key!r}, algo={self.algo!r}"


class _StridedNd(SparseConvolution):
    """spconv's SparseConvNd / SparseConvTransposeNd constructor for a class's _NDIM (1D / 2D:
    indices [N, 2] / [N, 3], weights [Co, K0, Ci] / [Co, K0, K1, Ci])."""

    _NDIM, _TRANSPOSED = 3, False

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, indice_key=None, algo=None, fp32_accum=None,
                 record_voxel_count: bool = False, large_kernel_fast_algo: bool = False,
                 name=None, **kwargs):
        super().__init__(self._NDIM, in_channels, out_channels, kernel_size, stride, padding,
                         dilation, groups, bias, transposed=self._TRANSPOSED,
                         indice_key=indice_key, algo=algo, fp32_accum=fp32_accum,
                         record_voxel_count=record_voxel_count,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name, **kwargs)


class _InverseNd(SparseConvolution):
    """Maps the output of the conv named by indice_key back onto that conv's input coords,
    with the paired conv's stride, padding and dilation (only the kernel size is given)."""

    _NDIM = 3

    def __init__(self, in_channels, out_channels, kernel_size, indice_key, bias=True, algo=None,
                 fp32_accum=None, large_kernel_fast_algo: bool = False, name=None, **kwargs):
        super().__init__(self._NDIM, in_channels, out_channels, kernel_size, bias=bias,
                         inverse=True, indice_key=indice_key, algo=algo, fp32_accum=fp32_accum,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name, **kwargs)


class SparseConv3d(_StridedNd):
    _NDIM = 3


class SparseConv2d(_StridedNd):
    _NDIM = 2


class SparseConv1d(_StridedNd):
    _NDIM = 1


class SparseConvTranspose3d(_StridedNd):
    _NDIM, _TRANSPOSED = 3, True


class SparseConvTranspose2d(_StridedNd):
    _NDIM, _TRANSPOSED = 2, True


class SparseConvTranspose1d(_StridedNd):
    _NDIM, _TRANSPOSED = 1, True


class SparseInverseConv3d(_InverseNd):
    _NDIM = 3


class SparseInverseConv2d(_InverseNd):
    _NDIM = 2


class SparseInverseConv1d(_InverseNd):
    _NDIM = 1


class SubMConv3d(_LoadsNativeLayout, _SubMConv3d, SparseModule):
    """spconv's SubMConv3d: flexplan's SubMConv3d with spconv's constructor and indice_key.

    Plans are shared by geometry through the tensor, so indice_key only matters to keep
    spconv's errors (an inverse conv paired with a submanifold key).
    """

    ndim = 3

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, indice_key=None, algo=None, fp32_accum=None,
                 large_kernel_fast_algo: bool = False, name=None, *,
                 allow_tf32: bool | None = False, device=None, dtype=None):
        kernel_size = lift(kernel_size, self.ndim, "kernel_size", 1)
        dilation = lift(dilation, self.ndim, "dilation", 1)
        if triple(lift(stride, self.ndim, "stride", 1), "stride") != (1, 1, 1):
            raise ValueError(f"submanifold convolution has stride 1, got {stride}")
        if groups != 1:
            raise NotImplementedError("grouped sparse convolution is not supported (groups=1)")
        # padding is moot: submanifold outputs are the input sites (spconv ignores it too).
        super().__init__(in_channels, out_channels, kernel_size, dilation, bias,
                         algo=algo_name(algo), allow_tf32=allow_tf32, device=device, dtype=dtype)
        if self.ndim < 3:  # spconv's layout [Co, K0, (K1,) Ci], viewed with unit kernel axes
            co, *kernel, ci = self.weight.shape
            self.weight = torch.nn.Parameter(
                self.weight.detach().reshape(co, *kernel[:self.ndim], ci).clone())
        self.name, self.indice_key = name, indice_key
        keep_spconv_options(self, fp32_accum, False, None, 0, 0, large_kernel_fast_algo)

    def conv_weight(self) -> torch.Tensor:
        return op_weight(self.weight, self.geometry)

    def forward(self, x: SparseConvTensor, *,
                bn_relu: BatchNormReLU | None = None) -> SparseConvTensor:
        _check_input(self, x)
        check_ndim(self, x)
        out = super().forward(x, bn_relu=bn_relu)
        if self.geometry.volume == 1:  # no neighbours, no plan: the key names nothing (spconv's
            return out                  # 1x1 path ignores it too, and may share a 3x3x3 conv's)
        out.indice_dict = _record(x.indice_dict, self.indice_key, self.geometry, x.coords,
                                  lambda: IndiceData(
            x.coords, x.coords, x._spatial_shape, x._spatial_shape, is_subm=True,
            plan=tensor_plan(x, self.geometry, training=torch.is_grad_enabled()), in_plans=x._plans))
        return out


class SubMConv2d(SubMConv3d):
    """spconv's SubMConv2d: indices [N, 3] (batch, d0, d1), weight [Co, K0, K1, Ci]."""

    ndim = 2


class SubMConv1d(SubMConv3d):
    """spconv's SubMConv1d: indices [N, 2] (batch, d0), weight [Co, K0, Ci]."""

    ndim = 1
