"""Coordinate checks, at the bottom of the package: layout (dtype, shape), range and duplicates,
and merging duplicates. The value type (sparse_tensor), the plan cache and the planner all ask
here; this module asks only the hash kernels below it (planner.hashmap, planner.keys), which
import nothing above them.
"""
from __future__ import annotations

import torch

from .compile_boundary import opaque
from .coords_hash import digest_identity, known_identity, lanes_to_digest, remember_identity
from .device_guard import on_device_of
from .host_waits import release_now
from .tensor_memo import TensorMemo


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


# The grids (spatial shape, batch size) each unmodified coordinate tensor passed the whole
# check on (range and duplicates): the same tensor handed again, e.g. the same coordinates
# wrapped in a new sparse tensor every call, is not checked again (no launch, no host sync).
_passed = TensorMemo()


@opaque
def check_coords(coords: torch.Tensor, spatial_shape: tuple[int, int, int], batch_size: int,
                 check_duplicates: bool = True) -> bytes | None:
    """Validate coords against the grid; raise SparseTensorError with the first offending row.
    Returns the coordinates' identity where the check computed it (read in its sync) or knew
    it, else None. A tensor that passed on this grid before, unmodified since, is not checked
    again."""
    check_coords_layout(coords)
    n = coords.shape[0]
    if n == 0:
        return
    grid = (tuple(spatial_shape), int(batch_size))
    passed = _passed.get(coords) if check_duplicates else None
    if passed is not None and grid in passed:
        return known_identity(coords)
    identity = _check_coords(coords, grid[0], grid[1], check_duplicates)
    if check_duplicates:  # (only the whole check counts as passed)
        _passed.put(coords, _with_grid(passed, grid))
    return identity


def _with_grid(grids: frozenset | None, grid: tuple) -> frozenset:
    """grids and grid (a tensor checked on a few grids keeps them all, up to 8)."""
    grids = grids or frozenset()
    return grids | {grid} if len(grids) < 8 else frozenset({grid})


def _check_coords(coords: torch.Tensor, spatial_shape: tuple[int, int, int], batch_size: int,
                  check_duplicates: bool) -> bytes | None:
    n = coords.shape[0]
    if check_duplicates and coords.is_cuda:
        # One hash insert pass finds both, without sorting; the coordinates' identity (the plan
        # cache's name for them) is hashed alongside and read in the same host sync.
        from .planner.hashmap import coords_problem_flags, problem_rows

        identity = known_identity(coords)
        need_identity = identity is None
        with on_device_of(coords):
            # (the identity's lanes hashed by the same pass)
            flags = coords_problem_flags(coords, spatial_shape, batch_size,
                                         spare_slots=2 * need_identity, lanes=need_identity)
            release_now()  # (while the pass runs: host_waits.py)
            values = flags.tolist()  # the one host sync
        if need_identity:
            identity = digest_identity(lanes_to_digest(values[2:]))
            remember_identity(coords, identity)
        raise_coords_problems(coords, spatial_shape, batch_size, *problem_rows(values[:2], n))
        return identity
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
