"""Synthetic coordinate sets shared by tests, benchmarks and demos."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

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


# ---------------------------------------------------------------- LiDAR scans (issue #20)
# What 3D detectors and segmenters train on: a spinning multi-beam sensor's points, augmented
# differently every step, voxelized onto a fine grid. Everything is generated in code with torch
# on the given device (no dataset), deterministic by seed.

# Point labels (the U-Net's classes); a voxel takes the largest label of its points.
GROUND, CAR, BUILDING, POLE = range(4)
NUM_CLASSES = 4


@dataclass(frozen=True)
class VoxelGrid:
    """OpenPCDet's POINT_CLOUD_RANGE (x0, y0, z0, x1, y1, z1) and VOXEL_SIZE (x, y, z), metres."""

    point_range: tuple = (-75.2, -75.2, -2.0, 75.2, 75.2, 4.0)
    voxel_size: tuple = (0.1, 0.1, 0.15)

    @property
    def grid_size(self) -> tuple[int, int, int]:
        """Voxels along (x, y, z)."""
        lo, hi = self.point_range[:3], self.point_range[3:]
        return tuple(round((h - l) / s) for l, h, s in zip(lo, hi, self.voxel_size))

    @property
    def sparse_shape(self) -> tuple[int, int, int]:
        """spconv's (Z + 1, Y, X): OpenPCDet pads z by one so the strided convs end at 2 in z."""
        nx, ny, nz = self.grid_size
        return (nz + 1, ny, nx)


WAYMO_GRID = VoxelGrid()  # 1504 x 1504 x 40, sparse_shape (41, 1504, 1504)
# The same z axis on a coarse, small xy grid (128 x 128): CPU tests through the interpreter.
SMALL_GRID = VoxelGrid((-25.6, -25.6, -2.0, 25.6, 25.6, 4.0), (0.4, 0.4, 0.15))


class VoxelBatch(NamedTuple):
    """A batch as spconv takes it: features [N, C] (mean x, y, z, intensity of the voxel's
    points), indices int32 [N, 4] as (batch, z, y, x), spatial_shape (Z + 1, Y, X), batch_size;
    labels int64 [N] (GROUND..POLE), for segmentation losses."""

    features: torch.Tensor
    indices: torch.Tensor
    spatial_shape: tuple[int, int, int]
    batch_size: int
    labels: torch.Tensor


def _random_boxes(gen: torch.Generator, num_boxes: int, num_poles: int, max_range: float):
    """Axis-aligned boxes [M, 6] (x0, y0, z0, x1, y1, z1) standing on z = 0, their labels [M]
    and reflectances [M]: cars (60%) and buildings, then thin poles. None contains the sensor."""
    def uniform(lo, hi, n):
        return lo + (hi - lo) * torch.rand(n, generator=gen)

    is_car = torch.rand(num_boxes, generator=gen) < 0.6
    size = torch.where(is_car[:, None],
                       torch.stack([uniform(4.0, 5.0, num_boxes), uniform(1.8, 2.0, num_boxes),
                                    uniform(1.4, 1.8, num_boxes)], 1),
                       torch.stack([uniform(8.0, 25.0, num_boxes), uniform(8.0, 25.0, num_boxes),
                                    uniform(4.0, 12.0, num_boxes)], 1))
    pole_size = torch.stack([torch.full((num_poles,), 0.25), torch.full((num_poles,), 0.25),
                             uniform(3.0, 8.0, num_poles)], 1)
    size = torch.cat([size, pole_size])
    # Centre distance: beyond the box's half diagonal (plus a margin) so the sensor is outside.
    half_diag = size[:, :2].norm(dim=1) / 2
    near = torch.cat([torch.full((num_boxes,), 3.0), torch.full((num_poles,), 2.0)])
    far = torch.cat([torch.full((num_boxes,), 0.8 * max_range), torch.full((num_poles,), 0.5 * max_range)])
    dist = half_diag + uniform(0.0, 1.0, len(size)) * (far - near) + near
    angle = uniform(0.0, 2 * math.pi, len(size))
    centre = torch.stack([dist * torch.cos(angle), dist * torch.sin(angle)], 1)
    lo = torch.cat([centre - size[:, :2] / 2, torch.zeros(len(size), 1)], 1)
    hi = torch.cat([centre + size[:, :2] / 2, size[:, 2:]], 1)
    labels = torch.cat([torch.where(is_car, CAR, BUILDING), torch.full((num_poles,), POLE)])
    reflectance = uniform(0.2, 0.9, len(size))
    return torch.cat([lo, hi], 1), labels, reflectance


