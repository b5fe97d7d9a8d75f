"""Plans of strided and transposed convolutions on the GPU (flexplan/planner/generative_triton.py
drives these; the rules and the torch oracle: flexplan/planner/generative.py).

Every (input row i, tap v) whose output falls on the output grid is a candidate; a row has at
most T of them (T: the taps of one stride residue, see generative_triton.candidate_slots), so
candidates go to T slots per row, unused slots get the key SENT that sorts after every key.
Sorted by output key, the first candidate of each run of equal keys starts an output row and
the inclusive scan of those starts numbers the output rows in ascending key order: the plan's
outputs, with no hash table and no unique().
"""
import triton
import triton.language as tl

from .plan_segments import _exclusive_prefix
from .row_count import live_rows

MISSING = tl.constexpr(-1)


@triton.jit
def _output_axis(c, S: tl.constexpr, P: tl.constexpr, K: tl.constexpr, D: tl.constexpr,
                 size, TRANSPOSED: tl.constexpr):
    """(output coordinate, in range) of input coordinate c through tap k of one axis:
    strided o = (c + p - k d) / s where that divides; transposed o = c s - p + k d."""
    if TRANSPOSED:
        o = c * S - P + K * D
        ok = (o >= 0) & (o < size)
    else:
        num = c + P - K * D
        o = num // S
        ok = (num >= 0) & (num % S == 0) & (o < size)
    return o, ok


# Not specialized (they vary from call to call; specializing would only multiply binaries): row
# and candidate counts, the grid extents (a job may pass each batch's own) and the caller's
# coords (maybe a view; read one value at a time). The constexprs and the alignment of the
# kernels' own allocations are.
@triton.jit(do_not_specialize=["coords", "n", "n_at", "padded", "size_x", "size_y", "size_z"])
def generative_candidates_kernel(coords, keys, taps, n, n_at, padded, size_x, size_y, size_z,
                                 KX: tl.constexpr, KY: tl.constexpr, KZ: tl.constexpr,
                                 SX: tl.constexpr, SY: tl.constexpr, SZ: tl.constexpr,
                                 PX: tl.constexpr, PY: tl.constexpr, PZ: tl.constexpr,
                                 DX: tl.constexpr, DY: tl.constexpr, DZ: tl.constexpr,
                                 T: tl.constexpr, TRANSPOSED: tl.constexpr, SENT: tl.constexpr,
                                 BLOCK: tl.constexpr):
    """keys[i * T + j], taps[i * T + j]: the output key and tap of row i's j-th candidate (taps
    ascending), SENT in the slots past its last, and in keys [n * T, padded) (padded <= 2 n T:
    the padding of a sort of a fixed size, flexplan/planner/rank_sort.py). Keys pack
    (b, x, y, z) row-major over the output grid (planner/keys.py), in keys' dtype. Grid:
    blocks of BLOCK rows. n_at: kernels_src/row_count.py (the rows past the live count are
    padding: their slots hold SENT)."""
    n = live_rows(n, n_at)
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = rows < n
    b = tl.load(coords + rows * 4, mask=live, other=0)
    x = tl.load(coords + rows * 4 + 1, mask=live, other=0)
    y = tl.load(coords + rows * 4 + 2, mask=live, other=0)
    z = tl.load(coords + rows * 4 + 3, mask=live, other=0)
    KT: tl.constexpr = keys.dtype.element_ty
    count = tl.zeros([BLOCK], tl.int32)
    for kx in tl.static_range(KX):
        ox, okx = _output_axis(x, SX, PX, kx, DX, size_x, TRANSPOSED)
        for ky in tl.static_range(KY):
            oy, oky = _output_axis(y, SY, PY, ky, DY, size_y, TRANSPOSED)
            for kz in tl.static_range(KZ):
                oz, okz = _output_axis(z, SZ, PZ, kz, DZ, size_z, TRANSPOSED)
                ok = live & okx & oky & okz
                key = ((b.to(tl.int64) * size_x + ox) * size_y + oy) * size_z + oz
                slot = rows * T + count
                tl.store(keys + slot, key.to(KT), mask=ok)
                tl.store(taps + slot, tl.full([BLOCK], (kx * KY + ky) * KZ + kz, tl.int32), mask=ok)
                count += ok.to(tl.int32)
    for j in tl.static_range(T):
        tl.store(keys + rows * T + j, tl.full([BLOCK], SENT, KT), mask=live & (j >= count))
        pad = (n + rows) * T + j  # this program's share of the padding (int64: rows is)
        tl.store(keys + pad, tl.full([BLOCK], SENT, KT), mask=pad < padded)


