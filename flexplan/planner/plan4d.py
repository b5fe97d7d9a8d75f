"""Plans of 4D sparse convolutions (spconv's SubMConv4d, SparseConv4d, SparseConvTranspose4d;
the inverse conv takes generative.inverse_plan of these): the 3D plan format over 4D coords.

A ConvPlan does not depend on the number of axes past its neighbour maps: a map is [M, V] rows
of the other side, whatever V, and the gather-GEMM, grad-weight and pool kernels loop over V.
So a 4D plan is a ConvPlan whose maps have V = K0 K1 K2 K3 columns, v = ((k0 K1 + k1) K2 + k2)
K3 + k3 (the weight [Co, K0, K1, K2, K3, Ci] flattened, kernel_offsets' order), its coords
[N, 5] and its geometry a ConvGeometry4d. Only the maps are built here, in torch ops on the
coords' device (sort + searchsorted on packed int64 keys, coords4d; no hash table): the 3D
planner's schedule (plan_schedule: Gray-code order, per-block offsets, pairs; Triton on a GPU)
takes them as they are. Submanifold plans keep the mirrored half of the pairs, as 3D ones:
with centred taps, offset V - 1 - v is the opposite of v on four axes too.
"""
from __future__ import annotations

import torch

from ..coords4d import key_steps_4d, pack_keys_4d, unpack_keys_4d
from ..device_guard import on_device_of
from ..geometry4d import ConvGeometry4d
from ..kernel_configs import PLAN_BLOCK_SIZES
from ..plan import MISSING, ConvPlan, mirrored_signal_offsets, signal_fields
# output_spatial_shape and the candidates read the geometry axis by axis (any number of axes).
from .generative import output_spatial_shape, plan_from_candidates
from .offsets import kernel_offsets
from .segments import plan_schedule


def build_plan_4d(coords: torch.Tensor, spatial_shape: tuple[int, int, int, int],
                  batch_size: int, geometry: ConvGeometry4d, training: bool = True) -> ConvPlan:
    """The plan of one 4D convolution over coords (int32 [N, 5], checked). training=False: an
    inference plan (ConvPlan.for_training)."""
    if not isinstance(geometry, ConvGeometry4d):
        raise TypeError(f"build_plan_4d takes a ConvGeometry4d, got {type(geometry).__name__}")
    with on_device_of(coords):
        if geometry.submanifold:
            return _submanifold_plan(coords, tuple(spatial_shape), batch_size, geometry, training)
        return _generative_plan(coords, tuple(spatial_shape), batch_size, geometry, training)


def submanifold_map_4d(coords: torch.Tensor, spatial_shape,
                       geometry: ConvGeometry4d) -> torch.Tensor:
    """int32 [N, V]: entry (i, v) is the row at coords[i] + offset v, or MISSING.

    Keys are linear in the coordinates, so a neighbour's key is the row's key plus the offset's
    (key_steps_4d): [N, V] int64 queries, never [N, V, 5] coordinates."""
    n = coords.shape[0]
    offsets = kernel_offsets(geometry, coords.device)                        # [V, 4] int64
    v = offsets.shape[0]
    if n == 0:
        return torch.empty((0, v), dtype=torch.int32, device=coords.device)
    keys = pack_keys_4d(coords, spatial_shape)
    # (a sum, not a matmul: CUDA has no int64 matmul)
    deltas = (offsets * key_steps_4d(spatial_shape).to(coords.device)).sum(dim=1)
    query = keys[:, None] + deltas[None, :]
    in_grid = None  # a shifted row outside the grid would alias another row's key
    for axis, size in enumerate(spatial_shape):
        shifted = coords[:, axis + 1, None].to(torch.int64) + offsets[None, :, axis]
        ok = (shifted >= 0) & (shifted < size)
        in_grid = ok if in_grid is None else in_grid & ok
    sorted_keys, order = torch.sort(keys)
    pos = torch.searchsorted(sorted_keys, query).clamp_(max=n - 1)
    found = in_grid & (sorted_keys[pos] == query)
    return torch.where(found, order[pos], MISSING).to(torch.int32)


def _submanifold_plan(coords, shape, batch_size, geometry, training) -> ConvPlan:
    nmap = submanifold_map_4d(coords, shape, geometry)
    signal_offsets = mirrored_signal_offsets(geometry.volume) if training else 0
    fwd, signal, _ = plan_schedule(nmap, PLAN_BLOCK_SIZES, signal_offsets=signal_offsets,
                                   pairs_total=None if signal_offsets else 0)
    n = coords.shape[0]
    return ConvPlan(
        geometry=geometry, batch_size=batch_size, in_spatial_shape=shape, out_spatial_shape=shape,
        num_in=n, num_out=n, out_coords=coords, fwd=fwd, bwd=None,
        **signal_fields(signal, coords.device, training))


def _generative_plan(coords, shape, batch_size, geometry, training) -> ConvPlan:
    """generative.generative_plan over 4D coords: output coords the distinct (input, tap)
    candidates in ascending (b, d0, d1, d2, d3) order, the maps straight from the candidates."""
    out_shape = output_spatial_shape(shape, geometry)
    return plan_from_candidates(coords, shape, out_shape, batch_size, geometry, training,
                                pack=lambda c: pack_keys_4d(c, out_shape),
                                unpack=lambda k: unpack_keys_4d(k, out_shape))
