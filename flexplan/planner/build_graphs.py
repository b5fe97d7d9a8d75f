"""Submanifold builds replayed from CUDA graphs: a build's dozen host operations in one.

A fresh training step is bound by the host: a submanifold build (table fill, hash insert and
lookups, Gray ranks, sort, schedule, pairs, their allocations) costs some 400 us of host time
on a GPU host, most of it Python and launch overhead, not waiting (scripts/results/
host_costs.md). Recorded once in a CUDA graph, the same launches replay with one call.

A graph replays fixed launches, so each serves a bucket of row counts (rank_sort.bucket; a
build replays the smallest kept one within graph_registry.ROOM of its rows, a capture takes
the largest there) for one grid, batch size and geometry: its kernels are launched
for the bucket's rows and read the live count from device memory (kernels_src/row_count.py),
written before each replay with the coordinates. Everything sized by the rows is laid out for
the bucket (the schedule's places, the pairs' room); what the plan's readers need in the live
rows' shape is written that way (the map [n, V], map_t [V, n], each block size's segs for the
live blocks), so the plan equals an eager build's in everything its readers see. Its buffers
are the graph's own, so after each replay they are copied out (device copies) before the next
replay can touch them: the plan owns its memory as an eager build's does (its bucket's arena,
so up to graph_registry.ROOM times an eager build's).

Like rank_sort's sorts, a bucket's graph is recorded the second time a build asks for it (a
first-use pass, then the capture: a few milliseconds), within bytes_budget() of graph memory for
all of a device's build graphs (graph_registry.py; a submanifold bucket row holds about 440
bytes); builds past it, or of row counts outside [MIN_ROWS, MAX_ROWS], or while a graph of the
caller's is being captured, build eagerly. FLEXPLAN_BUILD_GRAPHS=0 turns them off. Only
builds of coordinates checked before that read nothing back qualify: training builds with
their pairs deferred (their count read at the first backward) and one Gray-rank word (at most
63 offsets: CapturedBuild), and a first sighting's inference map, which has no schedule
(ConvPlan.schedule_deferred; any number of offsets: CapturedMapBuild).
"""
from __future__ import annotations

import functools
import os
import threading

import torch

from ..geometry import ConvGeometry
from ..kernel_configs import PLAN_BLOCK_SIZES
from ..launcher import launch
from ..plan import GatherMap, PendingCount, with_sorted_map_t
from . import graph_registry
from .graph_registry import CaptureRegistry, capture_graph, roomy_graph
from .hashmap import submanifold_neighbor_map_triton, table_capacity
from .segments import unscheduled_map
from .rank_sort import MAX_ROWS, MIN_ROWS, room_buckets
from .segments_torch import rank_words
from .segments_triton import (SCHEDULE_LAUNCH, _aligned, deferred_gather_map, deferred_pairs_bound,
                              launch_pairs, schedule_launches, schedule_layout)

BUILD_GRAPHS_ENV = "FLEXPLAN_BUILD_GRAPHS"
# Graph memory of all of a device's captured builds together, estimated (graph_bytes). One of
# bench_e2e's networks (~110k voxels a batch) keeps about 0.63 GB for its fresh training steps
# (session 48, scripts/results/bench_precision.md), its inference builds some more; a process
# running two networks, or larger scans, twice that. None: 1/40 of the device's memory, at most
# 2 GiB (2 GB of an 80 GB GPU, 0.6 GB of a 24 GB one); an int: that many bytes. Past it, builds
# run eagerly.
BYTES_BUDGET: int | None = None
# Per bucket row, what a build's graph holds besides its outputs: the coordinates, the hash
# table, the ranks and their sort (with CUB's buffers), the counts.
SCRATCH_BYTES_PER_ROW = 80

_builds = CaptureRegistry()  # budget: bytes_budget() per device


# False: every build eager, as before session 47 (A/B runs: scripts/bench_precision.py).
CAPTURE_BUILDS = True


def enabled() -> bool:
    return CAPTURE_BUILDS and os.environ.get(BUILD_GRAPHS_ENV, "1") != "0"


def arena_places(sizes) -> tuple[int, ...]:
    """(0, then each region's end): regions of `sizes` int32s, each starting 16-byte aligned
    (the kernels' pointers are specialized on it)."""
    places = [0]
    for size in sizes:
        places.append(places[-1] + _aligned(size))
    return tuple(places)


def _arena(cap: int, volume: int, signal_offsets: int):
    """(schedule layout, the pairs' room, the arena's places) of a submanifold build of cap
    rows: the arena's regions are plan_out, the map, map_t and the pair rows."""
    layout = schedule_layout(cap, volume, PLAN_BLOCK_SIZES, signal_offsets)
    room = _aligned(deferred_pairs_bound(cap, signal_offsets))
    return layout, room, arena_places((layout.out_size, cap * volume, cap * volume, 2 * room))


