"""Triton path of generative.py: the plan of a strided or transposed convolution with one sort of
the candidates and one host sync (kernels: kernels_src/plan_generative.py).

    candidates   (input row, tap) -> output key, T slots per row       one launch
    sort         by key (equal keys: one output row; a captured         CUB (a graph replay
                 sort for small builds, rank_sort.py)                   for small builds)
    run starts   output row of each candidate (their scan), the         one launch
                 numbers of output rows and of candidates, read in the build's one host sync
    fwd map, out coords                                                 one launch
    bwd map      input rows gather output rows (training): the fwd map   one launch
                 transposed, with its gather layout, rows in their own order and no
                 schedule (segments.SCHEDULE_BWD_MAPS; with it, the map comes from the
                 candidates before the fwd map and gets its schedule, no sync of its own)
    fwd schedule (segments_triton, no sync of its own: the pair count is known)

Same plans as generative.generative_plan (the test oracle): outputs in ascending key order,
pairs grouped by tap. (The order of equal keys after the sort does not matter: each candidate
writes its own map entry, and an output row's coordinates are its key.)

All readbacks share one int64 buffer, filled with -1 once: the totals, the bwd schedule's
state (if any), room for the fwd schedule's (whose rows are not known until the sync), the run
starts' scan state.
"""
from __future__ import annotations

import functools

import torch

from ..geometry import ConvGeometry
from ..host_waits import release_now
from ..kernel_configs import PLAN_BLOCK_SIZES
from ..kernels_src import plan_generative as kernels
from ..launch_spec import ADDRESS, INT32, INT64, KEYS, SIZE, UNREAD_ADDRESS
from ..launcher import launch
from ..plan import MISSING, ConvPlan, GatherMap, signal_fields, with_sorted_map_t
from .keys import key_dtype
from .rank_sort import CANDIDATES, rank_sorter
from . import segments
from .segments import unscheduled_map
from .segments_triton import plan_schedule_triton, readback_bound, schedule_layout

CANDIDATES_LAUNCH = dict(BLOCK=64, num_warps=2)
ENTRIES_LAUNCH = dict(BLOCK=1024, num_warps=4)
# The run starts' scan: tiles of ENTRIES_LAUNCH's BLOCK, look-back windows as the schedule's
# (segments_triton.SCHEDULE_LAUNCH).
RUN_STARTS_LAUNCH = dict(ENTRIES_LAUNCH, LOOK_BACK=128)
TRANSPOSE_LAUNCH = dict(MISSING=MISSING, BLOCK=1024, num_warps=4)
# The sort's sentinel per key dtype: above every packed key (key_dtype keeps int32 keys below it).
SENTINEL = {torch.int32: 2**31 - 1, torch.int64: 2**63 - 1}
# The counts read in the bwd schedule's sync: output rows, candidates.
TOTALS = 2


@functools.lru_cache(maxsize=256)
def candidate_slots(geometry: ConvGeometry) -> int:
    """T: the most taps one input row can have. Transposed: every tap (all land on the grid's
    lattice). Strided: tap k of an axis reaches an output only when k d = c + p (mod s), so a
    row has at most the largest number of taps sharing one residue of k d mod s per axis
    (3x3x3 with stride 2: 8 of 27)."""
    if geometry.transposed:
        return geometry.volume
    slots = 1
    for k, s, d in zip(geometry.kernel_size, geometry.stride, geometry.dilation):
        per_residue = [0] * s
        for tap in range(k):
            per_residue[tap * d % s] += 1
        slots *= max(per_residue)
    return slots


# Launch descriptions: each launch written once (flexplan/launch_spec.py), for the planner below
# and the AOT build (flexplan/aot/variants.py), which records them with example arguments.

