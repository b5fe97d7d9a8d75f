"""Split-K epilogue: out = sum_s partials[s] (+ bias), cast to out's dtype, in one pass.

The split-K convolution kernels (conv_gather_gemm, conv_wgrad) store each split's fp32 (fp64)
partial sum into an [S, ...] workspace. Reducing it with torch took a sum, then a cast or a
bias add and a copy: two or three device ops and their host dispatches per split call, in
fresh-coordinate steps that are host-bound. This kernel does the reduction, the bias and the
cast in one launch, summing the splits in order 0..S-1 in the workspace's dtype.

partials: [S, numel] contiguous; out: [numel] contiguous (any float dtype); bias: [n], added
to element i as bias[i % n] (rows of n channels), read only with HAS_BIAS.
"""
import triton
import triton.language as tl


# Not specialized: numel (rows x channels, new every call), n and splits (an elementwise pass
# gains nothing from knowing them; one binary per dtype combination and HAS_BIAS serves all).
@triton.jit(do_not_specialize=["numel", "n", "splits"])
def splitk_reduce_kernel(partials_ptr, bias_ptr, out_ptr, numel, n, splits,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    ptrs = partials_ptr + offs
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for _ in range(1, splits):
        ptrs += numel  # (pointers step in 64 bits: no int32 product of split and numel)
        acc += tl.load(ptrs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % n, mask=mask, other=0.0).to(acc.dtype)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
