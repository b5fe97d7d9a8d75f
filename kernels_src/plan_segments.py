"""Masked-GEMM schedule of a neighbour map on the GPU: Gray-code ranks, per-block offset
unions, and per-offset (input, output) pairs. Each reads the int32 [N, V] map directly, so no
[N, V] bool/int64 temporaries are made. Semantics: flexplan/planner/segments.py."""
import triton
import triton.language as tl

MISSING = tl.constexpr(-1)
# Mask bits per rank word (flexplan/planner/segments.py _WORD_BITS): words stay positive.
WORD_BITS = tl.constexpr(62)


@triton.jit
def gray_rank_kernel(nmap, ranks, n, V: tl.constexpr, NUM_WORDS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """ranks[w, i] = word w of row i's inverse-Gray-code rank (offset V-1 most significant)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = rows < n
    bit = tl.arange(0, 64)
    weight = tl.full([64], 1, tl.int64) << bit.to(tl.int64)
    all_ones = (tl.full([BLOCK], 1, tl.int64) << WORD_BITS) - 1
    carry = tl.zeros([BLOCK], tl.int64)
    for i in tl.static_range(NUM_WORDS):  # most significant word first
        w = NUM_WORDS - 1 - i
        cols = w * WORD_BITS + bit
        ok = live[:, None] & (bit[None, :] < WORD_BITS) & (cols[None, :] < V)
        entry = tl.load(nmap + rows[:, None] * V + cols[None, :], mask=ok, other=MISSING)
        word = tl.sum(tl.where(entry != MISSING, weight[None, :], 0), axis=1)
        for s in tl.static_range(6):  # prefix XOR from the top bit down
            word = word ^ (word >> (1 << s))
        word = word ^ (carry * all_ones)
        carry = word & 1
        tl.store(ranks + w * n + rows, word, mask=live)


@triton.jit
def block_union_kernel(nmap, order, union, n, V: tl.constexpr, VP: tl.constexpr,
                       B: tl.constexpr, GROUP: tl.constexpr):
    """union[k, v] = 1 if any of sorted rows order[k*B : (k+1)*B] has offset v."""
    block = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)
    rank = block[:, None] * B + tl.arange(0, B)[None, :]                    # [GROUP, B]
    row = tl.load(order + rank, mask=rank < n, other=0).to(tl.int64)
    cols = tl.arange(0, VP)
    ok = (rank < n)[:, :, None] & (cols < V)[None, None, :]
    entry = tl.load(nmap + row[:, :, None] * V + cols[None, None, :], mask=ok, other=MISSING)
    any_row = tl.max((entry != MISSING).to(tl.int8), axis=1)                # [GROUP, VP]
    n_blocks = (n + B - 1) // B
    tl.store(union + block[:, None] * V + cols[None, :], any_row,
             mask=(block < n_blocks)[:, None] & (cols < V)[None, :])


@triton.jit
def compact_rows_kernel(flags, starts, out, rows_total, V: tl.constexpr, VP: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Row r's set columns (ascending) go to out[starts[r]:]: the row-wise nonzero."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, VP)
    ok = (rows < rows_total)[:, None] & (cols < V)[None, :]
    f = tl.load(flags + rows[:, None] * V + cols[None, :], mask=ok, other=0).to(tl.int32)
    start = tl.load(starts + rows, mask=rows < rows_total, other=0).to(tl.int64)
    pos = start[:, None] + (tl.cumsum(f, axis=1) - f)
    tl.store(out + pos, cols[None, :] + 0 * f, mask=f != 0)


@triton.jit
def column_count_kernel(nmap_t, counts, n, n_blocks, BLOCK: tl.constexpr):
    """counts[v, p] = present entries of rows [p*BLOCK, (p+1)*BLOCK) in column v of the
    transposed map nmap_t [V, n]. Grid (n_blocks, V)."""
    p, v = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = p * BLOCK + tl.arange(0, BLOCK)
    entry = tl.load(nmap_t + v * n + rows, mask=rows < n, other=MISSING)
    tl.store(counts + v * n_blocks + p, tl.sum((entry != MISSING).to(tl.int32), axis=0))


@triton.jit
def column_pairs_kernel(nmap_t, starts, in_rows, out_rows, n, n_blocks, BLOCK: tl.constexpr):
    """Pairs (nmap_t[v, i], i) of column v, rows ascending, from starts[v, p] on: the
    column-wise nonzero. Grid (n_blocks, V)."""
    p, v = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = p * BLOCK + tl.arange(0, BLOCK)
    entry = tl.load(nmap_t + v * n + rows, mask=rows < n, other=MISSING)
    present = (entry != MISSING).to(tl.int32)
    pos = tl.load(starts + v * n_blocks + p) + (tl.cumsum(present, axis=0) - present)
    tl.store(in_rows + pos, entry, mask=present != 0)
    tl.store(out_rows + pos, rows, mask=present != 0)
