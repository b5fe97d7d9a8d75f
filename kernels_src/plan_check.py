"""The plan-file load check in one launch (flexplan/cache/format.py, plan_problem; its torch
expressions are the oracle): every index tensor of a loaded plan within its range, every
segment array starting at 0, never decreasing and ending at its total.

A table row per int32 tensor: (address, length, low, high, kind). kind 0: low <= x < high for
every entry; kind 1 (a segment array): x[0] == 0, x[i] >= x[i - 1], x[n - 1] == high. Program
(block, row) checks BLOCK entries of that row's tensor and raises flags[row] on any defect.
"""
import triton
import triton.language as tl

TABLE_COLUMNS = tl.constexpr(5)
RANGE, SEGMENTS = 0, 1


# Nothing here changes the binary between plans: the table and flags are fresh allocations
# (aligned), and everything else is read from the table at run time. A program checks ITERS
# blocks of BLOCK entries (a grid of cdiv(longest tensor, BLOCK * ITERS) x rows: the programs of
# shorter tensors return at once) and writes its row's flag only on a defect (no contention).
@triton.jit
def plan_bounds_kernel(table, flags, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    row = tl.program_id(1)
    entry = table + row * TABLE_COLUMNS
    address = tl.load(entry)
    n = tl.load(entry + 1)
    low = tl.load(entry + 2)
    high = tl.load(entry + 3)
    kind = tl.load(entry + 4)
    first = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    if first < n:
        values = address.to(tl.pointer_type(tl.int32))
        # (the row's kind as a block-wide mask: only segment rows read their previous entries)
        segments = (tl.zeros([BLOCK], dtype=tl.int64) + kind) == 1
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for k in range(ITERS):
            i = first + k * BLOCK + tl.arange(0, BLOCK)
            live = i < n
            x = tl.load(values + i, mask=live, other=0).to(tl.int64)
            before = tl.load(values + i - 1, mask=live & (i > 0) & segments, other=0).to(tl.int64)
            out_of_range = (x < low) | (x >= high)
            bad_segment = (x < before) | ((i == 0) & (x != 0)) | ((i == n - 1) & (x != high))
            bad |= (tl.where(segments, bad_segment, out_of_range) & live).to(tl.int32)
        if tl.max(bad, axis=0) > 0:
            tl.store(flags + row, 1)
