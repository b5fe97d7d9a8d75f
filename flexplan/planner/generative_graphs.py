"""Strided and transposed builds (training, inference and a pool's maps-only plans) replayed
from CUDA graphs (build_graphs.py for the submanifold ones, and the registry both use).

generative_triton.generative_plan_triton has one host sync: the output count, which sizes
everything after it. So its launches are recorded in two graphs. The first, per bucket of
input rows (and grid, geometry), records the candidates (its kernel reading the live input
count from device memory, kernels_src/row_count.py: rows past it are padding, their slots
sorted last), their sort and the run starts; the host then reads the output and pair counts.
The second, per bucket of output rows and kind of plan (the first's buffers are its inputs;
one first graph serves every kind), records the rest: the fwd map and output coordinates,
but for a maps-only plan the fwd map's schedule, for a training plan the bwd map transposed
from the fwd map and the pairs, and for an inference plan of a geometry whose inverse conv
asked for the bwd map before (INFER_BWD) that map: made inside the replay rather than by one
more launch and its host work at the inverse conv (planner.generative.bwd_from_fwd). Their
kernels read the live output count, which the run starts left on the device; a schedule
needs kernels of at most 63 offsets, whose Gray ranks are one word: only then are the padding
rows ranked last. Where the second is not captured yet, the rest runs eagerly over the
first's buffers, as generative_plan_triton runs it. The plan's buffers are one arena of the
second, copied out after each replay (build_graphs.py says why).
"""
from __future__ import annotations

import torch

from ..geometry import ConvGeometry
from ..host_waits import release_now
from ..kernel_configs import PLAN_BLOCK_SIZES
from ..launcher import launch
from ..plan import MISSING, ConvPlan, signal_fields, with_sorted_map_t
from .build_graphs import (LiveRowsGraph, arena_places, builds_registry, graph_bytes, kept_graph,
                           live_rows_graph)
from . import graph_registry
from .graph_registry import CaptureRegistry, capture_graph, roomy_graph
from .generative_triton import (SENTINEL, TOTALS, candidate_slots, launch_candidates,
                                launch_run_starts, launch_scatter, launch_transpose_map,
                                run_starts_tiles, scattered_fwd, transposed_gather_map)
from .keys import key_dtype
from .rank_sort import MAX_ROWS, TorchSort, room_buckets
from .segments import unscheduled_map
from .segments_torch import rank_words
from .segments_triton import (SCHEDULE_LAUNCH, _aligned, deferred_gather_map, launch_pairs,
                              plan_schedule_triton, readback_bound, schedule_launches,
                              schedule_layout)

# The kinds of plan a first graph's builds make (one second graph per output bucket and kind):
# a training plan, an inference plan (scheduled fwd map, no bwd map or pairs), the same with
# the bwd map an inverse conv reads (INFER_BWD), a pool's maps-only plan (ConvPlan.maps_only:
# the fwd map unscheduled).
TRAIN, INFER, INFER_BWD, MAPS = "train", "infer", "infer+bwd", "maps"
KINDS = (TRAIN, INFER, INFER_BWD, MAPS)
WITH_BWD = frozenset({TRAIN, INFER_BWD})


def plan_kind(training: bool, maps_only: bool, bwd: bool = False) -> str:
    """bwd: an inference plan with its bwd map (INFER_BWD)."""
    return MAPS if maps_only else TRAIN if training else INFER_BWD if bwd else INFER


# Per candidate, what a first graph's pool keeps (the capture's peak): keys, taps and ranks,
# the stable sort's input, iota, outputs and CUB's double buffers (int64 keys; int32 less).
CANDIDATE_BYTES = 56


