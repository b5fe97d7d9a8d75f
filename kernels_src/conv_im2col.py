"""im2col for the explicit algorithm: row r of the block holds, for each offset v, the row
map[row_start + r, v] of src (zeros where the map entry is < 0), in one of two column orders:

  im2col_kernel:                column v * K + k (offset-major). Times the layer weight
                                [Co, V * Ci] transposed: the forward, and grad-weight.
  im2col_channel_major_kernel:  column k * V + v (channel-major). Times the layer weight
                                [Co * V, Ci] as it is stored: grad-input, which would otherwise
                                need the weight transposed to [V * Co, Ci] (a copy of the whole
                                weight on every backward, dearer than this order's gather;
                                scripts/results/design_measurements.md).

Both read the int32 map as it is: no map widened to int64, no zero row appended to src.
REVERSE_V: offset v reads map column V - 1 - v (submanifold grad-input).
"""
import triton
import triton.language as tl


# Both kernels: specialized on K, V (layer constants) and the alignment of src, map and out (own
# allocations); not on row_start and rows, each chunk's place and size (they vary per call).
@triton.jit(do_not_specialize=["row_start", "rows"])
def im2col_kernel(src_ptr, map_ptr, out_ptr, row_start, rows, K, V,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid: (row blocks, V). One program copies BLOCK_M rows of one offset."""
    pid_m = tl.program_id(0)
    v = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < rows
    nbr = tl.load(map_ptr + (row_start + offs_m).to(tl.int64) * V + v, mask=m_mask, other=-1)
    src_rows = nbr.to(tl.int64)[:, None] * K
    out_rows = offs_m.to(tl.int64)[:, None] * V * K + v * K
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(src_ptr + src_rows + offs_k[None, :], mask=(nbr >= 0)[:, None] & k_mask[None, :],
                    other=0.0)
        tl.store(out_ptr + out_rows + offs_k[None, :], x, mask=m_mask[:, None] & k_mask[None, :])


@triton.jit(do_not_specialize=["row_start", "rows"])
def im2col_channel_major_kernel(src_ptr, map_ptr, out_ptr, row_start, rows, K, V,
                                REVERSE_V: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_K: tl.constexpr, V_PAD: tl.constexpr):
    """Grid: (row blocks, K blocks). One program copies a [BLOCK_M, BLOCK_K, every offset] tile:
    loaded along k, stored along v (Triton moves it between the two through shared memory).
    V_PAD: V rounded up to a power of two."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_v = tl.arange(0, V_PAD)
    m_mask = offs_m < rows
    k_mask = offs_k < K
    v_mask = offs_v < V
    if REVERSE_V:
        column = V - 1 - offs_v
    else:
        column = offs_v
    nbr = tl.load(map_ptr + (row_start + offs_m).to(tl.int64)[:, None] * V + column[None, :],
                  mask=m_mask[:, None] & v_mask[None, :], other=-1)
    x = tl.load(src_ptr + nbr.to(tl.int64)[:, None, :] * K + offs_k[None, :, None],
                mask=(nbr >= 0)[:, None, :] & k_mask[None, :, None], other=0.0)
    out = out_ptr + offs_m.to(tl.int64)[:, None, None] * V * K + offs_k[None, :, None] * V + offs_v[None, None, :]
    tl.store(out, x, mask=m_mask[:, None, None] & k_mask[None, :, None] & v_mask[None, None, :])
