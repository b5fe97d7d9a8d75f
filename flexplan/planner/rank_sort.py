"""Sorting the Gray ranks of a Triton build: small builds replay a captured CUDA graph.

torch.sort of the ranks issues about a dozen device operations (a copy, an index fill, memsets,
CUB's histogram, scan and onesweep passes); their host work is what bounds builds of a few
hundred thousand rows (measurements: scripts/results/design_measurements.md). A graph of that
sort replays them with one launch. Graphs sort a fixed number of keys, so each serves a bucket
of row counts: the keys are padded to the bucket with the largest word (gray_rank_kernel writes
the padding), which sorts after every rank; the sort is stable, so the real rows come first and
in order.

The strided and transposed plans sort their candidates' output keys the same way (padded with
their sentinel, which sorts after every key: generative_triton.py), under purpose
"candidates": a build holding one purpose's sort may ask for the other's.

One captured sort per (device, stream, bucket, key dtype, purpose), captured the second time a
build asks for it (a capture costs 1.5-2 ms) and kept until release(), within a budget of keys
per purpose for all of them together (each key costs about 36 bytes with CUB's buffers):
builds past the budget, like the first of each bucket, sort with torch.sort, so that a
workload of many row counts never recaptures. A captured sort owns its key buffer and outputs: builds that share
it hold its lock from writing the keys until the last kernel that reads the sorted outputs is
queued. FLEXPLAN_SORT_GRAPHS=0 turns captures off.
"""
from __future__ import annotations

import os
import threading

import torch

from .graph_registry import FIRST_USE_PASS, CaptureRegistry, capture_graph
from .segments_torch import sort_by_rank

SORT_GRAPHS_ENV = "FLEXPLAN_SORT_GRAPHS"
# Rows sorted through graphs: below, torch.sort is a single in-place kernel; above, the GPU's
# sort time outweighs the host's work and the buffers grow.
MIN_ROWS, MAX_ROWS = 1 << 12, 1 << 20
BUCKET_STEPS = 4  # buckets per power of two: keys padded by at most 1/4
KEYS_BUDGET = 1 << 21  # keys of all captured sorts of one purpose together (about 75 MB)
RANKS, CANDIDATES = "ranks", "candidates"  # the purposes

_sorts = CaptureRegistry()  # budget: KEYS_BUDGET per purpose


def bucket(rows: int) -> int:
    """The number of keys sorted for `rows` rows: rows rounded up to a multiple of 1/4 of the
    power of two at or below it."""
    step = max(1, (1 << (rows.bit_length() - 1)) // BUCKET_STEPS)
    return -(-rows // step) * step


def room_buckets(rows: int, room: float) -> list[int]:
    """bucket(rows) and the larger buckets of at most room * rows rows, smallest first."""
    caps = [bucket(rows)]
    while True:
        larger = bucket(caps[-1] + 1)
        if larger > room * rows:
            return caps
        caps.append(larger)


class TorchSort:
    """Keys [words, rows] (or [rows] for one word) allocated per build, sorted by torch.sort."""

    def __init__(self, rows: int, words: int, dtype: torch.dtype, device: torch.device):
        self.size = rows
        # (one word: a flat tensor, so that the sort needs no row view of it)
        self.keys = torch.empty((words, rows) if words > 1 else rows, dtype=dtype, device=device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def sort(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted keys, order): a stable sort of the rows by their keys."""
        return sort_by_rank(self.keys)


class CapturedSort:
    """torch.sort(keys, stable=True) of a fixed-size key buffer, captured once; sort() replays it
    on the current stream and returns the same (sorted keys, order) tensors. Hold it (with)
    from writing the keys until the sorted outputs are read."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        self.size = size
        self.keys = torch.empty(size, dtype=dtype, device=device)
        self.lock = threading.Lock()
        self.graph, (self.sorted, self.order) = capture_graph(
            lambda: torch.sort(self.keys, stable=True), device)

    def __enter__(self):
        self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()
        return False

    def sort(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.graph.replay()
        return self.sorted, self.order


def rank_sorter(rows: int, words: int, dtype: torch.dtype, device: torch.device,
                purpose: str = RANKS) -> CapturedSort | TorchSort:
    """How to sort the ranks of `rows` rows in `words` words of `dtype`: the captured sort of
    their bucket on the current stream of `device`, for one word and MIN_ROWS to MAX_ROWS rows
    (see the module's docstring for when it is captured), else torch.sort (also inside the
    caller's own graph capture). Its keys are where the ranks go, its size their padded
    length. purpose: RANKS, or CANDIDATES (the generative plans' keys): separate sorts."""
    if words > 1 or not MIN_ROWS <= rows <= MAX_ROWS or device.type != "cuda" or (
            torch.cuda.is_current_stream_capturing()  # (no nested capture)
            or FIRST_USE_PASS.get()):  # (graph_registry.capture_graph's first-use pass)
        return TorchSort(rows, words, dtype, device)
    found = _captured_sort(bucket(rows), dtype, device, purpose)
    return TorchSort(rows, words, dtype, device) if found is None else found


def _captured_sort(size: int, dtype: torch.dtype, device: torch.device,
                   purpose: str) -> CapturedSort | None:
    # (the purpose in the key: a build holds its candidates' sort while its ranks are sorted)
    if os.environ.get(SORT_GRAPHS_ENV, "1") == "0":
        return None
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), size, dtype, purpose)
    return _sorts.get(key, lambda: size, purpose, KEYS_BUDGET,
                      lambda: CapturedSort(size, dtype, device),
                      f"capturing the planner's sort failed; using torch.sort for {size} keys "
                      "on this stream")


def release() -> None:
    """Drop every captured sort (their graphs and buffers) and the requests counted."""
    _sorts.release()
