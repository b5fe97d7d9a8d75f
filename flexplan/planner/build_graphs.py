"""Submanifold training builds replayed from CUDA graphs: a build's dozen host operations in one.

A fresh training step is bound by the host: a submanifold build (table fill, hash insert and
lookups, Gray ranks, sort, schedule, pairs, their allocations) costs some 400 us of host time
on a GPU host, most of it Python and launch overhead, not waiting (scripts/results/
host_costs.md). Recorded once in a CUDA graph, the same launches replay with one call.

A graph replays fixed launches, so each serves a bucket of row counts (rank_sort.bucket: at
most 1/4 more rows than live) for one grid, batch size and geometry: its kernels are launched
for the bucket's rows and read the live count from device memory (kernels_src/row_count.py),
written before each replay with the coordinates. Everything sized by the rows is laid out for
the bucket (the schedule's places, the pairs' room); what the plan's readers need in the live
rows' shape is written that way (the map [n, V], map_t [V, n], each block size's segs for the
live blocks), so the plan equals an eager build's in everything its readers see. Its buffers
are the graph's own, so after each replay they are copied out (device copies) before the next
replay can touch them: the plan owns its memory as an eager build's does.

Like rank_sort's sorts, a bucket's graph is recorded the second time a build asks for it (a
first-use pass, then the capture: a few milliseconds), within a budget of rows for all graphs
of a device (each row holds about 400 bytes of graph memory); builds past it, or of row counts
outside [MIN_ROWS, MAX_ROWS], or while a graph of the caller's is being captured, build
eagerly. FLEXPLAN_BUILD_GRAPHS=0 turns them off. Only builds that read nothing back qualify:
training, coordinates checked before, pairs deferred (their count read at the first backward),
one Gray-rank word (at most 63 offsets).
"""
from __future__ import annotations

import os
import threading
import warnings

import torch

from ..geometry import ConvGeometry
from ..kernel_configs import PLAN_BLOCK_SIZES
from ..launcher import launch
from ..plan import PendingCount
from .hashmap import submanifold_neighbor_map_triton
from .rank_sort import MAX_ROWS, MIN_ROWS, bucket
from .segments_torch import rank_words
from .segments_triton import (SCHEDULE_LAUNCH, _aligned, deferred_gather_map, deferred_pairs_bound,
                              launch_pairs, schedule_launches, schedule_layout)

BUILD_GRAPHS_ENV = "FLEXPLAN_BUILD_GRAPHS"
ROWS_BUDGET = 1 << 20  # bucket rows of all of a device's build graphs together (about 400 MB)

_builds: dict = {}  # key -> CapturedBuild, or None where the capture failed
_requested: set = set()  # keys asked for once, not captured yet
_lock = threading.Lock()


# False: every build eager, as before session 47 (A/B runs: scripts/bench_precision.py).
CAPTURE_BUILDS = True


def enabled() -> bool:
    return CAPTURE_BUILDS and os.environ.get(BUILD_GRAPHS_ENV, "1") != "0"


