"""SparseConvTensor: spconv 2.x's sparse tensor, as a flexplan SparseTensor.

indices [N, 4] int32 rows are (batch, d0, d1, d2) with d0..d2 in the order of spatial_shape,
exactly as in spconv (which documents them as (b, z, y, x) for a (Z, Y, X) grid): flexplan's
(b, x, y, z) is only a naming, so no axis is permuted anywhere. Layers share plans through the
tensor (SparseTensor._plans) and record strided plans under their indice_key in indice_dict, so
that SparseInverseConv3d can map back onto the coordinates they came from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

import torch

from ..coords4d import check_coords_4d, check_grid_4d
from ..geometry import triple
from ..graph_capture import capturing
from ..plan import ConvPlan
from ..cache import refine_plan
from ..planner.generative import bwd_from_fwd, inverse_plan
from ..sparse_tensor import Plans, SparseTensor, SparseTensorError
from ..tensor_memo import TensorMemo


# A 2D / 1D indices tensor's 3D coords, per unmodified indices tensor: the same indices
# wrapped again (a new tensor per call over the same pillars) get the same coords object, so
# its remembered identity and passed checks (tensor_memo) serve them with no device work. The
# latest few only: each holds a copy of its indices (a dataset of pillar tensors kept on the
# GPU must not get a second copy of all of them).
_with_unit_axes = TensorMemo(max_entries=8)


def with_unit_axes(indices: torch.Tensor, ndim: int) -> torch.Tensor:
    """indices [N, 1 + ndim] as [N, 4] coords, the unit axes at 0 (dtype kept)."""
    known = _with_unit_axes.get(indices)
    if known is not None and known[1] == known[0]._version:  # (and those coords unchanged)
        return known[0]
    coords = torch.nn.functional.pad(indices, (0, 3 - ndim))
    # (not kept from a CUDA graph capture: its coords hold values only once the graph replays)
    if not coords.is_inference() and not capturing(coords.device):
        _with_unit_axes.put(indices, (coords, coords._version))
    return coords


@dataclass(eq=False)
class IndiceData:
    """What a conv with an indice_key leaves in indice_dict (spconv's field names).

    indices / spatial_shape: the conv's input coords and grid; out_indices / out_spatial_shape:
    its output. in_plans: the plans of the input coords, handed on to the inverse conv's output.
    """

    out_indices: torch.Tensor
    indices: torch.Tensor
    spatial_shape: tuple[int, int, int]
    out_spatial_shape: tuple[int, int, int]
    is_subm: bool
    plan: ConvPlan
    in_plans: dict = field(repr=False)

    @cached_property
    def inverse_plan(self) -> ConvPlan:
        paired = self.plan
        if paired.bwd is None:  # an inference plan: its bwd map is made once, kept by the cache
            paired = refine_plan(paired, bwd_from_fwd(paired))
            if self.in_plans.get(paired.geometry) is self.plan:  # the input's memo, likewise
                self.in_plans[paired.geometry] = paired
        return inverse_plan(paired, self.indices)


class SparseConvTensor(SparseTensor):
    """spconv.SparseConvTensor(features, indices, spatial_shape, batch_size, ...).

    spconv's grid / voxel_num / benchmark / allocator / timer arguments are accepted and kept
    as attributes but unused. check=True validates indices (int32, in range, no duplicates).

    2D and 1D tensors (spconv's [N, 3] / [N, 2] indices with a 2- / 1-entry spatial_shape, for
    the 2D and 1D layers) are kept as 3D ones with unit last axes: coords [N, 4] with zeros
    there and a grid like (D0, D1, 1), so every plan, kernel and cache serves them unchanged;
    indices, spatial_shape and dense() show the 2D / 1D view.

    4D tensors (spconv's [N, 5] indices (batch, d0, d1, d2, d3) with a 4-entry spatial_shape, for
    the 4D layers) keep their [N, 5] coords and 4D grid as they are: only the 4D layers, whose
    plans are 4D (flexplan/planner/plan4d.py), take them; 3D layers refuse them (check_ndim).
    """

    _ndim = 3  # spatial dimensions shown to the user: 3, 2 or 1 (unit axes inside), or 4

    def __init__(self, features: torch.Tensor, indices: torch.Tensor, spatial_shape, batch_size: int,
                 grid=None, voxel_num=None, indice_dict: Optional[dict] = None, benchmark: bool = False,
                 permanent_thrust_allocator: bool = False, enable_timer: bool = False,
                 force_algo=None, *, check: bool = True):
        if isinstance(indices, torch.Tensor) and indices.dim() == 2 and indices.shape[1] == 5:
            self._init_4d(features, indices, spatial_shape, int(batch_size), check)
        else:
            self._init_3d(features, indices, spatial_shape, batch_size, check)
        self.indice_dict = {} if indice_dict is None else indice_dict
        self.grid, self.voxel_num, self.force_algo = grid, voxel_num, force_algo
        self.benchmark, self.benchmark_record = benchmark, {}

    def _init_3d(self, features, indices, spatial_shape, batch_size, check: bool) -> None:
        if isinstance(indices, torch.Tensor) and indices.dim() == 2 and indices.shape[1] in (2, 3):
            ndim = indices.shape[1] - 1
            if len(tuple(spatial_shape)) != ndim:
                raise SparseTensorError(f"[N, {ndim + 1}] indices are {ndim}D: spatial_shape "
                                        f"needs {ndim} entries, got {tuple(spatial_shape)}")
            self._ndim = ndim
            indices = with_unit_axes(indices, ndim)
            spatial_shape = (*spatial_shape, *(1,) * (3 - ndim))
        super().__init__(features, indices, spatial_shape, int(batch_size), check=check)

    def _init_4d(self, features, indices, spatial_shape, batch_size: int, check: bool) -> None:
        """SparseTensor's fields over 4D coords, which its own checks (3D) do not take."""
        self._ndim = 4
        shape = check_grid_4d(spatial_shape, batch_size)
        if not isinstance(features, torch.Tensor) or not features.is_floating_point() or \
                features.dim() != 2:
            got = (f"{features.dtype} {tuple(features.shape)}" if isinstance(features, torch.Tensor)
                   else type(features).__name__)
            raise SparseTensorError(f"features must be a floating-point [N, C] tensor, got {got}")
        if features.shape[0] != indices.shape[0] or features.device != indices.device:
            raise SparseTensorError(f"features ({features.shape[0]} rows, {features.device}) and "
                                    f"indices ({indices.shape[0]} rows, {indices.device}) must "
                                    "match in rows and device")
        if check:
            check_coords_4d(indices, shape, batch_size)
        self.feats, self.coords, self._spatial_shape = features, indices, shape
        self.batch_size, self._plans = batch_size, Plans()

    # spconv names for SparseTensor's fields. Changing coords or grid drops the cached plans.
    @property
    def features(self) -> torch.Tensor:
        return self.feats

    @features.setter
    def features(self, value: torch.Tensor) -> None:
        if value.dim() != 2 or value.shape[0] != self.coords.shape[0]:
            raise SparseTensorError(f"features must have shape [{self.coords.shape[0]}, C], "
                                    f"got {tuple(value.shape)}")
        self.feats = value

    @property
    def grid_shape(self) -> tuple[int, int, int]:
        return self._spatial_shape

    @property
    def ndim(self) -> int:
        """Spatial dimensions: 3, 2 / 1 for a tensor of [N, 3] / [N, 2] indices, 4 for [N, 5]."""
        return self._ndim

    @property
    def indices(self) -> torch.Tensor:
        return self.coords if self._ndim >= 3 else self.coords[:, :1 + self._ndim]

    @indices.setter
    def indices(self, value: torch.Tensor) -> None:
        if self._ndim < 3 and value.dim() == 2 and value.shape[1] == 1 + self._ndim:
            value = with_unit_axes(value, self._ndim)
        self.coords = value
        self._plans = Plans()

    @property
    def spatial_shape(self) -> tuple:
        return self._spatial_shape if self._ndim >= 3 else self._spatial_shape[:self._ndim]

    @spatial_shape.setter
    def spatial_shape(self, value) -> None:
        value = tuple(value)
        if self._ndim == 4:
            self._spatial_shape = check_grid_4d(value, self.batch_size)
            self._plans = Plans()
            return
        if self._ndim < 3 and len(value) == self._ndim:
            value = (*value, *(1,) * (3 - self._ndim))
        self._spatial_shape = triple(value, "spatial_shape")
        self._plans = Plans()

    @classmethod
    def from_dense(cls, x: torch.Tensor) -> "SparseConvTensor":
        """From a channels-last [B, D0, D1, D2, C] tensor (or [B, D0, D1, C] / [B, D0, C]: a 2D /
        1D tensor; [B, D0, D1, D2, D3, C]: a 4D one): the sites with any nonzero channel."""
        if x.dim() not in (3, 4, 5, 6):
            raise SparseTensorError(f"from_dense expects [B, D0, D1, D2, C] (or 2D / 1D), "
                                    f"got {tuple(x.shape)}")
        active = (x != 0).any(dim=-1)
        return cls(x[active], active.nonzero().to(torch.int32), x.shape[1:-1], x.shape[0],
                   check=False)

    def replace_feature(self, feature: torch.Tensor) -> "SparseConvTensor":
        """Same indices, grid, indice_dict and plans; new features (e.g. after BN / ReLU)."""
        if feature.dim() != 2 or feature.shape[0] != self.num_voxels:
            raise SparseTensorError(f"replacement features must have shape [{self.num_voxels}, C], "
                                    f"got {tuple(feature.shape)}")
        return self._derived(feature, self.coords, self._spatial_shape, self.indice_dict, self._plans)

    replace_feats = replace_feature  # what flexplan's own layers call

    def _derived(self, features, indices, spatial_shape, indice_dict, plans) -> "SparseConvTensor":
        """A tensor of this one's kind made by a layer: its parts come from flexplan (features
        of the right rows, indices and grid of a plan), so nothing is validated again (every
        layer makes one or two: the checks' host time would add up)."""
        out = object.__new__(SparseConvTensor)
        out._ndim = self._ndim
        out.feats, out.coords, out._spatial_shape = features, indices, spatial_shape
        out.batch_size, out._plans, out.indice_dict = self.batch_size, plans, indice_dict
        out.grid, out.voxel_num, out.force_algo = self.grid, self.voxel_num, self.force_algo
        out.benchmark, out.benchmark_record = self.benchmark, self.benchmark_record
        return out

    def shadow_copy(self) -> "SparseConvTensor":
        return self._derived(self.feats, self.coords, self._spatial_shape, self.indice_dict,
                             self._plans)

    def find_indice_pair(self, key) -> Optional[IndiceData]:
        return None if key is None else self.indice_dict.get(key)

    def dense(self, channels_first: bool = True) -> torch.Tensor:
        """[B, C, D0, D1, D2], or [B, D0, D1, D2, C] with channels_first=False (2D / 1D: fewer
        axes; 4D: [B, C, D0, D1, D2, D3])."""
        if self._ndim == 4:
            out = self.feats.new_zeros((self.batch_size, self.num_channels, *self._spatial_shape))
            b, *sites = self.coords.long().unbind(1)
            out[(b, slice(None), *sites)] = self.feats
            return out if channels_first else out.movedim(1, -1).contiguous()
        out = super().dense()
        for _ in range(3 - self._ndim):  # the unit axes of a 2D or 1D tensor
            out = out.squeeze(-1)
        return out if channels_first else out.movedim(1, -1).contiguous()

    @property
    def spatial_size(self) -> int:
        return math.prod(self.spatial_shape)

    @property
    def sparity(self) -> float:  # sic: spconv's spelling
        return self.num_voxels / self.spatial_size / self.batch_size

    def __repr__(self) -> str:
        return "SparseConvTensor" + super().__repr__().removeprefix("SparseTensor")
