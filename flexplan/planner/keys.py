"""Packing (batch, x, y, z) into one integer key, 32-bit while the grid allows it."""
from __future__ import annotations

import torch

# Keys are non-negative, so -1 is free to mark an empty hash slot.
EMPTY_KEY = -1
INT32_KEY_LIMIT = 2**31 - 1


def key_dtype(spatial_shape: tuple[int, int, int], batch_size: int) -> torch.dtype:
    """int32 keys while B*X*Y*Z fits in 31 bits, int64 beyond (e.g. a 2048^3 grid with batch 8)."""
    x, y, z = spatial_shape
    cells = batch_size * x * y * z
    if cells > 2**62:
        raise ValueError(f"grid of {batch_size} x {spatial_shape} cells does not fit in 64-bit keys")
    return torch.int32 if cells <= INT32_KEY_LIMIT else torch.int64


def pack_coords(coords: torch.Tensor, spatial_shape: tuple[int, int, int], batch_size: int) -> torch.Tensor:
    """Row-major key of each (b, x, y, z) row, in the dtype key_dtype() picks."""
    dtype = key_dtype(spatial_shape, batch_size)
    c = coords.to(torch.int64)
    _, sy, sz = spatial_shape
    sx = spatial_shape[0]
    keys = ((c[:, 0] * sx + c[:, 1]) * sy + c[:, 2]) * sz + c[:, 3]
    return keys.to(dtype)


def unpack_keys(keys: torch.Tensor, spatial_shape: tuple[int, int, int]) -> torch.Tensor:
    """int32 [M, 4] (b, x, y, z) rows of pack_coords keys (its inverse)."""
    k = keys.to(torch.int64)
    _, sy, sz = spatial_shape
    z, k = k % sz, k // sz
    y, k = k % sy, k // sy
    x, b = k % spatial_shape[0], k // spatial_shape[0]
    return torch.stack([b, x, y, z], dim=1).to(torch.int32)
