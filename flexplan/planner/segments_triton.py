"""Triton path of segments.py: the same schedule, read straight from the int32 neighbour map,
with one host sync.

Gray ranks hold the offset masks losslessly, so after the sort one kernel takes the offset
unions of the blocks of every block size from the sorted ranks, scans their offset counts and
writes valid_kernel / valid_kernel_seg (into regions of the worst-case size, before the sync),
and scans the pair counts the gray-rank kernel left (layout: kernels_src/plan_segments.py).
The sync reads the totals (plus the caller's flags); the pairs are written after it.

Launches: gray ranks, sort (a graph replay for small builds: rank_sort.py), schedule (and the
totals to read), read, pairs.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..kernels_src import plan_segments as kernels
from ..launch_spec import ADDRESS, INT32, INT64, SCAN, SIZE, UNREAD_ADDRESS, WORDS
from ..launcher import cdiv, launch
from ..plan import BlockRuns, GatherMap, PendingCount, with_sorted_map_t
from .rank_sort import TorchSort, rank_sorter
from .segments_torch import gather_map_torch, rank_words, valid_signal_torch

# Tiles and warps, from sweeps (measurements: scripts/results/design_measurements.md). gray_rank and
# pairs share their row blocks (pairs are counted per row block): 32 rows beat 128 for both.
ROW_BLOCK = 32
GRAY_RANK_LAUNCH = dict(BLOCK=ROW_BLOCK, num_warps=2)
PAIRS_LAUNCH = dict(BLOCK=ROW_BLOCK, num_warps=2)
# schedule_offsets_kernel: chunk tiles of ROWS sorted rows (every block size divides it), pair
# tiles of PAIR_TILE entries, look-back windows of LOOK_BACK tiles: ROWS 512 the fastest of
# 512 / 1024 / 2048 on 4 warps (1 or 2 warps, or a tile per (chunk, block size), were slower);
# windows of 128 tiles faster than 32 (the pair tiles' scan halves), 256 or 512 slower
# (measurements: scripts/results/design_measurements.md).
SCHEDULE_LAUNCH = dict(ROWS=512, PAIR_TILE=1024, LOOK_BACK=128, num_warps=4)
ALIGN = kernels.ALIGN.value


def pairs_v_chunk(signal_offsets: int) -> int:
    """Offsets per map tile of the pairs kernel: all 27 of a 3x3x3 kernel (or the 14 its
    mirrored pairs need) in one."""
    return min(32, 1 << (signal_offsets - 1).bit_length())


def scan_dtype(bound: int) -> torch.dtype:
    """dtype of the count buffer's prefix sum when its total is at most bound."""
    return torch.int32 if bound < 2**31 else torch.int64


def block_levels(block_sizes: tuple[int, ...]) -> tuple[int, int]:
    """(smallest, count): the sizes must double from a power of two, up to a size that divides
    the schedule kernel's tiles of rows."""
    return _block_levels(tuple(block_sizes), SCHEDULE_LAUNCH["ROWS"])


@functools.lru_cache(maxsize=16)  # one set of block sizes per process, in practice
def _block_levels(block_sizes: tuple[int, ...], rows: int) -> tuple[int, int]:
    sizes = sorted(block_sizes)
    if (sizes[0] & (sizes[0] - 1) or sizes != [sizes[0] << l for l in range(len(sizes))]
            or sizes[-1] > rows):
        raise ValueError(f"Triton schedule needs block sizes doubling from a power of two up to "
                         f"{rows}, got {block_sizes}")
    return sizes[0], len(sizes)


