"""spconv 2.x pooling layers over flexplan plans: SparseMaxPool3d, SparseAvgPool3d and the global
pools, with spconv's constructors.

A pool's window is a convolution's: its plan (kernel, stride, padding, dilation; stride None
means stride = kernel, as in spconv) is the strided conv planner's, so the output coordinates
follow spconv's rules, a pool and a conv of one geometry share one plan, and a pool with an
indice_key can be inverted by a SparseInverseConv3d of the same kernel size, as in spconv.
"""
from __future__ import annotations

import torch

from ..geometry import ConvGeometry
from ..ops.pool import global_pool, sparse_pool
from ..plan_provider import tensor_plan
from .sparse_conv_tensor import SparseConvTensor
from .spconv_layers import SparseModule, check_ndim, lift, strided_plan_and_record


def _check_input(module, x) -> None:
    if not isinstance(x, SparseConvTensor):
        raise TypeError(f"{type(module).__name__} expects a SparseConvTensor, got "
                        f"{type(x).__name__}")


# Whether the strided pools ask for maps-only plans (ConvPlan.maps_only). False: scheduled
# inference plans, as before (for A/B runs: scripts/probe_pool_kinds.py).
MAPS_ONLY_PLANS = True


class SparsePool(SparseModule):
    """spconv's SparseMaxPool / SparseAvgPool (ndim 3, or 2 / 1 for [N, 3] / [N, 2] indices). subm=True pools each voxel's
    neighbourhood onto the voxel itself (output coordinates = input coordinates). algo and
    record_voxel_count are accepted for spconv compatibility (flexplan picks its own kernels)."""

    mode = "max"
    zero_floor = False

    def __init__(self, ndim: int, kernel_size=3, stride=1, padding=0, dilation=1,
                 indice_key=None, subm: bool = False, algo=None, record_voxel_count: bool = False,
                 name=None):
        super().__init__(name)
        stride = kernel_size if stride is None else stride
        kernel_size, stride = lift(kernel_size, ndim, "kernel_size", 1), lift(stride, ndim, "stride", 1)
        padding, dilation = lift(padding, ndim, "padding", 0), lift(dilation, ndim, "dilation", 1)
        self.geometry = ConvGeometry.make(kernel_size, dilation, stride, padding, submanifold=subm)
        if subm and (self.geometry.stride != (1, 1, 1) or self.geometry.padding != (0, 0, 0)):
            raise ValueError("a submanifold pool keeps each voxel: stride 1, padding 0")
        self.ndim = ndim
        self.kernel_size, self.stride = self.geometry.kernel_size, self.geometry.stride
        self.padding, self.dilation = self.geometry.padding, self.geometry.dilation
        self.indice_key, self.subm, self.algo = indice_key, subm, algo
        self.record_voxel_count = record_voxel_count

    def forward(self, x: SparseConvTensor) -> SparseConvTensor:
        _check_input(self, x)
        check_ndim(self, x)
        plan, plans, indice_dict = self._plan_and_record(x)
        feats = sparse_pool(x.features, plan, self.mode, self.zero_floor)
        return x._derived(feats, plan.out_coords, plan.out_spatial_shape, indice_dict, plans)

    def _plan_and_record(self, x: SparseConvTensor):
        """(plan, the output's Plans, the output's indice_dict), as the convs ask (the 4D
        pools ask their own planner)."""
        if self.subm:
            return tensor_plan(x, self.geometry, training=torch.is_grad_enabled()), x._plans, \
                x.indice_dict
        # The pool's own backward needs only the fwd map (ops.pool.backward_map), and its
        # kernels read the map in its own row order: a maps-only plan, the cheapest to build on
        # new coordinates. One an inverse conv may pair with (an indice_key) is a training
        # plan when autograd records, which that conv's own backward needs (an inverse conv
        # under no_grad reads the fwd map transposed, which a maps-only plan has).
        return strided_plan_and_record(
            self, x, training=torch.is_grad_enabled() and self.indice_key is not None,
            scheduled=not MAPS_ONLY_PLANS)

    def extra_repr(self) -> str:
        s = f"kernel_size={self.kernel_size}, stride={self.stride}"
        if any(self.padding):  # (any number of axes: the 4D pools' too)
            s += f", padding={self.padding}"
        if any(d != 1 for d in self.dilation):
            s += f", dilation={self.dilation}"
        return s + (", subm=True" if self.subm else "")


class SparseMaxPool(SparsePool):
    """Max over the voxels present in each window, floored at 0 as spconv 2.x computes it (its
    kernels start the max at 0): relu(max), the same numbers as spconv, and for the
    non-negative features of a ReLU network the plain max. (flexplan.ops.sparse_pool without
    zero_floor is the plain max of any features.)"""

    mode = "max"
    zero_floor = True


class SparseAvgPool(SparsePool):
    """Average over the voxels present in each window (spconv: the real point count)."""

    mode = "avg"


class _PoolNd(SparsePool):
    """spconv's SparseMaxPoolNd / SparseAvgPoolNd constructor for a class's _NDIM; the mode comes
    from the SparseMaxPool / SparseAvgPool base listed after this one."""

    _NDIM = 3

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, indice_key=None,
                 algo=None, record_voxel_count: bool = False, name=None):
        super().__init__(self._NDIM, kernel_size, stride, padding, dilation,
                         indice_key=indice_key, algo=algo,
                         record_voxel_count=record_voxel_count, name=name)


class SparseMaxPool3d(_PoolNd, SparseMaxPool):
    _NDIM = 3


class SparseMaxPool2d(_PoolNd, SparseMaxPool):
    _NDIM = 2


class SparseMaxPool1d(_PoolNd, SparseMaxPool):
    _NDIM = 1


class SparseAvgPool3d(_PoolNd, SparseAvgPool):
    _NDIM = 3


class SparseAvgPool2d(_PoolNd, SparseAvgPool):
    _NDIM = 2


class SparseAvgPool1d(_PoolNd, SparseAvgPool):
    _NDIM = 1


class SparseGlobalMaxOrAvgPool(SparseModule):
    """[batch_size, C] dense tensor: per batch entry, the max or mean of its voxels' features
    (an entry with no voxels: zeros)."""

    def __init__(self, is_mean: bool, name=None):
        super().__init__(name)
        self.is_mean = is_mean

    def forward(self, x: SparseConvTensor) -> torch.Tensor:
        _check_input(self, x)
        return global_pool(x.features, x.indices[:, 0], x.batch_size,
                           "avg" if self.is_mean else "max")


class SparseGlobalMaxPool(SparseGlobalMaxOrAvgPool):
    def __init__(self, name=None):
        super().__init__(is_mean=False, name=name)


class SparseGlobalAvgPool(SparseGlobalMaxOrAvgPool):
    def __init__(self, name=None):
        super().__init__(is_mean=True, name=name)
