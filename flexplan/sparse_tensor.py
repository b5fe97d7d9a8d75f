"""SparseTensor: features [N, C] + int32 coords [N, 4] as (batch, x, y, z) + spatial shape.

A passive value: it holds the plans made for its coordinates (Plans, shared by every tensor over
them) but never builds one; layers ask flexplan.plan_provider.tensor_plan for them."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .coords_check import (SparseTensorError, check_coords, check_coords_layout,  # noqa: F401
                           merge_duplicate_coords, raise_coords_problems)
from .coords_hash import coords_identity
from .geometry import triple


class Plans(dict):
    """The plans of one set of coordinates, by geometry, shared by every tensor over them, and
    the coordinates' identity for the plan cache (SparseTensor.coords_identity): None until
    hashed, or given by the layer that produced the coordinates. askers: per geometry, the
    (layer, tensor) ids that asked for its plan while the plan's schedule is deferred
    (plan_provider.tensor_plan)."""

    __slots__ = ("identity", "askers")

    def __init__(self, identity: bytes | None = None):
        super().__init__()
        self.identity = identity
        self.askers: dict = {}


class SparseTensor:
    """A batch of sparse 3D voxel features.

    feats:  [N, C] floating tensor
    coords: [N, 4] int32 tensor, rows (batch, x, y, z), unique unless merge_duplicates=True
    spatial_shape: (X, Y, Z) grid size; coords[:, 1:] must lie in [0, X) x [0, Y) x [0, Z)
    batch_size: number of batch entries; defaults to max(batch) + 1
    """

    def __init__(self, feats: torch.Tensor, coords: torch.Tensor, spatial_shape: Sequence[int],
                 batch_size: Optional[int] = None, *, merge_duplicates: bool = False,
                 check: bool = True):
        if not isinstance(feats, torch.Tensor) or not feats.is_floating_point():
            raise SparseTensorError(
                f"feats must be a floating-point torch.Tensor, got "
                f"{feats.dtype if isinstance(feats, torch.Tensor) else type(feats).__name__}")
        if feats.dim() != 2:
            raise SparseTensorError(f"feats must have shape [N, C], got {tuple(feats.shape)}")
        if not isinstance(coords, torch.Tensor):
            raise SparseTensorError(f"coords must be a torch.Tensor, got {type(coords).__name__}")
        if feats.shape[0] != coords.shape[0]:
            raise SparseTensorError(
                f"feats has {feats.shape[0]} rows but coords has {coords.shape[0]}; they must match")
        if feats.device != coords.device:
            raise SparseTensorError(f"feats is on {feats.device} but coords is on {coords.device}")
        shape = triple(spatial_shape, "spatial_shape")
        if any(s < 1 for s in shape):
            raise SparseTensorError(f"spatial_shape entries must be >= 1, got {shape}")
        if batch_size is None:
            batch_size = int(coords[:, 0].max()) + 1 if coords.numel() else 1
        if batch_size < 1:
            raise SparseTensorError(f"batch_size must be >= 1, got {batch_size}")
        identity = None
        if check or merge_duplicates:
            identity = check_coords(coords, shape, batch_size,
                                    check_duplicates=check and not merge_duplicates)
        if merge_duplicates:
            feats, coords = merge_duplicate_coords(feats, coords, shape, batch_size)
        self.feats = feats
        self.coords = coords
        self.spatial_shape = shape
        self.batch_size = int(batch_size)
        # Plans for these coords, by geometry; shared with tensors made by replace_feats so that
        # every layer over the same coordinates reuses one plan. Their identity: remembered
        # by coords_hash per tensor object and version, and checked against a change in place
        # when asked; inference tensors (torch.inference_mode) have no version, so the
        # check's identity is kept here (coordinates an inference server must not change in
        # place after making the tensor; merged coordinates are new ones, hashed when asked).
        self._plans = Plans(identity if identity is not None and coords.is_inference()
                            and not merge_duplicates else None)

    @property
    def grid_shape(self) -> tuple[int, int, int]:
        """The 3D grid the coordinates index (what plans are built over); a view may show
        fewer axes (SparseConvTensor's 2D tensors)."""
        return self.spatial_shape

    @property
    def num_voxels(self) -> int:
        return self.feats.shape[0]

    @property
    def num_channels(self) -> int:
        return self.feats.shape[1]

    @property
    def device(self) -> torch.device:
        return self.feats.device

    def replace_feats(self, feats: torch.Tensor) -> "SparseTensor":
        """Same coordinates, new features (e.g. the output of a submanifold layer)."""
        if feats.dim() != 2 or feats.shape[0] != self.num_voxels:
            raise SparseTensorError(
                f"replacement feats must have shape [{self.num_voxels}, C], got {tuple(feats.shape)}")
        out = SparseTensor(feats, self.coords, self.spatial_shape, self.batch_size, check=False)
        out._plans = self._plans
        return out

    def coords_identity(self) -> bytes:
        """16 bytes naming these coordinates for the plan cache: hashed once (one host sync),
        or set by the layer that produced them (derived from its input's, no device work).
        Kept with the plans, so every tensor sharing them shares it."""
        identity = self._plans.identity
        if identity is None:
            identity = self._plans.identity = coords_identity(self.coords)
        return identity

    def dense(self) -> torch.Tensor:
        """Dense [B, C, X, Y, Z] view, for tests and small grids."""
        b, x, y, z = self.coords.long().unbind(1)
        out = self.feats.new_zeros((self.batch_size, self.num_channels, *self.grid_shape))
        out[b, :, x, y, z] = self.feats
        return out

    def __repr__(self) -> str:
        return (f"SparseTensor(N={self.num_voxels}, C={self.num_channels}, "
                f"spatial_shape={self.spatial_shape}, batch_size={self.batch_size}, "
                f"dtype={self.feats.dtype}, device={self.device})")
