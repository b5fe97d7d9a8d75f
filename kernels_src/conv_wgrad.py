"""Grad-weight over the plan's (input row, output row) pairs, grouped by offset.

dW[:, v, :] = sum over the pairs p of offset v of grad_out[o_p]^T in[i_p]: per offset a
[Co, P_v] x [P_v, Ci] GEMM whose reduction runs over that offset's pairs. The plan holds the
pairs of the first S offsets; an offset v >= S (submanifold plans) takes those of V - 1 - v
with input and output rows swapped. Grid:
(Co tiles x Ci tiles, V, S); split s of offset v takes the s-th of S equal slices of its pairs.
dW ([Co, V, Ci], the weight's layout) is stored in out's dtype (the weight's). With SPLIT each
split stores its fp32 partial sum into an [S, Co, V, Ci] workspace, and the last split of a tile
to finish sums the S partials in order and stores the tile (conv_common.split_tile_ticket);
without it, partials and tile_counts are not read.
"""
import triton
import triton.language as tl

from .conv_common import dot_acc, split_partials_sum, split_tile_ticket


# Specialized (layer constants): CO, CI, V, S and the alignment of grad_out, src and out. Not
# specialized: the pair tensors, views into the plan's pair buffer at size-dependent places,
# read from run-time offsets (pair_seg) where alignment buys nothing, and the split-K tile
# counters (one scalar each; a dummy without SPLIT). No size is an argument.
@triton.jit(do_not_specialize=["pair_out_ptr", "pair_in_ptr", "pair_seg_ptr", "tile_counts_ptr"])
def conv_wgrad_kernel(
    grad_out_ptr, src_ptr, pair_out_ptr, pair_in_ptr, pair_seg_ptr, out_ptr, partials_ptr,
    tile_counts_ptr, CO, CI, V, S,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    v = tl.program_id(1)
    pid_k = tl.program_id(2)
    n_tiles = tl.cdiv(CI, BLOCK_N)
    pid_m = pid_mn // n_tiles
    pid_n = pid_mn % n_tiles

    offs_co = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    co_mask = offs_co < CO
    offs_ci = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ci_mask = offs_ci < CI
    arange_p = tl.arange(0, BLOCK_K)

    mirrored = v >= S
    stored = tl.where(mirrored, V - 1 - v, v)
    seg_lo = tl.load(pair_seg_ptr + stored)
    count = tl.load(pair_seg_ptr + stored + 1) - seg_lo
    splits = tl.num_programs(2)
    p_lo = seg_lo + count * pid_k // splits
    p_hi = seg_lo + count * (pid_k + 1) // splits

    if src_ptr.dtype.element_ty == tl.float64:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p in range(p_lo, p_hi, BLOCK_K):
        offs_p = p + arange_p
        p_mask = offs_p < p_hi
        rows_a = tl.load(pair_out_ptr + offs_p, mask=p_mask, other=0).to(tl.int64)
        rows_b = tl.load(pair_in_ptr + offs_p, mask=p_mask, other=0).to(tl.int64)
        rows_o = tl.where(mirrored, rows_b, rows_a)
        rows_i = tl.where(mirrored, rows_a, rows_b)
        a = tl.load(grad_out_ptr + rows_o[None, :] * CO + offs_co[:, None],
                    mask=p_mask[None, :] & co_mask[:, None], other=0.0)
        b = tl.load(src_ptr + rows_i[:, None] * CI + offs_ci[None, :],
                    mask=p_mask[:, None] & ci_mask[None, :], other=0.0)
        acc = dot_acc(a, b, acc, PRECISION)

    out_offs = offs_co[:, None] * (V * CI) + v * CI + offs_ci[None, :]
    out_mask = co_mask[:, None] & ci_mask[None, :]
    last = True
    if SPLIT:
        split_size = CO * V * CI
        tl.store(partials_ptr + pid_k.to(tl.int64) * split_size + out_offs, acc, mask=out_mask)
        count_ptr = tile_counts_ptr + pid_mn * V + v
        last = split_tile_ticket(count_ptr) == splits - 1
        if last:
            acc = split_partials_sum(partials_ptr + out_offs, out_mask, split_size, splits)
            tl.store(count_ptr, 0)  # ready for the next launch on this stream
    if last:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