def graph_bytes(places: tuple[int, ...], rows: int) -> int:
    """A build graph's memory, estimated: its arena (int32s up to places[-1]) and the scratch
    of `rows` bucket rows."""
    return 4 * places[-1] + SCRATCH_BYTES_PER_ROW * rows


class LiveRowsGraph:
    """Launches over the live rows of a buffer of `cap` coordinates (their count in device
    memory, `rows`), recorded in a CUDA graph on the current stream by capture() (else, the
    CPU tests' way, launched eagerly at each replay). Subclasses define _launches(), returning
    what a replay leaves (the graph's own buffers)."""

    def __init__(self, cap: int, device: torch.device):
        self.cap = cap
        self.coords = torch.zeros((cap, 4), dtype=torch.int32, device=device)
        self.rows = torch.zeros(1, dtype=torch.int32, device=device)  # the live count
        self.lock = threading.Lock()  # held from a replay's copy in to its copies out
        self.graph = self.outputs = None

    def _launches(self):
        raise NotImplementedError

    def capture(self) -> None:
        self.graph, self.outputs = capture_graph(self._launches)

    def replay(self, coords: torch.Tensor):
        """_launches()'s outputs for coords [n <= cap, 4] (copied in), the lock held."""
        n = coords.shape[0]
        self.coords[:n].copy_(coords)
        self.rows.fill_(n)
        if self.graph is None:
            return self._launches()
        self.graph.replay()
        return self.outputs


class CapturedBuild(LiveRowsGraph):
    """The launches of a submanifold training build of `cap` rows at most, recorded in a CUDA
    graph on the current stream; build() replays them for coordinates of up to cap rows.
    capture False: build() launches them (the same launches, eagerly: the CPU tests' way)."""

    def __init__(self, cap: int, shape: tuple[int, int, int], batch_size: int,
                 geometry: ConvGeometry, signal_offsets: int, device: torch.device,
                 capture: bool = True):
        super().__init__(cap, device)
        self.volume, self.signal_offsets = geometry.volume, signal_offsets
        self.layout, self.room, self.places = _arena(cap, geometry.volume, signal_offsets)
        self.args = (shape, batch_size, geometry)
        if capture:
            self.capture()


    def _launches(self):
        """The build's launches for the live rows of self.coords, as build_plan's Triton path
        launches them: (arena, readback). The arena holds what the plan keeps, one copy out:
        plan_out, the map [cap, V], map_t [V, cap] (its first V * rows entries: [V, rows]),
        the pair rows (self.places)."""
        shape, batch_size, geometry = self.args
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
            arena, readback = self.replay(coords)
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


class CapturedMapBuild(LiveRowsGraph):
    """The launches of a submanifold inference build without a schedule (a first sighting's,
    ConvPlan.schedule_deferred: the table, the inserts, the lookups writing the map and its
    transpose) for up to `cap` rows, recorded in a CUDA graph on the current stream; build()
    replays them for coordinates of up to cap rows (capture False: launches them eagerly)."""

    def __init__(self, cap: int, shape: tuple[int, int, int], batch_size: int,
                 geometry: ConvGeometry, device: torch.device, capture: bool = True):
        super().__init__(cap, device)
        self.volume = geometry.volume
        self.places = self.places_of(cap, geometry.volume)
        self.args = (shape, batch_size, geometry)
        if capture:
            self.capture()

    @staticmethod
    def places_of(cap: int, volume: int) -> tuple[int, ...]:
        """The arena's regions: the map [cap, V], the rows 0..cap-1 (the unscheduled map's
        sorted_idx), its transpose (first V * rows entries: [V, rows]). The map is copied out
        alone (a later schedule keeps it, not the rest); the rows and the transpose's live part
        together."""
        return arena_places((cap * volume, cap, volume * cap))

    @staticmethod
    def graph_bytes(cap: int, volume: int) -> int:
        """The graph's memory, estimated: its arena, the coordinates' buffer, and the hash
        table (8 bytes a slot, 4 more for a 64-bit key's value)."""
        return (4 * CapturedMapBuild.places_of(cap, volume)[-1] + 16 * cap
                + 12 * table_capacity(cap))

    def _launches(self) -> torch.Tensor:
        shape, batch_size, geometry = self.args
        cap, v, p = self.cap, self.volume, self.places
        arena = torch.empty(p[-1], dtype=torch.int32, device=self.coords.device)
        torch.arange(cap, dtype=torch.int32, device=arena.device, out=arena[p[1]:p[1] + cap])
        submanifold_neighbor_map_triton(
            self.coords, shape, batch_size, geometry, flags=False,
            map_t=arena[p[2]:p[2] + v * cap].view(v, cap), rows_at=self.rows.data_ptr(),
            out=arena[:cap * v].view(cap, v))
        return arena

    def build(self, coords: torch.Tensor) -> GatherMap:
        """The unscheduled fwd map (its sorted_map_t kept) of coords [n <= cap, 4], checked
        before: what build_plan's unscheduled Triton build makes."""
        n, v, p = coords.shape[0], self.volume, self.places
        with self.lock:  # the graph's buffers are ours from the copy in to the copies out
            arena = self.replay(coords)
            nmap = arena[:n * v].clone()
            rest = arena[p[1]:p[2] + v * n].clone()  # (the rows, padding, the live map_t)
        at = p[2] - p[1]
        fwd = unscheduled_map(nmap.view(n, v), rest[:n])
        return with_sorted_map_t(fwd, rest[at:at + v * n].view(v, n))