# Not specialized: the candidate count and the places and number of the scan's tiles.
@triton.jit(do_not_specialize=["total", "state_at", "tiles"])
def run_starts_kernel(sorted_keys, rank, totals, total, state_at, tiles, SENT: tl.constexpr,
                      BLOCK: tl.constexpr, LOOK_BACK: tl.constexpr):
    """rank[j] = the runs of equal sorted keys (output rows) that start at or before candidate j
    (the inclusive scan of the run starts: j's output row is rank[j] - 1); totals[0] = the
    output rows (the last tile writes it); totals[1] = the number of candidates (entries
    before the first SENT), left as it was when there are none. Tiles of BLOCK entries, taken
    in ticket order and scanned in this one launch by a decoupled look-back (plan_segments.py)
    whose state is at totals + state_at: one int64 per tile, then the ticket, all -1 before
    the launch. Grid: `tiles` programs (cdiv(total, BLOCK))."""
    state = totals + state_at
    tile = tl.atomic_add(state + tiles, 1) + 1
    j = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < total
    key = tl.load(sorted_keys + j, mask=live, other=SENT)
    prev = tl.load(sorted_keys + j - 1, mask=live & (j > 0), other=SENT)
    nxt = tl.load(sorted_keys + j + 1, mask=j + 1 < total, other=SENT)
    real = key != SENT
    start = (real & ((j == 0) | (key != prev))).to(tl.int32)
    count = tl.sum(start.to(tl.int64)[None, :], axis=1)  # [1]: one look-back column
    prefix = tl.sum(_exclusive_prefix(state, tile, count, 1, 1, LOOK_BACK))
    tl.store(rank + j, (prefix + tl.cumsum(start, 0)).to(tl.int32), mask=live)
    if tile == tiles - 1:
        tl.store(totals, prefix + tl.sum(start.to(tl.int64)))
    last = real & (nxt == SENT)  # at most one entry: the last real candidate
    tl.store(totals + 1 + j * 0, j + 1, mask=live & last)


# (out_coords: the caller's coords where WRITE_FWD is off.)
@triton.jit(do_not_specialize=["out_coords", "total", "n_in", "size_x", "size_y", "size_z"])
def generative_scatter_kernel(sorted_keys, order, rank, taps, bwd, fwd, out_coords, total, n_in,
                              size_x, size_y, size_z, T: tl.constexpr, V: tl.constexpr,
                              SENT: tl.constexpr, WRITE_BWD: tl.constexpr,
                              WRITE_FWD: tl.constexpr, BLOCK: tl.constexpr):
    """For each real sorted candidate j (input row order[j] // T, tap taps[order[j]], output
    row rank[j] - 1): WRITE_BWD: bwd[in, tap] = out; WRITE_FWD: fwd[out, tap] = in, and the
    run starts write out_coords[out] = the key unpacked. Maps start filled with MISSING."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < total
    key = tl.load(sorted_keys + j, mask=live, other=SENT)
    real = live & (key != SENT)
    slot = tl.load(order + j, mask=real, other=0).to(tl.int64)
    row = slot // T
    tap = tl.load(taps + slot, mask=real, other=0).to(tl.int64)
    out = tl.load(rank + j, mask=real, other=1).to(tl.int64) - 1
    if WRITE_BWD:
        tl.store(bwd + row * V + tap, out.to(tl.int32), mask=real)
    if WRITE_FWD:
        tl.store(fwd + out * V + tap, row.to(tl.int32), mask=real)
        prev = tl.load(sorted_keys + j - 1, mask=real & (j > 0), other=SENT)
        start = real & ((j == 0) | (key != prev))
        k = key.to(tl.int64)
        oz = k % size_z
        k = k // size_z
        oy = k % size_y
        k = k // size_y
        ox = k % size_x
        ob = k // size_x
        tl.store(out_coords + out * 4, ob.to(tl.int32), mask=start)
        tl.store(out_coords + out * 4 + 1, ox.to(tl.int32), mask=start)
        tl.store(out_coords + out * 4 + 2, oy.to(tl.int32), mask=start)
        tl.store(out_coords + out * 4 + 3, oz.to(tl.int32), mask=start)


@triton.jit(do_not_specialize=["entries", "num_in", "n_at"])
def transpose_map_kernel(fwd, bwd, bwd_t, entries, num_in, n_at, V: tl.constexpr,
                         MISSING: tl.constexpr, MAP_T: tl.constexpr, BLOCK: tl.constexpr):
    """The bwd map of a fwd map: for each entry fwd[o, v] = i (not MISSING), bwd[i, v] = o
    (entries = rows of fwd * V; bwd starts filled with MISSING); MAP_T: also bwd_t [V, num_in]
    (the same, transposed: the gather kernels' layout; started likewise). An inference plan's
    fwd map holds each (i, v) at most once, so no two entries write one place. n_at
    (kernels_src/row_count.py): bwd_t's rows are the live count's."""
    num_in = live_rows(num_in, n_at)
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < entries
    i = tl.load(fwd + j, mask=live, other=MISSING)
    real = live & (i != MISSING)
    tap = j % V
    tl.store(bwd + i.to(tl.int64) * V + tap, (j // V).to(tl.int32), mask=real)
    if MAP_T:
        tl.store(bwd_t + tap * num_in + i, (j // V).to(tl.int32), mask=real)
