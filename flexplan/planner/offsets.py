"""Kernel offsets in the order every plan column uses: v = (ix * Ky + iy) * Kz + iz."""
from __future__ import annotations

import torch

from ..geometry import ConvGeometry


def kernel_offsets(geometry: ConvGeometry, device=None) -> torch.Tensor:
    """int64 [V, 3] spatial offsets, centred for odd kernels, scaled by the dilation.

    For odd kernels offset v and offset V - 1 - v are opposite: the symmetry that lets the
    submanifold planner look up only half of them and that grad-input relies on.
    """
    axes = [(torch.arange(k, device=device) - k // 2) * d
            for k, d in zip(geometry.kernel_size, geometry.dilation)]
    grid = torch.meshgrid(*axes, indexing="ij")
    return torch.stack([g.reshape(-1) for g in grid], dim=1).to(torch.int64)
