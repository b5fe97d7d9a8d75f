"""The row count of a planner kernel whose launch was recorded in a CUDA graph.

A build replayed from a graph (flexplan/planner/build_graphs.py) launches its kernels for the
most rows of its bucket, `n`, and leaves the real count in device memory at `n_at` (an int32),
written before each replay. Every other launch passes NO_ROWS_AT: the count is n. Same binary
either way (a scalar load, masked off without an address).
"""
import triton
import triton.language as tl

# flexplan/launch_spec.py UNREAD_ADDRESS: what a launch passes for an address it does not give.
NO_ROWS_AT = tl.constexpr(1 << 40)


@triton.jit
def live_rows(n, n_at):
    """n, or where n_at is an address the int32 row count there (at most n)."""
    given = n_at != NO_ROWS_AT
    return tl.where(given, tl.load(n_at.to(tl.pointer_type(tl.int32)), mask=given, other=0), n)
