"""Masked-GEMM schedule of a neighbour map on the GPU (flexplan/planner/segments_triton.py drives
these; semantics: flexplan/planner/segments.py).

Offset masks travel as Gray ranks in words of WORD_BITS bits (int32 or int64), WORD_BITS - 1
mask bits each so that words stay positive and signed sorting is unsigned order. A rank is the
mask's inverse Gray code, so the mask comes back as rank ^ (rank >> 1).

Outputs are placed by prefix sums of counts. The offsets of the blocks of each block size
(B0 << l for l < LEVELS), in sorted-row order: by the scan of their offset counts, which
schedule_offsets_kernel counts and scans chunk by chunk. The pairs: `counts` holds the pairs of
each (offset v, row block p) at entry v * row_blocks + p, for the offsets v < signal_offsets
that get pairs (gray_rank_kernel counts them); their inclusive scan `scan` (int32, or int64
where it could pass 2^31) places each entry's pairs from scan[entry - 1] (0 for entry 0) on.
"""
import triton
import triton.language as tl

from .row_count import live_rows

MISSING = tl.constexpr(-1)
# valid_kernel / valid_kernel_seg of each block size start at a multiple of 4 int32s (16 bytes).
# (The kernels that read them do not specialize on their alignment: see conv_gather_gemm.py.)
ALIGN = tl.constexpr(4)


