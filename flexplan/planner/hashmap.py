"""Submanifold neighbour map through a GPU hash table of voxel keys (Triton).

Rows go into a table keyed by their packed (b, x, y, z); every row then looks up half of its
kernel offsets and fills the other half by symmetry. Equals the torch planner's map exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..geometry import ConvGeometry
from ..launcher import launch
from ..plan import MISSING
from .keys import EMPTY_KEY, key_dtype

_INSERT_BLOCK = 256
_LOOKUP_BLOCK = 256


@dataclass(frozen=True)
class HashTable:
    keys: torch.Tensor       # [capacity] int64: 64-bit keys, or 32-bit keys packed with values
    values: torch.Tensor     # [capacity] int32 row index of 64-bit keys (empty for 32-bit ones)
    first_dup: torch.Tensor  # [1] int32: smallest row whose key was already in, else N

    @property
    def slot_mask(self) -> int:
        return self.keys.numel() - 1


def table_capacity(n: int) -> int:
    """A power of two >= 2n: load factor <= 1/2 keeps probe chains short."""
    return max(16, 1 << (2 * n - 1).bit_length())


def build_hash_table(coords: torch.Tensor, spatial_shape: tuple[int, int, int],
                     batch_size: int) -> HashTable:
    """Table of key(coords[i]) -> i, keys as keys.pack_coords packs them (computed in-kernel)."""
    from ..kernels_src import hashmap as kernels

    n = coords.shape[0]
    capacity = table_capacity(n)
    key_64 = key_dtype(spatial_shape, batch_size) == torch.int64
    device = coords.device
    table = HashTable(torch.full((capacity,), EMPTY_KEY, dtype=torch.int64, device=device),
                      torch.empty(capacity if key_64 else 1, dtype=torch.int32, device=device),
                      torch.full((1,), n, dtype=torch.int32, device=device))
    if n:
        launch(kernels.hash_insert_kernel, (triton.cdiv(n, _INSERT_BLOCK),), table.keys,
               table.values, coords.contiguous(), n, table.slot_mask, table.first_dup,
               *spatial_shape, KEY_64=key_64, BLOCK=_INSERT_BLOCK)
    return table


def first_duplicate_row(coords: torch.Tensor, spatial_shape: tuple[int, int, int],
                        batch_size: int) -> torch.Tensor:
    """Device int32 [1]: a row whose coordinate an other row also has, or N if all are
    distinct. No sort and no host sync: the hash inserts notice the repeats."""
    return build_hash_table(coords, spatial_shape, batch_size).first_dup


def submanifold_neighbor_map_triton(coords: torch.Tensor, spatial_shape: tuple[int, int, int],
                                    batch_size: int, geometry: ConvGeometry) -> torch.Tensor:
    """int32 [N, V]: entry (i, v) is the row at coords[i] + offset v, or MISSING."""
    from ..kernels_src import hashmap as kernels

    n, volume = coords.shape[0], geometry.volume
    if volume == 1:  # 1x1x1 kernel: each row is its own only neighbour
        return torch.arange(n, dtype=torch.int32, device=coords.device).view(n, 1)
    if n == 0:
        return torch.empty((0, volume), dtype=torch.int32, device=coords.device)
    coords = coords.contiguous()
    table = build_hash_table(coords, spatial_shape, batch_size)
    nmap = torch.full((n, volume), MISSING, dtype=torch.int32, device=coords.device)
    lanes = n * (volume // 2)
    launch(kernels.submanifold_neighbor_map_kernel, (triton.cdiv(lanes, _LOOKUP_BLOCK),),
           table.keys, table.values, coords, nmap, n, table.slot_mask, *spatial_shape,
           KX=geometry.kernel_size[0], KY=geometry.kernel_size[1], KZ=geometry.kernel_size[2],
           DX=geometry.dilation[0], DY=geometry.dilation[1], DZ=geometry.dilation[2],
           KEY_64=key_dtype(spatial_shape, batch_size) == torch.int64, BLOCK=_LOOKUP_BLOCK)
    return nmap
