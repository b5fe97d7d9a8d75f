"""GatherMap's derived views (flexplan/plan_views.py: sorted_map_t, chunk_order) from their
one-launch kernels (kernels_src/plan_views.py) equal the torch expressions, for any row count
(none, fewer than a chunk, around chunk boundaries, many tiles of chunks) and volume;
plan_views derives them once per map object, keeps them on it, and uses the kernels wherever
the launcher can run them (chunk_order: for maps of CHUNK_ORDER_MIN_ROWS rows or more; smaller
ones keep the Gray order's chunks). On the CPU the kernels run through the interpreter."""
from __future__ import annotations

import pytest
import torch

from flexplan import launcher, plan_views
from flexplan.kernel_configs import SCHEDULE_CHUNK
from flexplan.plan import (CHUNK_ORDER_LAUNCH, ConvPlan, GatherMap, chunk_order_torch,
                           kernels_run_on, sorted_map_t_torch)
from flexplan.plan_views import chunk_order, chunk_order_triton, sorted_map_t, sorted_map_t_triton

ROWS = (0, 1, 511, 512, 513, 5000)
VOLUMES = (1, 8, 27)


@pytest.fixture
def kernel_device(device):
    if not kernels_run_on(torch.zeros(0, device=device)):
        pytest.skip("kernels need a GPU or TRITON_INTERPRET=1")
    return device


def _case(m: int, v: int, seed: int, device):
    """A random [m, v] map (about a third MISSING) and a random row order."""
    gen = torch.Generator().manual_seed(seed)
    nmap = torch.randint(0, max(m, 1), (m, v), generator=gen, dtype=torch.int32)
    nmap[torch.rand(m, v, generator=gen) < 0.3] = -1
    order = torch.randperm(m, generator=gen).to(torch.int32)
    return nmap.to(device), order.to(device)


@pytest.mark.parametrize("v", VOLUMES)
def test_sorted_map_t_kernel_is_the_torch_expression(v, kernel_device):
    for m in ROWS:
        nmap, order = _case(m, v, seed=m + v, device=kernel_device)
        got = sorted_map_t_triton(nmap, order)
        want = sorted_map_t_torch(nmap, order)
        assert got.shape == want.shape == (v, m) and got.dtype == want.dtype == torch.int32
        assert got.is_contiguous() and torch.equal(got, want), (m, v)


