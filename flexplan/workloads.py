"""Synthetic coordinate sets shared by tests, benchmarks and demos."""
from __future__ import annotations

import torch


def sphere_shell(resolution: int, batch_size: int = 1, device=None, thickness: float = 1.0) -> torch.Tensor:
    """int32 [N, 4] coords of the voxels within `thickness` of a sphere of radius 0.45 * R.

    The surface-like occupancy of 3D generative models (TRELLIS-style VAEs) at grid size R^3.
    Built one x-slice at a time so R = 1024 fits in memory.
    """
    r = 0.45 * resolution
    centre = resolution / 2.0
    yz = torch.stack(torch.meshgrid(torch.arange(resolution, device=device),
                                    torch.arange(resolution, device=device), indexing="ij"), -1)
    yz = yz.reshape(-1, 2)
    dyz2 = ((yz.to(torch.float32) + 0.5 - centre) ** 2).sum(1)
    parts = []
    for x in range(resolution):
        dist = torch.sqrt(dyz2 + (x + 0.5 - centre) ** 2)
        hit = yz[(dist - r).abs() <= thickness]
        if hit.numel():
            parts.append(torch.cat([torch.full_like(hit[:, :1], x), hit], 1))
    xyz = torch.cat(parts).to(torch.int32)
    batches = [torch.cat([torch.full_like(xyz[:, :1], b), xyz], 1) for b in range(batch_size)]
    return torch.cat(batches)


def random_coords(num: int, spatial_shape, batch_size: int = 1, generator=None, device=None) -> torch.Tensor:
    """int32 [n, 4] unique random coords (n <= num: duplicates of the draw are dropped), shuffled."""
    x, y, z = spatial_shape
    cells = batch_size * x * y * z
    flat = torch.randint(0, cells, (num,), generator=generator, dtype=torch.int64)
    flat = torch.unique(flat)
    flat = flat[torch.randperm(flat.numel(), generator=generator)]
    b, rest = flat // (x * y * z), flat % (x * y * z)
    coords = torch.stack([b, rest // (y * z), rest // z % y, rest % z], 1)
    return coords.to(torch.int32).to(device)
