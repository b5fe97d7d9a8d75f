"""Triton path of segments.py: the same schedule, read straight from the int32 neighbour map,
with one host sync.

Gray ranks hold the offset masks losslessly, so after the sort the offset unions of the blocks
of every block size come from the sorted ranks in one pass. Every size the host needs comes out
of one prefix sum over one count buffer (layout: kernels_src/plan_segments.py): the offsets of
each block, then the pairs of each (offset, row block). The scan also places each block's
offsets and each pair. The offsets go to a buffer of the worst-case size before the one sync
(the sums at the segment ends, plus the caller's flags); the pairs, after it.

Launches: gray ranks, sort, block unions, scan, offsets (and the sizes to read), read, pairs.
"""
from __future__ import annotations

import torch

from ..kernels_src import plan_segments as kernels
from ..launcher import cdiv, launch
from ..plan import BlockRuns, GatherMap
from .segments import gather_map, rank_words, sort_by_rank, valid_signal

# Tiles and warps (H100 sweeps, 2026-11-24, R = 256 / 512 / 1024 shells). gray_rank and pairs
# share their row blocks (pairs are counted per row block): 32 rows took pairs 31 / 120 / 466 us
# against 37 / 151 / 595 with 128, gray_rank the same. compact_offsets: 5 / 16 / 58 us against
# 10 / 32 / 119 with 64 entries; block_masks on one warp: 3.7 / 9.4 against 4.8 / 13.5 us on four.
ROW_BLOCK = 32
GRAY_RANK_LAUNCH = dict(BLOCK=ROW_BLOCK, num_warps=2)
PAIRS_LAUNCH = dict(BLOCK=ROW_BLOCK, num_warps=2)
COMPACT_LAUNCH = dict(BLOCK=16, num_warps=4)
BLOCK_MASKS_LAUNCH = dict(num_warps=1)
ALIGN = kernels.ALIGN.value


def pairs_v_chunk(signal_offsets: int) -> int:
    """Offsets per map tile of the pairs kernel: all 27 of a 3x3x3 kernel (or the 14 its
    mirrored pairs need) in one."""
    return min(32, 1 << (signal_offsets - 1).bit_length())