# SCHEDULE_CHUNK, the brief's 512, and 16: 312 chunks at 5000 rows, over several tiles of chunks
# both ways (programs, and the comparison loop).
@pytest.mark.parametrize("chunk", sorted({SCHEDULE_CHUNK, 512, 16}))
def test_chunk_order_kernel_is_the_torch_expression(chunk, kernel_device):
    assert -(-5000 // 16) > 2 * CHUNK_ORDER_LAUNCH["TILE"]
    for m in ROWS + (chunk - 1, chunk, chunk + 1, 2 * chunk):
        _, order = _case(m, 0, seed=m, device=kernel_device)
        for rows in (order, torch.arange(m, dtype=torch.int32, device=kernel_device),
                     torch.arange(m - 1, -1, -1, dtype=torch.int32, device=kernel_device)):
            got, want = chunk_order_triton(rows, chunk), chunk_order_torch(rows, chunk)
            assert got.dtype == want.dtype == torch.int32 and got.shape == (-(-m // chunk),)
            assert torch.equal(got, want), (m, chunk, got.tolist(), want.tolist())


def test_gather_map_derives_its_views_in_one_launch_each(kernel_device, monkeypatch):
    monkeypatch.setattr(plan_views, "CHUNK_ORDER_MIN_ROWS", 0)  # every map: the spatial chunk order
    launched = []
    real_launch = launcher.launch

    def recording_launch(kernel, grid, *args, **constexprs):
        launched.append(launcher.jit_function(kernel).fn.__name__)
        return real_launch(kernel, grid, *args, **constexprs)

    monkeypatch.setattr(launcher, "launch", recording_launch)
    for m in (0, 700):
        nmap, order = _case(m, 27, seed=3, device=kernel_device)
        gmap = GatherMap(nmap, order, {}, {})
        launched.clear()
        assert torch.equal(sorted_map_t(gmap), sorted_map_t_torch(nmap, order))
        assert torch.equal(chunk_order(gmap), chunk_order_torch(order))
        assert sorted_map_t(gmap) is sorted_map_t(gmap) and chunk_order(gmap) is chunk_order(gmap)
        assert launched == (["sorted_map_t_kernel", "chunk_order_kernel"] if m else []), launched
        assert sorted_map_t(gmap).shape == (27, m)


def test_row_counts_make_no_new_launch_class(kernel_device, monkeypatch):
    """Sizes are not specialized: every row count is one call class per kernel."""
    keys = set()
    real_launch = launcher.launch

    def recording_launch(kernel, grid, *args, **constexprs):
        keys.add(launcher._call_key(kernel, 0, args, constexprs))
        return real_launch(kernel, grid, *args, **constexprs)

    monkeypatch.setattr(launcher, "launch", recording_launch)
    for m, v in ((1, 27), (16, 8), (513, 27), (1024, 1)):
        nmap, order = _case(m, v, seed=m, device=kernel_device)
        sorted_map_t_triton(nmap, order)
        chunk_order_triton(order)
    assert len(keys) == 2, keys


def test_small_maps_run_their_chunks_in_gray_order_without_a_launch(kernel_device, monkeypatch):
    monkeypatch.setattr(plan_views, "CHUNK_ORDER_MIN_ROWS", 5000)
    monkeypatch.setattr(plan_views, "chunk_order_triton", None)  # would raise if called
    for m in (0, 1, SCHEDULE_CHUNK, 4999):
        nmap, order = _case(m, 8, seed=2, device=kernel_device)
        got = chunk_order(GatherMap(nmap, order, {}, {}))
        assert got.dtype == torch.int32 and got.device == nmap.device
        assert got.tolist() == list(range(-(-m // SCHEDULE_CHUNK)))


def test_cpu_maps_without_the_interpreter_use_torch(monkeypatch):
    monkeypatch.setattr(plan_views, "CHUNK_ORDER_MIN_ROWS", 0)
    monkeypatch.setattr(plan_views, "kernels_run_on", lambda t: False)
    monkeypatch.setattr(plan_views, "sorted_map_t_triton", None)  # would raise if called
    monkeypatch.setattr(plan_views, "chunk_order_triton", None)
    nmap, order = _case(300, 8, seed=1, device="cpu")
    gmap = GatherMap(nmap, order, {}, {})
    assert torch.equal(sorted_map_t(gmap), nmap[order.long()].t())
    assert chunk_order(gmap).tolist() == chunk_order_torch(order).tolist()


def test_the_map_holds_its_views_but_never_derives_them(monkeypatch):
    """GatherMap is a passive value: it keeps the views plan_views made (held_tensors counts
    them), and a moved, pickled or equal-field copy starts without them."""
    import pickle

    monkeypatch.setattr(plan_views, "CHUNK_ORDER_MIN_ROWS", 0)
    monkeypatch.setattr(plan_views, "kernels_run_on", lambda t: False)
    nmap, order = _case(300, 8, seed=1, device="cpu")
    gmap = GatherMap(nmap, order, {}, {})
    assert gmap.derived_views == {} and not hasattr(gmap, "sorted_map_t")
    held = len(gmap.held_tensors())
    view, chunks = sorted_map_t(gmap), chunk_order(gmap)
    assert gmap.derived_views == {"sorted_map_t": view, "chunk_order": chunks}
    assert len(gmap.held_tensors()) == held + 2
    assert gmap.held_tensors()[-2:] == [view, chunks]
    for copy in (gmap.to("cpu"), pickle.loads(pickle.dumps(gmap)), gmap.map_tensors(lambda t: t)):
        assert copy.derived_views == {} and copy is not gmap
        assert torch.equal(sorted_map_t(copy), view)
    assert "derived_views" not in repr(gmap)


def test_memory_cache_counts_the_views_once_whether_made_or_not(monkeypatch):
    from flexplan.cache.memory import held_bytes
    from flexplan.geometry import ConvGeometry

    monkeypatch.setattr(plan_views, "kernels_run_on", lambda t: False)
    nmap, order = _case(300, 8, seed=1, device="cpu")
    empty = torch.zeros(0, dtype=torch.int32)
    plan = ConvPlan(ConvGeometry.make(3), 1, (8, 8, 8), (8, 8, 8), 300, 300,
                    torch.zeros(300, 4, dtype=torch.int32), GatherMap(nmap, order, {}, {}), None,
                    empty, empty, torch.zeros(1, dtype=torch.int32))
    before = held_bytes(plan)
    sorted_map_t(plan.fwd)
    assert held_bytes(plan) == before  # counted as made before, as held after


def test_block_runs_region_and_views():
    """A run of unread length: region is its room (no read of the length), kept between calls;
    once the run is viewed (its length read), region is the exact run."""
    from flexplan.plan import BlockRuns

    buffer = torch.arange(20, dtype=torch.int32)
    buffer[19] = 3  # the second run's length, where length_at points
    runs = BlockRuns(buffer, {16: (0, 4), 32: (4, 10, 19)})
    assert torch.equal(runs.region(16), buffer[0:4]) and runs.region(16) is runs[16]
    room = runs.region(32)
    assert torch.equal(room, buffer[4:14]) and runs.region(32) is room
    assert torch.equal(runs[32], buffer[4:7])
    assert torch.equal(runs.region(32), buffer[4:7])
    assert dict(runs).keys() == {16, 32} and len(runs) == 2


@pytest.mark.parametrize("m", [1, 511, 513, 1300])
def test_a_scheduled_map_comes_with_its_sorted_map_t(m, kernel_device, monkeypatch):
    """The schedule kernel writes the map in sorted order along with the schedule
    (segments_triton: with_sorted_map_t): the view the conv would derive, with no launch of
    its own at the first convolution."""
    from flexplan.planner.segments_triton import plan_schedule_triton
    from flexplan.kernel_configs import PLAN_BLOCK_SIZES

    nmap, _ = _case(m, 27, seed=m, device=kernel_device)
    gmap = plan_schedule_triton(nmap, PLAN_BLOCK_SIZES, 0, pairs_total=0)[0]
    view = gmap.derived_views["sorted_map_t"]
    assert torch.equal(view.cpu(), sorted_map_t_torch(nmap.cpu(), gmap.sorted_idx.cpu()))
    monkeypatch.setattr(plan_views, "sorted_map_t_triton", None)  # (never called now)
    monkeypatch.setattr(plan_views, "sorted_map_t_torch", None)
    assert sorted_map_t(gmap) is view


def test_unscheduled_maps_come_with_their_layout(kernel_device, monkeypatch):
    """A first sighting's submanifold map (built unscheduled) and an inverse conv's map (the
    transposer's) come with their transpose, the view their convolutions read (rows in their
    own order), and their full schedule keeps it, with its chunks in order, at any size."""
    from flexplan import ConvGeometry, build_plan
    from flexplan.planner.generative import transposed_map_torch
    from flexplan.planner.generative_triton import transposed_map_and_t_triton
    from flexplan.workloads import random_coords

    gen = torch.Generator().manual_seed(3)
    coords = random_coords(400, (9, 8, 7), 2, generator=gen).to(kernel_device)
    plan = build_plan(coords, (9, 8, 7), 2, ConvGeometry.submanifold_conv(3), backend="triton",
                      training=False, scheduled=False)
    assert plan.schedule_deferred
    gmap = plan.fwd
    rows = torch.arange(gmap.num_rows, dtype=torch.int32)
    assert torch.equal(gmap.derived_views["sorted_map_t"].cpu(),
                       sorted_map_t_torch(gmap.neighbor_map.cpu(), rows))
    full = plan_views.full_schedule(gmap)
    assert full.derived_views["sorted_map_t"] is gmap.derived_views["sorted_map_t"]
    assert full.derived_views["chunk_order"].tolist() == chunk_order_torch(rows).tolist()

    fwd, _ = _case(700, 27, seed=4, device=kernel_device)
    fwd = torch.where(torch.rand(fwd.shape, generator=gen).to(fwd.device) < 0.5, -1, fwd)
    fwd = fwd.clone()
    # (an inference plan's fwd map holds each (input, tap) at most once)
    first = torch.zeros_like(fwd, dtype=torch.bool)
    for v in range(27):
        col = fwd[:, v].cpu()
        seen, keep = set(), []
        for x in col.tolist():
            keep.append(x >= 0 and x not in seen)
            seen.add(x)
        first[:, v] = torch.tensor(keep)
    fwd = torch.where(first, fwd, -1)
    bwd, bwd_t = transposed_map_and_t_triton(fwd, 700)
    want = transposed_map_torch(fwd.cpu(), 700)
    assert torch.equal(bwd.cpu(), want) and torch.equal(bwd_t.cpu(), want.t())

    big = 3000 * SCHEDULE_CHUNK + 5  # (past the Gray order's own chunk constants)
    assert plan_views._chunks_in_order(big, torch.device("cpu")).tolist() == list(
        range(-(-big // SCHEDULE_CHUNK)))
