"""4D coordinates, int32 [N, 5] rows (batch, d0, d1, d2, d3) as spconv's 4D layers take them:
their packed keys and their checks (layout, range, duplicates).

The key of a row is its row-major index in the [batch, D0, D1, D2, D3] grid, always int64 (the
4D planner adds offsets to keys, and a 4D grid outgrows 31 bits sooner). It equals the 3D key
of (batch * D0 + d0, d1, d2, d3) over batch_size * D0 entries: time folded into the batch axis,
so 4D keys sort like the 3D planner's. A bottom module: it asks only coords_check.
"""
from __future__ import annotations

import math

import torch

from .coords_check import SparseTensorError, raise_coords_problems


def check_grid_4d(spatial_shape, batch_size: int) -> tuple[int, int, int, int]:
    """spatial_shape as 4 ints >= 1; raises if the grid outgrows 64-bit keys."""
    shape = tuple(int(s) for s in spatial_shape)
    if len(shape) != 4:
        raise SparseTensorError(f"[N, 5] indices are 4D: spatial_shape needs 4 entries, got "
                                f"{tuple(spatial_shape)}")
    if any(s < 1 for s in shape):
        raise SparseTensorError(f"spatial_shape entries must be >= 1, got {shape}")
    if batch_size < 1:
        raise SparseTensorError(f"batch_size must be >= 1, got {batch_size}")
    if batch_size * math.prod(shape) > 2**62:
        raise SparseTensorError(f"grid of {batch_size} x {shape} cells does not fit in 64-bit keys")
    return shape  # type: ignore[return-value]


def pack_keys_4d(coords: torch.Tensor, spatial_shape) -> torch.Tensor:
    """int64 [N]: the row-major key of each (batch, d0, d1, d2, d3) row."""
    c = coords.to(torch.int64)
    keys = c[:, 0]
    for axis, size in enumerate(spatial_shape):
        keys = keys * size + c[:, axis + 1]
    return keys


def key_steps_4d(spatial_shape) -> torch.Tensor:
    """int64 [4]: how much a key grows per unit step along each axis (keys are linear in the
    coordinates, so a row shifted by an in-grid offset has its key shifted by offset @ steps)."""
    steps = [1]
    for size in reversed(spatial_shape[1:]):
        steps.insert(0, steps[0] * size)
    return torch.tensor(steps, dtype=torch.int64)


def unpack_keys_4d(keys: torch.Tensor, spatial_shape) -> torch.Tensor:
    """int32 [M, 5] rows of pack_keys_4d keys (its inverse)."""
    k = keys.to(torch.int64)
    columns = []
    for size in reversed(spatial_shape):
        columns.append(k % size)
        k = k // size
    columns.append(k)
    return torch.stack(columns[::-1], dim=1).to(torch.int32)


def check_coords_4d(coords: torch.Tensor, spatial_shape, batch_size: int) -> None:
    """Validate 4D coords: int32 [N, 5], inside the grid, no duplicates (plain torch ops, one or
    two host syncs); raise SparseTensorError naming the first offending row."""
    if not isinstance(coords, torch.Tensor) or coords.dtype != torch.int32:
        got = coords.dtype if isinstance(coords, torch.Tensor) else type(coords).__name__
        raise SparseTensorError(f"indices must be an int32 tensor, got {got}")
    if coords.dim() != 2 or coords.shape[1] != 5:
        raise SparseTensorError(f"4D indices must have shape [N, 5] (batch, d0, d1, d2, d3), got "
                                f"{tuple(coords.shape)}")
    n = coords.shape[0]
    if n == 0:
        return
    upper = torch.tensor([batch_size, *spatial_shape], dtype=torch.int32, device=coords.device)
    bad = ((coords < 0) | (coords >= upper)).any(dim=1)
    first_bad = torch.where(bad.any(), bad.to(torch.int8).argmax(), n)  # argmax: first True
    raise_coords_problems(coords, spatial_shape, batch_size, int(first_bad), n)
    sorted_keys, order = torch.sort(pack_keys_4d(coords, spatial_shape), stable=True)
    dup = (sorted_keys[1:] == sorted_keys[:-1]).nonzero()
    raise_coords_problems(coords, spatial_shape, batch_size, n,
                          int(order[dup[0, 0]]) if dup.numel() else n)
