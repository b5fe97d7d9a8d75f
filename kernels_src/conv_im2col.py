"""im2col for the explicit algorithm: out[r, v * K + k] = src[map[row_start + r, v], k].

One program copies BLOCK_M rows of one offset v; a missing neighbour (map entry < 0) writes
zeros. It reads the int32 map as it is, so the gather needs neither the map widened to int64
nor a zero row appended to src (H100, 1352 rows x 27 x 1024 fp16: the gather alone runs at
~2.3 TB/s, and the three torch ops it replaces cost about as much again).

REVERSE_V: column v of out reads map column V - 1 - v (submanifold grad-input).
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["row_start"])
def im2col_kernel(src_ptr, map_ptr, out_ptr, row_start, rows, K, V,
                  REVERSE_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    v = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < rows
    if REVERSE_V:
        column = V - 1 - v
    else:
        column = v
    nbr = tl.load(map_ptr + (row_start + offs_m).to(tl.int64) * V + column, mask=m_mask, other=-1)
    src_rows = nbr.to(tl.int64)[:, None] * K
    out_rows = offs_m.to(tl.int64)[:, None] * V * K + v * K
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(src_ptr + src_rows + offs_k[None, :], mask=(nbr >= 0)[:, None] & k_mask[None, :],
                    other=0.0)
        tl.store(out_ptr + out_rows + offs_k[None, :], x, mask=m_mask[:, None] & k_mask[None, :])