def _ray_directions(beams: int, azimuth_steps: int, device) -> torch.Tensor:
    """Unit directions [beams * azimuth_steps, 3], beam-major like a range image."""
    elevation = torch.deg2rad(torch.linspace(-25.0, 3.0, beams, device=device))
    azimuth = torch.arange(azimuth_steps, device=device) * (2 * math.pi / azimuth_steps)
    e, a = torch.meshgrid(elevation, azimuth, indexing="ij")
    return torch.stack([e.cos() * a.cos(), e.cos() * a.sin(), e.sin()], -1).reshape(-1, 3)


def _cast_rays(directions, origin, boxes, chunk: int = 32768):
    """Distance to the first hit of each ray from `origin` (inf: none) and what it hit (-1: the
    ground plane z = 0, else the box index). Slab test against every box, in chunks of rays."""
    dists, hits = [], []
    lo, hi = boxes[:, :3] - origin, boxes[:, 3:] - origin
    for d in directions.split(chunk):
        # Avoid 1/0: a component this small changes no hit at the ranges of a scan.
        d_safe = torch.where(d.abs() < 1e-9, torch.full_like(d, 1e-9), d)
        inv = 1.0 / d_safe[:, None, :]                                # [R, 1, 3]
        t1, t2 = lo[None] * inv, hi[None] * inv                       # [R, M, 3]
        t_near = torch.minimum(t1, t2).amax(-1)
        t_far = torch.maximum(t1, t2).amin(-1)
        t_box = torch.where((t_near <= t_far) & (t_near > 0), t_near, torch.inf)
        best, which = t_box.min(1) if len(boxes) else (torch.full_like(d[:, 0], torch.inf),
                                                        torch.zeros_like(d[:, 0], dtype=torch.long))
        t_ground = torch.where(d[:, 2] < 0, -origin[2] / d_safe[:, 2], torch.inf)
        ground_first = t_ground < best
        dists.append(torch.where(ground_first, t_ground, best))
        hits.append(torch.where(ground_first, -1, which))
    return torch.cat(dists), torch.cat(hits)


def lidar_scan(seed: int = 0, device=None, beams: int = 64, azimuth_steps: int = 2000,
               max_range: float = 75.0, num_boxes: int = 30, num_poles: int = 12,
               sensor_height: float = 2.0, ground_roughness: float = 0.04):
    """One sweep of a spinning `beams`-beam LiDAR (elevations -25..+3 degrees, `azimuth_steps`
    per turn) at `sensor_height` over flat ground, ray-cast against random cars, buildings and
    poles. Returns points [P, 4] (x, y, z, intensity; z = 0 is the ground) and labels [P], in
    beam-major scan order; returns beyond max_range and 5% random dropouts are missing.
    64 x 2000 rays give about 115k points, 50-60k voxels of WAYMO_GRID."""
    gen = torch.Generator().manual_seed(seed)  # scene layout: a few numbers, on the CPU
    boxes, box_labels, box_reflect = (t.to(device) for t in _random_boxes(gen, num_boxes, num_poles,
                                                                           max_range))
    directions = _ray_directions(beams, azimuth_steps, device)
    origin = torch.tensor([0.0, 0.0, sensor_height], device=device)
    dist, hit = _cast_rays(directions, origin, boxes)
    # Per-point noise from a generator on the device: 2 cm range noise, dropouts, intensity.
    dgen = torch.Generator(device=device).manual_seed(seed)
    n = len(dist)
    dist = dist + 0.02 * torch.randn(n, device=device, generator=dgen)
    keep = (dist <= max_range) & (torch.rand(n, device=device, generator=dgen) > 0.05)
    dist, hit, directions = dist[keep], hit[keep], directions[keep]
    on_box = hit >= 0
    box = hit.clamp_min(0)
    labels = torch.where(on_box, box_labels[box], GROUND)
    reflect = torch.where(on_box, box_reflect[box], 0.15)
    intensity = (reflect * (1 + 0.1 * torch.randn(len(dist), device=device, generator=dgen))
                 / (1 + dist / 50)).clamp(0, 1)
    xyz = origin + dist[:, None] * directions
    # Rough ground (grass, kerbs, 4 cm): without it the near rings collapse into few voxels.
    xyz[:, 2] += torch.where(on_box, 0.0, ground_roughness) * torch.randn(
        len(xyz), device=device, generator=dgen)
    return torch.cat([xyz, intensity[:, None]], 1), labels


