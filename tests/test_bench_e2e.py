"""scripts/bench_e2e.py's parts on the CPU: the LiDAR batch generator (flexplan.workloads), both
networks of scripts/e2e_networks.py on flexplan.nn.spconv at --small sizes (forward + backward
through the Triton interpreter), and the benchmark's counting helpers."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

import bench_e2e  # noqa: E402
from e2e_networks import NETWORKS  # noqa: E402

import flexplan.nn.spconv as spconv  # noqa: E402
from flexplan.workloads import (NUM_CLASSES, SMALL_GRID, WAYMO_GRID, augment_points,  # noqa: E402
                                lidar_batch, lidar_scans)

SMALL = bench_e2e.sizes_for(small=True)
SCAN = dict(beams=4, azimuth_steps=48, max_range=24.0, num_boxes=8, num_poles=4)


def small_batch(step=0, seed=0, device="cpu", **kwargs):
    return lidar_batch(step, 2, seed, device, SMALL_GRID, **SCAN, **kwargs)


def coord_set(indices):
    return {tuple(r) for r in indices.tolist()}


def test_grids_follow_openpcdet():
    assert WAYMO_GRID.grid_size == (1504, 1504, 40)
    assert WAYMO_GRID.sparse_shape == (41, 1504, 1504)
    assert SMALL_GRID.sparse_shape == (41, 128, 128)


def test_batch_layout_unique_in_range():
    b = small_batch()
    n = b.indices.shape[0]
    assert n > 50 and b.batch_size == 2 and b.spatial_shape == (41, 128, 128)
    assert b.indices.dtype == torch.int32 and b.indices.shape == (n, 4)
    assert b.features.dtype == torch.float32 and b.features.shape == (n, 4)
    assert b.labels.dtype == torch.int64 and b.labels.shape == (n,)
    assert len(coord_set(b.indices)) == n  # unique
    lo = torch.zeros(4, dtype=torch.int32)
    # z stays below the padded slice: OpenPCDet's sparse_shape is (Z + 1, Y, X).
    hi = torch.tensor([2, 40, 128, 128], dtype=torch.int32)
    assert bool(((b.indices >= lo) & (b.indices < hi)).all())
    assert set(b.indices[:, 0].tolist()) == {0, 1}
    assert 0 <= int(b.labels.min()) and int(b.labels.max()) < NUM_CLASSES


def test_indices_are_batch_z_y_x():
    """A voxel's mean point lies inside it: its (x, y, z) cell is indices[:, (3, 2, 1)]."""
    b = small_batch()
    lo = torch.tensor(SMALL_GRID.point_range[:3])
    size = torch.tensor(SMALL_GRID.voxel_size)
    cell = torch.floor((b.features[:, :3].double() - lo) / size).long()
    assert torch.equal(cell, b.indices[:, [3, 2, 1]].long())


def test_deterministic_by_seed_and_step():
    a, b = small_batch(3, seed=5), small_batch(3, seed=5)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.labels, b.labels)
    torch.testing.assert_close(a.features, b.features)
    assert coord_set(small_batch(4, seed=5).indices) != coord_set(a.indices)  # next step
    assert coord_set(small_batch(3, seed=6).indices) != coord_set(a.indices)  # other seed


