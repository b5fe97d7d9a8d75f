"""Submanifold neighbour map through a GPU hash table of voxel keys (Triton).

Rows go into a table keyed by their packed (b, x, y, z); every row then looks up half of its
kernel offsets and fills the other half by symmetry. Equals the torch planner's map exactly.
The insert pass also checks the input (range, duplicates) on the way, so a checked build needs
no separate pass and no host sync of its own.
"""
from __future__ import annotations

import torch

from ..geometry import ConvGeometry
from ..kernels_src import hashmap as kernels
from ..launch_spec import ADDRESS, INT32, INT64, SIZE, UNREAD_ADDRESS
from ..launcher import launch
from .keys import EMPTY_KEY, key_dtype

# Tiles and warps, from sweeps (measurements: scripts/results/design_measurements.md): small
# insert programs end their probe loops sooner (each lane waits for the longest chain in its
# program): 32 rows beat 128. Lookups: 256 lanes on one warp beat 512 on four.
INSERT_LAUNCH = dict(BLOCK=32, num_warps=4)
LOOKUP_LAUNCH = dict(BLOCK=256, num_warps=1)


# The input check's slots after the table: the first row outside the grid, a duplicated row.
PROBLEM_SLOTS = 2
# The check's geometry (one insert pass, the map of a 1x1x1 kernel), made once: making and
# validating a geometry costs microseconds of host time per check.
_POINT = ConvGeometry.make(1)


# Launch descriptions: each launch written once (flexplan/launch_spec.py), for the planner below
# and the AOT build (flexplan/aot/variants.py), which records them with example arguments.

