"""From a neighbour map to the masked-GEMM schedule: Gray-code order, per-block valid offsets,
and per-offset (input, output) pairs. This module picks the path: plain torch ops
(segments_torch.py: the CPU path and the test oracle) or the same schedule on the GPU
(segments_triton.py)."""
from __future__ import annotations

import torch

from ..kernel_configs import PLAN_BLOCK_SIZES
from ..plan import GatherMap
# The torch path lives below the Triton path (which takes its word layout and its empty-map
# results from there); the helpers are re-exported because callers name them as segments'.
from .segments_torch import (block_valid_offsets, gather_map_torch, gray_code_order,  # noqa: F401
                             gray_rank_words, rank_words, sort_by_rank, valid_signal_torch)
from .segments_triton import ScheduleLayout, plan_schedule_triton

# Whether the bwd map of a strided or transposed plan (a training build's, or the one
# generative.bwd_from_fwd makes for an inverse conv over an inference plan) gets the masked
# schedule (Gray-code order, per-block offsets). False: its rows stay in their own order with
# no schedule, and the convs reading it (the strided conv's grad-input, the inverse conv's
# forward) run every offset of every block (ops/conv.py: plan_views.full_schedule, or a masked
# schedule made at the first conv where the work is large, SCHEDULE_WORK_MIN). A row of such a
# map has at most candidate_slots of its V offsets (8 of 27 at stride 2), so those convs do
# more GPU work; a build then skips a Gray-rank pass, a sort, the schedule and their
# allocations, host time that exceeds that work on host-bound steps (measurements:
# scripts/results/bench_precision.md, sessions 37 and 41). True: scheduled, as before (A/B).
SCHEDULE_BWD_MAPS = False


def _use_triton(neighbor_map: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown segments backend {backend!r}; choose auto, torch or triton")
    return backend == "triton" or (backend == "auto" and neighbor_map.is_cuda)


def plan_schedule(neighbor_map: torch.Tensor, block_sizes: tuple[int, ...], backend: str = "auto",
                  readback: torch.Tensor | None = None, num_flags: int = 0,
                  signal_offsets: int | None = None, layout: ScheduleLayout | None = None,
                  pairs_total: int | None = None, defer_pairs: bool = False):
    """(GatherMap, valid_signal's triple, flags as ints or None): the whole schedule of one map.

    readback: None, or an int64 tensor on the map's device of num_flags + layout.readback_slots
    entries (layout: segments_triton.schedule_layout of the map), the first num_flags the
    caller's flags (e.g. the build's input checks), read in the same host sync as the schedule's
    own sizes, the rest -1 (the Triton path writes its sizes and state there). The Triton path
    makes one host sync in all, none when it has no flags to read and is given pairs_total
    (the number of pairs, e.g. 0 for signal_offsets 0). signal_offsets: as in valid_signal.
    defer_pairs: the Triton path makes no sync without flags either; the pairs come with room
    past them and their count pending (plan_schedule_triton).
    """
    signal_offsets = neighbor_map.shape[1] if signal_offsets is None else signal_offsets
    if _use_triton(neighbor_map, backend):
        return plan_schedule_triton(neighbor_map, block_sizes, signal_offsets, readback, num_flags,
                                    layout, pairs_total, defer_pairs)
    return (gather_map_torch(neighbor_map, block_sizes),
            valid_signal_torch(neighbor_map, signal_offsets),
            readback[:num_flags].tolist() if num_flags else None)


def unscheduled_map(neighbor_map: torch.Tensor, rows: torch.Tensor | None = None) -> GatherMap:
    """A gather map with its rows in their own order and no masked schedule (no block sizes):
    what the implicit kernels need, without the schedule's sort and launches. rows: the int32
    0..M-1 its sorted_idx is, where the caller has them (else made here)."""
    if rows is None:
        rows = torch.arange(neighbor_map.shape[0], dtype=torch.int32, device=neighbor_map.device)
    return GatherMap(neighbor_map, rows, {}, {})


def scheduled_map(neighbor_map: torch.Tensor) -> GatherMap:
    """The masked schedule of a map built without one (the plan block sizes), as a build
    makes it, with no host sync: its valid_kernel lengths stay on the device (BlockRuns)."""
    return plan_schedule(neighbor_map, PLAN_BLOCK_SIZES, signal_offsets=0, pairs_total=0)[0]


def gather_map(neighbor_map: torch.Tensor, block_sizes: tuple[int, ...],
               backend: str = "auto") -> GatherMap:
    """Schedule the masked kernels for one neighbour map.

    backend: "torch", "triton" (same results, reads the map in place, one host sync) or
    "auto" (Triton on a GPU).
    """
    if _use_triton(neighbor_map, backend):
        return plan_schedule_triton(neighbor_map, block_sizes, 0)[0]
    return gather_map_torch(neighbor_map, block_sizes)


def valid_signal(neighbor_map: torch.Tensor, backend: str = "auto", signal_offsets: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input rows, output rows, seg [S + 1]) of the pairs of the first S = signal_offsets
    offsets (default all), grouped by offset, ascending rows. Submanifold plans keep S = V // 2 + 1
    (see plan.mirrored_signal_offsets)."""
    v = neighbor_map.shape[1] if signal_offsets is None else signal_offsets
    if _use_triton(neighbor_map, backend):
        return plan_schedule_triton(neighbor_map, (), v)[1]
    return valid_signal_torch(neighbor_map, v)
