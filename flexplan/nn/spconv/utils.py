"""spconv.pytorch.utils for spconv users: `PointToVoxel` (point cloud -> voxels, as spconv's CPU
implementation gives them) and `gather_features_by_pc_voxel_id` (voxel results back onto the
points). Reached as `flexplan.nn.spconv.utils`.

PointToVoxel is written with torch ops over the whole cloud (a stable sort of the voxel keys for
the runs of points per voxel, a sort of the runs' first points for spconv's voxel order), so it
runs on any device and gives the same, deterministic result there. spconv's CUDA path orders
voxels by hash-table slot and points by atomics (run to run different); here every device
follows spconv's CPU order.

Rules matched (spconv 2.3.8, Point2VoxelCPU::point_to_voxel_static):
  - the axes are reversed: vsize / coors_range / grid_size and the returned indices are zyx for
    3D ((w)zyx for 4D, yx for 2D), while points carry xyz in their first ndim columns;
  - grid_size = round((max - min) / vsize) in float32 (half away from zero), voxel coordinate
    c = floor((p - min) / vsize) in the points' precision with min, vsize rounded to float32;
    a point with any c outside [0, grid_size) is dropped (pc_voxel_id -1);
  - voxels come in the order of their first point, points in a voxel in input order;
  - at most max_num_points_per_voxel points are stored per voxel; the later ones are not stored
    but keep their voxel's id in pc_voxel_id (so gather_features_by_pc_voxel_id labels them);
  - at most max_num_voxels voxels; the points of a later voxel get pc_voxel_id -1;
  - voxels are float32 whatever the points' dtype; indices and num_points int32, ids int64.

Where it differs from spconv (on purpose):
  - empty_mean: the unused slots get the mean of the voxel's stored points (float32 sum in slot
    order, then / count: spconv's CUDA kernel, bit for bit). spconv 2.3.8's CPU path adds the
    previous voxel's mean into each voxel's sum (std::vector::clear() then operator[]), a bug
    not copied.
  - clear_voxels=False: spconv then leaves the previous call's values in unused slots of its
    persistent buffer; here there is no such buffer and unused slots are always zero (or the
    mean).
  - the `device` argument is not enforced (spconv asserts the points' device type matches);
    outputs are on the points' device. float64 points work on CUDA too, half / int points are
    computed as float32 (spconv: float32 / float64 on CPU, float32 on CUDA).
  - NaN / inf / huge coordinates are dropped (spconv casts them to int: undefined).
"""
from __future__ import annotations

import math
from typing import List, Sequence, Union

import torch

__all__ = ["PointToVoxel", "gather_features_by_pc_voxel_id"]


def _float32(values: Sequence[float]) -> List[float]:
    """spconv keeps vsize and the range as C++ floats; every later step sees those values."""
    return torch.tensor([float(v) for v in values], dtype=torch.float32).tolist()


def _round_half_away(x: float) -> int:
    """std::round (Python's round() goes half to even)."""
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