def _aligned(count: int) -> int:
    return -(-count // ALIGN) * ALIGN


class ScheduleLayout(NamedTuple):
    """Sizes and places of the schedule of m rows (kernels_src/plan_segments.py). plan_out, the
    plan's int32 outputs, holds runs starting at multiples of ALIGN: sorted_idx at 0; from
    kernels_at, each block size's valid_kernel in a region sized for every block having every
    offset (kernel_starts; about 12% of the map's size for the shipped block sizes: the offsets
    are written before the host sync, not after it); from segs_at, their segs (seg_runs: block
    size -> (start, length)); valid_signal's seg at signal_seg_at."""
    smallest: int
    levels: int
    row_blocks: int
    entries: int  # pair counts: one per (offset < signal_offsets, row block)
    chunks: int  # chunk tiles of the schedule kernel; then pair tiles, `tiles` in all
    tiles: int
    kernels_at: int
    kernel_starts: tuple[int, ...]
    segs_at: int
    seg_runs: dict
    signal_seg_at: int
    out_size: int
    # int64 entries after the caller's flags, all -1 before the schedule runs: the totals its
    # one host sync reads (each block size's offsets, the pairs), then its look-back state (one
    # per chunk tile and block size, one per pair tile, a ticket).
    readback_slots: int


def schedule_layout(m: int, v: int, block_sizes: tuple[int, ...], signal_offsets: int
                    ) -> ScheduleLayout:
    """The layout of the schedule of an [m, v] map (one per build: the caller sizes its
    readback buffer by it and hands it to plan_schedule)."""
    smallest, levels = block_levels(block_sizes) if block_sizes else (1, 0)
    row_blocks = cdiv(m, ROW_BLOCK)
    entries = signal_offsets * row_blocks
    chunks = cdiv(m, SCHEDULE_LAUNCH["ROWS"]) if levels else 0
    tiles = chunks + cdiv(entries, SCHEDULE_LAUNCH["PAIR_TILE"])
    at = kernels_at = _aligned(m) if levels else 0
    blocks = [cdiv(m, smallest << l) for l in range(levels)]
    kernel_starts = []
    for count in blocks:
        kernel_starts.append(at)
        at += _aligned(count * v)
    segs_at, seg_runs = at, {}
    for l, count in enumerate(blocks):
        seg_runs[smallest << l] = (at, count + 1)
        at += _aligned(count + 1)
    signal_seg_at = at
    at += _aligned(signal_offsets + 1) if signal_offsets else 0
    return ScheduleLayout(smallest, levels, row_blocks, entries, chunks, tiles, kernels_at,
                          tuple(kernel_starts), segs_at, seg_runs, signal_seg_at, at,
                          _readback_slots(levels, chunks, tiles))


def deferred_pairs_bound(m: int, signal_offsets: int) -> int:
    """The most pairs the offsets < signal_offsets of an [m, V] map can have: every row a
    neighbour at each. A build that defers its pair count sizes the pairs by it."""
    return m * signal_offsets


def _readback_slots(levels: int, chunks: int, tiles: int) -> int:
    return levels + 1 + chunks * levels + (tiles - chunks) + 1


def readback_bound(m: int, block_sizes: tuple[int, ...], signal_offsets: int) -> int:
    """ScheduleLayout.readback_slots of any map of at most m rows (they grow with the rows): a
    caller that learns the rows later sets the room aside in a readback it fills anyway."""
    levels = block_levels(block_sizes)[1] if block_sizes else 0
    chunks = cdiv(m, SCHEDULE_LAUNCH["ROWS"]) if levels else 0
    tiles = chunks + cdiv(signal_offsets * cdiv(m, ROW_BLOCK), SCHEDULE_LAUNCH["PAIR_TILE"])
    return _readback_slots(levels, chunks, tiles)


# Launch descriptions: each launch written once (flexplan/launch_spec.py), for the planner below
# and the AOT build (flexplan/aot/variants.py), which records them with example arguments.

def launch_gray_rank(run, nmap: INT32, ranks: WORDS, counts: INT32, n: SIZE, n_at: ADDRESS,
                     signal_offsets: SIZE, padded: SIZE, v: int, words: int,
                     word_bits: int) -> None:
    """Gray ranks of nmap [n, v]'s rows (rank_words(v): words, word_bits) padded to `padded`,
    and the pair counts of the offsets < signal_offsets per row block. n_at: UNREAD_ADDRESS, or
    where the live rows' count is, n the most (kernels_src/row_count.py); so for the others."""
    run(kernels.gray_rank_kernel, (-(-n // ROW_BLOCK),), nmap, ranks, counts, n, n_at,
        signal_offsets, padded, V=v, WORDS=words, WORD_BITS=word_bits, **GRAY_RANK_LAUNCH)


def launch_schedule(run, sorted_ranks: WORDS, order: INT64, nmap: INT32, map_t: INT32,
                    sorted_idx: INT32, counts: INT32, scan: SCAN, plan_out: INT32,
                    readback: INT64, n: SIZE, n_at: ADDRESS, layout: ScheduleLayout, v: int,
                    words: int, word_bits: int, num_flags: int) -> None:
    """The schedule of n sorted rows of the [n, v] map nmap, laid out as `layout` says, and the
    map in sorted order, map_t [v, n] (with block sizes: plan_views.sorted_map_t's view)."""
    run(kernels.schedule_offsets_kernel, (layout.tiles,), sorted_ranks, order, nmap, map_t,
        sorted_idx, counts, scan, plan_out, readback, n, n_at, layout.entries, layout.kernels_at,
        layout.segs_at,
        layout.chunks, layout.tiles, V=v, WORDS=words, WORD_BITS=word_bits, B0=layout.smallest,
        LEVELS=layout.levels, FLAGS=num_flags, **SCHEDULE_LAUNCH)


def launch_pairs(run, nmap: INT32, scan: SCAN, pair_rows: INT32, room: SIZE, seg: INT32, n: SIZE,
                 n_at: ADDRESS, v: int, signal_offsets: int) -> None:
    """The pairs of nmap [n, v]'s offsets < signal_offsets: input rows, then output rows from
    `room` on, in pair_rows."""
    run(kernels.pairs_kernel, (-(-n // ROW_BLOCK),), nmap, scan, pair_rows, room, seg, n, n_at,
        V=v, SIGNAL=signal_offsets, **PAIRS_LAUNCH, V_CHUNK=pairs_v_chunk(signal_offsets))


def plan_schedule_triton(neighbor_map: torch.Tensor, block_sizes: tuple[int, ...],
                         signal_offsets: int, readback: torch.Tensor | None = None,
                         num_flags: int = 0, layout: ScheduleLayout | None = None,
                         pairs_total: int | None = None, defer_pairs: bool = False):
    """segments.plan_schedule: (GatherMap or None without block sizes, the valid_signal triple of
    the offsets v < signal_offsets or None for 0, the flags as ints or None). layout: the
    map's schedule_layout, when the caller made it already. pairs_total: the number of pairs,
    when the caller knows it (and passes no flags): then no host sync at all, the valid_kernel
    lengths stay on the device until a run is viewed (BlockRuns).
    defer_pairs (without flags): no host sync either when the count is unknown; the pairs get
    room for deferred_pairs_bound(m, signal_offsets) and the triple a fourth entry, the
    PendingCount of the pairs (plan.ConvPlan.pairs_pending)."""
    m, v = neighbor_map.shape
    if m == 0:  # nothing to launch
        return (gather_map_torch(neighbor_map, block_sizes) if block_sizes else None,
                valid_signal_torch(neighbor_map, signal_offsets) if signal_offsets else None,
                readback[:num_flags].tolist() if num_flags else None)
    nmap = neighbor_map.contiguous()
    if layout is None:
        layout = schedule_layout(m, v, block_sizes, signal_offsets)
    levels = layout.levels
    plan_out, map_t, scan, readback = schedule_launches(nmap, layout, signal_offsets, readback,
                                                        num_flags)
    if signal_offsets:  # (made before the sync: after it, the pairs' launch waits on the host)
        seg = plan_out[layout.signal_seg_at:layout.signal_seg_at + signal_offsets + 1]
    pending = None
    if defer_pairs and pairs_total is None and not num_flags:
        pending = PendingCount(readback[levels:levels + 1])  # (copied behind an event)
        flag_values, lengths = None, None
    elif pairs_total is None or num_flags:
        values = readback[:num_flags + levels + 1].tolist()  # the one host sync
        flag_values = values[:num_flags] if num_flags else None
        lengths, pairs_total = values[num_flags:-1], values[-1]
    else:
        flag_values, lengths = None, None

    pairs = None
    if signal_offsets:  # launched first: the Python below then runs while the GPU writes pairs
        # Input rows, then output rows from `room` on (16-byte aligned): one allocation.
        room = _aligned(pairs_total if pending is None
                        else deferred_pairs_bound(m, signal_offsets))
        pair_rows = torch.empty(2 * room, dtype=torch.int32, device=nmap.device)
        launch_pairs(launch, nmap, scan, pair_rows, room, seg, m, UNREAD_ADDRESS, v,
                     signal_offsets)
        if pending is None:
            pairs = (pair_rows[:pairs_total], pair_rows[room:room + pairs_total], seg)
        else:
            pairs = (pair_rows[:room], pair_rows[room:], seg, pending)
    gmap = None
    if levels:
        if lengths is not None:
            runs = {block: (start, length) for block, start, length
                    in zip(layout.seg_runs, layout.kernel_starts, lengths)}
            gmap = with_sorted_map_t(GatherMap(nmap, plan_out[:m], BlockRuns(plan_out, runs),
                                               BlockRuns(plan_out, layout.seg_runs)), map_t)
        else:
            gmap = deferred_gather_map(nmap, plan_out, map_t, layout, layout.seg_runs)
    return gmap, pairs, flag_values


def schedule_launches(nmap: torch.Tensor, layout: ScheduleLayout, signal_offsets: int,
                      readback: torch.Tensor | None, num_flags: int,
                      rows_at: int = UNREAD_ADDRESS, plan_out: torch.Tensor | None = None,
                      map_t: torch.Tensor | None = None):
    """(plan_out, map_t, scan, readback): the launches of an [m, v] map's schedule up to its
    totals (gray ranks, sort, schedule; the pairs come after, by the scan), into new buffers
    laid out as `layout` (the map's schedule_layout) says; map_t [v, m] (None without block
    sizes); readback made where None is given. rows_at: UNREAD_ADDRESS, or the address of the
    int32 count of nmap's rows that live (a build recorded in a CUDA graph: the layout is m's,
    map_t's rows the live count's, planner/build_graphs.py). plan_out, map_t: int32 tensors
    of their sizes to write them into (else new ones; map_t only with block sizes)."""
    m, v = nmap.shape
    device = nmap.device
    levels, entries = layout.levels, layout.entries
    # The plan's int32 outputs share one buffer (one allocation, not four).
    if plan_out is None:
        plan_out = torch.empty(max(1, layout.out_size), dtype=torch.int32, device=device)
    # Without pairs the counts are neither written nor read (no offset gets pairs, no pair
    # tile runs): the kernels get plan_out in their place, one allocation fewer.
    counts = (torch.empty(entries, dtype=torch.int32, device=device) if entries else plan_out)
    word_bits, word_dtype, words = rank_words(v)
    # (without block sizes nothing is sorted: the ranks are only computed with the pair counts)
    sorter = (rank_sorter if levels else TorchSort)(m, words, word_dtype, device)
    with sorter:  # a captured sort's keys and outputs are ours until the schedule is queued
        ranks = sorter.keys
        launch_gray_rank(launch, nmap, ranks, counts, m, rows_at, signal_offsets, sorter.size, v,
                         words, word_bits)
        if levels:
            sorted_ranks, order = sorter.sort()
            sorted_idx = plan_out[:m]
            # The map in sorted order, as the gather kernels read it, written by the schedule
            # on the way (else one more launch at the map's first convolution).
            if map_t is None:
                map_t = torch.empty((v, m), dtype=torch.int32, device=device)
        else:  # not read: no block sizes, no blocks
            sorted_ranks = order = sorted_idx = counts
            map_t = None
        # int32 where no sum can pass it (then in place of the counts): each row has at most
        # signal_offsets pairs.
        scan = (counts if scan_dtype(m * signal_offsets) == torch.int32
                else torch.empty(max(1, entries), dtype=torch.int64, device=device))
        if readback is None:
            readback = torch.full((num_flags + layout.readback_slots,), -1, dtype=torch.int64,
                                  device=device)
        launch_schedule(launch, sorted_ranks, order, nmap, counts if map_t is None else map_t,
                        sorted_idx, counts, scan, plan_out, readback, m, rows_at, layout, v,
                        words, word_bits, num_flags)
    # Scratch is dropped once the last launch that reads it is queued (the allocator reuses it
    # in stream order): before the host sync, its frees overlap the GPU's work.
    del ranks, sorted_ranks, order, counts
    return plan_out, map_t, scan, readback


def deferred_gather_map(nmap: torch.Tensor, plan_out: torch.Tensor, map_t: torch.Tensor,
                        layout: ScheduleLayout, seg_runs: dict) -> GatherMap:
    """The GatherMap of a schedule whose valid_kernel lengths stay on the device: each run's
    room ends where the next begins, its length is its seg's last entry. seg_runs: block size ->
    (start, blocks + 1) of its seg (layout.seg_runs, but for a build recorded for more rows than
    live: the live rows' blocks at the layout's places); sorted_idx: plan_out's first rows."""
    ends = (*layout.kernel_starts[1:], layout.segs_at)
    runs = {block: (start, end - start, seg_at + seg_count - 1)
            for (block, (seg_at, seg_count)), start, end
            in zip(seg_runs.items(), layout.kernel_starts, ends)}
    return with_sorted_map_t(GatherMap(nmap, plan_out[:nmap.shape[0]], BlockRuns(plan_out, runs),
                                       BlockRuns(plan_out, seg_runs)), map_t)