def _aligned_starts(lengths: list[int], align: int) -> list[int]:
    """Starts of runs of these lengths laid out at multiples of align, and the end."""
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + -(-length // align) * align)
    return starts


def scan_dtype(bound: int) -> torch.dtype:
    """dtype of the count buffer's prefix sum when its total is at most bound."""
    return torch.int32 if bound < 2**31 else torch.int64


def block_levels(block_sizes: tuple[int, ...]) -> tuple[int, int]:
    """(smallest, count): the sizes must double from a power of two, so that one program's
    rows hold whole blocks of every size."""
    sizes = sorted(block_sizes)
    if sizes[0] & (sizes[0] - 1) or sizes != [sizes[0] << l for l in range(len(sizes))]:
        raise ValueError(f"Triton schedule needs block sizes doubling from a power of two, got "
                         f"{tuple(block_sizes)}")
    return sizes[0], len(sizes)


def readback_slots(block_sizes: tuple[int, ...]) -> int:
    """int64 entries the schedule writes for its one host sync (after the caller's flags): the
    scan at the end of each block size's entries and of the pair entries."""
    return (block_levels(block_sizes)[1] if block_sizes else 0) + 1


def plan_schedule_triton(neighbor_map: torch.Tensor, block_sizes: tuple[int, ...],
                         signal_offsets: int, readback: torch.Tensor | None = None,
                         num_flags: int = 0):
    """segments.plan_schedule: (GatherMap or None without block sizes, the valid_signal triple of
    the offsets v < signal_offsets or None for 0, the flags as ints or None)."""
    m, v = neighbor_map.shape
    if m == 0:  # nothing to launch
        return (gather_map(neighbor_map, block_sizes, "torch") if block_sizes else None,
                valid_signal(neighbor_map, "torch", signal_offsets) if signal_offsets else None,
                readback[:num_flags].tolist() if num_flags else None)
    device = neighbor_map.device
    nmap = neighbor_map.contiguous()
    smallest, levels = block_levels(block_sizes) if block_sizes else (1, 0)
    level_blocks = [cdiv(m, smallest << l) for l in range(levels)]
    pairs_at = sum(level_blocks)
    row_blocks = cdiv(m, ROW_BLOCK)
    entries = pairs_at + signal_offsets * row_blocks
    counts = torch.empty(entries, dtype=torch.int32, device=device)
    word_bits, word_dtype, words = rank_words(v)
    # (one word: a flat tensor, so that the sort needs no row view of it)
    ranks = torch.empty((words, m) if words > 1 else m, dtype=word_dtype, device=device)
    launch(kernels.gray_rank_kernel, (row_blocks,), nmap, ranks, counts, m, pairs_at,
           signal_offsets, V=v, WORDS=words, WORD_BITS=word_bits, **GRAY_RANK_LAUNCH)
    # The plan's int32 outputs whose sizes are known before the sync share one buffer (one
    # allocation instead of four): sorted_idx, valid_kernel of every block size (sized for
    # every block having every offset, about 12% of the map's size for the shipped block sizes,
    # so that the compaction runs before the host sync instead of waiting on it), their segs,
    # and valid_signal's seg. Runs start at multiples of ALIGN.
    bound_at = _aligned_starts([blocks * v for blocks in level_blocks], ALIGN)
    seg_at = _aligned_starts([blocks + 1 for blocks in level_blocks], ALIGN)
    sorted_at, kernels_at, segs_at, signal_seg_at, out_size = _aligned_starts(
        [m if levels else 0, bound_at[-1], seg_at[-1], signal_offsets + 1 if signal_offsets else 0], ALIGN)
    plan_out = torch.empty(max(1, out_size), dtype=torch.int32, device=device)
    # Scratch is dropped as soon as the last launch that reads it is queued (the allocator
    # reuses it in stream order): before the host sync, its frees overlap the GPU's work.
    if levels:
        sorted_ranks, order = sort_by_rank(ranks)
        del ranks
        sorted_idx = plan_out[sorted_at:sorted_at + m]
        unions = torch.empty((pairs_at, words), dtype=word_dtype, device=device)
        launch(kernels.block_masks_kernel, (level_blocks[-1],), sorted_ranks, order, sorted_idx,
               unions, counts, m, WORDS=words, WORD_BITS=word_bits, B0=smallest, LEVELS=levels,
               **BLOCK_MASKS_LAUNCH)
        del sorted_ranks, order
    else:
        unions = ranks  # not read: no block sizes, no blocks
    # int32 where no sum can pass it (one launch fewer than int64's widening, and less to move):
    # each block holds at most V offsets, each row at most signal_offsets pairs.
    scan = counts.cumsum(0, dtype=scan_dtype(pairs_at * v + m * signal_offsets))
    del counts
    if readback is None:
        readback = torch.empty(num_flags + levels + 1, dtype=torch.int64, device=device)
    # The compaction also writes what the sync reads (the scan at the end of each block size's
    # entries and of the pair entries) after the caller's flags.
    launch(kernels.compact_offsets_kernel, (max(1, cdiv(pairs_at, COMPACT_LAUNCH["BLOCK"])),), unions,
           scan, plan_out, readback, m, entries, kernels_at, segs_at, WORDS=words,
           WORD_BITS=word_bits, B0=smallest, LEVELS=levels, FLAGS=num_flags, **COMPACT_LAUNCH)
    del unions
    values = readback.tolist()  # the one host sync
    flag_values = values[:num_flags] if num_flags else None
    level_ends, pairs_end = values[num_flags:-1], values[-1]
    offsets_total = level_ends[-1] if levels else 0

    pairs = None
    if signal_offsets:  # launched first: the Python below then runs while the GPU writes pairs
        total = pairs_end - offsets_total
        in_rows = torch.empty(total, dtype=torch.int32, device=device)
        out_rows = torch.empty(total, dtype=torch.int32, device=device)
        seg = plan_out[signal_seg_at:signal_seg_at + signal_offsets + 1]
        launch(kernels.pairs_kernel, (row_blocks,), nmap, scan, in_rows, out_rows, seg, m,
               pairs_at, offsets_total, V=v, SIGNAL=signal_offsets, **PAIRS_LAUNCH,
               V_CHUNK=pairs_v_chunk(signal_offsets))
        pairs = (in_rows, out_rows, seg)
    gmap = None
    if levels:
        lengths = [b - a for a, b in zip([0] + level_ends, level_ends)]  # valid_kernel per size
        kernel_at = _aligned_starts(lengths, ALIGN)  # where the kernel put them
        gmap = GatherMap(
            nmap, sorted_idx,
            BlockRuns(plan_out, {smallest << l: (kernels_at + kernel_at[l], lengths[l]) for l in range(levels)}),
            BlockRuns(plan_out, {smallest << l: (segs_at + seg_at[l], level_blocks[l] + 1) for l in range(levels)}))
    return gmap, pairs, flag_values