def captured_map_build(n: int, shape: tuple[int, int, int], batch_size: int,
                       geometry: ConvGeometry, device: torch.device) -> CapturedMapBuild | None:
    """The captured unscheduled inference build for n checked rows on the current stream of
    `device`, or None where the caller builds eagerly (live_rows_graph's rules, any number of
    offsets: nothing is ranked)."""
    return live_rows_graph(
        n, device, lambda cap: ("map", cap, shape, batch_size, geometry),
        lambda cap: CapturedMapBuild.graph_bytes(cap, geometry.volume),
        lambda cap: CapturedMapBuild(cap, shape, batch_size, geometry, device))


def captured_build(n: int, shape: tuple[int, int, int], batch_size: int, geometry: ConvGeometry,
                   signal_offsets: int, device: torch.device, pairs_max: int
                   ) -> CapturedBuild | None:
    """The captured build for a deferred submanifold training build of n rows on the current
    stream of `device`, or None where the caller builds eagerly (see the module's docstring).
    pairs_max: the most pairs a deferred build sizes its room for (the bucket's bound)."""
    if rank_words(geometry.volume)[2] != 1:
        return None
    return live_rows_graph(
        n, device, lambda cap: (cap, shape, batch_size, geometry, signal_offsets),
        lambda cap: graph_bytes(_arena(cap, geometry.volume, signal_offsets)[2], cap),
        lambda cap: CapturedBuild(cap, shape, batch_size, geometry, signal_offsets, device),
        # (the schedule's chunk tiles divide the bucket: those of 4096+ rows do)
        lambda cap: (not cap % SCHEDULE_LAUNCH["ROWS"]
                     and deferred_pairs_bound(cap, signal_offsets) <= pairs_max))


def live_rows_graph(n: int, device: torch.device, key, size, make, usable=lambda cap: True):
    """The kept LiveRowsGraph for a build of n rows on the current stream of `device`: the
    smallest kept one within graph_registry.ROOM, else make(cap)'s for the roomiest bucket
    there on that key's second request (within the budget); or None where the caller builds
    eagerly (rows outside [MIN_ROWS, MAX_ROWS], not CUDA, graphs off, a capture running).
    key(cap): the key past the device and stream; size(cap): the graph's bytes; usable(cap):
    whether a bucket serves this build."""
    if not MIN_ROWS <= n <= MAX_ROWS or device.type != "cuda" or not enabled() or (
            torch.cuda.is_current_stream_capturing()):
        return None
    caps = [cap for cap in room_buckets(n, graph_registry.ROOM)
            if cap <= MAX_ROWS and usable(cap)]
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    key_of = lambda cap: (device.index, stream, *key(cap))  # noqa: E731
    return roomy_graph(_builds, caps, key_of, lambda cap: kept_graph(
        key_of(cap), lambda: size(cap), lambda: make(cap)))


def bytes_budget(device_index: int) -> int:
    """The graph memory the device's captured builds may keep (BYTES_BUDGET)."""
    if BYTES_BUDGET is not None:
        return BYTES_BUDGET
    return min(2 << 30, _device_memory(device_index) // 40)


@functools.cache
def _device_memory(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).total_memory


def kept_graph(key: tuple, size, capture):
    """The captured build kept under key (its first entry the device index), capture()'s on
    the key's second request (a graph of about size() bytes, within the device's
    bytes_budget), or None where the caller builds eagerly (graph_registry.py)."""
    return _builds.get(key, size, key[0], bytes_budget(key[0]), capture,
                       "capturing a plan build failed; building this bucket eagerly")


def builds_registry() -> CaptureRegistry:
    """The registry of every captured build graph (generative_graphs.py's too)."""
    return _builds


def kept() -> list:
    """The captured builds kept (first graphs of strided builds: generative_graphs.py)."""
    return list(_builds.kept().values())


def release() -> None:
    """Drop every captured build (their graphs and buffers) and the requests counted."""
    _builds.release()
