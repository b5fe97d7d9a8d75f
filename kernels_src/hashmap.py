"""GPU hash table of voxel keys: open addressing, linear probing, lock-free inserts (CAS).

`capacity` slots (a power of two, so `& (capacity - 1)` is the modulo), -1 when free. int64
keys: a key array and an int32 value (row index) array; int32 keys: one int64 array holding
key and value together (see _pack).
Probing loops run per program while any lane of the vector still probes.
"""
import triton
import triton.language as tl

from .plan_hash import lane_sums
from .row_count import live_rows

EMPTY_KEY = tl.constexpr(-1)
MISSING = tl.constexpr(-1)


@triton.jit
def _hash_slot(key, slot_mask, KEY_64: tl.constexpr):
    """Murmur3 finalizer (fmix32 / fmix64) of the key: a slot. (Keeping z-neighbours in
    adjacent slots made lookups no faster and inserts slower: runs of related keys lengthen
    the probe chains; measurements: scripts/results/design_measurements.md.)"""
    if KEY_64:
        h = key.to(tl.uint64, bitcast=True)
        h ^= h >> 33
        h *= 0xFF51AFD7ED558CCD
        h ^= h >> 33
        h *= 0xC4CEB9FE1A85EC53
        h ^= h >> 33
        return (h & slot_mask.to(tl.uint64)).to(tl.int64)
    else:
        h = key.to(tl.uint32, bitcast=True)
        h ^= h >> 16
        h *= 0x85EBCA6B
        h ^= h >> 13
        h *= 0xC2B2AE35
        h ^= h >> 16
        return (h & slot_mask.to(tl.uint32)).to(tl.int64)