# Plan kernels: sizes, counts and places in the plan's buffers vary from call to call, and views
# at size-dependent places (the caller's readback slots, seg) are read or written one value at a
# time: none is specialized (specializing would only multiply binaries). The constexprs and the
# alignment of the kernels' own allocations are.
@triton.jit(do_not_specialize=["n", "n_at", "signal_offsets", "padded"])
def gray_rank_kernel(nmap, ranks, counts, n, n_at, signal_offsets, padded, V: tl.constexpr,
                     WORDS: tl.constexpr, WORD_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """ranks[w, i] = word w of row i's inverse-Gray-code rank (offset V-1 most significant), and
    the pair count of each offset v < signal_offsets in this program's rows. One word: ranks
    [n, padded) (padded <= 2n) get the largest word, which sorts after every rank (a sort
    of a fixed size, flexplan/planner/rank_sort.py). Grid: the row blocks. n_at:
    kernels_src/row_count.py (ranks [n_at's rows, padded) get the largest word, words are n
    apart)."""
    MASK_BITS: tl.constexpr = WORD_BITS - 1
    ALL_ONES: tl.constexpr = (1 << MASK_BITS) - 1
    DT: tl.constexpr = ranks.dtype.element_ty
    cap = n
    n = live_rows(n, n_at)
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
        tl.store(ranks + w * cap + rows, word, mask=live)
        tl.store(counts + cols.to(tl.int64) * tl.num_programs(0) + pid,
                 tl.sum(present.to(tl.int32), axis=0), mask=valid & (cols < signal_offsets))
    if WORDS == 1:  # this program's share of the padding: rows n + its rows
        pad = n + rows
        tl.store(ranks + pad, tl.full([BLOCK], ALL_ONES, DT), mask=pad < padded)


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def _aligned(count):
    """count rounded up to ALIGN."""
    return (count + ALIGN - 1) // ALIGN * ALIGN


# Decoupled look-back (Merrill and Garland, "Single-pass Parallel Prefix Scan with Decoupled
# Look-back", 2016): each tile publishes its sums (one per column), then its inclusive
# prefixes, in int64s that stay -1 until then; a tile adds up the sums before it, LOOK_BACK
# tiles at a time, until it meets a prefix. Tiles are taken in ticket order, so every tile
# waited on belongs to a program already running (no co-residency needed; under the
# interpreter, programs run in order and never wait). Each published word carries its whole
# message, so readers poll with volatile loads (nothing else needs ordering).
AGGREGATE = tl.constexpr(1 << 61)
PREFIX = tl.constexpr(1 << 62)
VALUE = tl.constexpr((1 << 61) - 1)


@triton.jit
def _published(ptr, valid):
    """The int64s at ptr where valid, once earlier tiles have published them (-1 until then)."""
    value = tl.load(ptr, mask=valid, other=0, volatile=True)
    while tl.sum(((value == -1) & valid).to(tl.int32)) > 0:
        value = tl.load(ptr, mask=valid, other=0, volatile=True)
    return value


@triton.jit
def _exclusive_prefix(state, tile, aggregate, columns, COLUMNS: tl.constexpr,
                      LOOK_BACK: tl.constexpr):
    """Per column, the sum over the tiles before this one of their aggregates; publishes this
    tile's. state: [tiles, columns] int64; aggregate: [COLUMNS] int64 (columns of them used)."""
    col = tl.arange(0, COLUMNS)
    used = col < columns
    tl.atomic_xchg(state + tile * columns + col, aggregate | AGGREGATE, mask=used, sem="release")
    prefix = aggregate * 0
    looking = used
    end = tile  # the window: the LOOK_BACK tiles before end
    while tl.sum(looking.to(tl.int32)) > 0:
        before = end - LOOK_BACK + tl.arange(0, LOOK_BACK)
        valid = (before >= 0)[:, None] & looking[None, :]
        published = _published(state + before[:, None] * columns + col[None, :], valid)
        # From the nearest tile with its prefix (if any) up to end: their values add up.
        nearest = tl.max(tl.where(valid & ((published & PREFIX) != 0), before[:, None], -1), axis=0)
        prefix += tl.sum(tl.where(valid & (before[:, None] >= nearest[None, :]), published & VALUE, 0),
                         axis=0)
        looking = looking & (nearest < 0) & (end > LOOK_BACK)
        end -= LOOK_BACK
    tl.atomic_xchg(state + tile * columns + col, (prefix + aggregate) | PREFIX, mask=used, sem="release")
    return prefix


@triton.jit
def _popcount(x, WORD_BITS: tl.constexpr):
    """Set bits of each non-negative int32 / int64 (SWAR, no multiply)."""
    if WORD_BITS == 64:
        x = x - ((x >> 1) & 0x5555555555555555)
        x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
        x = x + (x >> 32)
    else:
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    return (x & 0x7F).to(tl.int64)


@triton.jit
def _unions(masks, previous, l: tl.constexpr, B0: tl.constexpr, ROWS: tl.constexpr,
            WORDS_P2: tl.constexpr):
    """[ROWS // (B0 << l), WORDS_P2]: the offset-mask union of each block of size B0 << l, from
    the rows' masks (l = 0) or the unions of the size below (pairs of blocks)."""
    if l == 0:
        return tl.reduce(tl.reshape(masks, [ROWS // B0, B0, WORDS_P2]), 1, _bitwise_or)
    else:
        return tl.reduce(tl.reshape(previous, [ROWS // (B0 << l), 2, WORDS_P2]), 1, _bitwise_or)


@triton.jit
def _chunk_tile(sorted_ranks, order, nmap, map_t, sorted_idx, plan_out, readback, state, n, cap,
                c, chunks, kernels_at, segs_at, V: tl.constexpr, WORDS: tl.constexpr,
                WORD_BITS: tl.constexpr, B0: tl.constexpr, LEVELS: tl.constexpr,
                FLAGS: tl.constexpr, ROWS: tl.constexpr, LOOK_BACK: tl.constexpr):
    """Chunk c of ROWS sorted rows, which holds whole blocks of every block size: their unions
    and offset counts; one look-back with a column per block size; then each size's segs and
    offsets. sorted_idx = int32(order) on the way; the last chunk reports each size's total.
    Last (after its prefix is published: no tile waits for it), the chunk's columns of map_t
    [V, n], the map in sorted order as the gather kernels read it (plan_views.sorted_map_t).
    n: the live rows; cap: the rows the launch was made for (the ranks' word stride, the
    regions' sizes), n but in a replayed graph (kernels_src/row_count.py)."""
    MASK_BITS: tl.constexpr = WORD_BITS - 1
    WORDS_P2: tl.constexpr = triton.next_power_of_2(WORDS)
    LEVELS_P2: tl.constexpr = triton.next_power_of_2(LEVELS)
    rows = c * ROWS + tl.arange(0, ROWS)
    live = rows < n
    tl.store(sorted_idx + rows, tl.load(order + rows, mask=live).to(tl.int32), mask=live)
    word = tl.arange(0, WORDS_P2)
    at = word[None, :] * cap + rows[:, None]
    rank = tl.load(sorted_ranks + at, mask=live[:, None] & (word < WORDS)[None, :], other=0)
    above = tl.load(sorted_ranks + at + cap, mask=live[:, None] & (word + 1 < WORDS)[None, :], other=0)
    # Word w's mask; its top bit pairs with the lowest rank bit of the word above.
    masks = rank ^ (rank >> 1) ^ ((above & 1) << (MASK_BITS - 1))
    level = tl.arange(0, LEVELS_P2)
    aggregate = tl.zeros([LEVELS_P2], tl.int64)
    union = masks
    for l in tl.static_range(LEVELS):
        union = _unions(masks, union, l, B0, ROWS, WORDS_P2)
        aggregate += tl.where(level == l, tl.sum(tl.sum(_popcount(union, WORD_BITS), axis=1)), 0)
    prefix = _exclusive_prefix(state, c, aggregate, LEVELS, LEVELS_P2, LOOK_BACK)
    if c == chunks - 1:
        tl.store(readback + FLAGS + level, prefix + aggregate, mask=level < LEVELS)
    region = kernels_at  # each size's offsets: a run from the start of its worst-case region
    seg_at = segs_at
    union = masks
    for l in tl.static_range(LEVELS):
        union = _unions(masks, union, l, B0, ROWS, WORDS_P2)
        n_blocks = (n + (B0 << l) - 1) // (B0 << l)
        _write_level(plan_out, union, tl.sum(tl.where(level == l, prefix, 0)), region, seg_at, c,
                     n_blocks, B0 << l, WORDS, WORD_BITS, ROWS)
        cap_blocks = (cap + (B0 << l) - 1) // (B0 << l)
        region += _aligned(cap_blocks * V)
        seg_at += _aligned(cap_blocks + 1)
    source = tl.load(order + rows, mask=live, other=0).to(tl.int64) * V
    for v in tl.range(0, V):
        entry = tl.load(nmap + source + v, mask=live, other=MISSING)
        tl.store(map_t + v * n.to(tl.int64) + rows, entry, mask=live)


@triton.jit
def _write_level(plan_out, union, prefix, region, seg_at, c, n_blocks, B: tl.constexpr,
                 WORDS: tl.constexpr, WORD_BITS: tl.constexpr, ROWS: tl.constexpr):
    """The segs (at seg_at) and offsets (from region on) of chunk c's blocks of size B, whose
    unions are `union` [ROWS // B, words] and whose offsets start `prefix` into the size's run."""
    MASK_BITS: tl.constexpr = WORD_BITS - 1
    DT: tl.constexpr = union.dtype
    count = tl.sum(_popcount(union, WORD_BITS), axis=1)
    inclusive = prefix + tl.cumsum(count, 0)
    block = c * (ROWS // B) + tl.arange(0, ROWS // B)
    real = block < n_blocks
    tl.store(plan_out + seg_at + block + 1, inclusive.to(tl.int32), mask=real)
    tl.store(plan_out + seg_at + block, tl.zeros([ROWS // B], tl.int32), mask=real & (block == 0))
    start = region + inclusive - count
    lane = tl.arange(0, WORD_BITS)
    word = tl.arange(0, union.shape[1])
    for w in tl.static_range(WORDS):
        bits_w = tl.sum(tl.where(word[None, :] == w, union, 0), axis=1)
        bits = ((bits_w[:, None] >> lane.to(DT)[None, :]) & 1).to(tl.int32)
        out = start[:, None] + (tl.cumsum(bits, axis=1) - bits)
        tl.store(plan_out + out, w * MASK_BITS + lane[None, :] + 0 * bits, mask=(bits != 0) & real[:, None])
        start += tl.sum(bits, axis=1)


@triton.jit
def _pair_tile(counts, scan, readback, state, entries, p, pair_tiles, FLAGS: tl.constexpr,
               LEVELS: tl.constexpr, PAIR_TILE: tl.constexpr, LOOK_BACK: tl.constexpr):
    """Tile p of the pair entries: the scan of their counts (gray_rank_kernel's); the last tile
    reports the pairs' total."""
    entry = p * PAIR_TILE + tl.arange(0, PAIR_TILE)
    live = entry < entries
    count = tl.load(counts + entry, mask=live, other=0).to(tl.int64)
    inclusive = tl.cumsum(count, 0)
    total = tl.sum(count[None, :], axis=1)  # [1]: one look-back column
    prefix = tl.sum(_exclusive_prefix(state, p, total, 1, 1, LOOK_BACK))
    tl.store(scan + entry, (prefix + inclusive).to(scan.dtype.element_ty), mask=live)
    if p == pair_tiles - 1:
        tl.store(readback + FLAGS + LEVELS, prefix + tl.sum(count))


@triton.jit(do_not_specialize=["readback", "n", "n_at", "entries", "kernels_at", "segs_at",
                               "chunks", "tiles"])
def schedule_offsets_kernel(sorted_ranks, order, nmap, map_t, sorted_idx, counts, scan, plan_out,
                            readback, n, n_at, entries, kernels_at, segs_at, chunks, tiles,
                            V: tl.constexpr,
                            WORDS: tl.constexpr, WORD_BITS: tl.constexpr, B0: tl.constexpr,
                            LEVELS: tl.constexpr, FLAGS: tl.constexpr, ROWS: tl.constexpr,
                            PAIR_TILE: tl.constexpr, LOOK_BACK: tl.constexpr):
    """The schedule after the sort, in one launch of `tiles` tiles taken in ticket order:
    - `chunks` tiles of ROWS sorted rows (every block size divides ROWS): per block of every
      size, the union of its rows' offset masks and its offset count; valid_kernel_seg and the
      offsets (valid_kernel) of each size into the plan's int32 buffer plan_out, the segs of
      size l at segs_at + sum over l' < l of aligned(blocks(l') + 1), its offsets from
      kernels_at + sum over l' < l of aligned(blocks(l') * V) (worst-case regions); also
      sorted_idx = int32(order) and map_t [V, n] (map_t[v, i] = nmap[order[i], v]);
    - then tiles of PAIR_TILE of the `entries` pair entries: the inclusive scan of their counts
      (the pairs kernel places the pairs by it).
    Written for the host's one sync into readback, after the FLAGS entries the caller's kernels
    wrote: each block size's offset total, then the pairs' total. After those, readback holds
    the look-back state, all -1 before the launch: [chunks, LEVELS], [tiles - chunks], then the
    ticket counter. n_at (kernels_src/row_count.py): the layout is n's, the live rows (the
    blocks written, map_t's [V, rows]) n_at's."""
    chunk_state = readback + FLAGS + LEVELS + 1
    pair_state = chunk_state + chunks * LEVELS
    tile = tl.atomic_add(pair_state + tiles - chunks, 1) + 1
    if tile < chunks:
        if LEVELS > 0:  # (without block sizes there are no chunk tiles)
            _chunk_tile(sorted_ranks, order, nmap, map_t, sorted_idx, plan_out, readback,
                        chunk_state, live_rows(n, n_at), n, tile, chunks, kernels_at, segs_at, V, WORDS, WORD_BITS, B0,
                        LEVELS, FLAGS, ROWS, LOOK_BACK)
    else:
        _pair_tile(counts, scan, readback, pair_state, entries, tile - chunks, tiles - chunks,
                   FLAGS, LEVELS, PAIR_TILE, LOOK_BACK)


@triton.jit(do_not_specialize=["room", "seg", "n", "n_at"])
def pairs_kernel(nmap, scan, pair_rows, room, seg, n, n_at, V: tl.constexpr,
                 SIGNAL: tl.constexpr, BLOCK: tl.constexpr, V_CHUNK: tl.constexpr):
    """valid_signal: the pairs (nmap[i, v], i) of this program's rows i, per offset v < SIGNAL,
    rows ascending, at position scan[its entry - 1] of the input rows (pair_rows) and of the
    output rows (pair_rows + room). Program 0 also writes seg [SIGNAL + 1].
    (A static loop over the offsets: a runtime one gets software-pipelined, which made the
    kernel 1.5x slower.) Grid: the row blocks of gray_rank. A [BLOCK, V_CHUNK] tile of the map
    at a time: one load of whole map rows and one scan down the rows for V_CHUNK offsets
    together. n_at: kernels_src/row_count.py."""
    n = live_rows(n, n_at)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = rows < n
    in_rows, out_rows = pair_rows, pair_rows + room
    for v0 in tl.static_range(0, SIGNAL, V_CHUNK):
        v = v0 + tl.arange(0, V_CHUNK)
        v_ok = v < SIGNAL
        entry = tl.load(nmap + rows[:, None] * V + v[None, :], mask=live[:, None] & v_ok[None, :],
                        other=MISSING)
        present = (entry != MISSING).to(tl.int32)
        at = v * programs + pid
        start = tl.load(scan + at - 1, mask=v_ok & (at > 0), other=0)
        pos = start[None, :] + (tl.cumsum(present, axis=0) - present)
        tl.store(in_rows + pos, entry, mask=present != 0)
        tl.store(out_rows + pos, rows.to(tl.int32)[:, None] + 0 * present, mask=present != 0)
        tl.store(seg + v, start.to(tl.int32), mask=v_ok & (pid + 0 * v == 0))
    total = tl.load(scan + SIGNAL * programs - 1)
    tl.store(seg + SIGNAL, total.to(tl.int32), mask=pid == 0)
