"""Launch descriptions: each kernel launch written once (issue #24), for the ops and the AOT build.

A launch description is a plain function next to the code that launches its kernel (ops/conv.py,
ops/pool.py, planner/hashmap.py, planner/segments_triton.py, planner/generative_triton.py,
coords_hash.py, plan.py's views, cache/format.py's load check, nn/sync_batchnorm.py's statistics):

    def launch_<name>(run, <the kernel's runtime arguments, in its order, each annotated with
                      its kind below>, <what the constexprs and the grid derive from>) -> None:
        run(<kernel>, <grid rule>, <the arguments>, **<constexprs and launch options>)

The launching code calls it with launcher.launch as `run` and its tensors and sizes: that is its
only launch path. The AOT build (flexplan/aot/variants.py, `record`) calls the same function with
a recorder as `run` and, for each argument it does not give, an example of the argument's kind
(FlashInfer's pattern: the build runs the generators the runtime runs). So the argument list, the
constexprs and the grid of a launch are written in one place, and the registry's variants are
what the ops launch by construction. A description therefore forwards its tensors untouched (the
build passes examples, not tensors) and launches exactly once. The launching code runs it on
every launch: it computes only what the launch needs (grids spelled -(-n // block), a Python
call fewer than launcher.cdiv; see the host-cost note in ops/conv.py).

What a kernel specializes an int or pointer on is not described here: its decorator says it
(`do_not_specialize`), read by the launcher and the build alike. The kinds only tell the build
which example to pass: a tensor's dtype, SIZE for an int that any example stands for, or
ADDRESS for a device address passed as an int (64-bit).

This module imports nothing: value modules (plan.py) and the planner may use it.
"""
from __future__ import annotations


class Tensor:
    """The kind of a tensor argument: its torch dtype name ("int32"), or a role ("feature")
    whose dtype the build names per variant."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: str):
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"Tensor({self.dtype!r})"


class Size:
    """The kind of an int any example stands for: one the kernel does not specialize on (rows,
    counts, places; its decorator's do_not_specialize, checked by the build), or one that only
    sizes the grid."""

    def __repr__(self) -> str:
        return "SIZE"


class Address(Size):
    """The kind of a device address passed as an int, for a pointer whose dtype the kernel picks
    at run time (a typed pointer would make each dtype a binary of its own): not specialized,
    and always 64-bit (Triton types an int by its width: where the address is not read, pass
    UNREAD_ADDRESS, as the build does)."""

    def __repr__(self) -> str:
        return "ADDRESS"


# Any int64: what an ADDRESS argument that is not read gets, and the build's example of one.
UNREAD_ADDRESS = 1 << 40

INT32, INT64 = Tensor("int32"), Tensor("int64")
FLOAT32, FLOAT64 = Tensor("float32"), Tensor("float64")
FEATURE = Tensor("feature")  # the op's feature dtype (a float dtype; float32 for tf32)
# What an op writes: the features' dtype, or float32 (a float32 master weight's gradient).
OUTPUT = Tensor("output")
ACCUMULATOR = Tensor("accumulator")  # split-K partial sums: float32 (float64 for float64 features)
KEYS = Tensor("keys")  # packed voxel keys: int32 or int64 (planner/keys.py key_dtype)
WORDS = Tensor("words")  # Gray-rank words: int32 or int64 (planner/segments_torch.py rank_words)
SCAN = Tensor("scan")  # a prefix sum of counts: int32 or int64 (segments_triton.scan_dtype)
SIZE = Size()
ADDRESS = Address()
