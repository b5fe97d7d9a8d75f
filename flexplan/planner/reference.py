"""Submanifold neighbour map with plain torch ops (sort + searchsorted).

Serves as the CPU planner and as the oracle the Triton hash-table planner must equal exactly.
"""
from __future__ import annotations

import torch

from ..geometry import ConvGeometry
from ..plan import MISSING
from .keys import pack_coords
from .offsets import kernel_offsets


def lookup_coords(query: torch.Tensor, in_bounds: torch.Tensor, coords: torch.Tensor,
                  spatial_shape: tuple[int, int, int], batch_size: int) -> torch.Tensor:
    """Row of `coords` equal to each query row (any leading shape, last dim 4), MISSING if absent."""
    keys = pack_coords(coords, spatial_shape, batch_size)
    sorted_keys, order = torch.sort(keys)
    flat = query.reshape(-1, 4).clamp(min=0)  # out-of-bounds rows are masked below
    qkeys = pack_coords(flat, spatial_shape, batch_size)
    pos = torch.searchsorted(sorted_keys, qkeys).clamp_(max=max(keys.numel() - 1, 0))
    found = in_bounds.reshape(-1) & (sorted_keys[pos] == qkeys) if keys.numel() else \
        torch.zeros_like(qkeys, dtype=torch.bool)
    rows = torch.where(found, order[pos] if keys.numel() else qkeys, MISSING)
    return rows.to(torch.int32).reshape(query.shape[:-1])


def submanifold_neighbor_map_torch(coords: torch.Tensor, spatial_shape: tuple[int, int, int],
                                   batch_size: int, geometry: ConvGeometry) -> torch.Tensor:
    """int32 [N, V]: entry (i, v) is the row at coords[i] + offset v, or MISSING."""
    offsets = kernel_offsets(geometry, coords.device)                       # [V, 3]
    c = coords.to(torch.int64)
    spatial = c[:, None, 1:] + offsets[None]                                 # [N, V, 3]
    upper = torch.tensor(spatial_shape, device=coords.device)
    in_bounds = ((spatial >= 0) & (spatial < upper)).all(dim=2)
    query = torch.cat([c[:, None, :1].expand(-1, offsets.shape[0], 1), spatial], dim=2)
    return lookup_coords(query, in_bounds, coords, spatial_shape, batch_size)
