"""Torch path of segments.py: the masked-GEMM schedule of a neighbour map in plain torch ops (the
CPU path and the test oracle), and the Gray-rank words both paths share.

The bottom of the schedule's modules: segments (picks a path) -> segments_triton (the GPU path)
-> rank_sort (its sort) -> this module, which imports none of them, so the Triton path can take
its word layout, its stable sort and, for empty maps, its results from here.
"""
from __future__ import annotations

import torch

from ..plan import MISSING, GatherMap


def rank_words(volume: int) -> tuple[int, torch.dtype, int]:
    """(bits, dtype, count) of the words holding a Gray rank of `volume` offsets, least
    significant first, bits - 1 mask bits per word so that every word is positive (signed
    sorting is then unsigned order): one int32 word up to 31 offsets (a cheaper radix sort),
    else int64 words."""
    bits, dtype = (32, torch.int32) if volume <= 31 else (64, torch.int64)
    return bits, dtype, -(-volume // (bits - 1))


def gray_rank_words(present: torch.Tensor) -> torch.Tensor:
    """[words, M]: rank of each row of the bool [M, V] mask in the reflected Gray code, in the
    words rank_words(V) gives: the inverse Gray code of the mask read as a big integer (offset
    V-1 most significant), i.e. bit i of the rank is the XOR of mask bits >= i.
    """
    m, v = present.shape
    bits, dtype, count = rank_words(v)
    mask_bits = bits - 1
    ranks = torch.empty((count, m), dtype=dtype, device=present.device)
    carry = torch.zeros(m, dtype=torch.int64, device=present.device)
    for w in reversed(range(count)):  # most significant word first
        chunk = present[:, w * mask_bits:(w + 1) * mask_bits].to(torch.int64)
        word = (chunk << torch.arange(chunk.shape[1], device=chunk.device)).sum(dim=1)
        for shift in (1, 2, 4, 8, 16, 32):  # prefix XOR from the top bit down
            word = word ^ (word >> shift)
        word = word ^ (carry * ((1 << mask_bits) - 1))  # parity of the words above flips all bits
        carry = word & 1
        ranks[w] = word
    return ranks


def sort_by_rank(ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted ranks, order): stable sort of rows by their rank, [M] (one word) or [words, M]."""
    if ranks.dim() == 1:
        return torch.sort(ranks, stable=True)
    values, order = torch.sort(ranks[0], stable=True)
    for rank in ranks[1:]:  # stable sorts from the least significant word upward
        values, step = torch.sort(rank[order], stable=True)
        order = order[step]
    return (values[None] if ranks.shape[0] == 1 else ranks[:, order]), order


def gray_code_order(present: torch.Tensor) -> torch.Tensor:
    """Permutation sorting rows of the bool [M, V] mask by their rank in the reflected Gray code.

    Neighbouring rows in that order differ in few offsets, so a block of them shares most of its
    offsets and the masked kernel skips the rest.
    """
    return sort_by_rank(gray_rank_words(present))[1]


def block_valid_offsets(present_sorted: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """valid_kernel, valid_kernel_seg for blocks of `block` consecutive sorted rows."""
    m, v = present_sorted.shape
    n_blocks = -(-m // block)
    padded = present_sorted.new_zeros((n_blocks * block, v))
    padded[:m] = present_sorted
    union = padded.view(n_blocks, block, v).any(dim=1)
    seg = torch.zeros(n_blocks + 1, dtype=torch.int32, device=present_sorted.device)
    seg[1:] = union.sum(dim=1).cumsum(0)
    valid_kernel = union.nonzero()[:, 1].to(torch.int32)
    return valid_kernel, seg


def gather_map_torch(neighbor_map: torch.Tensor, block_sizes: tuple[int, ...]) -> GatherMap:
    """segments.gather_map in torch ops."""
    present = neighbor_map != MISSING
    order = gray_code_order(present)
    present_sorted = present[order]
    kernels, segs = {}, {}
    for block in block_sizes:
        kernels[block], segs[block] = block_valid_offsets(present_sorted, block)
    return GatherMap(neighbor_map, order.to(torch.int32), kernels, segs)


def valid_signal_torch(neighbor_map: torch.Tensor, signal_offsets: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """segments.valid_signal of the first `signal_offsets` offsets, in torch ops."""
    v = signal_offsets
    offset, out_rows = (neighbor_map[:, :v].t() != MISSING).nonzero(as_tuple=True)
    in_rows = neighbor_map[out_rows, offset]
    seg = torch.zeros(v + 1, dtype=torch.int32, device=neighbor_map.device)
    seg[1:] = torch.bincount(offset, minlength=v).cumsum(0)
    return in_rows.to(torch.int32), out_rows.to(torch.int32), seg