def launch_candidates(run, coords: INT32, keys: KEYS, taps: INT32, n: SIZE, n_at: ADDRESS,
                      padded: SIZE, size_x: SIZE, size_y: SIZE, size_z: SIZE,
                      geometry: ConvGeometry, slots: int, sent: int) -> None:
    """keys, taps [n * slots]: the candidates of coords' n rows on the output grid (slots:
    candidate_slots(geometry); sent: SENTINEL of the keys' dtype), keys padded with sent up to
    `padded` (at most twice n * slots). n_at: UNREAD_ADDRESS, or where the live rows' count
    is, n the most (kernels_src/row_count.py)."""
    (kx, ky, kz), (sx, sy, sz) = geometry.kernel_size, geometry.stride
    (px, py, pz), (dx, dy, dz) = geometry.padding, geometry.dilation
    run(kernels.generative_candidates_kernel, (-(-n // CANDIDATES_LAUNCH["BLOCK"]),), coords,
        keys, taps, n, n_at, padded, size_x, size_y, size_z, KX=kx, KY=ky, KZ=kz, SX=sx, SY=sy, SZ=sz,
        PX=px, PY=py, PZ=pz, DX=dx, DY=dy, DZ=dz, T=slots, TRANSPOSED=geometry.transposed,
        SENT=sent, **CANDIDATES_LAUNCH)


def run_starts_tiles(total: int) -> int:
    """The tiles (programs) of the run starts' scan of `total` candidates."""
    return -(-total // RUN_STARTS_LAUNCH["BLOCK"])


def launch_run_starts(run, sorted_keys: KEYS, rank: INT32, totals: INT64, total: SIZE,
                      state_at: SIZE, sent: int) -> None:
    """rank [total]: each sorted candidate's output row + 1 (the scan of where runs of equal
    keys begin); totals[0]: the output rows, totals[1]: the candidates. The scan's state:
    run_starts_tiles(total) + 1 entries of totals from state_at on, all -1."""
    tiles = run_starts_tiles(total)
    run(kernels.run_starts_kernel, (tiles,), sorted_keys, rank, totals, total, state_at, tiles,
        SENT=sent, **RUN_STARTS_LAUNCH)


def launch_scatter(run, sorted_keys: KEYS, order: INT64, rank: INT32, taps: INT32, bwd: INT32,
                   fwd: INT32, out_coords: INT32, total: SIZE, n_in: SIZE, size_x: SIZE,
                   size_y: SIZE, size_z: SIZE, slots: int, v: int, sent: int,
                   write_fwd: bool) -> None:
    """The bwd map, or (write_fwd) the fwd map and the output coordinates, from the sorted
    candidates."""
    run(kernels.generative_scatter_kernel, (-(-total // ENTRIES_LAUNCH["BLOCK"]),), sorted_keys,
        order, rank, taps, bwd, fwd, out_coords, total, n_in, size_x, size_y, size_z, T=slots,
        V=v, SENT=sent, WRITE_BWD=not write_fwd, WRITE_FWD=write_fwd, **ENTRIES_LAUNCH)


def launch_transpose_map(run, fwd: INT32, bwd: INT32, bwd_t: INT32, entries: SIZE,
                         num_in: SIZE, n_at: ADDRESS, v: int, map_t: bool) -> None:
    """bwd of fwd's `entries` (rows x v) entries; with map_t also bwd_t [v, num_in]. n_at: as
    launch_candidates' (for num_in)."""
    run(kernels.transpose_map_kernel, (-(-entries // TRANSPOSE_LAUNCH["BLOCK"]),), fwd, bwd,
        bwd_t, entries, num_in, n_at, V=v, MAP_T=map_t, **TRANSPOSE_LAUNCH)


def generative_plan_triton(coords: torch.Tensor, spatial_shape: tuple[int, int, int],
                           out_shape: tuple[int, int, int], batch_size: int,
                           geometry: ConvGeometry, training: bool = True,
                           maps_only: bool = False) -> ConvPlan:
    """The plan of generative.generative_plan on a GPU (coords already checked); training=False:
    an inference plan (no bwd map and schedule, no pairs; the sync reads just the totals);
    maps_only (with training False): no fwd schedule either (a pool's plan)."""
    device = coords.device
    coords = coords.contiguous()
    n, v = coords.shape[0], geometry.volume
    slots = candidate_slots(geometry)
    kdtype = key_dtype(out_shape, batch_size)
    sent = SENTINEL[kdtype]
    total = n * slots
    schedule_bwd = training and segments.SCHEDULE_BWD_MAPS
    # The bwd schedule's layout (its rows: the inputs), and the readbacks' places (the module's
    # docstring): the bwd schedule's slots follow the totals, as its flags.
    layout = schedule_layout(n, v, PLAN_BLOCK_SIZES, 0) if schedule_bwd else None
    fwd_at = TOTALS + (layout.readback_slots if schedule_bwd else 0)
    state_at = fwd_at + readback_bound(total, PLAN_BLOCK_SIZES, v if training else 0)
    readback = torch.full((state_at + run_starts_tiles(total) + 1,), -1, dtype=torch.int64,
                          device=device)
    taps = torch.empty(total, dtype=torch.int32, device=device)
    rank = torch.empty(total, dtype=torch.int32, device=device)
    # A captured sort's keys and outputs are ours until the last scatter is queued.
    with rank_sorter(total, 1, kdtype, device, CANDIDATES) as sorter:
        launch_candidates(launch, coords, sorter.keys, taps, n, UNREAD_ADDRESS, sorter.size,
                          *out_shape, geometry, slots, sent)
        sorted_keys, order = sorter.sort()
        launch_run_starts(launch, sorted_keys, rank, readback, total, state_at, sent)
        scatter = (sorted_keys, order, rank, taps)
        release_now()  # (while the launches above run: host_waits.py)
        n_out, pairs = readback[:TOTALS].tolist()  # the one host sync
        pairs = max(pairs, 0)  # -1: no candidate at all
        bwd_map = None
        if schedule_bwd:  # queued after the sync: the host does not wait for its schedule
            bwd = torch.full((n, v), MISSING, dtype=torch.int32, device=device)
            launch_scatter(launch, *scatter, bwd, bwd, coords, total, n, *out_shape, slots, v,
                           sent, False)
            bwd_map = plan_schedule_triton(bwd, PLAN_BLOCK_SIZES, 0, readback[TOTALS:fwd_at], 0,
                                           layout, pairs_total=0)[0]
        fwd, out_coords = scattered_fwd(scatter, total, n, n_out, pairs, out_shape, slots, v,
                                        sent)
    del scatter, sorted_keys, order, rank, taps
    if training and not schedule_bwd:
        bwd_map = transposed_gather_map(fwd, n)
    if maps_only and not training:  # (its fwd slots of the readback stay unread)
        fwd_map, signal = unscheduled_map(fwd), None
    else:
        fwd_map, signal, _ = plan_schedule_triton(fwd, PLAN_BLOCK_SIZES, v if training else 0,
                                                  readback[fwd_at:state_at], pairs_total=pairs)
    return ConvPlan(
        geometry=geometry, batch_size=batch_size, in_spatial_shape=tuple(spatial_shape),
        out_spatial_shape=out_shape, num_in=n, num_out=n_out, out_coords=out_coords, fwd=fwd_map,
        bwd=bwd_map, **signal_fields(signal, device, training))


def scattered_fwd(scatter: tuple, total: int, n_in: int, n_out: int, pairs: int,
                  out_shape: tuple[int, int, int], slots: int, v: int, sent: int):
    """(fwd map [n_out, V], out_coords [n_out, 4]) from the sorted candidates (scatter: sorted
    keys, order, rank, taps; `total` of them, padding included) after the build's sync."""
    device = scatter[0].device
    fwd = torch.full((n_out, v), MISSING, dtype=torch.int32, device=device)
    out_coords = torch.empty((n_out, 4), dtype=torch.int32, device=device)
    if pairs:
        launch_scatter(launch, *scatter, fwd, fwd, out_coords, total, n_in, *out_shape, slots, v,
                       sent, True)
    return fwd, out_coords


def transposed_map_triton(fwd: torch.Tensor, num_in: int) -> torch.Tensor:
    """bwd [num_in, V] of a fwd map [M, V] (fwd[o, v] = i  <=>  bwd[i, v] = o): one launch."""
    m, v = fwd.shape
    bwd = torch.full((num_in, v), MISSING, dtype=torch.int32, device=fwd.device)
    if m:
        launch_transpose_map(launch, fwd.contiguous(), bwd, bwd, m * v, num_in, UNREAD_ADDRESS, v,
                             False)
    return bwd


def transposed_gather_map(fwd: torch.Tensor, num_in: int) -> GatherMap:
    """The bwd map of a fwd map [M, V] as a gather map with no schedule, its rows in their own
    order and its gather layout made with it (transposed_map_and_t_triton: one launch)."""
    bwd, bwd_t = transposed_map_and_t_triton(fwd, num_in)
    return with_sorted_map_t(unscheduled_map(bwd), bwd_t)


def transposed_map_and_t_triton(fwd: torch.Tensor, num_in: int
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(bwd [num_in, V], bwd's transpose [V, num_in]) of a fwd map [M, V]: one fill of one
    buffer for both, one launch. The transpose is the gather kernels' layout of bwd with its
    rows in their own order (an inverse conv's map: sorted_map_t of its unscheduled map)."""
    m, v = fwd.shape
    entries = num_in * v
    room = -(-entries // 4) * 4  # (the transpose starts 16-byte aligned, as AOT variants are)
    both = torch.full((room + entries,), MISSING, dtype=torch.int32, device=fwd.device)
    bwd, bwd_t = both[:entries].view(num_in, v), both[room:].view(v, num_in)
    if m:
        launch_transpose_map(launch, fwd.contiguous(), bwd, bwd_t, m * v, num_in, UNREAD_ADDRESS,
                             v, True)
    return bwd, bwd_t
