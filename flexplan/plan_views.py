"""The views the gather kernels read, derived from a GatherMap (a passive value) on first use.

sorted_map_t(gmap) and chunk_order(gmap) return the view, deriving it the first time it is asked
for on that map object and keeping it in gmap.derived_views (the map holds the slot, never fills
it: layers above ask layers below, so the plan value does not launch kernels). Each view is one
Triton launch (kernels_src/plan_views.py, described by plan.py's launch_sorted_map_t /
launch_chunk_order) where the launcher can run kernels (CUDA tensors, or any under
TRITON_INTERPRET=1), else the torch expression in plan.py, which is also the kernels' oracle.
Views are not written to plan files, pickled or carried by GatherMap.to(): a moved or loaded
map derives its own.
"""
from __future__ import annotations

import torch

from . import launcher
from .device_guard import on_device_of
from .graph_capture import capturing, device_constant
from .kernel_configs import CHUNK_ORDER_MIN_ROWS, PLAN_BLOCK_SIZES, SCHEDULE_CHUNK
from .plan import (BlockRuns, GatherMap, chunk_order_torch, kernels_run_on, launch_chunk_order,
                   launch_sorted_map_t, sorted_map_t_torch)
from .planner.generative import transposed_map_torch
from .planner.generative_triton import transposed_map_triton
from .planner.segments import scheduled_map


def sorted_map_t(gmap: GatherMap) -> torch.Tensor:
    """int32 [V, M]: entry (v, i) is neighbor_map[sorted_idx[i], v], the layout the gather
    kernels read (one offset's neighbours of a block of sorted rows are contiguous).
    Derived on first use (one launch: sorted_map_t_triton) and kept with the map object."""
    view = gmap.derived_views.get("sorted_map_t")
    if view is not None:
        return view
    nmap, idx = gmap.neighbor_map, gmap.sorted_idx
    return _keep(gmap, "sorted_map_t", (
        sorted_map_t_triton if kernels_run_on(nmap) else sorted_map_t_torch)(nmap, idx))


def chunk_order(gmap: GatherMap) -> torch.Tensor:
    """int32 [ceil(M / SCHEDULE_CHUNK)]: the order in which the gather kernels run the chunks
    of SCHEDULE_CHUNK sorted rows (every block size of the plan tiles them): whole chunks by
    ascending first row, a partial last chunk last.

    Blocks stay as the Gray order formed them, but the GPU runs chunks of nearby rows at the
    same time: rows come in spatial order from voxelization, sorted coords and strided plans
    (torch.unique), so their neighbours are shared and stay in L2 (the gather-GEMM runs
    faster on big maps than in Gray order, which runs one mask class at a time across the
    whole grid; scripts/results/design_measurements.md). Derived on first use (one launch:
    chunk_order_triton) and kept with the map object, like sorted_map_t; maps of fewer than
    CHUNK_ORDER_MIN_ROWS rows keep the Gray order's own chunk sequence (gray_chunk_order: no
    launch)."""
    view = gmap.derived_views.get("chunk_order")
    if view is not None:
        return view
    idx = gmap.sorted_idx
    if idx.shape[0] < CHUNK_ORDER_MIN_ROWS:  # small maps: the Gray order's own chunk order
        view = gray_chunk_order(idx.shape[0], idx.device)
    else:
        view = (chunk_order_triton if kernels_run_on(idx) else chunk_order_torch)(idx)
    return _keep(gmap, "chunk_order", view)


def transposed_map(gmap: GatherMap, num_in: int) -> torch.Tensor:
    """int32 [num_in, V]: the neighbour map read the other way (entry (i, v) is the row o with
    gmap.neighbor_map[o, v] = i, or MISSING), for a strided plan's fwd map whose plan keeps no
    bwd map (an inference plan) when a pool's backward asks for it. Only the map, no schedule:
    the pool's backward kernel walks rows in order. Derived on first use (one launch) and kept
    with the map object, like sorted_map_t."""
    view = gmap.derived_views.get("transposed_map")
    if view is not None:
        return view
    nmap = gmap.neighbor_map
    return _keep(gmap, "transposed_map", (
        transposed_map_triton if kernels_run_on(nmap) else transposed_map_torch)(nmap, num_in))


def masked_schedule(gmap: GatherMap) -> GatherMap:
    """The map with the masked kernels' schedule (rows in Gray order, each block's offsets),
    for a map built without one (ConvPlan.schedule_deferred, a bwd map) that a
    convolution big enough to repay the schedule runs over (ops.conv.SCHEDULE_WORK_MIN).
    Derived on first use (no host sync) and kept with the map object, like sorted_map_t; None
    during a CUDA graph capture (the sort replays a graph of its own: no schedule made there)."""
    view = gmap.derived_views.get("masked_schedule")
    if view is not None:
        return view
    nmap = gmap.neighbor_map
    if capturing(nmap.device):
        return None
    with on_device_of(nmap):
        return _keep(gmap, "masked_schedule", scheduled_map(nmap))