def test_augmentation_moves_points():
    scans = lidar_scans(2, 0, "cpu", **SCAN)
    points = scans[0][0]
    moved = augment_points(points, torch.Generator().manual_seed(1))
    assert moved.shape == points.shape
    assert torch.equal(moved[:, 3], points[:, 3])  # intensity kept
    assert not torch.allclose(moved[:, :3], points[:, :3])
    # Rotation, flips and scale keep distances to the z axis within the scale range (+ shift).
    r0, r1 = points[:, :2].norm(dim=1), moved[:, :2].norm(dim=1)
    assert bool(((r1 - r0 * 1.0).abs() <= 0.05 * r0 + 1.5).all())
    plain = lidar_batch(0, 2, 0, "cpu", SMALL_GRID, scans=scans, augment=False)
    augmented = lidar_batch(0, 2, 0, "cpu", SMALL_GRID, scans=scans)
    assert coord_set(plain.indices) != coord_set(augmented.indices)


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_network_forward_backward_flexplan(name, device):
    """Each network on flexplan.nn.spconv at --small sizes: forward, loss, backward."""
    batch = lidar_batch(0, 2, 0, device, SMALL.grid, **SMALL.scan)
    torch.manual_seed(0)
    net = NETWORKS[name](spconv, base=SMALL.base).to(device)
    x = spconv.SparseConvTensor(batch.features, batch.indices, list(batch.spatial_shape), 2)
    out = net(x)
    if name == "encoder":  # BEV map: 8 * base channels x 2 z slices, 128 / 8 cells a side
        assert out.shape == (2, 16 * SMALL.base, 16, 16)
    else:
        assert out.shape == (batch.indices.shape[0], NUM_CLASSES)
    loss = net.loss(out, batch.labels)
    assert torch.isfinite(loss)
    loss.backward()
    convs = [m for m in net.modules() if isinstance(m, (spconv.SubMConv3d, spconv.SparseConvolution))]
    assert convs and all(m.weight.grad is not None and torch.isfinite(m.weight.grad).all()
                         for m in convs)
    # spconv's weight layout [Co, K0, K1, K2, Ci]: what an spconv copy's state_dict holds.
    assert net.conv_input[0].weight.shape == (SMALL.base, 3, 3, 3, 4)


def test_compile_counting_helpers(tmp_path):
    fn = SimpleNamespace(device_caches={0: ({"k1": 1, "k2": 2}, {}, None, None, None)})
    assert bench_e2e.jit_cache_entries({"a": fn, "b": SimpleNamespace()}) == {"a": 2, "b": 0}
    before = bench_e2e.KernelSnapshot({"a": 2, "b": 0}, {"aot": 1, "direct": 1}, 5)
    after = bench_e2e.KernelSnapshot({"a": 3, "b": 2}, {"aot": 3, "direct": 2, "jit": 2}, 7)
    delta = bench_e2e.compile_delta(before, after)
    # 3 new cache entries, one of them a bundle binary the AOT hook handed over.
    assert delta["compiles"] == 2 and delta["jit_cache_entries"] == 3
    assert delta["kernels"] == ["a", "b"] and delta["new_launch_classes"] == 2
    (tmp_path / "k.fxplan").write_bytes(b"")
    (tmp_path / ".tmp-x.fxplan").write_bytes(b"")
    (tmp_path / "other").write_bytes(b"")
    assert bench_e2e.plan_files(tmp_path) == 1 and bench_e2e.plan_files(tmp_path / "no") == 0
    assert bench_e2e.numeric_delta({"builds": 2, "mode": "auto"},
                                   {"builds": 5, "mode": "auto", "disk_writable": True}) == {"builds": 3}


def test_options():
    args = bench_e2e.parse_args(["--small", "--modes", "fp16,bf16"])
    assert (args.steps, args.warmup, args.out) == (2, 1, None) and args.modes == ["fp16", "bf16"]
    args = bench_e2e.parse_args([])
    assert (args.steps, args.warmup, args.networks) == (30, 10, ["encoder", "unet"])
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--modes", "fp8"])


def test_timed_steps_take_turns_and_a_failing_step_leaves_them():
    """bench_common.time_paired, as bench_e2e times its rows: step i of each implementation,
    the order alternating with i; with `failures`, one whose step raises is noted there and
    takes no further turns (no ratio then); without, the error propagates."""
    from bench_common import time_paired

    log = []

    def step_of(name, fail_at=None):
        def step(batch):
            if batch == fail_at:
                raise RuntimeError(f"{name} failed")
            log.append((name, batch))
        return step

    steps = {"spconv": step_of("spconv", fail_at=3), "flexplan": step_of("flexplan")}
    failures = {}
    timed = time_paired(steps, [0, 1, 2, 3, 4], 0, failures=failures)
    assert log == [("spconv", 0), ("flexplan", 0), ("flexplan", 1), ("spconv", 1),
                   ("spconv", 2), ("flexplan", 2), ("flexplan", 3), ("flexplan", 4)]
    assert set(timed["times"]) == {"flexplan"} and len(timed["times"]["flexplan"]) == 5
    assert timed["ratio"] is None and str(failures["spconv"]) == "spconv failed"
    with pytest.raises(RuntimeError, match="spconv failed"):
        time_paired(steps, [3], 0)
