"""Gather-GEMM: out[m] = sum_v src[map[m, v]] @ W_v, the one kernel of forward and grad-input.

One program computes a BLOCK_M x BLOCK_N tile of out ([M, N]) for BLOCK_M consecutive rows of
the plan's Gray-code order (order[i] is the output row); programs take those row blocks chunk
by chunk of CHUNK rows in GatherMap.chunk_order (chunks of nearby rows together, for L2 reuse
of the gathered rows). The reduction runs over (offset v,
K-chunk) pairs, gathering the rows of src through the neighbour map on the fly (implicit GEMM:
the [M, V*K] im2col matrix is never built). The map comes as GatherMap.sorted_map_t, [V, M] in
that order: a block's neighbours of one offset are one contiguous load (faster than reading
the [M, V] map row by row; scripts/results/design_measurements.md).

Constexpr switches (each a small, enumerable set, so the AOT build can list them):
  MASKED:    each block of rows only visits the offsets its rows have (valid_kernel /
             valid_kernel_seg for BLOCK_M); else all V.
  REVERSE_V: map column v pairs with weight offset V - 1 - v (submanifold grad-input).
  WEIGHT_KVN: the weight is read as [K, V, N] (grad-input reads the forward's [Co, V, Ci] as
             it is stored) instead of [N, V, K] (the forward's): no transposed copy of the
             weight per backward, a copy kernel and its host ops fewer in every training step.
  SPLIT:     grid axis 1 (of size S) splits the reduction; each split stores its fp32 partial
             sum in partials[split] of an [S, M, N] workspace, and the last split of a tile to
             finish sums the S partials in order 0..S-1 and writes the tile (conv_common.py,
             split_tile_ticket: no second launch). The split count comes from the grid, so it
             costs no compiled variant. Without SPLIT, partials and tile_counts are not read.
  PRECISION: how float32 inputs multiply (conv_common.dot_acc): ieee, tf32 or tf32x3.

The epilogue is a run-time argument (one binary serves them all, so an AOT bundle holds one
forward binary per config, not four; issue #23's size per target): epilogue ==
  EPILOGUE_NONE:        the sums as they are;
  EPILOGUE_BIAS:        plus bias[n];
  EPILOGUE_BN_RELU:     an eval-mode BatchNorm and a ReLU, read from the BatchNorm's own
                        running statistics and affine parameters at the launch (ops/conv.py,
                        BatchNormReLU): out = max((acc - mean) * weight / sqrt(var + eps) +
                        bias, 0) in the accumulator's dtype, rounded once; its four tensors in
                        the features' dtype;
  EPILOGUE_BN_RELU_F32: the same with float32 tensors (an fp32 BatchNorm under autocast).
The BatchNorm's tensors come as addresses (bn_*_addr, ints: a typed pointer would make each
dtype a binary of its own); the bias pointer, where the epilogue reads none, is a dummy. Not
for float64 features (bn_eps, a float argument, arrives as float32): their binaries leave the
BatchNorm out.

The weight is [N, V, K] contiguous: the layer weight [Co, V, Ci] for the forward, its transpose
[Ci, V, Co] for grad-input; either way tiles are K-major, which TF32 tensor cores require.
"""
import triton
import triton.language as tl

from .conv_common import dot_acc, split_partials_sum, split_tile_ticket

# The epilogues (the kernel's `epilogue` argument; the ops pass their .value).
EPILOGUE_NONE = tl.constexpr(0)
EPILOGUE_BIAS = tl.constexpr(1)
EPILOGUE_BN_RELU = tl.constexpr(2)
EPILOGUE_BN_RELU_F32 = tl.constexpr(3)


@triton.jit
def _load_norms(mean_addr, var_addr, weight_addr, bias_addr, offs_n, n_mask, NORM: tl.constexpr,
                ACC: tl.constexpr):
    """The BatchNorm's four [BLOCK_N] vectors, stored as NORM at the four addresses, in ACC."""
    ty = tl.pointer_type(NORM)
    mean = tl.load(mean_addr.to(ty) + offs_n, mask=n_mask, other=0.0).to(ACC)
    var = tl.load(var_addr.to(ty) + offs_n, mask=n_mask, other=1.0).to(ACC)
    weight = tl.load(weight_addr.to(ty) + offs_n, mask=n_mask, other=0.0).to(ACC)
    bias = tl.load(bias_addr.to(ty) + offs_n, mask=n_mask, other=0.0).to(ACC)
    return mean, var, weight, bias


# Specialized (layer constants, one binary per layer): K, N, V (K and N divisible by 16 vectorize
# the feature loads and output stores) and the alignment of the feature, weight, bias, map,
# order and output tensors (own allocations: always 16-byte aligned). Not specialized (they
# change from call to call): the row count M, and the offsets of valid_kernel and
# valid_kernel_seg, views into the plan's one int32 buffer at size-dependent places that the
# kernel reads one value at a time (alignment would buy nothing), the split-K tile counters
# (one scalar each; a dummy without SPLIT), the epilogue and the BatchNorm's addresses (never
# a binary of their own, see above).
@triton.jit(do_not_specialize=["M", "valid_kernel_ptr", "valid_kernel_seg_ptr",
                             "tile_counts_ptr", "bn_mean_addr", "bn_var_addr",
                             "bn_weight_addr", "bn_bias_addr", "epilogue"])
