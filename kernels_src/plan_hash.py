"""One-pass 128-bit hash of int64 words for the plan cache key (flexplan/cache/key.py).

Same function as key.py's torch path, bit for bit: per word w at position i and per lane,
x = w ^ (i * STEP); splitmix64 finalizer; sum over words modulo 2**64. Each program writes its
two partial sums; the caller adds them up (integer sums do not depend on order).
"""
import triton
import triton.language as tl


@triton.jit
def _lane(w, pos, step, mul1, mul2, mask):
    x = w ^ (pos * step)
    x = x ^ (x >> 30)
    x = x * mul1
    x = x ^ (x >> 27)
    x = x * mul2
    x = x ^ (x >> 31)
    return tl.sum(tl.where(mask, x, 0), axis=0)


@triton.jit
def lane_sums(w, pos, mask):
    """The two lanes' sums over the masked words w (uint64) at positions pos (uint64): the
    constants of coords_hash._LANES (splitmix64 and murmur3 fmix64)."""
    a = _lane(w, pos, 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, mask)
    b = _lane(w, pos, 0xC2B2AE3D27D4EB4F, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, mask)
    return a, b


# Not specialized on the word count (it varies); specialized on the words' alignment (coords are
# whole 16-byte rows: any row view of them is aligned) for vectorized loads.
@triton.jit(do_not_specialize=["n_words"])
def plan_hash_kernel(words_ptr, partial_ptr, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_words
    # uint64: shifts are logical and products wrap, as in the torch path's masked int64 ops.
    w = tl.load(words_ptr + offs, mask=mask, other=0).to(tl.uint64, bitcast=True)
    pos = offs.to(tl.uint64)
    a, b = lane_sums(w, pos, mask)
    tl.store(partial_ptr + pid * 2, a.to(tl.int64, bitcast=True))
    tl.store(partial_ptr + pid * 2 + 1, b.to(tl.int64, bitcast=True))
