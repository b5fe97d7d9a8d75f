"""Pieces shared by the convolution kernels."""
import os

import triton
import triton.language as tl

# Triton's interpreter (CPU) gets bfloat16 tl.dot wrong (seen with Triton 3.9: results off by
# ~1e10); there, and only there, bfloat16 operands are widened to float32 first.
_WIDEN_BF16_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def dot_acc(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b with the accumulator's precision; float32 operands multiply as PRECISION
    says (tl.dot's input_precision: "ieee", "tf32" or "tf32x3"; kernel_configs.dot_precision)."""
    if a.dtype == tl.float64:
        # Multiply-adds on the CUDA cores: Triton 3.6 cannot lower a float64 tl.dot for sm_90,
        # and float64 is the correctness path (gradcheck), run with small tiles. (if / else,
        # not an early return: Triton 3.6 would still compile the tl.dot below.)
        acc = acc + tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
        if _WIDEN_BF16_DOT and a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if a.dtype == tl.float32:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def split_tile_ticket(count_ptr):
    """Called by each split of a split-K tile once its partial sum is stored: how many splits of
    the tile stored theirs before this one (the last one sees S - 1 and sums the partials).

    The counters live in a zeroed int32 buffer that the last split resets after reading, so a
    buffer serves launch after launch on its stream (ops/conv.py, split_tile_counts). The
    barrier orders every thread's partial stores before the one atomic, whose acq_rel
    semantics (GPU scope) publish them to the program that draws the last ticket and make
    them visible to it (the pattern of CUTLASS's serial split-K semaphore); that program
    reads them past L1 (.cg). One thread runs the atomic; the second barrier makes its
    acquire every thread's (on AMD the barrier Triton adds to share the ticket fences local
    memory only, so formally just the atomic's wave would acquire)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    tl.debug_barrier()
    return ticket


@triton.jit
def split_partials_sum(ptrs, mask, split_size, splits):
    """The sum of a tile's S split-K partials (at ptrs, ptrs + split_size, ...) in the order
    0..S-1, the same bits whichever split draws the last ticket and sums them; read past L1
    (.cg: other programs wrote them, split_tile_ticket)."""
    acc = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for _ in range(1, splits):
        ptrs += split_size
        acc += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    return acc
