"""CUDA graphs the planner captures on a key's second request, within a budget, and how it
captures one (capture_graph).

The planner's captured sorts (rank_sort.py) and captured builds (build_graphs.py,
generative_graphs.py) each serve a bucket of sizes. A capture costs milliseconds and holds
memory, so a key's first request is only remembered (the caller works eagerly), its second
captures, and the sizes kept per pool (a purpose, a device) stay within a budget: a workload
of many sizes never recaptures. A capture that fails is remembered too (warned once; the
caller works eagerly from then on).
"""
from __future__ import annotations

import threading
import warnings

import torch

from ..thread_setting import ThreadSetting

# True on a thread inside capture_graph's first-use pass: the planner's captured sorts are not
# asked for there (rank_sort.rank_sorter answers torch.sort), since that pass runs on a side
# stream whose sorts would otherwise be requested, and captured, for nothing.
FIRST_USE_PASS = ThreadSetting(False)


def capture_graph(record, device: torch.device | None = None):
    """(graph, outputs) of record() recorded in a CUDA graph on a side stream of `device`
    (default: the current one), after one eager call of it (first-use work: binaries, CUB, the
    allocator). The current stream waits for the side stream whatever happens, so work queued
    after a failed capture follows the first-use pass."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            with FIRST_USE_PASS.set(True):
                record()
            # thread_local: other threads' CUDA calls during the capture do not break it
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = record()
            finally:
                graph.capture_end()
    finally:
        current.wait_stream(side)
    return graph, outputs


# A request may replay a kept graph of up to a third more rows than it has (the smallest such),
# and a capture takes the largest bucket within that room: sizes that vary from step to step
# (an augmented scan's levels, about 10% either way) settle on one graph each instead of one
# per bucket they touch, so fewer captures (a few milliseconds each) in a job's first steps
# and less graph memory kept. Padding rows cost the kernels little (they read the live count),
# the sorts sort them.
ROOM = 4 / 3


def roomy_graph(registry: "CaptureRegistry", caps: list[int], key_of, request):
    """The graph for a request that fits any bucket of caps (rank_sort.room_buckets, smallest
    first, those the caller can use): the smallest one kept under key_of(cap), else
    request(caps[-1]) (the caller's registry.get for that bucket); None without caps."""
    for cap in caps:
        found = registry.kept_one(key_of(cap))
        if found is not None:
            return found
    return request(caps[-1]) if caps else None


class CaptureRegistry:
    """Captured graphs by key, within a budget (summed size) per pool."""

    def __init__(self):
        self._kept: dict = {}  # key -> (captured or None where the capture failed, size, pool)
        self._requested: set = set()  # keys asked for once, not captured yet
        self._lock = threading.Lock()

    def get(self, key, size, pool, budget: int, capture, failed: str):
        """What is kept under key; else capture()'s answer at the key's second request, when
        size() more (asked only then) fits the pool's `budget` (the caller's setting of the
        moment); else None. failed: the warning's words for a capture that raised
        RuntimeError (the exception follows)."""
        kept = self._kept.get(key)
        if kept is not None:
            return kept[0]
        with self._lock:
            if key in self._kept:
                return self._kept[key][0]
            held = sum(kept_size for found, kept_size, known in self._kept.values()
                       if found is not None and known == pool)
            size = size()
            if held + size > budget:
                return None
            if key not in self._requested:  # the first request: remembered only
                if len(self._requested) >= 1024:  # (streams and shapes come and go)
                    self._requested.clear()
                self._requested.add(key)
                return None
            self._requested.discard(key)
            found = None
            try:
                # (outside inference mode whatever the request's: a graph's buffers made in it
                # would be inference tensors, whose in-place updates outside it torch refuses;
                # no_grad: leaving inference mode turns gradients on)
                with torch.inference_mode(False), torch.no_grad():
                    found = capture()
            except RuntimeError as exc:
                warnings.warn(f"flexplan: {failed} ({exc})", RuntimeWarning)
            self._kept[key] = found, size, pool
            return found

    def kept_one(self, key):
        """The graph kept under key, or None (not captured, failed, or never asked for); no
        request is counted."""
        kept = self._kept.get(key)
        return None if kept is None else kept[0]

    def kept(self) -> dict:
        """key -> captured graph, for those kept (not the failures)."""
        with self._lock:
            return {key: found for key, (found, _, _) in self._kept.items() if found is not None}

    def release(self) -> None:
        """Drop every graph kept (their buffers with them) and the requests counted."""
        with self._lock:
            self._kept.clear()
            self._requested.clear()
