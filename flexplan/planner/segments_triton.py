"""Triton path of segments.py: the same schedule, read straight from the int32 neighbour map.

Each step is one or two kernels plus small torch reductions; the only host syncs are the two
output sizes (all block sizes' valid_kernel lengths at once, and the number of pairs).
"""
from __future__ import annotations

import torch
import triton

from ..launcher import launch
from ..plan import GatherMap
from .segments import _WORD_BITS, sort_by_rank_words

_RANK_BLOCK = 128
_ROWS_PER_PROGRAM = 128  # union: blocks of B rows per program = this // B
_COMPACT_BLOCK = 64
_PAIRS_BLOCK = 1024


def _kernels():
    from ..kernels_src import plan_segments

    return plan_segments


def gray_code_order_triton(neighbor_map: torch.Tensor) -> torch.Tensor:
    """segments.gray_code_order(neighbor_map != MISSING), without building the mask."""
    m, v = neighbor_map.shape
    words = -(-v // _WORD_BITS)
    ranks = torch.empty((words, m), dtype=torch.int64, device=neighbor_map.device)
    if m:
        launch(_kernels().gray_rank_kernel, (triton.cdiv(m, _RANK_BLOCK),), neighbor_map, ranks, m,
               V=v, NUM_WORDS=words, BLOCK=_RANK_BLOCK)
    return sort_by_rank_words(list(ranks), v)


def _block_unions(neighbor_map: torch.Tensor, order: torch.Tensor,
                  block_sizes: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """bool [ceil(M / B), V] union of each block's offsets, per block size. Sizes that are
    multiples of the smallest one are merged from its unions instead of re-reading the map."""
    m, v = neighbor_map.shape
    base = min(block_sizes)
    unions = {}
    for block in sorted(block_sizes):
        n_blocks = -(-m // block)
        if block % base == 0 and base in unions:
            fine = unions[base]
            factor = block // base
            padded = fine.new_zeros((n_blocks * factor, v))
            padded[:fine.shape[0]] = fine
            unions[block] = padded.view(n_blocks, factor, v).any(dim=1)
            continue
        union = torch.empty((n_blocks, v), dtype=torch.int8, device=neighbor_map.device)
        group = max(1, _ROWS_PER_PROGRAM // block)
        if n_blocks:
            launch(_kernels().block_union_kernel, (triton.cdiv(n_blocks, group),), neighbor_map,
                   order, union, m, V=v, VP=triton.next_power_of_2(v), B=block, GROUP=group)
        unions[block] = union.view(torch.bool)
    return unions


def _compact_rows(flags: torch.Tensor, starts: torch.Tensor, total: int) -> torch.Tensor:
    """int32 column indices of the set entries of bool [R, V], row after row (row-wise nonzero)."""
    rows, v = flags.shape
    out = torch.empty(total, dtype=torch.int32, device=flags.device)
    if rows:
        launch(_kernels().compact_rows_kernel, (triton.cdiv(rows, _COMPACT_BLOCK),),
               flags.view(torch.int8), starts, out, rows, V=v, VP=triton.next_power_of_2(v),
               BLOCK=_COMPACT_BLOCK)
    return out


def gather_map_triton(neighbor_map: torch.Tensor, block_sizes: tuple[int, ...]) -> GatherMap:
    neighbor_map = neighbor_map.contiguous()
    order = gray_code_order_triton(neighbor_map)
    unions = _block_unions(neighbor_map, order, block_sizes)
    segs = {}
    for block, union in unions.items():
        seg = torch.zeros(union.shape[0] + 1, dtype=torch.int32, device=union.device)
        seg[1:] = union.sum(dim=1).cumsum(0)
        segs[block] = seg
    totals = torch.stack([segs[b][-1] for b in block_sizes]).tolist()  # the one host sync
    kernels = {b: _compact_rows(unions[b].contiguous(), segs[b], t)
               for b, t in zip(block_sizes, totals)}
    return GatherMap(neighbor_map, order.to(torch.int32), kernels, {b: segs[b] for b in block_sizes})


def valid_signal_triton(neighbor_map: torch.Tensor):
    """segments.valid_signal on the transposed map (columns contiguous): per-block column
    counts, their prefix sums, then one coalesced scatter."""
    m, v = neighbor_map.shape
    device = neighbor_map.device
    nmap_t = neighbor_map.t().contiguous()
    n_blocks = triton.cdiv(m, _PAIRS_BLOCK)
    counts = torch.zeros((v, n_blocks), dtype=torch.int32, device=device)
    if n_blocks:
        launch(_kernels().column_count_kernel, (n_blocks, v), nmap_t, counts, m, n_blocks,
               BLOCK=_PAIRS_BLOCK)
    # Pairs of column v, block p start after all columns < v and blocks < p of column v.
    starts = counts.view(-1).to(torch.int64).cumsum(0)
    total = int(starts[-1]) if starts.numel() else 0  # the one host sync
    starts -= counts.view(-1)
    seg = torch.full((v + 1,), total, dtype=torch.int32, device=device)
    seg[:v] = starts.view(v, n_blocks)[:, 0] if n_blocks else 0
    in_rows = torch.empty(total, dtype=torch.int32, device=device)
    out_rows = torch.empty(total, dtype=torch.int32, device=device)
    if total:
        launch(_kernels().column_pairs_kernel, (n_blocks, v), nmap_t, starts, in_rows, out_rows,
               m, n_blocks, BLOCK=_PAIRS_BLOCK)
    return in_rows, out_rows, seg
