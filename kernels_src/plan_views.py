"""Views of a gather map that the gather kernels read, derived on first use (flexplan/plan.py,
GatherMap.sorted_map_t and GatherMap.chunk_order drive these; the torch expressions there are
the oracle). One launch each: a plan derives them once per map, every training step with new
coordinates, so their host time counts (a torch.sort alone is a dozen device operations).
"""
import triton
import triton.language as tl


# Not specialized: the row count (changes every step) and the volume (one binary for every
# kernel size; the map's row stride is read at run time either way). The pointers are the
# plan's own allocations and this kernel's output: specialized (always 16-byte aligned).
@triton.jit(do_not_specialize=["m", "V"])
def sorted_map_t_kernel(nmap, sorted_idx, out, m, V, BLOCK: tl.constexpr,
                        V_TILE: tl.constexpr):
    """out[v, i] = nmap[sorted_idx[i], v] for this program's BLOCK sorted rows i: nmap is the
    [m, V] map, out its [V, m] transpose in sorted-row order. V_TILE offsets at a time: whole
    map rows are read, and each offset's BLOCK entries are one contiguous store. Grid: the
    row blocks, cdiv(m, BLOCK)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < m
    row = tl.load(sorted_idx + i, mask=live, other=0).to(tl.int64)
    for v0 in range(0, V, V_TILE):
        v = v0 + tl.arange(0, V_TILE)
        ok = live[:, None] & (v < V)[None, :]
        entry = tl.load(nmap + row[:, None] * V + v[None, :], mask=ok)
        tl.store(out + v.to(tl.int64)[None, :] * m + i[:, None], entry, mask=ok)


# Not specialized: the row count. sorted_idx is read one value per chunk (its alignment would
# buy nothing).
@triton.jit(do_not_specialize=["sorted_idx", "m"])
def chunk_order_kernel(sorted_idx, order, m, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """The order in which the gather kernels run the cdiv(m, CHUNK) chunks of CHUNK sorted rows:
    the full chunks by ascending first row (sorted_idx[c * CHUNK]; ties, which a permutation
    never has, by chunk), then the partial last chunk if m % CHUNK. Each chunk c of this
    program's TILE counts the full chunks before it (its rank), comparing against TILE chunks
    at a time, and writes order[rank] = c. Grid: cdiv(cdiv(m, CHUNK), TILE) (the chunks number
    m / CHUNK: a few thousand at most, so the quadratic count is cheap)."""
    full = m // CHUNK
    chunks = full + (m % CHUNK > 0).to(tl.int32)
    c = tl.program_id(0) * TILE + tl.arange(0, TILE)
    mine = c < full
    first = tl.load(sorted_idx + c.to(tl.int64) * CHUNK, mask=mine, other=0)
    rank = tl.zeros([TILE], tl.int32)
    for t in range(0, full, TILE):
        other = t + tl.arange(0, TILE)
        theirs = other < full
        their_first = tl.load(sorted_idx + other.to(tl.int64) * CHUNK, mask=theirs, other=0)
        before = (their_first[None, :] < first[:, None]) | (
            (their_first[None, :] == first[:, None]) & (other[None, :] < c[:, None]))
        rank += tl.sum((before & theirs[None, :]).to(tl.int32), axis=1)
    rank = tl.where(mine, rank, c)  # the partial chunk (c == full) runs last
    tl.store(order + rank, c, mask=c < chunks)
