"""GPU hash table of voxel keys: open addressing, linear probing, lock-free inserts (CAS).

The table is two arrays of `capacity` slots (a power of two, so `& (capacity - 1)` is the
modulo): keys (int32 or int64, EMPTY_KEY = -1 when free) and values (int32 row index).
Probing loops run per program while any lane of the vector still probes.
"""
import triton
import triton.language as tl

EMPTY_KEY = tl.constexpr(-1)
MISSING = tl.constexpr(-1)


@triton.jit
def _hash_slot(key, slot_mask, KEY_64: tl.constexpr):
    """Murmur3 finalizer (fmix32 / fmix64) of the key, reduced to a slot."""
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
def hash_insert_kernel(table_keys, table_vals, keys, n, slot_mask, first_dup,
                       KEY_64: tl.constexpr, BLOCK: tl.constexpr):
    """Insert keys[i] -> i. A lane whose key is already in the table is a duplicate row:
    first_dup[0] gets the smallest such row (atomic min), and the stored value stays."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    active = rows < n
    key = tl.load(keys + rows, mask=active, other=0)
    slot = _hash_slot(key, slot_mask, KEY_64)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        # atomic_cas has no mask: idle lanes swap their key for itself, which changes nothing.
        expected = tl.where(active, EMPTY_KEY, key).to(key.dtype)
        prev = tl.atomic_cas(table_keys + slot, expected, key)
        won = active & (prev == EMPTY_KEY)
        tl.store(table_vals + slot, rows, mask=won)
        tl.atomic_min(first_dup + 0 * rows, rows, mask=active & (prev == key))
        active = active & (prev != EMPTY_KEY) & (prev != key)
        slot = tl.where(active, (slot + 1) & slot_mask, slot)


@triton.jit
def _lookup(table_keys, table_vals, key, active, slot_mask, KEY_64: tl.constexpr):
    """Value of each active lane's key, MISSING where absent or inactive."""
    slot = _hash_slot(key, slot_mask, KEY_64)
    found = tl.full(key.shape, MISSING, tl.int32)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        stored = tl.load(table_keys + slot, mask=active, other=EMPTY_KEY)
        hit = active & (stored == key)
        found = tl.where(hit, tl.load(table_vals + slot, mask=hit, other=MISSING), found)
        active = active & (stored != key) & (stored != EMPTY_KEY)
        slot = (slot + 1) & slot_mask
    return found


@triton.jit
def submanifold_neighbor_map_kernel(
        table_keys, table_vals, coords, nmap, n, slot_mask,
        size_x, size_y, size_z,
        KX: tl.constexpr, KY: tl.constexpr, KZ: tl.constexpr,
        DX: tl.constexpr, DY: tl.constexpr, DZ: tl.constexpr,
        KEY_64: tl.constexpr, BLOCK: tl.constexpr):
    """Fill nmap [n, V] (pre-set to MISSING) from the table of coords' keys.

    One lane per (row i, offset v < V // 2). Offsets v and V - 1 - v are opposite, so a hit
    j also gives nmap[j, V - 1 - v] = i: half the lookups. Lanes with v == 0 write the centre.
    """
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
    inside = live & (x >= 0) & (x < size_x) & (y >= 0) & (y < size_y) & (z >= 0) & (z < size_z)
    if KEY_64:
        key = ((b.to(tl.int64) * size_x + x) * size_y + y) * size_z + z
    else:
        key = ((b * size_x + x) * size_y + y) * size_z + z
    key = tl.where(inside, key, 0)
    j = _lookup(table_keys, table_vals, key, inside, slot_mask, KEY_64)
    hit = j != MISSING
    tl.store(nmap + row * V + v, j, mask=hit)
    tl.store(nmap + j.to(tl.int64) * V + (V - 1 - v), row.to(tl.int32), mask=hit)
    tl.store(nmap + row * V + HALF, row.to(tl.int32), mask=live & (v == 0))