class CapturedBuild:
    """The launches of a submanifold training build of `cap` rows at most, recorded in a CUDA
    graph on the current stream; build() replays them for coordinates of up to cap rows.
    capture False: build() launches them (the same launches, eagerly: the CPU tests' way)."""

    def __init__(self, cap: int, shape: tuple[int, int, int], batch_size: int,
                 geometry: ConvGeometry, signal_offsets: int, device: torch.device,
                 capture: bool = True):
        self.cap, self.volume, self.signal_offsets = cap, geometry.volume, signal_offsets
        self.rows_held = cap  # (what it counts against ROWS_BUDGET)
        self.layout = schedule_layout(cap, geometry.volume, PLAN_BLOCK_SIZES, signal_offsets)
        self.room = _aligned(deferred_pairs_bound(cap, signal_offsets))
        # the arena's regions (int32s, 16-byte aligned): plan_out, map, map_t, pair rows
        self.places = (0, _aligned(self.layout.out_size))
        self.places += (self.places[1] + cap * geometry.volume,)
        self.places += (self.places[2] + cap * geometry.volume,)
        self.places += (self.places[3] + 2 * self.room,)
        self.coords = torch.zeros((cap, 4), dtype=torch.int32, device=device)
        self.rows = torch.zeros(1, dtype=torch.int32, device=device)  # the live count
        self.lock = threading.Lock()
        self.args = (shape, batch_size, geometry)
        self.graph = self.outputs = None
        if capture:
            self._capture(device)

    def _capture(self, device: torch.device) -> None:
        self.graph, args = torch.cuda.CUDAGraph(), self.args
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._launches(*args)  # first-use work (binaries, CUB, allocator): not captured
            # thread_local: other threads' CUDA calls during the capture do not break it
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.outputs = self._launches(*args)
            finally:
                self.graph.capture_end()
        current.wait_stream(side)

    def _launches(self, shape, batch_size, geometry):
        """The build's launches for the live rows of self.coords, as build_plan's Triton path
        launches them: (arena, readback). The arena holds what the plan keeps, one copy out:
        plan_out, the map [cap, V], map_t [V, cap] (its first V * rows entries: [V, rows]),
        the pair rows (self.places)."""
        rows_at, cap, v, places = self.rows.data_ptr(), self.cap, self.volume, self.places
        arena = torch.empty(places[-1], dtype=torch.int32, device=self.coords.device)
        nmap = arena[places[1]:places[2]].view(cap, v)
        plan_out = arena[:self.layout.out_size]
        nmap, readback = submanifold_neighbor_map_triton(
            self.coords, shape, batch_size, geometry, spare_slots=self.layout.readback_slots,
            flags=False, rows_at=rows_at, out=nmap)
        _, _, scan, readback = schedule_launches(nmap, self.layout, self.signal_offsets, readback,
                                                 0, rows_at, plan_out,
                                                 arena[places[2]:places[3]].view(v, cap))
        at = self.layout.signal_seg_at
        launch_pairs(launch, nmap, scan, arena[places[3]:], self.room,
                     plan_out[at:at + self.signal_offsets + 1], cap, rows_at, v,
                     self.signal_offsets)
        return arena, readback

    def build(self, coords: torch.Tensor):
        """(fwd GatherMap, valid_signal's four entries with the pairs' PendingCount) of coords
        [n <= cap, 4], checked before: what plan_schedule returns for a deferred build."""
        n, v, layout = coords.shape[0], self.volume, self.layout
        with self.lock:  # the graph's buffers are ours from the copy in to the copies out
            self.coords[:n].copy_(coords)
            self.rows.fill_(n)
            if self.graph is None:
                outputs = self._launches(*self.args)
            else:
                self.graph.replay()
                outputs = self.outputs
            arena, readback = outputs
            arena = arena.clone()  # (one copy: the plan's views below share it)
            pending = PendingCount(readback[layout.levels:layout.levels + 1])
        places, room = self.places, self.room
        plan_out = arena[:layout.out_size]
        nmap = arena[places[1]:places[1] + n * v].view(n, v)
        map_t = arena[places[2]:places[2] + v * n].view(v, n)
        # each block size's segs at the layout's places, for the live rows' blocks
        seg_runs = {block: (at, -(-n // block) + 1) for block, (at, _) in layout.seg_runs.items()}
        at = layout.signal_seg_at
        signal = (arena[places[3]:places[3] + room], arena[places[3] + room:places[4]],
                  plan_out[at:at + self.signal_offsets + 1], pending)
        return deferred_gather_map(nmap, plan_out, map_t, layout, seg_runs), signal


def captured_build(n: int, shape: tuple[int, int, int], batch_size: int, geometry: ConvGeometry,
                   signal_offsets: int, device: torch.device, pairs_max: int
                   ) -> CapturedBuild | None:
    """The captured build for a deferred submanifold training build of n rows on the current
    stream of `device`, or None where the caller builds eagerly (see the module's docstring).
    pairs_max: the most pairs a deferred build sizes its room for (the bucket's bound)."""
    if not MIN_ROWS <= n <= MAX_ROWS or device.type != "cuda" or not enabled() or (
            rank_words(geometry.volume)[2] != 1 or torch.cuda.is_current_stream_capturing()):
        return None
    cap = bucket(n)
    # (the schedule's chunk tiles divide the bucket: those of 4096+ rows do)
    if cap % SCHEDULE_LAUNCH["ROWS"] or deferred_pairs_bound(cap, signal_offsets) > pairs_max:
        return None
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), cap, shape,
           batch_size, geometry, signal_offsets)
    return kept_graph(key, cap, lambda: CapturedBuild(cap, shape, batch_size, geometry,
                                                      signal_offsets, device))


def kept_graph(key: tuple, rows: int, capture):
    """The captured build kept under key (its first two entries: the device index and the
    stream), capture()'s on the key's second request (a build of `rows` bucket rows, within
    the device's ROWS_BUDGET), or None where the caller builds eagerly: the first request, past
    the budget, or after a capture that failed (warned once)."""
    found = _builds.get(key)
    if found is not None:
        return found
    with _lock:
        if key in _builds:
            return _builds[key]
        held = sum(kept.rows_held for known, kept in _builds.items()
                   if kept is not None and known[0] == key[0])
        if held + rows > ROWS_BUDGET:
            return None
        if key not in _requested:  # the first request: remember it, build eagerly
            if len(_requested) >= 1024:  # (streams and shapes come and go)
                _requested.clear()
            _requested.add(key)
            return None
        _requested.discard(key)
        try:
            found = capture()
        except RuntimeError as exc:  # keep building, eagerly
            warnings.warn(f"flexplan: capturing a plan build failed ({exc}); building "
                          f"{rows}-row buckets of this geometry eagerly", RuntimeWarning)
        _builds[key] = found
        return found


def release() -> None:
    """Drop every captured build (their graphs and buffers) and the requests counted."""
    with _lock:
        _builds.clear()
        _requested.clear()