class PointToVoxel:
    """spconv.pytorch.utils.PointToVoxel: voxelize one point cloud.

    vsize_xyz: voxel size per axis (x, y, z; 1 to 4 axes: ndim = len(vsize_xyz)).
    coors_range_xyz: [x_min, y_min, z_min, x_max, y_max, z_max] (2 * ndim numbers).
    num_point_features: columns of a point (xyz first, then e.g. intensity).
    device: accepted for spconv's signature; the outputs are on the points' device.

    Attributes as spconv's: ndim, vsize, grid_size, grid_stride, coors_range (zyx order),
    num_point_features, max_num_voxels, max_num_points_per_voxel, device.
    """

    def __init__(self, vsize_xyz: List[float], coors_range_xyz: List[float],
                 num_point_features: int, max_num_voxels: int, max_num_points_per_voxel: int,
                 device: torch.device = torch.device("cpu:0")):
        ndim = len(vsize_xyz)
        if not 1 <= ndim <= 4:
            raise ValueError(f"PointToVoxel supports 1 to 4 axes, got vsize_xyz={vsize_xyz}")
        if len(coors_range_xyz) != 2 * ndim:
            raise ValueError(f"coors_range_xyz needs {2 * ndim} numbers (min then max of each "
                             f"axis) for {ndim} axes, got {list(coors_range_xyz)}")
        if num_point_features < ndim:
            raise ValueError(f"num_point_features={num_point_features} < {ndim}: the points "
                             f"must carry their {ndim} coordinates first")
        if max_num_voxels < 0 or max_num_points_per_voxel < 0:
            raise ValueError("max_num_voxels and max_num_points_per_voxel must be >= 0")
        vsize_xyz, range_xyz = _float32(vsize_xyz), _float32(coors_range_xyz)
        # spconv stores everything zyx (axis 0 = the points' last coordinate column).
        self.ndim = ndim
        self.vsize = vsize_xyz[::-1]
        self.coors_range = range_xyz[:ndim][::-1] + range_xyz[ndim:][::-1]
        lo = torch.tensor(self.coors_range[:ndim], dtype=torch.float32)
        hi = torch.tensor(self.coors_range[ndim:], dtype=torch.float32)
        extent = ((hi - lo) / torch.tensor(self.vsize, dtype=torch.float32)).tolist()
        if not all(v > 0 for v in self.vsize) or not all(math.isfinite(e) for e in extent):
            raise ValueError(f"bad voxel grid: vsize_xyz={vsize_xyz}, "
                             f"coors_range_xyz={range_xyz}")
        self.grid_size = [_round_half_away(e) for e in extent]
        if min(self.grid_size) < 1:
            raise ValueError(f"empty voxel grid {self.grid_size[::-1]} (xyz) from "
                             f"coors_range_xyz={range_xyz}, vsize_xyz={vsize_xyz}")
        self.grid_stride = [math.prod(self.grid_size[i + 1:]) for i in range(ndim)]
        self.num_point_features = int(num_point_features)
        self.max_num_voxels = int(max_num_voxels)
        self.max_num_points_per_voxel = int(max_num_points_per_voxel)
        self.device = torch.device(device)

    def __call__(self, pc: torch.Tensor, clear_voxels: bool = True, empty_mean: bool = False):
        """pc [N, num_point_features] -> (voxels float32 [V, max_points, F], indices int32
        [V, ndim] (zyx), num_points_per_voxel int32 [V])."""
        return self.generate_voxel_with_id(pc, clear_voxels, empty_mean)[:3]

    @torch.no_grad()
    def generate_voxel_with_id(self, pc: torch.Tensor, clear_voxels: bool = True,
                               empty_mean: bool = False):
        """As __call__, plus pc_voxel_id int64 [N]: the voxel (row of the outputs) of each point,
        -1 for points out of range or in a voxel past max_num_voxels.

        empty_mean: fill each voxel's unused point slots with the mean of its stored points
        (else they are zero). clear_voxels is accepted for spconv's signature: unused slots are
        always zero here (spconv leaves an earlier call's values there when it is False)."""
        del clear_voxels
        if pc.dim() != 2 or pc.shape[1] != self.num_point_features:
            raise ValueError(f"pc must be [N, {self.num_point_features}] "
                             f"(num_point_features), got {list(pc.shape)}")
        dev, n = pc.device, pc.shape[0]
        max_voxels, max_points = self.max_num_voxels, self.max_num_points_per_voxel

        coords = self._voxel_coords(pc)  # int64 [N, ndim] zyx, -1 rows where out of range
        in_range = torch.nonzero(coords[:, 0] >= 0).view(-1)  # in input order
        m = in_range.numel()
        # One stable sort of the voxel keys gives the rest: a voxel's points are a run of the
        # sorted list, in input order, so the run's head is the voxel's first point and a
        # point's slot in its voxel is its offset in the run.
        sorted_key, perm = torch.sort(self._linear_keys(coords[in_range]), stable=True)
        head = torch.ones(m, dtype=torch.bool, device=dev)
        head[1:] = sorted_key[1:] != sorted_key[:-1]
        run_start = torch.nonzero(head).view(-1)  # [U]
        run = torch.cumsum(head, 0) - 1  # [m] the run of each sorted position
        slot = torch.arange(m, device=dev) - run_start[run]
        run_len = torch.diff(run_start, append=run_start.new_tensor([m]))
        # Voxel id = rank of the voxel's first point: spconv numbers voxels as it meets them.
        first = perm[run_start]  # [U] distinct, so any sort is deterministic
        by_first = torch.argsort(first)
        rank = torch.empty_like(by_first)
        rank[by_first] = torch.arange(by_first.numel(), device=dev)
        voxel = rank[run]  # [m]

        num_voxels = min(by_first.numel(), max_voxels)
        point = in_range[perm]  # [m] the point at each sorted position
        # The points of voxels past max_num_voxels get -1; index_copy_ / index_select avoid
        # boolean-mask indexing (a nonzero per mask).
        pc_voxel_id = torch.full((n,), -1, dtype=torch.long, device=dev)
        pc_voxel_id.index_copy_(0, point, torch.where(voxel < num_voxels, voxel, -1))
        # A full voxel takes no more points (spconv's rule).
        stored = torch.nonzero((voxel < num_voxels) & (slot < max_points)).view(-1)
        voxels = torch.zeros((num_voxels * max_points, self.num_point_features),
                             dtype=torch.float32, device=dev)
        voxels.index_copy_(0, voxel[stored] * max_points + slot[stored],
                           pc.index_select(0, point[stored]).to(torch.float32))
        voxels = voxels.view(num_voxels, max_points, self.num_point_features)
        num_points = run_len[by_first[:num_voxels]].clamp(max=max_points)
        if empty_mean and num_voxels and max_points:
            voxels = self._fill_mean(voxels, num_points)
        indices = coords[in_range[first[by_first[:num_voxels]]]]  # those of its first point
        return voxels, indices.to(torch.int32), num_points.to(torch.int32), pc_voxel_id

    def _voxel_coords(self, pc: torch.Tensor) -> torch.Tensor:
        """int64 [N, ndim] zyx voxel coordinates; a point out of range gets a row of -1.

        Computed as spconv does, floor((p - min) / vsize) in the points' precision (float64 for
        double points, else float32) with min / vsize float32. The range test runs on the float
        values, so NaN / inf / huge points are dropped rather than cast."""
        ndim = self.ndim
        ctype = torch.float64 if pc.dtype == torch.float64 else torch.float32
        coords = torch.empty((pc.shape[0], ndim), dtype=torch.long, device=pc.device)
        inside = torch.ones(pc.shape[0], dtype=torch.bool, device=pc.device)
        for j in range(ndim):  # over axes, not points
            lo = torch.tensor(self.coors_range[j], dtype=torch.float32).to(ctype)
            vs = torch.tensor(self.vsize[j], dtype=torch.float32).to(ctype)
            c = torch.floor((pc[:, ndim - 1 - j].to(ctype) - lo.to(pc.device)) / vs.to(pc.device))
            ok = (c >= 0) & (c < self.grid_size[j])  # False for NaN
            inside &= ok
            coords[:, j] = torch.where(ok, c, torch.zeros_like(c)).to(torch.long)
        return torch.where(inside[:, None], coords, -1)

    def _linear_keys(self, coords: torch.Tensor) -> torch.Tensor:
        """One int64 per voxel (row-major over grid_size); a grid too large for int64 keys
        falls back to numbering the distinct rows."""
        if math.prod(self.grid_size) < 2 ** 62:
            stride = torch.tensor(self.grid_stride, dtype=torch.long, device=coords.device)
            return (coords * stride).sum(1)
        if coords.shape[0] == 0:
            return coords.new_zeros(0)
        return torch.unique(coords, dim=0, return_inverse=True)[1]

    @staticmethod
    def _fill_mean(voxels: torch.Tensor, num_points: torch.Tensor) -> torch.Tensor:
        """Unused slots <- the mean of the stored points, summed in slot order in float32 as
        spconv's kernel does (a loop over the max_num_points_per_voxel slots, not the points)."""
        used = (torch.arange(voxels.shape[1], device=voxels.device)[None, :]
                < num_points[:, None])[:, :, None]
        # -0.0 in the unused slots: x + (-0.0) == x for every x (a +0.0 would turn -0.0 into
        # +0.0), so summing all slots equals summing the used ones, bit for bit.
        terms = torch.where(used, voxels, torch.full_like(voxels[:1, :1], -0.0))
        total = terms[:, 0].clone()
        for k in range(1, voxels.shape[1]):
            total += terms[:, k]
        mean = total / num_points.to(torch.float32)[:, None]  # every kept voxel has a point
        return torch.where(used, voxels, mean[:, None, :])


def gather_features_by_pc_voxel_id(seg_res_features: torch.Tensor, pc_voxel_id: torch.Tensor,
                                   invalid_value: Union[int, float] = 0) -> torch.Tensor:
    """Per-voxel results back onto the points: row i = seg_res_features[pc_voxel_id[i]], or
    invalid_value where pc_voxel_id[i] == -1 (spconv.pytorch.utils' function)."""
    pc_voxel_id = pc_voxel_id.to(seg_res_features.device)
    res = torch.full((pc_voxel_id.shape[0], *seg_res_features.shape[1:]), invalid_value,
                     dtype=seg_res_features.dtype, device=seg_res_features.device)
    valid = torch.nonzero(pc_voxel_id != -1).view(-1)
    res[valid] = seg_res_features[pc_voxel_id[valid]]
    return res
