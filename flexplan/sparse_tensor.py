"""SparseTensor: features [N, C] + int32 coords [N, 4] as (batch, x, y, z) + spatial shape."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .coords_hash import (coords_identity, digest_identity, digest_lanes, known_identity,
                          lanes_to_digest, remember_identity)
from .device_guard import on_device_of
from .geometry import triple


class SparseTensorError(ValueError):
    """Raised for malformed sparse tensors (bad dtype, shape, range, duplicates)."""


def check_coords_layout(coords: torch.Tensor) -> None:
    """The host-side checks: type, dtype, shape. No device work."""
    if not isinstance(coords, torch.Tensor):
        raise SparseTensorError(f"coords must be a torch.Tensor, got {type(coords).__name__}")
    if coords.dtype != torch.int32:
        raise SparseTensorError(f"coords must be int32, got {coords.dtype}")
    if coords.dim() != 2 or coords.shape[1] != 4:
        raise SparseTensorError(f"coords must have shape [N, 4] (batch, x, y, z), got {tuple(coords.shape)}")


def raise_coords_problems(coords: torch.Tensor, spatial_shape: tuple[int, int, int],
                          batch_size: int, bad_row: int, dup_row: int) -> None:
    """Raise for the first row outside the grid, else for a duplicated row (N: none)."""
    n = coords.shape[0]
    if bad_row < n:
        raise SparseTensorError(
            f"coords row {bad_row} = {coords[bad_row].tolist()} is outside batch_size={batch_size}, "
            f"spatial_shape={tuple(spatial_shape)} (each entry must be in [0, size))")
    if dup_row < n:
        a, b = (coords == coords[dup_row]).all(dim=1).nonzero()[:2, 0].tolist()
        raise SparseTensorError(
            f"duplicate coordinate {coords[a].tolist()} at rows {a} and {b}; "
            "pass merge_duplicates=True to SparseTensor to sum their features")


def check_coords(coords: torch.Tensor, spatial_shape: tuple[int, int, int], batch_size: int,
                 check_duplicates: bool = True) -> None:
    """Validate coords against the grid; raise SparseTensorError with the first offending row."""
    check_coords_layout(coords)
    n = coords.shape[0]
    if n == 0:
        return
    if check_duplicates and coords.is_cuda:
        # One hash insert pass finds both, without sorting; the coordinates' identity (the plan
        # cache's name for them) is hashed alongside and read in the same host sync.
        from .planner.hashmap import coords_problem_flags, problem_rows

        need_identity = known_identity(coords) is None
        with on_device_of(coords):
            flags = coords_problem_flags(coords, spatial_shape, batch_size, spare_slots=2)
            if need_identity:
                digest_lanes(coords, out=flags[2:])
            values = flags.tolist()  # the one host sync
        if need_identity:
            remember_identity(coords, digest_identity(lanes_to_digest(values[2:])))
        raise_coords_problems(coords, spatial_shape, batch_size, *problem_rows(values[:2], n))
        return
    upper = torch.tensor([batch_size, *spatial_shape], dtype=torch.int32, device=coords.device)
    bad = ((coords < 0) | (coords >= upper)).any(dim=1)
    first_bad = torch.where(bad.any(), bad.to(torch.int8).argmax(), n)  # argmax: first True
    raise_coords_problems(coords, spatial_shape, batch_size, int(first_bad), n)
    if check_duplicates:
        from .planner.keys import pack_coords  # local import: keys depends on nothing here

        keys = pack_coords(coords, spatial_shape, batch_size)
        sorted_keys, order = torch.sort(keys, stable=True)
        dup = (sorted_keys[1:] == sorted_keys[:-1]).nonzero()
        raise_coords_problems(coords, spatial_shape, batch_size, n,
                              int(order[dup[0, 0]]) if dup.numel() else n)


def merge_duplicate_coords(feats: torch.Tensor, coords: torch.Tensor,
                           spatial_shape: tuple[int, int, int], batch_size: int):
    """Sum the features of equal coordinates; keeps the first occurrence's position order."""
    from .planner.keys import pack_coords

    keys = pack_coords(coords, spatial_shape, batch_size)
    uniq, inverse = torch.unique(keys, return_inverse=True)
    first = torch.full((uniq.numel(),), coords.shape[0], dtype=torch.long, device=coords.device)
    first.scatter_reduce_(0, inverse, torch.arange(coords.shape[0], device=coords.device), "amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    slot = rank[inverse]
    merged = torch.zeros((uniq.numel(), feats.shape[1]), dtype=feats.dtype, device=feats.device)
    merged.index_add_(0, slot, feats)
    return merged, coords[first[order]]


class Plans(dict):
    """The plans of one set of coordinates, by geometry, shared by every tensor over them, and
    the coordinates' identity for the plan cache (SparseTensor.coords_identity): None until
    hashed, or given by the layer that produced the coordinates."""

    __slots__ = ("identity",)

    def __init__(self, identity: bytes | None = None):
        super().__init__()
        self.identity = identity


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
        if check or merge_duplicates:
            check_coords(coords, shape, batch_size, check_duplicates=check and not merge_duplicates)
        if merge_duplicates:
            feats, coords = merge_duplicate_coords(feats, coords, shape, batch_size)
        self.feats = feats
        self.coords = coords
        self.spatial_shape = shape
        self.batch_size = int(batch_size)
        # Plans for these coords, by geometry; shared with tensors made by replace_feats so that
        # every layer over the same coordinates reuses one plan.
        self._plans = Plans()

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

    def get_plan(self, geometry, training: bool = True):
        """The plan of `geometry` over these coords: built (or found in the plan cache) once.
        training=False accepts an inference plan (ConvPlan.for_training), cheaper to build; a
        training plan serves both, and replaces an inference plan when training asks."""
        plan = self._plans.get(geometry)
        if plan is None or not plan.serves(training):
            from .cache import cached_plan

            plan = cached_plan(self.coords, self.spatial_shape, self.batch_size, geometry,
                               check=False, identity=self.coords_identity(), training=training)
            self._plans[geometry] = plan
        return plan

    def dense(self) -> torch.Tensor:
        """Dense [B, C, X, Y, Z] view, for tests and small grids."""
        b, x, y, z = self.coords.long().unbind(1)
        out = self.feats.new_zeros((self.batch_size, self.num_channels, *self.spatial_shape))
        out[b, :, x, y, z] = self.feats
        return out

    def __repr__(self) -> str:
        return (f"SparseTensor(N={self.num_voxels}, C={self.num_channels}, "
                f"spatial_shape={self.spatial_shape}, batch_size={self.batch_size}, "
                f"dtype={self.feats.dtype}, device={self.device})")