def conv_gather_gemm_kernel(
    src_ptr, weight_ptr, bias_ptr, map_ptr, order_ptr, chunk_order_ptr, valid_kernel_ptr,
    valid_kernel_seg_ptr, out_ptr, partials_ptr, tile_counts_ptr,
    bn_mean_addr, bn_var_addr, bn_weight_addr, bn_bias_addr, bn_eps, epilogue,
    M, K, N, V,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    MASKED: tl.constexpr, REVERSE_V: tl.constexpr, PRECISION: tl.constexpr,
    CHUNK: tl.constexpr, WEIGHT_KVN: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid_mn // n_tiles
    pid_n = pid_mn % n_tiles
    BLOCKS_PER_CHUNK: tl.constexpr = CHUNK // BLOCK_M
    chunk = tl.load(chunk_order_ptr + pid_m // BLOCKS_PER_CHUNK)
    pid_m = chunk * BLOCKS_PER_CHUNK + pid_m % BLOCKS_PER_CHUNK

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    if MASKED:
        seg_start = tl.load(valid_kernel_seg_ptr + pid_m)
        num_v = tl.load(valid_kernel_seg_ptr + pid_m + 1) - seg_start
    else:
        seg_start = 0
        num_v = V
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    arange_k = tl.arange(0, BLOCK_K)

    # This split's share of the (offset, K-chunk) iterations.
    num_kc = tl.cdiv(K, BLOCK_K)
    total = num_v * num_kc
    splits = tl.num_programs(1)
    it_lo = total * pid_k // splits
    it_hi = total * (pid_k + 1) // splits

    if src_ptr.dtype.element_ty == tl.float64:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Masked: the offset of iteration it + 1 is loaded during iteration it. The map and weight
    # loads then depend on no load of their own iteration, so Triton's pipeliner (which divides
    # num_stages among the levels of a load chain) keeps one more tile in flight for the same
    # num_stages: faster (measurements: scripts/results/design_measurements.md).
    if MASKED:
        v_next = tl.load(valid_kernel_ptr + seg_start + it_lo // num_kc, mask=it_lo < it_hi, other=0)
    for it in range(it_lo, it_hi):
        j = it // num_kc
        kc = it - j * num_kc
        if MASKED:
            v = v_next
            v_next = tl.load(valid_kernel_ptr + seg_start + (it + 1) // num_kc, mask=it + 1 < it_hi,
                             other=0)
        else:
            v = j
        nbr = tl.load(map_ptr + v.to(tl.int64) * M + offs_m, mask=m_mask, other=-1)
        if REVERSE_V:
            w_off = V - 1 - v
        else:
            w_off = v
        offs_k = kc * BLOCK_K + arange_k
        k_mask = offs_k < K
        a = tl.load(src_ptr + nbr.to(tl.int64)[:, None] * K + offs_k[None, :],
                    mask=(nbr >= 0)[:, None] & k_mask[None, :], other=0.0)
        if WEIGHT_KVN:
            b = tl.load(weight_ptr + (offs_k[:, None] * V + w_off) * N + offs_n[None, :],
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        else:
            b = tl.load(weight_ptr + (offs_n[None, :] * V + w_off) * K + offs_k[:, None],
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = dot_acc(a, b, acc, PRECISION)

    out_mask = m_mask[:, None] & n_mask[None, :]
    tile_offs = rows[:, None] * N + offs_n[None, :]
    last = True
    if SPLIT:
        split_size = M.to(tl.int64) * N  # (64-bit: S * M * N may pass 2**31)
        tl.store(partials_ptr + pid_k * split_size + tile_offs, acc, mask=out_mask)
        ticket = split_tile_ticket(tile_counts_ptr + pid_mn)
        last = ticket == splits - 1
        if last:
            acc = split_partials_sum(partials_ptr + tile_offs, out_mask, split_size, splits)
            tl.store(tile_counts_ptr + pid_mn, 0)  # ready for the next launch on this stream
    if last:
        if epilogue == EPILOGUE_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(acc.dtype)[None, :]
        if src_ptr.dtype.element_ty != tl.float64:  # (a compile-time test: see above)
            if epilogue >= EPILOGUE_BN_RELU:
                if epilogue == EPILOGUE_BN_RELU_F32:
                    mean, var, gamma, beta = _load_norms(
                        bn_mean_addr, bn_var_addr, bn_weight_addr, bn_bias_addr, offs_n, n_mask,
                        tl.float32, acc.dtype)
                else:
                    mean, var, gamma, beta = _load_norms(
                        bn_mean_addr, bn_var_addr, bn_weight_addr, bn_bias_addr, offs_n, n_mask,
                        src_ptr.dtype.element_ty, acc.dtype)
                scale = gamma / tl.sqrt_rn(var + bn_eps)  # (tl.sqrt: the fast approximation)
                # (NaN stays NaN, as torch.relu keeps it; the default maximum would drop it)
                acc = tl.maximum((acc - mean[None, :]) * scale[None, :] + beta[None, :], 0.0,
                                 propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_ptr + tile_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
