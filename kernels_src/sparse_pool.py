"""Sparse max / average pooling over a plan's gather maps (no atomics: bitwise reproducible).

Forward, per output row o and channel c, over the taps v whose map entry i = nmap[o, v] exists:
    max: out = max_v feats[i, c], arg[o, c] = the first i (in tap order) that reaches it;
         ZERO_FLOOR: max(0, that) (spconv's SparseMaxPool), arg -1 where 0 wins
    avg: out = sum_v feats[i, c] / count[o], count[o] = the number of such taps (spconv's rule:
         the real point count, not the kernel volume)
Backward, per input row i, over the taps v whose bwd entry o = bmap[i, v] exists (a submanifold
plan's fwd map serves as is: its window is symmetric, and the sum runs over all taps):
    max: grad_in[i, c] = sum_v grad_out[o, c] where arg[o, c] == i
    avg: grad_in[i, c] = sum_v grad_out[o, c] / count[o]
Both accumulate in fp32 (fp64 for float64 inputs) and store in the features' dtype.
"""
import triton
import triton.language as tl


# Specialized: V, the channel count C (a layer constant) and the alignment of every tensor.
# Not specialized: the row counts, which change with every set of coordinates.
@triton.jit(do_not_specialize=["rows"])
def sparse_pool_fwd_kernel(feats, nmap, out, arg, count, rows, C, V: tl.constexpr,
                           IS_MAX: tl.constexpr, ZERO_FLOOR: tl.constexpr,
                           WRITE_ARG: tl.constexpr, FP64: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live_o = o < rows
    live = live_o[:, None] & (c[None, :] < C)
    # fp32 (fp64 for float64): exact for a max of 16-bit values, and the sum of avg
    if FP64:
        total = tl.zeros((BLOCK_M, BLOCK_C), tl.float64)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)
    best = total + float("-inf")
    best_i = tl.full((BLOCK_M, BLOCK_C), -1, tl.int32)
    seen = tl.zeros((BLOCK_M,), tl.int32)
    for v in range(V):
        i = tl.load(nmap + o * V + v, mask=live_o, other=-1)
        has = i >= 0
        x = tl.load(feats + i.to(tl.int64)[:, None] * C + c[None, :], mask=live & has[:, None],
                    other=0.0).to(total.dtype)
        if IS_MAX:
            # a NaN wins and stays (NaN > x is false), as torch's max propagates it
            better = has[:, None] & ((x > best) | (x != x) | (best_i < 0))
            best = tl.where(better, x, best)
            best_i = tl.where(better, i[:, None], best_i)
        else:
            total += x
            seen += has.to(tl.int32)
    if IS_MAX:
        if ZERO_FLOOR:  # 0 wins unless a value passes it: no input gets the gradient
            best_i = tl.where(best > 0, best_i, -1)
        result = tl.where(best_i >= 0, best, tl.zeros_like(best))
        if WRITE_ARG:
            tl.store(arg + o[:, None] * C + c[None, :], best_i, mask=live)
    else:
        n = tl.maximum(seen, 1).to(total.dtype)
        result = total / n[:, None]
        if WRITE_ARG:
            if tl.program_id(1) == 0:  # one channel block writes the counts
                tl.store(count + o, n.to(tl.float32), mask=live_o)
    tl.store(out + o[:, None] * C + c[None, :], result.to(out.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["rows"])
def sparse_pool_bwd_kernel(grad_out, bmap, arg, count, grad_in, rows, C, V: tl.constexpr,
                           IS_MAX: tl.constexpr, FP64: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live_i = i < rows
    live = live_i[:, None] & (c[None, :] < C)
    if FP64:
        acc = tl.zeros((BLOCK_M, BLOCK_C), tl.float64)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)
    for v in range(V):
        o = tl.load(bmap + i * V + v, mask=live_i, other=-1)
        has = o >= 0
        m = live & has[:, None]
        o64 = o.to(tl.int64)[:, None]
        g = tl.load(grad_out + o64 * C + c[None, :], mask=m, other=0.0).to(acc.dtype)
        if IS_MAX:
            winner = tl.load(arg + o64 * C + c[None, :], mask=m, other=-1)
            acc += tl.where(winner == i[:, None], g, tl.zeros_like(g))
        else:
            n = tl.load(count + o, mask=live_i & has, other=1.0).to(acc.dtype)
            acc += g / n[:, None]
    tl.store(grad_in + i[:, None] * C + c[None, :], acc.to(grad_in.dtype.element_ty), mask=live)