def lidar_scans(num: int, seed: int = 0, device=None, **scan_kwargs) -> list:
    """`num` scans of different scenes: (points, labels) of lidar_scan(seed * 1000 + i)."""
    return [lidar_scan(seed * 1000 + i, device, **scan_kwargs) for i in range(num)]


def augment_points(points: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """OpenPCDet's global augmentations, parameters drawn from `gen` (a CPU generator): random
    flips along x and y, rotation about z in [-pi/4, pi/4], scaling in [0.95, 1.05] and a
    translation of std 0.2 m per axis. Intensity is kept."""
    flip = torch.rand(2, generator=gen) < 0.5
    angle = (torch.rand(1, generator=gen).item() * 2 - 1) * math.pi / 4
    scale = 0.95 + 0.1 * torch.rand(1, generator=gen).item()
    shift = (0.2 * torch.randn(3, generator=gen)).to(points.device)
    xyz = points[:, :3].clone()
    if flip[0]:
        xyz[:, 1] = -xyz[:, 1]
    if flip[1]:
        xyz[:, 0] = -xyz[:, 0]
    c, s = math.cos(angle), math.sin(angle)
    rot = torch.tensor([[c, s, 0.0], [-s, c, 0.0], [0.0, 0.0, 1.0]], device=points.device)
    xyz = (xyz @ rot) * scale + shift
    return torch.cat([xyz, points[:, 3:]], 1)


def voxelize(scans: list, grid: VoxelGrid = WAYMO_GRID) -> VoxelBatch:
    """Batch the (points, labels) of each scan into unique voxels of `grid`: mean point features
    (OpenPCDet's MeanVFE), the largest point label, and voxels in the order their first point
    came (as spconv's PointToVoxel gives them). Points outside the grid are dropped."""
    nx, ny, nz = grid.grid_size
    device = scans[0][0].device
    lo = torch.tensor(grid.point_range[:3], device=device)
    size = torch.tensor(grid.voxel_size, device=device)
    keys, feats, labels = [], [], []
    for b, (points, point_labels) in enumerate(scans):
        cell = torch.floor((points[:, :3] - lo) / size).long()
        inside = ((cell >= 0) & (cell < torch.tensor([nx, ny, nz], device=device))).all(1)
        x, y, z = cell[inside].unbind(1)
        keys.append(((b * nz + z) * ny + y) * nx + x)
        feats.append(points[inside])
        labels.append(point_labels[inside])
    keys, feats, labels = torch.cat(keys), torch.cat(feats), torch.cat(labels)
    uniq, inverse = torch.unique(keys, return_inverse=True)
    n = len(uniq)
    count = torch.zeros(n, device=device).index_add_(0, inverse, torch.ones_like(keys, dtype=torch.float32))
    mean = torch.zeros(n, feats.shape[1], device=device).index_add_(0, inverse, feats) / count[:, None]
    label = torch.zeros(n, dtype=torch.long, device=device).scatter_reduce_(
        0, inverse, labels, "amax", include_self=False)
    first = torch.full((n,), len(keys), dtype=torch.long, device=device).scatter_reduce_(
        0, inverse, torch.arange(len(keys), device=device), "amin")
    order = torch.argsort(first)
    key = uniq[order]
    indices = torch.stack([key // (nx * ny * nz), key // (nx * ny) % nz, key // nx % ny, key % nx], 1)
    return VoxelBatch(mean[order], indices.to(torch.int32), grid.sparse_shape, len(scans), label[order])


def lidar_batch(step: int = 0, batch_size: int = 2, seed: int = 0, device=None,
                grid: VoxelGrid = WAYMO_GRID, scans: list | None = None, augment: bool = True,
                **scan_kwargs) -> VoxelBatch:
    """Batch number `step` of an endless training stream: entry b is scan (step * batch_size + b)
    modulo len(scans), augmented by a draw seeded by (seed, step, b), then voxelized on `grid`.
    Each step has new coordinates; the same (seed, step) gives the same batch.

    scans: from lidar_scans() (ray casting is the slow part: make them once); None makes
    `batch_size` scans of lidar_scans(seed=seed, device=device, **scan_kwargs).
    Full size (64 beams x 2000 steps, WAYMO_GRID): 100-120k voxels for batch 2.
    """
    if scans is None:
        scans = lidar_scans(batch_size, seed, device, **scan_kwargs)
    entries = []
    for b in range(batch_size):
        points, labels = scans[(step * batch_size + b) % len(scans)]
        if augment:
            gen = torch.Generator().manual_seed(((seed * 1_000_003) + step) * 64 + b)
            points = augment_points(points, gen)
        entries.append((points, labels))
    return voxelize(entries, grid)