def full_schedule(gmap: GatherMap) -> GatherMap:
    """The map with the schedule in which every block of rows runs every offset, rows in their
    own order: what the masked kernels run over a map built without a schedule (a first
    sighting's submanifold inference map, a bwd map: planner.segments.SCHEDULE_BWD_MAPS),
    doing an implicit kernel's work with the masked kernels' variants (the ones AOT bundles
    hold and tables tune). No sort, no launch: views of per-device constants. Kept with the map
    object, like sorted_map_t."""
    view = gmap.derived_views.get("full_schedule")
    if view is not None:
        return view
    m, v = gmap.neighbor_map.shape
    blocks = {block: -(-m // block) for block in PLAN_BLOCK_SIZES}
    every, starts = _every_offset(v, max(blocks.values()), gmap.neighbor_map.device)
    # (runs of the constants, each viewed when a kernel asks for its block size)
    offsets = BlockRuns(every, {block: (0, count * v) for block, count in blocks.items()})
    segs = BlockRuns(starts, {block: (0, count + 1) for block, count in blocks.items()})
    full = GatherMap(gmap.neighbor_map, gmap.sorted_idx, offsets, segs)
    # Same rows in the same (their own) order: the map's views serve it as they are, and its
    # chunks run in order (no launch for either).
    made = gmap.derived_views.get("sorted_map_t")
    if made is not None:
        full.derived_views["sorted_map_t"] = made
    full.derived_views["chunk_order"] = _chunks_in_order(m, gmap.neighbor_map.device)
    return _keep(gmap, "full_schedule", full)


def _chunks_in_order(m: int, device: torch.device) -> torch.Tensor:
    """int32 [ceil(m / SCHEDULE_CHUNK)]: 0, 1, 2, ..., what chunk_order makes of rows in their
    own order at any size (a view of a per-device arange of a power-of-two length)."""
    chunks = -(-m // SCHEDULE_CHUNK)
    room = 1 << max(chunks - 1, 0).bit_length()
    return device_constant(("chunks_in_order", room), device, lambda: torch.arange(
        room, dtype=torch.int32, device=device))[:chunks]


def _every_offset(v: int, blocks: int, device: torch.device):
    """(0..v-1 repeated, block starts 0, v, 2v, ...), int32, for at least `blocks` blocks: per
    device constants of a power-of-two block count (a handful per offset count)."""
    room = 1 << max(blocks - 1, 0).bit_length()

    def make():
        every = torch.arange(v, dtype=torch.int32, device=device).repeat(room)
        starts = torch.arange(0, (room + 1) * v, v, dtype=torch.int32, device=device)
        return every, starts
    return device_constant(("every_offset", v, room), device, make)


def _keep(gmap: GatherMap, name: str, view):
    """view, kept with the map object as its derived view `name`, unless it was made during a
    CUDA graph capture (graph_capture: never kept from a capture)."""
    if not capturing(gmap.neighbor_map.device):
        gmap.derived_views[name] = view
    return view


def gray_chunk_order(m: int, device: torch.device) -> torch.Tensor:
    """int32 [ceil(m / SCHEDULE_CHUNK)]: 0, 1, 2, ... (chunks in Gray order, a partial last
    chunk last), a view of one arange kept per device: no launch, no allocation."""
    chunks = -(-m // SCHEDULE_CHUNK)
    device = torch.device(device)
    n = CHUNK_ORDER_MIN_ROWS // SCHEDULE_CHUNK + 1
    return device_constant("chunk_aranges", device,
                           lambda: torch.arange(n, dtype=torch.int32, device=device))[:chunks]


def sorted_map_t_triton(neighbor_map: torch.Tensor, sorted_idx: torch.Tensor) -> torch.Tensor:
    """sorted_map_t_torch in one launch."""
    m, v = neighbor_map.shape
    out = torch.empty((v, m), dtype=neighbor_map.dtype, device=neighbor_map.device)
    if m:  # (launcher.launch looked up per call: tests record launches there)
        launch_sorted_map_t(launcher.launch, neighbor_map.contiguous(), sorted_idx.contiguous(),
                            out, m, v)
    return out


def chunk_order_triton(sorted_idx: torch.Tensor, chunk: int = SCHEDULE_CHUNK) -> torch.Tensor:
    """chunk_order_torch in one launch."""
    m = sorted_idx.shape[0]
    order = torch.empty(-(-m // chunk), dtype=torch.int32, device=sorted_idx.device)
    if m:
        launch_chunk_order(launcher.launch, sorted_idx.contiguous(), order, m, chunk)
    return order
