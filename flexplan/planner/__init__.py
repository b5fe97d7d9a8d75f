"""Planner: from coordinates and convolution geometry to a ConvPlan."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from ..device_guard import on_device_of
from ..geometry import ConvGeometry, triple
from ..graph_capture import capturing
from ..kernel_configs import PLAN_BLOCK_SIZES
from ..plan import (ConvPlan, maps_only_request, mirrored_signal_offsets, signal_fields,
                    with_sorted_map_t)
from ..coords_check import check_coords, check_coords_layout, raise_coords_problems
from . import segments
from .generative import generative_plan, inverse_geometries, output_spatial_shape
from .generative_graphs import captured_strided_build, plan_kind
from .build_graphs import captured_build, captured_map_build
from .generative_triton import generative_plan_triton
from .hashmap import PROBLEM_SLOTS, problem_rows, submanifold_neighbor_map_triton
from .reference import submanifold_neighbor_map_torch
from .segments import plan_schedule, scheduled_map, unscheduled_map
from .segments_triton import deferred_pairs_bound, schedule_layout

BACKENDS = ("auto", "torch", "triton")
# The most pairs a submanifold training build sizes by their bound (segments_triton.
# deferred_pairs_bound, 8 bytes each) rather than syncing to learn their count: 4M, 32 MiB
# held with the plan. A 230k-row LiDAR level's bound is 3.2M (26 MiB, ~3x its real pairs); a
# larger build syncs, as the sync's cost (its own kernels' latency, ~0.1 ms) shrinks next to
# its work while the room's memory grows.
DEFERRED_PAIRS_MAX = 4 << 20


def build_plan(coords: torch.Tensor, spatial_shape: Sequence[int], batch_size: int,
               geometry: ConvGeometry, *, backend: str = "auto", check: bool = True,
               training: bool = True, scheduled: bool = True) -> ConvPlan:
    """Build the execution plan of one sparse convolution over `coords`.

    backend: "triton" (GPU hash table), "torch" (sort + searchsorted; the CPU path and test
    oracle) or "auto" (Triton on a GPU, torch elsewhere). Both give identical plans (but a
    strided inference plan replayed from a graph may come with the bwd map an inverse conv of
    its geometry asked for before: generative_graphs.INFER_BWD).
    check: validate coords (range, duplicates) first; pass False for coords already checked
    (unchecked duplicates make a plan whose parts may disagree: never pass unchecked input).
    training: False builds an inference plan (ConvPlan.for_training): no pairs (nor, but
    as said above, a bwd map).
    scheduled: False with training False builds no schedule of the fwd map: for a strided
    geometry a maps-only plan (ConvPlan.maps_only), what pools read; for a submanifold one a
    plan whose schedule is deferred (ConvPlan.schedule_deferred: its convs run every offset
    of every block until scheduled_plan adds the schedule), what the plan cache builds for a
    first sighting.
    The Triton path checks within the build (its hash inserts see both problems) and reads the
    verdict in the build's one host sync, raising the same errors as check_coords.
    """
    shape = triple(spatial_shape, "spatial_shape")
    if backend not in BACKENDS:
        raise ValueError(f"unknown planner backend {backend!r}; choose one of {BACKENDS}")
    check_coords_layout(coords)
    if backend == "auto":
        backend = "triton" if coords.is_cuda else "torch"
    with on_device_of(coords):
        return _build_plan(coords, shape, batch_size, geometry, backend, check, training,
                           scheduled)


def scheduled_plan(plan: ConvPlan) -> ConvPlan:
    """plan (ConvPlan.schedule_deferred) with the masked schedule of its fwd map: the plan a
    scheduled build of the same request makes. No host sync."""
    nmap = plan.fwd.neighbor_map
    with on_device_of(nmap):
        return replace(plan, fwd=scheduled_map(nmap))


def _build_plan(coords, shape, batch_size, geometry, backend, check, training,
                scheduled: bool = True) -> ConvPlan:
    if not geometry.submanifold:
        maps_only = maps_only_request(geometry, training, scheduled)
        if check:
            check_coords(coords, shape, batch_size)
        if backend == "torch" or coords.shape[0] == 0:
            return generative_plan(coords, shape, batch_size, geometry, training, maps_only)
        out_shape = output_spatial_shape(shape, geometry)
        if coords.is_cuda and not (training and segments.SCHEDULE_BWD_MAPS):
            # replayed from CUDA graphs where they are kept (generative_graphs.py); an
            # inference plan of a geometry whose inverse conv asked for its bwd map before
            # comes with it (unscheduled, as bwd_from_fwd makes it without SCHEDULE_BWD_MAPS)
            replayed = captured_strided_build(coords.shape[0], out_shape, batch_size, geometry,
                                              coords.device)
            if replayed is not None:
                bwd = geometry in inverse_geometries and not segments.SCHEDULE_BWD_MAPS
                return replayed.build(coords, shape, batch_size,
                                      plan_kind(training, maps_only, bwd))
        return generative_plan_triton(coords, shape, out_shape, batch_size, geometry, training,
                                      maps_only)
    signal_offsets = mirrored_signal_offsets(geometry.volume) if training else 0
    unscheduled = not training and not scheduled  # (a first sighting's: schedule_deferred)
    if backend == "triton" and training and not check and coords.is_cuda:
        # A build that reads nothing back: replayed from a CUDA graph where one is kept
        # (build_graphs.py; its pairs deferred as below, sized by its bucket's rows).
        replayed = captured_build(coords.shape[0], shape, batch_size, geometry, signal_offsets,
                                  coords.device, DEFERRED_PAIRS_MAX)
        if replayed is not None:
            fwd, signal = replayed.build(coords)
            return _submanifold_plan(coords, shape, batch_size, geometry, fwd, signal, training)
    if backend == "triton" and unscheduled and not check and coords.is_cuda:
        # a first sighting's inference map (no schedule, no sync): replayed likewise
        replayed = captured_map_build(coords.shape[0], shape, batch_size, geometry,
                                      coords.device)
        if replayed is not None:
            return _submanifold_plan(coords, shape, batch_size, geometry,
                                     replayed.build(coords), None, training)
    if backend == "torch":
        if check:
            check_coords(coords, shape, batch_size)
        nmap = submanifold_neighbor_map_torch(coords, shape, batch_size, geometry)
        problems = layout = map_t = None
    else:
        # The schedule's sizes and state ride behind the problems, filled with the hash table
        # and read back with the problems in one sync (an unscheduled build has none).
        layout = None if unscheduled else schedule_layout(coords.shape[0], geometry.volume,
                                                          PLAN_BLOCK_SIZES, signal_offsets)
        # An unscheduled map's rows stay in their own order: the hash kernels write the gather
        # kernels' layout of it too (its sorted_map_t, one launch fewer at its first conv; a
        # conv big enough to schedule the map, ops.conv.SCHEDULE_WORK_MIN, reads the
        # schedule's own layout instead, and this one only takes memory).
        map_t = torch.empty((geometry.volume, coords.shape[0]), dtype=torch.int32,
                            device=coords.device) if unscheduled else None
        # (checked before: the flags are not read, the problems start at the schedule's slots)
        nmap, problems = submanifold_neighbor_map_triton(
            coords, shape, batch_size, geometry, flags=check,
            spare_slots=0 if unscheduled else layout.readback_slots, map_t=map_t)
    num_flags = 0 if problems is None or not check else PROBLEM_SLOTS
    # Nothing to read back without flags and pairs: an unchecked inference build makes no host
    # sync at all (its valid_kernel lengths stay on the device, plan.BlockRuns). An unchecked
    # training build neither: its pairs get room for the most there can be, their count is
    # read when the backward needs it (ConvPlan.pairs_pending).
    defer = (signal_offsets > 0 and not num_flags and not capturing(coords.device)
             and deferred_pairs_bound(coords.shape[0], signal_offsets) <= DEFERRED_PAIRS_MAX)
    if unscheduled:  # the flags, if any, read alone (one sync)
        fwd, signal = unscheduled_map(nmap), None
        if map_t is not None:
            fwd = with_sorted_map_t(fwd, map_t)
        flag_values = problems[:num_flags].tolist() if num_flags else None
    else:
        fwd, signal, flag_values = plan_schedule(
            nmap, PLAN_BLOCK_SIZES, backend, readback=problems, num_flags=num_flags,
            signal_offsets=signal_offsets, layout=layout,
            pairs_total=0 if not signal_offsets and not num_flags else None, defer_pairs=defer)
    # The Triton build's coords check: a flag other than -1 names a row.
    if check and flag_values is not None and max(flag_values) >= 0:
        raise_coords_problems(coords, shape, batch_size, *problem_rows(flag_values, coords.shape[0]))
    return _submanifold_plan(coords, shape, batch_size, geometry, fwd, signal, training)


def _submanifold_plan(coords, shape, batch_size, geometry, fwd, signal, training) -> ConvPlan:
    return ConvPlan(
        geometry=geometry, batch_size=batch_size, in_spatial_shape=shape, out_spatial_shape=shape,
        num_in=coords.shape[0], num_out=coords.shape[0], out_coords=coords,
        fwd=fwd, bwd=None, **signal_fields(signal, coords.device, training))