def launch_hash_insert(run, table_keys: INT64, table_vals: INT32, coords: INT32, n: SIZE,
                       n_at: ADDRESS, slot_mask: SIZE, nmap: INT32, nmap_t: INT32,
                       batch_size: SIZE, size_x: SIZE, size_y: SIZE, size_z: SIZE, volume: int,
                       key_64: bool, lanes: bool, map_t: bool) -> None:
    """The table of coords' n keys, in table_keys' first slot_mask + 1 slots, the input's
    problems in the PROBLEM_SLOTS after them; starts nmap [n, volume] (its centre column) and,
    with map_t, nmap_t [volume, n]. lanes: also coords' identity lanes (coords_hash) in the 2
    slots after the problems. n_at: UNREAD_ADDRESS, or where the live rows' count is, n the
    most (kernels_src/row_count.py)."""
    run(kernels.hash_insert_kernel, (-(-n // INSERT_LAUNCH["BLOCK"]),), table_keys, table_vals,
        coords, n, n_at, slot_mask, nmap, nmap_t, batch_size, size_x, size_y, size_z, V=volume,
        KEY_64=key_64, LANES=lanes, MAP_T=map_t, **INSERT_LAUNCH)


def launch_neighbor_map(run, table_keys: INT64, table_vals: INT32, coords: INT32, nmap: INT32,
                        nmap_t: INT32, n: SIZE, n_at: ADDRESS, slot_mask: SIZE, batch_size: SIZE,
                        size_x: SIZE, size_y: SIZE, size_z: SIZE, geometry: ConvGeometry,
                        key_64: bool, map_t: bool) -> None:
    """nmap [n, V] of a submanifold geometry (and with map_t its transpose nmap_t [V, n]): a
    lane per row and looked-up offset (half). n_at: as launch_hash_insert's."""
    (kx, ky, kz), (dx, dy, dz) = geometry.kernel_size, geometry.dilation
    lanes = n * (kx * ky * kz // 2)
    run(kernels.submanifold_neighbor_map_kernel, (-(-lanes // LOOKUP_LAUNCH["BLOCK"]),),
        table_keys, table_vals, coords, nmap, nmap_t, n, n_at, slot_mask, batch_size, size_x, size_y,
        size_z, KX=kx, KY=ky, KZ=kz, DX=dx, DY=dy, DZ=dz, KEY_64=key_64, MAP_T=map_t,
        **LOOKUP_LAUNCH)


def table_capacity(n: int) -> int:
    """A power of two >= 2n: load factor <= 1/2 keeps probe chains short."""
    return max(16, 1 << (2 * n - 1).bit_length())


def submanifold_neighbor_map_triton(coords: torch.Tensor, spatial_shape: tuple[int, int, int],
                                    batch_size: int, geometry: ConvGeometry, spare_slots: int = 0,
                                    flags: bool = True, lanes: bool = False,
                                    map_t: torch.Tensor | None = None,
                                    rows_at: int = UNREAD_ADDRESS,
                                    out: torch.Tensor | None = None
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(nmap, problems). nmap: int32 [N, V], entry (i, v) is the row at coords[i] + offset v, or
    MISSING. problems: device int64 [PROBLEM_SLOTS + spare_slots]: the first row outside the
    grid and a row whose coordinate another row also has, each as N - 1 - row, -1 where there
    is none (decode with problem_rows), then spare_slots entries for the caller (a schedule's
    sizes, read back with the problems in one sync); flags False: only the spare slots (the
    caller checked the coords before). lanes (with flags and spare_slots >= 2): the first two
    spare slots get coords' identity lanes (coords_hash.digest_lanes' values). The map only
    means something when both problems are -1, but it is always safe to read. map_t: an int32
    [V, N] tensor the kernels fill with the map's transpose too (rows in their own order: the
    gather kernels' layout of an unscheduled map). rows_at: UNREAD_ADDRESS, or the address of
    an int32 count of the rows of coords that live (a build recorded in a CUDA graph for at most
    coords' rows: planner/build_graphs.py); the map's rows past it are not written (nothing
    reads them), the problems are undefined. out: an int32 [N, V] tensor to write nmap into (else a new one). No host
    sync."""
    if lanes and not (flags and spare_slots >= 2):
        raise ValueError("identity lanes need the problem slots and two spare slots")
    n, volume = coords.shape[0], geometry.volume
    device = coords.device
    coords = coords.contiguous()
    key_64 = key_dtype(spatial_shape, batch_size) == torch.int64
    capacity = table_capacity(n)
    # The slots, then the problems and the spare slots: one fill for all (-1: empty, and none).
    keys = torch.full((capacity + PROBLEM_SLOTS + spare_slots,), EMPTY_KEY, dtype=torch.int64,
                      device=device)
    problems = keys[capacity if flags else capacity + PROBLEM_SLOTS:]
    nmap = torch.empty((n, volume), dtype=torch.int32, device=device) if out is None else out
    # 32-bit keys share their int64 slot with the row: no value table (the kernels never read
    # this one then; nmap stands in, saving an allocation per build).
    values = torch.empty(capacity, dtype=torch.int32, device=device) if key_64 else nmap
    if not n and lanes:  # (no rows: no launch; the lanes' sums over nothing are 0)
        problems[PROBLEM_SLOTS:PROBLEM_SLOTS + 2] = 0
    if n:
        transposed = map_t is not None
        nmap_t = map_t if transposed else nmap  # (not written without map_t)
        launch_hash_insert(launch, keys, values, coords, n, rows_at, capacity - 1, nmap, nmap_t,
                           batch_size, *spatial_shape, volume, key_64, lanes, transposed)
        if volume > 1:  # (1x1x1: the insert wrote the map's one column)
            launch_neighbor_map(launch, keys, values, coords, nmap, nmap_t, n, rows_at,
                                capacity - 1, batch_size, *spatial_shape, geometry, key_64,
                                transposed)
    return nmap, problems


def problem_rows(encoded: list[int], n: int) -> list[int]:
    """The rows of submanifold_neighbor_map_triton's problems (its first PROBLEM_SLOTS entries)
    read back: N where there is none."""
    return [n - 1 - value for value in encoded]


def coords_problem_flags(coords: torch.Tensor, spatial_shape: tuple[int, int, int],
                         batch_size: int, spare_slots: int = 0, lanes: bool = False) -> torch.Tensor:
    """Device int64 [PROBLEM_SLOTS + spare_slots]: the encoded first row outside the grid and a
    row whose coordinate another row also has (decode with problem_rows), then spare slots for
    the caller to read in the same sync; lanes: the first two of them coords' identity lanes
    (coords_hash), hashed in the same pass. No host sync. One hash insert pass (the map of a
    1x1x1 kernel)."""
    return submanifold_neighbor_map_triton(coords, spatial_shape, batch_size, _POINT,
                                           spare_slots=spare_slots, lanes=lanes)[1]


def coords_problems(coords: torch.Tensor, spatial_shape: tuple[int, int, int],
                    batch_size: int) -> list[int]:
    """The first row outside the grid and a row whose coordinate another row also has, N where
    there is none (one host sync)."""
    return problem_rows(coords_problem_flags(coords, spatial_shape, batch_size).tolist(),
                        coords.shape[0])
