"""Plans of strided (generative), transposed and inverse sparse convolutions.

Tap k of an axis (kernel_offsets(..., centered=False): offset k * d) links output o and input i by
    strided:    i = o * s - p + k * d     (an output exists iff some input falls in its window)
    transposed: o = i * s - p + k * d     (every in-range target of an input exists)
which are spconv's rules and those of torch's conv3d / conv_transpose3d with the same weight.
Each (input row, tap v) reaches at most one output and each (output row, v) at most one input
(coords are unique), so both gather maps come straight from the list of valid (input, tap)
candidates: no hash lookups. Plain torch ops, on whatever device the coords are.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..compile_boundary import opaque
from ..device_guard import on_device_of
from ..geometry import ConvGeometry
from ..kernel_configs import PLAN_BLOCK_SIZES
from ..plan import MISSING, ConvPlan, signal_fields
from .keys import pack_coords, unpack_keys
from .offsets import kernel_offsets
from .generative_triton import transposed_gather_map, transposed_map_triton
from . import segments
from .segments import gather_map, plan_schedule, unscheduled_map


def output_spatial_shape(spatial_shape, geometry: ConvGeometry) -> tuple[int, int, int]:
    """spconv's output grid: (in + 2p - d(k-1) - 1) // s + 1, or for transposed convolutions
    (in - 1) s - 2p + d(k-1) + 1. Raises if an axis would be empty."""
    if geometry.submanifold:
        return tuple(spatial_shape)
    out = []
    for n, k, s, p, d in zip(spatial_shape, geometry.kernel_size, geometry.stride,
                             geometry.padding, geometry.dilation):
        span = d * (k - 1) + 1
        out.append((n - 1) * s - 2 * p + span if geometry.transposed else (n + 2 * p - span) // s + 1)
    if any(o < 1 for o in out):
        raise ValueError(f"{'transposed ' if geometry.transposed else ''}convolution with "
                         f"{geometry} maps spatial_shape {tuple(spatial_shape)} to an empty grid "
                         f"{tuple(out)}")
    return tuple(out)


def _candidates(coords: torch.Tensor, geometry: ConvGeometry, out_shape) -> tuple[torch.Tensor, ...]:
    """(input rows, taps, output coords [M, 4]) of every valid (input, tap) candidate."""
    offsets = kernel_offsets(geometry, coords.device, centered=False).to(torch.int32)  # [V, 3]
    stride = torch.tensor(geometry.stride, dtype=torch.int32, device=coords.device)
    padding = torch.tensor(geometry.padding, dtype=torch.int32, device=coords.device)
    spatial = coords[:, 1:]
    # Validity one axis at a time keeps the temporaries at [N, V] rather than [N, V, 3].
    valid = None
    for a, (s, p, n) in enumerate(zip(geometry.stride, geometry.padding, out_shape)):
        if geometry.transposed:
            o = spatial[:, a, None] * s - p + offsets[None, :, a]
            ok = (o >= 0) & (o < n)
        else:
            num = spatial[:, a, None] + p - offsets[None, :, a]
            ok = (num >= 0) & (num % s == 0) & (num < n * s)
        valid = ok if valid is None else valid & ok
    rows, taps = valid.nonzero(as_tuple=True)
    if geometry.transposed:
        out_spatial = spatial[rows] * stride - padding + offsets[taps]
    else:
        out_spatial = torch.div(spatial[rows] + padding - offsets[taps], stride, rounding_mode="floor")
    return rows, taps, torch.cat([coords[rows, :1], out_spatial], dim=1)


def generative_plan(coords: torch.Tensor, spatial_shape: tuple[int, int, int], batch_size: int,
                    geometry: ConvGeometry, training: bool = True,
                    maps_only: bool = False) -> ConvPlan:
    """Plan of a strided or transposed convolution (geometry.submanifold is False).

    Output coords are the distinct candidates in ascending (b, x, y, z) order. training=False:
    an inference plan (no bwd map, no valid_signal pairs); maps_only (with training False):
    its fwd map unscheduled too (ConvPlan.maps_only, a pool's plan).
    """
    if geometry.submanifold:
        raise ValueError("generative_plan is for non-submanifold geometries")
    out_shape = output_spatial_shape(spatial_shape, geometry)
    return plan_from_candidates(
        coords, tuple(spatial_shape), out_shape, batch_size, geometry, training,
        pack=lambda c: pack_coords(c, out_shape, batch_size),
        unpack=lambda k: unpack_keys(k, out_shape), maps_only=maps_only and not training)


def plan_from_candidates(coords, shape, out_shape, batch_size, geometry, training: bool,
                         pack, unpack, maps_only: bool = False) -> ConvPlan:
    """The plan whose outputs are the distinct (input row, tap) candidates on out_shape, in
    ascending key order (pack / unpack: the coordinates' key packing, 3D here or 4D in
    plan4d.py); the maps straight from the candidates."""
    rows, taps, out_coords = _candidates(coords, geometry, out_shape)
    out_keys, out_rows = torch.unique(pack(out_coords), return_inverse=True)
    n_in, n_out, v = coords.shape[0], out_keys.numel(), geometry.volume
    fwd = torch.full((n_out, v), MISSING, dtype=torch.int32, device=coords.device)
    fwd[out_rows, taps] = rows.to(torch.int32)
    bwd_map = None
    if training:
        bwd = torch.full((n_in, v), MISSING, dtype=torch.int32, device=coords.device)
        bwd[rows, taps] = out_rows.to(torch.int32)
        bwd_map = (gather_map(bwd, PLAN_BLOCK_SIZES) if segments.SCHEDULE_BWD_MAPS
                   else unscheduled_map(bwd))
    if maps_only:
        fwd_map, signal = unscheduled_map(fwd), None
    else:
        fwd_map, signal, _ = plan_schedule(fwd, PLAN_BLOCK_SIZES,
                                           signal_offsets=v if training else 0)
    return ConvPlan(
        geometry=geometry, batch_size=batch_size, in_spatial_shape=shape,
        out_spatial_shape=out_shape, num_in=n_in, num_out=n_out,
        out_coords=unpack(out_keys), fwd=fwd_map, bwd=bwd_map,
        **signal_fields(signal, coords.device, training))


def transposed_map_torch(fwd: torch.Tensor, num_in: int) -> torch.Tensor:
    """bwd [num_in, V] of a fwd map [M, V] (fwd[o, v] = i  <=>  bwd[i, v] = o), in torch ops."""
    n_out, v = fwd.shape
    # Missing entries write to a spare row past the inputs: no boolean indexing, no host sync.
    rows = torch.where(fwd == MISSING, num_in, fwd).long()
    bwd = torch.full((num_in + 1, v), MISSING, dtype=torch.int32, device=fwd.device)
    bwd[rows, torch.arange(v, device=fwd.device)] = torch.arange(
        n_out, dtype=torch.int32, device=fwd.device)[:, None].expand(n_out, v)
    return bwd[:num_in]


# The geometries whose inference plans an inverse conv asked for the bwd map of (bwd_from_fwd):
# the planner's later strided inference builds of them replayed from graphs make that map in
# the replay (generative_graphs.INFER_BWD), other networks' builds none.
inverse_geometries: set = set()


@opaque
def bwd_from_fwd(plan: ConvPlan) -> ConvPlan:
    """The plan with its bwd map (input rows gather output rows) made from the fwd map, for an
    inference plan of a strided / transposed conv whose inverse conv needs it: one launch (and,
    with segments.SCHEDULE_BWD_MAPS, the map's schedule) on a GPU, no host sync (an inference
    plan keeps no pairs)."""
    inverse_geometries.add(plan.geometry)
    fwd = plan.fwd.neighbor_map
    with on_device_of(fwd):  # (its launches: on the plan's GPU)
        # (a maps-only plan stays one)
        scheduled = segments.SCHEDULE_BWD_MAPS and not plan.maps_only
        if fwd.is_cuda and not scheduled:  # (a scheduled map gets its layout from the schedule)
            bwd_map = transposed_gather_map(fwd, plan.num_in)
        else:
            bwd = (transposed_map_triton if fwd.is_cuda else transposed_map_torch)(fwd, plan.num_in)
            bwd_map = (plan_schedule(bwd, PLAN_BLOCK_SIZES, signal_offsets=0, pairs_total=0)[0]
                       if scheduled else unscheduled_map(bwd))
    return replace(plan, bwd=bwd_map)


@opaque  # a plan is made (and indexed: plan_tokens) outside torch.compile's graphs
def inverse_plan(paired: ConvPlan, paired_in_coords: torch.Tensor) -> ConvPlan:
    """Plan of the inverse of a strided/transposed convolution (spconv's SparseInverseConv3d).

    It maps the paired conv's outputs back onto its inputs: out coords = paired_in_coords, the
    maps are the paired plan's swapped, with the same tap v (weight not reversed). That is the
    transposed convolution of the paired geometry restricted to those coords, so its geometry is
    the paired one with `transposed` flipped.
    """
    if paired.geometry.submanifold:
        raise ValueError("inverse convolution needs a strided or transposed paired plan, "
                         "not a submanifold one")
    if paired.bwd is None:  # an inference plan: its inverse's gather map is made here
        paired = bwd_from_fwd(paired)
    if paired_in_coords.shape[0] != paired.num_in:
        raise ValueError(f"paired conv had {paired.num_in} inputs, got "
                         f"{paired_in_coords.shape[0]} coords")
    # Same pairs, roles swapped: still grouped by tap (within a tap, in the paired order).
    return ConvPlan(
        geometry=replace(paired.geometry, transposed=not paired.geometry.transposed),
        batch_size=paired.batch_size, in_spatial_shape=paired.out_spatial_shape,
        out_spatial_shape=paired.in_spatial_shape, num_in=paired.num_out,
        num_out=paired.num_in, out_coords=paired_in_coords, fwd=paired.bwd, bwd=paired.fwd,
        valid_signal_i=paired.valid_signal_o, valid_signal_o=paired.valid_signal_i,
        valid_signal_seg=paired.valid_signal_seg, for_training=paired.for_training,
        pairs_pending=paired.pairs_pending)
