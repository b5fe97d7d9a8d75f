"""Kernel offsets in the order every plan column uses: v = (ix * Ky + iy) * Kz + iz."""
from __future__ import annotations

import torch

from ..geometry import ConvGeometry


def kernel_offsets(geometry: ConvGeometry, device=None, centered: bool = True) -> torch.Tensor:
    """int64 [V, 3] spatial offsets, scaled by the dilation.

    centered=True (submanifold): tap index k sits at (k - K // 2) * d; for odd kernels offset v
    and offset V - 1 - v are opposite, the symmetry grad-input relies on.
    centered=False (strided / transposed): tap k sits at k * d, so output o reads input
    o * s - p + k * d (spconv's and torch's rule; the padding does the centring).
    """
    axes = [(torch.arange(k, device=device) - (k // 2 if centered else 0)) * d
            for k, d in zip(geometry.kernel_size, geometry.dilation)]
    grid = torch.meshgrid(*axes, indexing="ij")
    return torch.stack([g.reshape(-1) for g in grid], dim=1).to(torch.int64)