class CapturedCandidates(LiveRowsGraph):
    """The first graph: candidates, sort and run starts of up to `cap` input rows."""

    def __init__(self, cap: int, out_shape: tuple[int, int, int], batch_size: int,
                 geometry: ConvGeometry, device: torch.device, capture: bool = True):
        super().__init__(cap, device)
        self.out_shape, self.geometry = out_shape, geometry
        self.slots = candidate_slots(geometry)
        self.kdtype = key_dtype(out_shape, batch_size)
        self.total = cap * self.slots  # candidates sorted, padding included
        v = geometry.volume
        self.fwd_at = TOTALS
        self.state_at = self.fwd_at + readback_bound(self.total, PLAN_BLOCK_SIZES, v)
        # (eager, the CPU tests' way: second "graphs" kept here, no device to key or budget by)
        self.eager_rests = CaptureRegistry()
        self.rest_layouts: dict = {}  # output bucket -> its schedule's layout
        self.captured = capture
        if capture:
            self.capture()

    @staticmethod
    def graph_bytes(cap: int, geometry: ConvGeometry) -> int:
        """The first graph's memory, estimated."""
        return CANDIDATE_BYTES * cap * candidate_slots(geometry) + 16 * cap

    def _launches(self):
        """(sorted keys, order, rank, taps, readback) of the live rows of self.coords."""
        device = self.coords.device
        readback = torch.full((self.state_at + run_starts_tiles(self.total) + 1,), -1,
                              dtype=torch.int64, device=device)
        taps = torch.empty(self.total, dtype=torch.int32, device=device)
        rank = torch.empty(self.total, dtype=torch.int32, device=device)
        sent = SENTINEL[self.kdtype]
        # (torch.sort: the graph records it; the bucket's padding is this graph's own)
        sorter = TorchSort(self.total, 1, self.kdtype, device)
        launch_candidates(launch, self.coords, sorter.keys, taps, self.cap, self.rows.data_ptr(),
                          sorter.size, *self.out_shape, self.geometry, self.slots, sent)
        sorted_keys, order = sorter.sort()
        launch_run_starts(launch, sorted_keys, rank, readback, self.total, self.state_at, sent)
        return sorted_keys, order, rank, taps, readback

    def build(self, coords: torch.Tensor, in_shape: tuple[int, int, int], batch_size: int,
              kind: str = TRAIN) -> ConvPlan:
        """generative_plan_triton's plan of `kind` (KINDS) for coords [n <= cap, 4], checked
        (INFER_BWD: also the bwd map, as planner.generative.bwd_from_fwd would add it)."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind of plan {kind!r}; one of {KINDS}")
        n = coords.shape[0]
        with self.lock:  # the graphs' buffers are ours from the copy in to the copies out
            outputs = self.replay(coords)
            readback = outputs[-1]
            release_now()  # (while the replay runs)
            n_out, pairs = readback[:TOTALS].tolist()  # the one host sync
            pairs = max(pairs, 0)  # -1: no candidate at all
            rest = self._second(n_out, kind) if pairs else None
            if rest is not None:
                parts = rest.build(outputs, n, n_out, pairs)
            else:
                parts = self._rest_eagerly(outputs, n, n_out, pairs, kind)
        out_coords, fwd_map, bwd_map, signal = parts
        training = kind == TRAIN
        return ConvPlan(
            geometry=self.geometry, batch_size=batch_size, in_spatial_shape=in_shape,
            out_spatial_shape=self.out_shape, num_in=n, num_out=n_out, out_coords=out_coords,
            fwd=fwd_map, bwd=bwd_map, **signal_fields(signal, coords.device, training))

    def _rest_eagerly(self, outputs, n: int, n_out: int, pairs: int, kind: str):
        """generative_plan_triton's launches after its sync, over this graph's buffers."""
        v, readback = self.geometry.volume, outputs[-1]
        fwd, out_coords = scattered_fwd(outputs[:4], self.total, n, n_out, pairs, self.out_shape,
                                        self.slots, v, SENTINEL[self.kdtype])
        if kind == MAPS:
            return out_coords, unscheduled_map(fwd), None, None
        fwd_readback = readback[self.fwd_at:self.state_at]
        # -1 as the schedule's look-back expects: a second graph's first-use pass (a capture
        # that then failed) may have left its state there
        fwd_readback.fill_(-1)
        bwd_map = transposed_gather_map(fwd, n) if kind in WITH_BWD else None
        fwd_map, signal, _ = plan_schedule_triton(fwd, PLAN_BLOCK_SIZES,
                                                  v if kind == TRAIN else 0, fwd_readback,
                                                  pairs_total=pairs)
        return out_coords, fwd_map, bwd_map, signal

    def _second(self, n_out: int, kind: str):
        """The second graph for n_out output rows of a plan of `kind` (captured at its bucket's
        second request, within the device's budget: build_graphs.kept_graph), or None: the
        rest runs eagerly."""
        v = self.geometry.volume
        # (a schedule's Gray ranks of several words: the padding rows get none)
        if kind != MAPS and rank_words(v)[2] != 1:
            return None
        rows = SCHEDULE_LAUNCH["ROWS"]
        caps = sorted({-(-cap // rows) * rows for cap in room_buckets(n_out, graph_registry.ROOM)})
        caps = caps[:1] + [cap for cap in caps[1:] if cap <= MAX_ROWS]  # (no room past it)
        # (those whose schedule's state fits the readback: its room is the first graph's)
        layout = lambda cap: self._rest_layout(cap, kind)  # noqa: E731
        caps = [cap for cap in caps if kind == MAPS
                or layout(cap).readback_slots <= self.state_at - self.fwd_at]
        make = lambda cap: CapturedRest(self, cap, layout(cap), kind)  # noqa: E731
        size = lambda cap: graph_bytes(  # noqa: E731
            CapturedRest.places_of(self, cap, layout(cap), kind), cap)
        if not self.captured:
            return roomy_graph(self.eager_rests, caps, lambda cap: (cap, kind), lambda cap:
                               self.eager_rests.get((cap, kind), lambda: size(cap), None,
                                                    1 << 62, lambda: make(cap), ""))
        device = self.coords.device
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        key_of = lambda cap: (device.index, stream, "rest", id(self), cap, kind)  # noqa: E731
        return roomy_graph(builds_registry(), caps, key_of, lambda cap: kept_graph(
            key_of(cap), lambda: size(cap), lambda: make(cap)))

    def _rest_layout(self, cap_out: int, kind: str):
        """The fwd schedule's layout of a second graph of cap_out rows (made once per bucket):
        with the pairs of every offset for training, none for inference; None for MAPS (no
        schedule)."""
        if kind == MAPS:
            return None
        layout = self.rest_layouts.get((cap_out, kind))
        if layout is None:
            v = self.geometry.volume
            layout = self.rest_layouts[(cap_out, kind)] = schedule_layout(
                cap_out, v, PLAN_BLOCK_SIZES, v if kind == TRAIN else 0)
        return layout


class CapturedRest:
    """The second graph: fwd map and output coordinates of up to `cap` output rows, over a
    CapturedCandidates' buffers; but for MAPS also the fwd schedule, for TRAIN and INFER_BWD
    the bwd map, for TRAIN the pairs too."""

    def __init__(self, first: CapturedCandidates, cap: int, layout, kind: str = TRAIN):
        self.first, self.cap, self.layout, self.kind = first, cap, layout, kind
        self.room = _aligned(first.total)  # the pairs: at most one per candidate
        self.places = self.places_of(first, cap, layout, kind)
        self.rows_out = torch.zeros(1, dtype=torch.int32, device=first.coords.device)
        self.graph = self.arena = None
        if first.captured:
            self.graph, self.arena = capture_graph(lambda: self._launches(first.outputs))

    @staticmethod
    def places_of(first: CapturedCandidates, cap: int, layout,
                  kind: str = TRAIN) -> tuple[int, ...]:
        """The arena's regions: plan_out (MAPS: none), fwd map, out coords; but for MAPS map_t;
        for TRAIN and INFER_BWD the pair rows (room: one per candidate; INFER_BWD: none), bwd
        map, bwd_t."""
        v = first.geometry.volume
        regions = (0 if kind == MAPS else layout.out_size, cap * v, cap * 4)
        if kind != MAPS:
            regions += (v * cap,)
        if kind in WITH_BWD:
            regions += (2 * _aligned(first.total) if kind == TRAIN else 0, first.cap * v,
                        v * first.cap)
        return arena_places(regions)

    def _launches(self, outputs) -> torch.Tensor:
        """The arena (self.places) of the rest of the build over the first graph's outputs."""
        first, v, p = self.first, self.first.geometry.volume, self.places
        sorted_keys, order, rank, taps, readback = outputs
        arena = torch.empty(p[-1], dtype=torch.int32, device=first.coords.device)
        fwd = arena[p[1]:p[1] + self.cap * v].view(self.cap, v)
        out_coords = arena[p[2]:p[2] + self.cap * 4].view(self.cap, 4)
        arena[p[1]:p[2]].fill_(MISSING)
        launch_scatter(launch, sorted_keys, order, rank, taps, fwd, fwd, out_coords, first.total,
                       first.cap, *first.out_shape, first.slots, v, SENTINEL[first.kdtype], True)
        if self.kind == MAPS:
            return arena
        self.rows_out.copy_(readback[:1])  # (the run starts' int64 output count)
        rows_out, rows_in = self.rows_out.data_ptr(), first.rows.data_ptr()
        plan_out = arena[:self.layout.out_size]
        map_t = arena[p[3]:p[3] + v * self.cap].view(v, self.cap)
        training = self.kind == TRAIN
        if self.kind in WITH_BWD:
            arena[p[5]:].fill_(MISSING)
            launch_transpose_map(launch, fwd, arena[p[5]:p[6]], arena[p[6]:p[7]], self.cap * v,
                                 first.cap, rows_in, v, True)
        signal_offsets = v if training else 0
        fwd_readback = readback[first.fwd_at:first.fwd_at + self.layout.readback_slots]
        fwd_readback.fill_(-1)
        _, _, scan, _ = schedule_launches(fwd, self.layout, signal_offsets, fwd_readback, 0,
                                          rows_out, plan_out, map_t)
        if training:
            at = self.layout.signal_seg_at
            launch_pairs(launch, fwd, scan, arena[p[4]:p[5]], self.room,
                         plan_out[at:at + v + 1], self.cap, rows_out, v, v)
        return arena

    def build(self, outputs, n_in: int, n_out: int, pairs: int):
        """(out_coords, fwd map, bwd map, valid_signal's triple; the bwd map None but for
        TRAIN and INFER_BWD, the triple None but for TRAIN) of the first graph's live rows, from
        its outputs (its last replay's), the first's lock held."""
        v, p, layout = self.first.geometry.volume, self.places, self.layout
        if self.graph is None:
            arena = self._launches(outputs)
        else:
            self.graph.replay()
            arena = self.arena
        arena = arena.clone()  # (one copy: the plan's views below share it)
        fwd = arena[p[1]:p[1] + n_out * v].view(n_out, v)
        out_coords = arena[p[2]:p[2] + n_out * 4].view(n_out, 4)
        if self.kind == MAPS:
            return out_coords, unscheduled_map(fwd), None, None
        plan_out = arena[:layout.out_size]
        map_t = arena[p[3]:p[3] + v * n_out].view(v, n_out)
        seg_runs = {block: (at, -(-n_out // block) + 1)
                    for block, (at, _) in layout.seg_runs.items()}
        fwd_map = deferred_gather_map(fwd, plan_out, map_t, layout, seg_runs)
        if self.kind == INFER:
            return out_coords, fwd_map, None, None
        bwd = arena[p[5]:p[5] + n_in * v].view(n_in, v)
        bwd_map = with_sorted_map_t(unscheduled_map(bwd),
                                    arena[p[6]:p[6] + v * n_in].view(v, n_in))
        if self.kind == INFER_BWD:
            return out_coords, fwd_map, bwd_map, None
        at = layout.signal_seg_at
        signal = (arena[p[4]:p[4] + pairs], arena[p[4] + self.room:p[4] + self.room + pairs],
                  plan_out[at:at + v + 1])
        return out_coords, fwd_map, bwd_map, signal


def captured_strided_build(n: int, out_shape: tuple[int, int, int], batch_size: int,
                           geometry: ConvGeometry, device: torch.device
                           ) -> CapturedCandidates | None:
    """The captured first graph for a strided or transposed build of n checked rows (any kind
    of plan) on the current stream of `device`, or None where the caller builds eagerly (the
    same rules as build_graphs.live_rows_graph's)."""
    return live_rows_graph(
        n, device, lambda cap: ("candidates", cap, out_shape, batch_size, geometry),
        lambda cap: CapturedCandidates.graph_bytes(cap, geometry),
        lambda cap: CapturedCandidates(cap, out_shape, batch_size, geometry, device))
