"""Masked-GEMM schedule of a neighbour map on the GPU (flexplan/planner/segments_triton.py drives
these; semantics: flexplan/planner/segments.py).

Offset masks travel as Gray ranks in words of WORD_BITS bits (int32 or int64), WORD_BITS - 1
mask bits each so that words stay positive and signed sorting is unsigned order. A rank is the
mask's inverse Gray code, so the mask comes back as rank ^ (rank >> 1).

`counts` is one int32 buffer whose inclusive prefix sum `scan` (int32, or int64 where its total
could pass 2^31) places every output:
entries [0, pairs_at) are the blocks of every block size (B0 << l for l < LEVELS, size after
size), entries from pairs_at on are the pairs of each (offset v, row block p) at
pairs_at + v * row_blocks + p, for the offsets v < signal_offsets that get pairs. An entry's output starts at scan[entry - 1] (0 for entry 0),
less the scan before its segment's first entry.
"""
import triton
import triton.language as tl

MISSING = tl.constexpr(-1)
# valid_kernel / valid_kernel_seg of each block size start at a multiple of 4 int32s: 16-byte
# aligned pointers, the specialization the gather-GEMM's JIT and AOT binaries see.
ALIGN = tl.constexpr(4)


# Offsets into the count buffer and the offset count take any value: specializing on them
# would only multiply binaries.
@triton.jit(do_not_specialize=["pairs_at", "signal_offsets"])
def gray_rank_kernel(nmap, ranks, counts, n, pairs_at, signal_offsets, V: tl.constexpr,
                     WORDS: tl.constexpr, WORD_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """ranks[w, i] = word w of row i's inverse-Gray-code rank (offset V-1 most significant), and
    the pair count of each offset v < signal_offsets in this program's rows. Grid: the row
    blocks."""
    MASK_BITS: tl.constexpr = WORD_BITS - 1
    ALL_ONES: tl.constexpr = (1 << MASK_BITS) - 1
    DT: tl.constexpr = ranks.dtype.element_ty
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = rows < n
    bit = tl.arange(0, WORD_BITS)
    weight = tl.full([WORD_BITS], 1, DT) << bit.to(DT)
    carry = tl.zeros([BLOCK], DT)
    for i in tl.static_range(WORDS):  # most significant word first
        w = WORDS - 1 - i
        cols = w * MASK_BITS + bit
        valid = (bit < MASK_BITS) & (cols < V)
        entry = tl.load(nmap + rows[:, None] * V + cols[None, :],
                        mask=live[:, None] & valid[None, :], other=MISSING)
        present = entry != MISSING
        word = tl.sum(tl.where(present, weight[None, :], 0), axis=1)
        for s in tl.static_range(6):  # prefix XOR from the top bit down
            if (1 << s) < MASK_BITS:
                word = word ^ (word >> (1 << s))
        word = word ^ (carry * ALL_ONES)  # parity of the higher words flips every bit here
        carry = word & 1
        tl.store(ranks + w * n + rows, word, mask=live)
        tl.store(counts + pairs_at + cols.to(tl.int64) * tl.num_programs(0) + pid,
                 tl.sum(present.to(tl.int32), axis=0), mask=valid & (cols < signal_offsets))


@triton.jit
def _sorted_masks(sorted_ranks, rows, live, n, w: tl.constexpr, WORDS: tl.constexpr,
                  MASK_BITS: tl.constexpr):
    """Word w of the offset masks of sorted rows (0 past n), from their sorted ranks."""
    rank = tl.load(sorted_ranks + w * n + rows, mask=live, other=0)
    mask = rank ^ (rank >> 1)
    if w + 1 < WORDS:  # the top bit pairs with the lowest rank bit of the word above
        above = tl.load(sorted_ranks + (w + 1) * n + rows, mask=live, other=0)
        mask = mask ^ ((above & 1) << (MASK_BITS - 1))
    return mask


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def _block_unions(sorted_ranks, unions, counts, n, rows, live, first, B: tl.constexpr,
                  CHUNK: tl.constexpr, WORDS: tl.constexpr, WORD_BITS: tl.constexpr):
    """block_masks_kernel for one block size B: this program's blocks are entries first + k.
    Returns the number of blocks of size B."""
    DT: tl.constexpr = sorted_ranks.dtype.element_ty
    lane = tl.arange(0, WORD_BITS).to(DT)
    block = tl.program_id(0) * (CHUNK // B) + tl.arange(0, CHUNK // B)
    n_blocks = (n + B - 1) // B
    count = tl.zeros([CHUNK // B], tl.int32)
    for w in tl.static_range(WORDS):
        masks = _sorted_masks(sorted_ranks, rows, live, n, w, WORDS, WORD_BITS - 1)
        # OR the words of each block's rows (one word per row); expand only the unions to bits.
        union = tl.reduce(tl.reshape(masks, [CHUNK // B, B]), 1, _bitwise_or)
        count += tl.sum(((union[:, None] >> lane[None, :]) & 1).to(tl.int32), axis=1)
        tl.store(unions + (first + block) * WORDS + w, union, mask=block < n_blocks)
    tl.store(counts + first + block, count, mask=block < n_blocks)
    return n_blocks


@triton.jit
def block_masks_kernel(sorted_ranks, order, sorted_idx, unions, counts, n, WORDS: tl.constexpr,
                       WORD_BITS: tl.constexpr, B0: tl.constexpr, LEVELS: tl.constexpr):
    """Per block of every block size: unions[entry, w] = word w of the union of its sorted rows'
    offset masks, counts[entry] = its number of offsets. Each program takes a chunk of the
    largest block's rows, so every block lies in one program. Also sorted_idx = int32(order)."""
    CHUNK: tl.constexpr = B0 << (LEVELS - 1)
    rows = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    live = rows < n
    tl.store(sorted_idx + rows, tl.load(order + rows, mask=live).to(tl.int32), mask=live)
    first = 0  # entry of block 0 of the current block size
    for l in tl.static_range(LEVELS):
        first += _block_unions(sorted_ranks, unions, counts, n, rows, live, first, B0 << l, CHUNK,
                               WORDS, WORD_BITS)


@triton.jit
def _aligned(count):
    """count rounded up to ALIGN."""
    return (count + ALIGN - 1) // ALIGN * ALIGN


@triton.jit(do_not_specialize=["entries", "kernels_at", "segs_at"])
def compact_offsets_kernel(unions, scan, plan_out, readback, n, entries, kernels_at, segs_at,
                           WORDS: tl.constexpr, WORD_BITS: tl.constexpr, B0: tl.constexpr,
                           LEVELS: tl.constexpr, FLAGS: tl.constexpr, BLOCK: tl.constexpr):
    """valid_kernel and valid_kernel_seg of every block size, into the plan's int32 buffer from
    kernels_at and segs_at on, each block size's run starting at a multiple of ALIGN: a
    block's offsets (set bits of its union, ascending) go to scan[entry - 1] minus the scan
    before its block size's first entry plus that run's start.

    Program 0 also writes what the host reads in its one sync into readback (int64), after the
    FLAGS entries the caller's kernels wrote there: the scan at the end of each block size's
    entries, then at the end of all `entries` (the pairs' end)."""
    MASK_BITS: tl.constexpr = WORD_BITS - 1
    DT: tl.constexpr = unions.dtype.element_ty
    valid_kernel = plan_out + kernels_at
    segs = plan_out + segs_at
    entry = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    block = tl.zeros([BLOCK], tl.int64)        # index within its block size
    seg_at = tl.zeros([BLOCK], tl.int64)       # where its block size's seg starts in segs
    out_at = tl.zeros([BLOCK], tl.int64)       # where its block size's offsets start
    level_start = tl.zeros([BLOCK], tl.int64)  # the scan before its block size's first entry
    first = 0  # first entry of block size l
    seg_first = 0
    out_first = 0
    scan_before = 0
    for l in tl.static_range(LEVELS):
        n_blocks = (n + (B0 << l) - 1) // (B0 << l)
        here = (entry >= first) & (entry < first + n_blocks)
        block = tl.where(here, entry - first, block)
        seg_at = tl.where(here, seg_first, seg_at)
        out_at = tl.where(here, out_first, out_at)
        level_start = tl.where(here, scan_before, level_start)
        scan_end = tl.load(scan + first + n_blocks - 1)
        tl.store(readback + FLAGS + l, scan_end, mask=tl.program_id(0) == 0)
        first += n_blocks
        seg_first += _aligned(n_blocks + 1)
        out_first += _aligned(scan_end - scan_before)
        scan_before = scan_end
    if tl.program_id(0) == 0:
        tl.store(readback + FLAGS + LEVELS, tl.load(scan + entries - 1))
    live = entry < first
    end = tl.load(scan + entry, mask=live, other=0) - level_start
    start = tl.load(scan + entry - 1, mask=live & (entry > 0), other=0) - level_start
    tl.store(segs + seg_at + block + 1, end.to(tl.int32), mask=live)
    tl.store(segs + seg_at, tl.zeros([BLOCK], tl.int32), mask=live & (block == 0))
    start += out_at
    lane = tl.arange(0, WORD_BITS)
    for w in tl.static_range(WORDS):
        word = tl.load(unions + entry * WORDS + w, mask=live, other=0)
        bits = ((word[:, None] >> lane.to(DT)[None, :]) & 1).to(tl.int32)
        at = start[:, None] + (tl.cumsum(bits, axis=1) - bits)
        tl.store(valid_kernel + at, w * MASK_BITS + lane[None, :] + 0 * bits, mask=bits != 0)
        start += tl.sum(bits, axis=1)


@triton.jit(do_not_specialize=["pairs_at", "pairs_first"])
def pairs_kernel(nmap, scan, in_rows, out_rows, seg, n, pairs_at, pairs_first, V: tl.constexpr,
                 SIGNAL: tl.constexpr, BLOCK: tl.constexpr, V_CHUNK: tl.constexpr):
    """valid_signal: the pairs (nmap[i, v], i) of this program's rows i, per offset v < SIGNAL,
    rows ascending, at position scan[its entry - 1] - pairs_first (pairs_first: the scan before
    the first pair entry). Program 0 also writes seg [SIGNAL + 1]. (A static loop over the
    offsets: a runtime one gets software-pipelined, which made the kernel 1.5x slower.) Grid: the row blocks of gray_rank. A [BLOCK, V_CHUNK] tile of the
    map at a time: one load of whole map rows and one scan down the rows for V_CHUNK offsets
    together."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = rows < n
    for v0 in tl.static_range(0, SIGNAL, V_CHUNK):
        v = v0 + tl.arange(0, V_CHUNK)
        v_ok = v < SIGNAL
        entry = tl.load(nmap + rows[:, None] * V + v[None, :], mask=live[:, None] & v_ok[None, :],
                        other=MISSING)
        present = (entry != MISSING).to(tl.int32)
        at = pairs_at + v * programs + pid
        start = tl.load(scan + at - 1, mask=v_ok & (at > 0), other=0) - pairs_first
        pos = start[None, :] + (tl.cumsum(present, axis=0) - present)
        tl.store(in_rows + pos, entry, mask=present != 0)
        tl.store(out_rows + pos, rows.to(tl.int32)[:, None] + 0 * present, mask=present != 0)
        tl.store(seg + v, start.to(tl.int32), mask=v_ok & (pid + 0 * v == 0))
    total = tl.load(scan + pairs_at + SIGNAL * programs - 1) - pairs_first
    tl.store(seg + SIGNAL, total.to(tl.int32), mask=pid == 0)