@triton.jit
def _pack(key, value):
    """32-bit keys share one int64 slot with their value (value high, key low): one memory
    access per probe; an all-ones slot (-1) is empty and its key half reads EMPTY_KEY."""
    return (value.to(tl.int64) << 32) | (key.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _voxel_key(b, x, y, z, size_x, size_y, size_z, KEY_64: tl.constexpr):
    """flexplan/planner/keys.py pack_coords: ((b * X + x) * Y + y) * Z + z."""
    if KEY_64:
        return ((b.to(tl.int64) * size_x + x) * size_y + y) * size_z + z
    else:
        return ((b * size_x + x) * size_y + y) * size_z + z


# Both table kernels: specialized on the constexprs and on the alignment of the table, value and
# map tensors (own allocations). Not specialized (they vary from call to call, and the kernels
# only do arithmetic or scalar accesses with them): the row count, the slot mask (the table's
# size follows it), the batch size (1 would compile its own binary), the grid extents (a job may
# pass each batch's own) and the coords (the caller's tensor, maybe a view).
@triton.jit(do_not_specialize=["coords", "n", "n_at", "slot_mask", "batch_size", "size_x",
                               "size_y", "size_z"])
def hash_insert_kernel(table_keys, table_vals, coords, n, n_at, slot_mask, nmap, nmap_t, batch_size,
                       size_x, size_y, size_z, V: tl.constexpr, KEY_64: tl.constexpr,
                       LANES: tl.constexpr, MAP_T: tl.constexpr, BLOCK: tl.constexpr):
    """Insert key(coords[i]) -> i for the rows inside the grid, and note what is wrong with the
    input in the problem slots right after the table's slot_mask + 1 slots: problems[0] gets
    the smallest row outside [0, batch_size) x grid, problems[1] the smallest row whose key was
    already in (a duplicate; the stored value stays), each as n - 1 - row by atomic max, so
    that they start at -1 (none) like an empty slot: the table's fill covers them. (Found
    from the table: the caller makes no view of them for this launch.) int64 keys: keys in
    table_keys, values in table_vals; int32 keys: packed in table_keys.

    Also starts the neighbour map nmap [n, V] of these rows (the lookups write only hits):
    MISSING everywhere but the centre column, which is the row itself; MAP_T: also its
    transpose nmap_t [V, n] (the map's layout for the gather kernels, rows in their own order:
    plan_views.sorted_map_t of an unscheduled map). LANES: also the
    coordinates' identity (flexplan/coords_hash.py: two lanes over the rows as int64 words,
    kernels_src/plan_hash.py) into the two slots after the problems, summed by atomic adds
    (integer sums do not depend on order); they start at -1 like the table, program 0 adds 1.
    n_at: kernels_src/row_count.py (nmap_t [V, live rows], as the other planner kernels' maps).
    """
    n = live_rows(n, n_at)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < n
    problems = table_keys + slot_mask + 1
    base = coords + rows.to(tl.int64) * 4
    b = tl.load(base, mask=live, other=0)
    x = tl.load(base + 1, mask=live, other=0)
    y = tl.load(base + 2, mask=live, other=0)
    z = tl.load(base + 3, mask=live, other=0)
    inside = ((b >= 0) & (b < batch_size) & (x >= 0) & (x < size_x) & (y >= 0) & (y < size_y)
              & (z >= 0) & (z < size_z))
    # Relaxed atomics: only atomicity matters inside the kernel; the launch boundary publishes
    # the table to the lookups (acq_rel would fence every probe).
    tl.atomic_max(problems + 0 * rows, n - 1 - rows.to(tl.int64), mask=live & ~inside, sem="relaxed")
    if LANES:
        # Row i is the words 2i = (x << 32) | b and 2i + 1 = (z << 32) | y (int32 pairs read
        # as little-endian int64), hashed at their positions.
        low = b.to(tl.uint32, bitcast=True).to(tl.uint64)
        word0 = (x.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | low
        word1 = ((z.to(tl.uint32, bitcast=True).to(tl.uint64) << 32)
                 | y.to(tl.uint32, bitcast=True).to(tl.uint64))
        pos0 = rows.to(tl.uint64) * 2
        a0, b0 = lane_sums(word0, pos0, live)
        a1, b1 = lane_sums(word1, pos0 + 1, live)
        fix = (tl.program_id(0) == 0).to(tl.uint64)
        tl.atomic_add(problems + 2, (a0 + a1 + fix).to(tl.int64, bitcast=True), sem="relaxed")
        tl.atomic_add(problems + 3, (b0 + b1 + fix).to(tl.int64, bitcast=True), sem="relaxed")
    # The map rows of this program are one contiguous run of BLOCK * V entries.
    run = nmap + tl.program_id(0).to(tl.int64) * BLOCK * V
    for c in range(V):
        local = c * BLOCK + tl.arange(0, BLOCK)
        owner = tl.program_id(0) * BLOCK + local // V
        tl.store(run + local, tl.where(local % V == V // 2, owner, MISSING), mask=owner < n)
    if MAP_T:
        for c in range(V):
            tl.store(nmap_t + c * n.to(tl.int64) + rows, tl.where(c == V // 2, rows, MISSING),
                     mask=live)
    active = live & inside
    key = _voxel_key(b, x, y, z, size_x, size_y, size_z, KEY_64)
    slot = _hash_slot(key, slot_mask, KEY_64)
    if KEY_64:
        entry = key
    else:
        entry = _pack(key, rows)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        # atomic_cas has no mask: idle lanes swap their entry for itself, which changes nothing.
        expected = tl.where(active, -1, entry).to(entry.dtype)
        prev = tl.atomic_cas(table_keys + slot, expected, entry, sem="relaxed")
        won = active & (prev == -1)
        if KEY_64:
            tl.store(table_vals + slot, rows, mask=won)
        else:
            prev = prev.to(tl.int32)  # its key half
        dup = active & ~won & (prev == key)
        tl.atomic_max(problems + 1 + 0 * rows, n - 1 - rows.to(tl.int64), mask=dup, sem="relaxed")
        active = active & ~won & ~dup
        slot = tl.where(active, (slot + 1) & slot_mask, slot)


@triton.jit
def _lookup(table_keys, table_vals, key, active, slot_mask, KEY_64: tl.constexpr):
    """Value of each active lane's key, MISSING where absent or inactive."""
    slot = _hash_slot(key, slot_mask, KEY_64)
    found = tl.full(key.shape, MISSING, tl.int32)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        stored = tl.load(table_keys + slot, mask=active, other=-1)
        if KEY_64:
            hit = active & (stored == key)
            found = tl.where(hit, tl.load(table_vals + slot, mask=hit, other=MISSING), found)
            stored_key = stored
        else:
            stored_key = stored.to(tl.int32)
            hit = active & (stored_key == key)
            found = tl.where(hit, (stored >> 32).to(tl.int32), found)
        active = active & ~hit & (stored_key != EMPTY_KEY)
        slot = (slot + 1) & slot_mask
    return found


@triton.jit(do_not_specialize=["coords", "n", "n_at", "slot_mask", "batch_size", "size_x",
                               "size_y", "size_z"])
def submanifold_neighbor_map_kernel(
        table_keys, table_vals, coords, nmap, nmap_t, n, n_at, slot_mask,
        batch_size, size_x, size_y, size_z,
        KX: tl.constexpr, KY: tl.constexpr, KZ: tl.constexpr,
        DX: tl.constexpr, DY: tl.constexpr, DZ: tl.constexpr,
        KEY_64: tl.constexpr, MAP_T: tl.constexpr, BLOCK: tl.constexpr):
    """Fill nmap [n, V] (started by hash_insert_kernel) from the table of coords' keys; MAP_T:
    also its transpose nmap_t [V, n] (started likewise).

    One lane per (row i, offset v < V // 2). Offsets v and V - 1 - v are opposite, so a hit
    j also gives nmap[j, V - 1 - v] = i: half the lookups, but nmap[i, V - 1 - v] has no writer
    when there is no such j, which is why the map must start as MISSING. n_at: as
    hash_insert_kernel's.
    """
    n = live_rows(n, n_at)
    V: tl.constexpr = KX * KY * KZ
    HALF: tl.constexpr = V // 2
    lane = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row = lane // HALF
    v = (lane % HALF).to(tl.int32)
    live = row < n
    base = coords + row * 4
    b = tl.load(base, mask=live, other=0)
    x = tl.load(base + 1, mask=live, other=0) + (v // (KY * KZ) - KX // 2) * DX
    y = tl.load(base + 2, mask=live, other=0) + (v // KZ % KY - KY // 2) * DY
    z = tl.load(base + 3, mask=live, other=0) + (v % KZ - KZ // 2) * DZ
    # Rows outside the batch range (bad input, rejected after the build) look nothing up: their
    # keys could be anything, EMPTY_KEY included.
    inside = (live & (b >= 0) & (b < batch_size) & (x >= 0) & (x < size_x) & (y >= 0)
              & (y < size_y) & (z >= 0) & (z < size_z))
    key = tl.where(inside, _voxel_key(b, x, y, z, size_x, size_y, size_z, KEY_64), 0)
    j = _lookup(table_keys, table_vals, key, inside, slot_mask, KEY_64)
    hit = j != MISSING
    tl.store(nmap + row * V + v, j, mask=hit)
    tl.store(nmap + j.to(tl.int64) * V + (V - 1 - v), row.to(tl.int32), mask=hit)
    if MAP_T:
        tl.store(nmap_t + v.to(tl.int64) * n + row, j, mask=hit)
        tl.store(nmap_t + (V - 1 - v).to(tl.int64) * n + j, row.to(tl.int32), mask=hit)
