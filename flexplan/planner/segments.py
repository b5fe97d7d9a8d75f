"""From a neighbour map to the masked-GEMM schedule: Gray-code order, per-block valid offsets,
and per-offset (input, output) pairs. Plain torch ops, shared by every planner backend."""
from __future__ import annotations

import torch

from ..plan import MISSING, GatherMap

# Mask bits per int64 word; 62 keeps every word positive so signed sorting is unsigned order.
_WORD_BITS = 62


def gray_rank_words(present: torch.Tensor) -> list[torch.Tensor]:
    """Rank of each row of the bool [M, V] mask in the reflected Gray code, as int64 words of
    _WORD_BITS bits, least significant first: the inverse Gray code of the mask read as a big
    integer (offset V-1 most significant), i.e. bit i of the rank is the XOR of mask bits >= i.
    """
    m, v = present.shape
    ranks = []
    carry = torch.zeros(m, dtype=torch.int64, device=present.device)
    all_ones = (1 << _WORD_BITS) - 1
    for start in reversed(range(0, v, _WORD_BITS)):  # most significant word first
        bits = present[:, start:start + _WORD_BITS].to(torch.int64)
        word = (bits << torch.arange(bits.shape[1], device=bits.device)).sum(dim=1)
        for shift in (1, 2, 4, 8, 16, 32):  # prefix XOR from the top bit down
            word = word ^ (word >> shift)
        word = word ^ (carry * all_ones)  # parity of the higher words flips every bit here
        carry = word & 1
        ranks.append(word)
    return ranks[::-1]


def sort_by_rank_words(ranks: list[torch.Tensor], volume: int) -> torch.Tensor:
    """Stable permutation sorting rows by their multi-word rank (words least significant first)."""
    m = ranks[0].numel() if ranks else 0
    order = torch.arange(m, device=ranks[0].device if ranks else None)
    if m == 0:
        return order
    if volume <= 31:  # the rank fits in int32: a cheaper radix sort, same permutation
        return torch.sort(ranks[0].to(torch.int32), stable=True).indices
    for rank in ranks:  # stable sorts from the least significant word upward
        order = order[torch.sort(rank[order], stable=True).indices]
    return order


def gray_code_order(present: torch.Tensor) -> torch.Tensor:
    """Permutation sorting rows of the bool [M, V] mask by their rank in the reflected Gray code.

    Neighbouring rows in that order differ in few offsets, so a block of them shares most of its
    offsets and the masked kernel skips the rest.
    """
    m, v = present.shape
    if m == 0:
        return torch.arange(0, device=present.device)
    return sort_by_rank_words(gray_rank_words(present), v)


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


def _use_triton(neighbor_map: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown segments backend {backend!r}; choose auto, torch or triton")
    return backend == "triton" or (backend == "auto" and neighbor_map.is_cuda)


def gather_map(neighbor_map: torch.Tensor, block_sizes: tuple[int, ...],
               backend: str = "auto") -> GatherMap:
    """Schedule the masked kernels for one neighbour map.

    backend: "torch", "triton" (same results, reads the map in place, one host sync) or
    "auto" (Triton on a GPU).
    """
    if _use_triton(neighbor_map, backend):
        from .segments_triton import gather_map_triton

        return gather_map_triton(neighbor_map, block_sizes)
    present = neighbor_map != MISSING
    order = gray_code_order(present)
    present_sorted = present[order]
    kernels, segs = {}, {}
    for block in block_sizes:
        kernels[block], segs[block] = block_valid_offsets(present_sorted, block)
    return GatherMap(neighbor_map, order.to(torch.int32), kernels, segs)


def valid_signal(neighbor_map: torch.Tensor,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input rows, output rows, seg [V + 1]) of all pairs, grouped by offset, ascending rows."""
    if _use_triton(neighbor_map, backend):
        from .segments_triton import valid_signal_triton

        return valid_signal_triton(neighbor_map)
    v = neighbor_map.shape[1]
    offset, out_rows = (neighbor_map.t() != MISSING).nonzero(as_tuple=True)
    in_rows = neighbor_map[out_rows, offset]
    seg = torch.zeros(v + 1, dtype=torch.int32, device=neighbor_map.device)
    seg[1:] = torch.bincount(offset, minlength=v).cumsum(0)
    return in_rows.to(torch.int32), out_rows.to(torch.int32), seg
