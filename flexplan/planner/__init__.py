"""Planner: from coordinates and convolution geometry to a ConvPlan."""
from __future__ import annotations

from typing import Sequence

import torch

from ..geometry import ConvGeometry, triple
from ..kernel_configs import PLAN_BLOCK_SIZES
from ..plan import ConvPlan
from ..sparse_tensor import check_coords
from .generative import generative_plan
from .reference import submanifold_neighbor_map_torch
from .segments import gather_map, valid_signal

BACKENDS = ("auto", "torch", "triton")


def _submanifold_neighbor_map(coords, spatial_shape, batch_size, geometry, backend):
    if backend == "auto":
        backend = "triton" if coords.is_cuda else "torch"
    if backend == "torch":
        return submanifold_neighbor_map_torch(coords, spatial_shape, batch_size, geometry)
    if backend == "triton":
        from .hashmap import submanifold_neighbor_map_triton

        return submanifold_neighbor_map_triton(coords, spatial_shape, batch_size, geometry)
    raise ValueError(f"unknown planner backend {backend!r}; choose one of {BACKENDS}")


def build_plan(coords: torch.Tensor, spatial_shape: Sequence[int], batch_size: int,
               geometry: ConvGeometry, *, backend: str = "auto", check: bool = True) -> ConvPlan:
    """Build the execution plan of one sparse convolution over `coords`.

    backend: "triton" (GPU hash table), "torch" (sort + searchsorted; the CPU path and test
    oracle) or "auto" (Triton on a GPU, torch elsewhere). Both give identical plans.
    check: validate coords (range, duplicates) first; pass False for coords already checked.
    """
    shape = triple(spatial_shape, "spatial_shape")
    if check:
        check_coords(coords, shape, batch_size)
    if not geometry.submanifold:
        if backend not in BACKENDS:
            raise ValueError(f"unknown planner backend {backend!r}; choose one of {BACKENDS}")
        # Candidate enumeration + unique: torch ops, fast on any device, for every backend.
        return generative_plan(coords, shape, batch_size, geometry)
    nmap = _submanifold_neighbor_map(coords, shape, batch_size, geometry, backend)
    sig_i, sig_o, sig_seg = valid_signal(nmap)
    return ConvPlan(
        geometry=geometry, batch_size=batch_size, in_spatial_shape=shape, out_spatial_shape=shape,
        num_in=coords.shape[0], num_out=coords.shape[0], out_coords=coords,
        fwd=gather_map(nmap, PLAN_BLOCK_SIZES), bwd=None,
        valid_signal_i=sig_i, valid_signal_o=sig_o, valid_signal_seg=sig_seg)
