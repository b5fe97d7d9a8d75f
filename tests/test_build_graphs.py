"""Submanifold training builds replayed from CUDA graphs (flexplan/planner/build_graphs.py): the
kernels launched for a bucket's rows that read the live count from device memory make the same
plan as an eager build of the live rows, build after build on the same buffers (here eagerly,
capture=False, as the interpreter runs them; the capture itself is GPU-tested)."""
import pytest
import torch

from flexplan import ConvGeometry, build_plan
from flexplan import planner
from flexplan.plan import mirrored_signal_offsets
from flexplan.plan_views import sorted_map_t
from flexplan.planner import build_graphs
from flexplan.planner.generative import bwd_from_fwd
from flexplan.planner.segments_triton import deferred_pairs_bound
from flexplan.workloads import random_coords

SHAPE, BATCH = (14, 12, 11), 3


@pytest.fixture(params=[0, 1 << 30], ids=["zeros", "large"])
def poisoned_empty(request, monkeypatch):
    """torch.empty's int32 / int64 tensors filled with a value (what a graph's reused memory
    may hold): a kernel that reads what it did not write gives a wrong plan here."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(request.param) if t.dtype in (torch.int32, torch.int64) else t

    monkeypatch.setattr(torch, "empty", empty)


def fake_gpu(monkeypatch, memory=80 << 30):
    """What captured_build asks of a GPU, answered on any machine: no capture running, stream
    7, `memory` bytes of device memory."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(build_graphs, "_device_memory", lambda index: memory)


def test_bytes_budget(monkeypatch):
    """1/40 of the device's memory, at most 2 GiB; BYTES_BUDGET set: that."""
    fake_gpu(monkeypatch, memory=24 << 30)
    assert build_graphs.bytes_budget(0) == (24 << 30) // 40
    fake_gpu(monkeypatch, memory=141 << 30)
    assert build_graphs.bytes_budget(0) == 2 << 30
    monkeypatch.setattr(build_graphs, "BYTES_BUDGET", 12345)
    assert build_graphs.bytes_budget(0) == 12345


def _assert_same(a, b):
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name].cpu(), tb[name].cpu()), name


@pytest.mark.parametrize("kernel", [3, (3, 3, 1)])
def test_replayed_builds_equal_eager_builds(device, kernel, poisoned_empty):
    geometry = ConvGeometry.make(kernel)
    signal = mirrored_signal_offsets(geometry.volume)
    cap = 1024
    recorded = build_graphs.CapturedBuild(cap, SHAPE, BATCH, geometry, signal,
                                          torch.device(device), capture=False)
    # larger, then smaller counts: rows a previous build left in the buffers must not leak in
    for seed, n in enumerate((1000, 300, cap, 513, 40)):
        coords = random_coords(n, SHAPE, BATCH, generator=torch.Generator().manual_seed(seed),
                               device=device)
        fwd, signal_parts = recorded.build(coords)
        plan = planner._submanifold_plan(coords, SHAPE, BATCH, geometry, fwd, signal_parts, True)
        exact = build_plan(coords, SHAPE, BATCH, geometry, backend="torch")
        assert plan.pairs_pending is not None
        assert plan.valid_signal_i.numel() >= deferred_pairs_bound(cap, signal)  # the bucket's room
        assert plan.num_pairs == exact.num_pairs
        _assert_same(plan, exact)
        assert torch.equal(sorted_map_t(plan.fwd).cpu(), sorted_map_t(exact.fwd).cpu())
        eager = build_plan(coords, SHAPE, BATCH, geometry, backend="triton", check=False)
        for block in eager.fwd.valid_kernel:  # the places a conv reads without a sync
            assert torch.equal(plan.fwd.valid_kernel[block], eager.fwd.valid_kernel[block])
            assert torch.equal(plan.fwd.valid_kernel_seg[block], eager.fwd.valid_kernel_seg[block])


def test_captured_build_is_asked_for_twice_within_its_bounds(monkeypatch):
    """Who gets a graph: CUDA only, rows within the sort's bounds, one rank word, the bound's
    room within the caller's limit, the second request of a key (the first builds eagerly)."""
    geometry = ConvGeometry.make(3)
    cuda = torch.device("cuda", 0)
    made = []
    monkeypatch.setattr(build_graphs, "CapturedBuild", lambda *a: made.append(a) or "graph")
    fake_gpu(monkeypatch)
    build_graphs.release()
    ask = lambda n, **kw: build_graphs.captured_build(  # noqa: E731
        n, SHAPE, BATCH, kw.get("geometry", geometry), 14, kw.get("device", cuda),
        kw.get("pairs_max", 1 << 22))
    for _ in range(2):  # (asked twice: a first request alone gets None anyway)
        assert ask(5000, device=torch.device("cpu")) is None
        assert ask(100) is None  # below MIN_ROWS
        assert ask(5000, pairs_max=1000) is None
        assert ask(5000, geometry=ConvGeometry.make(5)) is None  # 125 offsets: two rank words
    assert not made
    assert ask(5000) is None and not made  # first request
    assert ask(5100) == "graph" and len(made) == 1  # same bucket, second request
    assert ask(5050) == "graph" and len(made) == 1  # kept
    monkeypatch.setenv(build_graphs.BUILD_GRAPHS_ENV, "0")
    assert ask(9000) is None and ask(9000) is None and len(made) == 1
    build_graphs.release()


def test_a_failed_capture_builds_eagerly_from_then_on(monkeypatch):
    def fail(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(build_graphs, "CapturedBuild", fail)
    fake_gpu(monkeypatch)
    build_graphs.release()
    ask = lambda: build_graphs.captured_build(  # noqa: E731
        5000, SHAPE, BATCH, ConvGeometry.make(3), 14, torch.device("cuda", 0), 1 << 22)
    assert ask() is None
    with pytest.warns(RuntimeWarning, match="capturing a plan build failed"):
        assert ask() is None
    assert ask() is None  # remembered: no second attempt, no second warning
    build_graphs.release()


def test_row_count_constant_is_the_unread_address():
    from flexplan.kernels_src.row_count import NO_ROWS_AT
    from flexplan.launch_spec import UNREAD_ADDRESS

    assert NO_ROWS_AT.value == UNREAD_ADDRESS


@pytest.mark.gpu
def test_captured_builds_on_the_gpu():
    """Fresh coordinates in two buckets, each built several times through build_plan: the
    second build of a bucket is captured, later ones replay; every plan equals the torch
    planner's, also after later replays (the plan owns its buffers), and a conv's forward and
    gradients over a replayed plan equal those over an eager one."""
    from flexplan.ops.conv import sparse_conv

    build_graphs.release()
    geometry, shape, batch = ConvGeometry.make(3), (120, 110, 40), 2
    plans = []
    for seed, n in enumerate((20000, 19000, 21000, 9000, 8800, 9100, 19500)):
        coords = random_coords(n, shape, batch, generator=torch.Generator().manual_seed(seed),
                               device="cuda")
        plans.append((coords, build_plan(coords, shape, batch, geometry, check=False)))
    assert len(build_graphs.kept()) == 2
    for coords, plan in plans:
        exact = build_plan(coords.cpu(), shape, batch, geometry, backend="torch")
        _assert_same(plan, exact)
        assert torch.equal(sorted_map_t(plan.fwd).cpu(), sorted_map_t(exact.fwd).cpu())
    coords, replayed = plans[-1]
    build_graphs.release()
    eager = build_plan(coords, shape, batch, geometry, check=False)
    x = torch.randn(coords.shape[0], 16, device="cuda", dtype=torch.float16, requires_grad=True)
    w = torch.randn(32, 3, 3, 3, 16, device="cuda", dtype=torch.float16, requires_grad=True)
    grads = []
    for plan in (replayed, eager):
        out = sparse_conv(x, plan, w)
        grads.append((out, *torch.autograd.grad(out.float().square().sum(), (x, w))))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


STRIDED = [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=(3, 1, 1), stride=(2, 1, 1)),
           dict(kernel_size=2, stride=2, transposed=True), dict(kernel_size=4, stride=2)]


@pytest.mark.parametrize("args", STRIDED, ids=["k3s2p1", "k311s211", "k2s2T", "k4s2"])
def test_replayed_strided_builds_equal_eager_builds(device, args, poisoned_empty):
    """The two graphs of a strided or transposed build (generative_graphs.py), run eagerly:
    for several input counts in one bucket, training, inference and maps-only plans, the rest
    eager (an output bucket's first sighting) and through the second graph (its next ones),
    every plan equals the torch planner's, with its views."""
    from flexplan.planner import generative_graphs
    from flexplan.planner.generative import output_spatial_shape

    geometry = ConvGeometry.make(submanifold=False, **args)
    out_shape = output_spatial_shape(SHAPE, geometry)
    cap = 512
    first = generative_graphs.CapturedCandidates(cap, out_shape, BATCH, geometry,
                                                 torch.device(device), capture=False)
    # training, inference and maps-only plans from one first graph, each kind its own second
    # graphs
    T, I, M = generative_graphs.TRAIN, generative_graphs.INFER, generative_graphs.MAPS
    B = generative_graphs.INFER_BWD
    for seed, (n, kind) in enumerate(((500, T), (300, T), (cap, I), (410, T), (490, I), (450, T),
                                      (470, I), (460, M), (420, M), (505, M), (480, B),
                                      (495, B), (430, B))):
        if kind == M and geometry.transposed:  # (no maps-only plan: maps_only_request)
            kind = I
        coords = random_coords(n, SHAPE, BATCH, generator=torch.Generator().manual_seed(seed),
                               device=device)
        plan = first.build(coords, SHAPE, BATCH, kind)
        exact = build_plan(coords.cpu(), SHAPE, BATCH, geometry, backend="torch",
                           training=kind == T, scheduled=kind != M)
        if kind == B:  # (with the bwd map an inverse conv reads)
            exact = bwd_from_fwd(exact)
        _assert_same(plan, exact)
        assert plan.for_training == (kind == T)
        assert (plan.bwd is None) == (kind not in generative_graphs.WITH_BWD)
        assert plan.maps_only == exact.maps_only == (kind == M)
        assert (plan.num_out, plan.out_spatial_shape) == (exact.num_out, exact.out_spatial_shape)
        for gmap, other in ((plan.fwd, exact.fwd), (plan.bwd, exact.bwd))[:1 + (plan.bwd is not None)]:
            assert torch.equal(sorted_map_t(gmap).cpu(), sorted_map_t(other).cpu())
    # the second graphs' launches ran, but the scheduled kinds' for 64 offsets (two rank words:
    # the rest eager)
    kinds = {kind for _, kind in first.eager_rests.kept()}
    maps = set() if geometry.transposed else {M}
    assert kinds == ({T, I, B} | maps if geometry.volume <= 63 else maps)


def test_eager_rest_after_a_failed_second_capture(device):
    """A second graph whose capture fails after its first-use pass: that pass left the fwd
    schedule's look-back state in the first graph's readback, which the eager rest resets."""
    from flexplan.planner import generative_graphs
    from flexplan.planner.generative import output_spatial_shape
    from flexplan.planner.generative_graphs import TOTALS, CapturedRest
    from flexplan.planner.rank_sort import bucket
    from flexplan.kernel_configs import PLAN_BLOCK_SIZES
    from flexplan.planner.segments_triton import SCHEDULE_LAUNCH, schedule_layout

    geometry = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    out_shape = output_spatial_shape(SHAPE, geometry)
    first = generative_graphs.CapturedCandidates(512, out_shape, BATCH, geometry,
                                                 torch.device(device), capture=False)
    coords = random_coords(480, SHAPE, BATCH, generator=torch.Generator().manual_seed(5),
                           device=device)
    n = coords.shape[0]
    first.coords[:n].copy_(coords)
    first.rows.fill_(n)
    outputs = first._launches()
    n_out, pairs = outputs[-1][:TOTALS].tolist()
    rows = SCHEDULE_LAUNCH["ROWS"]
    cap_out = -(-bucket(n_out) // rows) * rows
    rest = CapturedRest(first, cap_out, schedule_layout(cap_out, 27, PLAN_BLOCK_SIZES, 27))
    rest._launches(outputs)  # the first-use pass, then (say) the capture failed
    out_coords, fwd, bwd, signal = first._rest_eagerly(outputs, n, n_out, pairs,
                                                       generative_graphs.TRAIN)
    exact = build_plan(coords.cpu(), SHAPE, BATCH, geometry, backend="torch")
    assert torch.equal(out_coords.cpu(), exact.out_coords)
    assert torch.equal(fwd.neighbor_map.cpu(), exact.fwd.neighbor_map)
    assert torch.equal(bwd.neighbor_map.cpu(), exact.bwd.neighbor_map) and signal is not None
    for block in exact.fwd.valid_kernel:
        assert torch.equal(fwd.valid_kernel[block].cpu(), exact.fwd.valid_kernel[block])


@pytest.mark.gpu
def test_captured_strided_builds_on_the_gpu():
    """Strided training, inference and maps-only builds through build_plan on fresh
    coordinates: first graphs captured at an input bucket's second build (shared by every
    kind), second graphs at an output bucket's (per kind); every plan equals the torch
    planner's, also after later replays."""
    from flexplan.planner import generative_graphs

    build_graphs.release()
    geometry = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    shape, batch = (120, 110, 40), 2
    plans = []
    for seed, n in enumerate((20000, 19000, 21000, 19500, 20500, 9000, 8800)):
        coords = random_coords(n, shape, batch, generator=torch.Generator().manual_seed(seed),
                               device="cuda")
        for training, scheduled in ((True, True), (False, True), (False, False)):
            plans.append((coords, training, scheduled, build_plan(
                coords, shape, batch, geometry, check=False, training=training,
                scheduled=scheduled)))
    firsts = [b for b in build_graphs.kept()
              if isinstance(b, generative_graphs.CapturedCandidates)]
    rests = [b for b in build_graphs.kept() if isinstance(b, generative_graphs.CapturedRest)]
    assert firsts and all(rest.graph is not None for rest in rests)
    assert {rest.kind for rest in rests} == {generative_graphs.TRAIN, generative_graphs.INFER,
                                            generative_graphs.MAPS}
    for coords, training, scheduled, plan in plans:
        exact = build_plan(coords.cpu(), shape, batch, geometry, backend="torch",
                           training=training, scheduled=scheduled)
        _assert_same(plan, exact)
        assert plan.maps_only == exact.maps_only == (not scheduled)
        for gmap, other in ((plan.fwd, exact.fwd), (plan.bwd, exact.bwd))[:1 + training]:
            assert torch.equal(sorted_map_t(gmap).cpu(), sorted_map_t(other).cpu())
    # once an inverse conv asked an inference plan of this geometry for its bwd map, the
    # inference builds make it in their replays (INFER_BWD), as bwd_from_fwd adds it
    bwd_from_fwd(plans[1][3])
    for seed, n in enumerate((20000, 19000, 21000), start=10):
        coords = random_coords(n, shape, batch, generator=torch.Generator().manual_seed(seed),
                               device="cuda")
        plan = build_plan(coords, shape, batch, geometry, check=False, training=False)
        exact = bwd_from_fwd(build_plan(coords.cpu(), shape, batch, geometry, backend="torch",
                                        training=False))
        _assert_same(plan, exact)
        assert torch.equal(sorted_map_t(plan.bwd).cpu(), sorted_map_t(exact.bwd).cpu())
    assert any(rest.kind == generative_graphs.INFER_BWD and rest.graph is not None
               for rest in build_graphs.kept() if isinstance(rest, generative_graphs.CapturedRest))
    build_graphs.release()


def test_capture_registry_rules():
    """Second request captures; sizes per pool within the budget given at each request (a
    budget lowered later holds); a failed capture is remembered; release forgets all."""
    from flexplan.planner.graph_registry import CaptureRegistry

    registry, made = CaptureRegistry(), []

    def get(key, size, pool="a", budget=100):
        return registry.get(key, lambda: size, pool, budget,
                            lambda: made.append(key) or f"graph {key}", "failed")

    assert get(1, 60) is None and get(1, 60) == "graph 1" and get(1, 60) == "graph 1"
    assert get(2, 50) is None and get(2, 50) is None  # 60 + 50 > 100 in pool a
    assert get(3, 50, pool="b") is None and get(3, 50, pool="b") == "graph 3"  # pool b's own
    assert get(4, 30, budget=80) is None and get(4, 30, budget=80) is None  # a budget of 80
    # then 100 again: fits (requests past the budget were not counted: its first, its second)
    assert get(4, 30) is None and get(4, 30) == "graph 4" and made == [1, 3, 4]
    assert set(registry.kept()) == {1, 3, 4}

    def fail():
        raise RuntimeError("no")

    assert registry.get(5, lambda: 1, "a", 100, fail, "x") is None
    with pytest.warns(RuntimeWarning, match="x"):
        assert registry.get(5, lambda: 1, "a", 100, fail, "x") is None
    assert registry.get(5, lambda: 1, "a", 100, fail, "x") is None and 5 not in registry.kept()
    registry.release()
    assert registry.kept() == {} and get(1, 60) is None


@pytest.mark.parametrize("rows", [1, 3, 4095, 4096, 5000, 99000, 123000, 1 << 20])
def test_room_buckets(rows):
    """bucket(rows) first, then every larger bucket within the room, none past it."""
    from flexplan.planner.rank_sort import bucket, room_buckets

    caps = room_buckets(rows, 4 / 3)
    assert caps[0] == bucket(rows) and caps == sorted(set(caps))
    assert all(bucket(cap) == cap for cap in caps) and caps[-1] <= max(caps[0], 4 / 3 * rows)
    assert bucket(caps[-1] + 1) > 4 / 3 * rows


def test_a_request_replays_the_smallest_kept_graph_within_its_room():
    """graph_registry.roomy_graph: a kept graph of any bucket in the room serves (the smallest
    first) without counting a request; else the request is for the largest bucket."""
    from flexplan.planner.graph_registry import CaptureRegistry, roomy_graph

    registry, made = CaptureRegistry(), []

    def ask(caps):
        return roomy_graph(registry, caps, lambda cap: ("k", cap), lambda cap: registry.get(
            ("k", cap), lambda: 1, "a", 100, lambda: made.append(cap) or f"graph {cap}", ""))

    assert ask([10, 12]) is None and ask([10, 12, 14]) is None  # requests for 12, then 14
    assert ask([8, 10, 12]) == "graph 12" and made == [12]  # 12's second request
    assert ask([10, 12, 14]) == "graph 12" and ask([12]) == "graph 12"  # kept, in the room
    assert ask([14]) == "graph 14" and made == [12, 14]
    assert ask([12, 14]) == "graph 12" and ask([13, 14]) == "graph 14"  # the smallest kept
    assert ask([16]) is None and ask([]) is None and made == [12, 14]


def test_captured_build_replays_a_larger_kept_bucket(monkeypatch):
    """A build of fewer rows than a kept graph's bucket, within the room, replays that graph."""
    made = []
    monkeypatch.setattr(build_graphs, "CapturedBuild", lambda *a: made.append(a[0]) or a[0])
    fake_gpu(monkeypatch)
    build_graphs.release()
    ask = lambda n: build_graphs.captured_build(  # noqa: E731
        n, SHAPE, BATCH, ConvGeometry.make(3), 14, torch.device("cuda", 0), 1 << 22)
    assert ask(5000) is None and ask(5100) == 6144  # the roomiest bucket of 5000-5100 rows
    assert ask(4700) == 6144 and ask(6144) == 6144 and made == [6144]  # (4700: 5120 first)
    assert ask(4500) is None and made == [6144]  # 6144 > 4/3 * 4500: its own request
    build_graphs.release()


def test_graphs_made_under_inference_mode_serve_builds_outside_it(device):
    """A graph requested under torch.inference_mode (a strided inference build, a validation
    loop's) is made outside it: its buffers are normal tensors, which builds outside inference
    mode may update in place (torch refuses that on inference tensors)."""
    from flexplan.planner import generative_graphs
    from flexplan.planner.generative import output_spatial_shape
    from flexplan.planner.graph_registry import CaptureRegistry

    registry = CaptureRegistry()
    with torch.inference_mode():
        for _ in range(2):
            made = registry.get("k", lambda: 1, "a", 10, lambda: torch.zeros(3), "")
    assert not made.is_inference()
    made.fill_(1)  # (raised on an inference tensor)
    geometry = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    first = generative_graphs.CapturedCandidates(
        512, output_spatial_shape(SHAPE, geometry), BATCH, geometry, torch.device(device),
        capture=False)
    coords = [random_coords(n, SHAPE, BATCH, generator=torch.Generator().manual_seed(n),
                            device=device) for n in (480, 470, 490)]
    with torch.inference_mode():  # the inference rest's second request makes it here
        for c in coords[:2]:
            first.build(c, SHAPE, BATCH, generative_graphs.INFER)
    assert first.eager_rests.kept()
    plan = first.build(coords[2], SHAPE, BATCH, generative_graphs.INFER)  # and serves outside
    _assert_same(plan, build_plan(coords[2].cpu(), SHAPE, BATCH, geometry, backend="torch",
                                  training=False))


def test_strided_first_graphs_replay_a_larger_kept_bucket(monkeypatch):
    """captured_strided_build takes its room as captured_build does (its first graphs), within
    MAX_ROWS."""
    from flexplan.planner import generative_graphs
    from flexplan.planner.rank_sort import MAX_ROWS

    made = []

    class Made:  # (what captured_strided_build reads of the class: its size, its making)
        graph_bytes = staticmethod(generative_graphs.CapturedCandidates.graph_bytes)

        def __new__(cls, cap, *args):
            made.append(cap)
            return cap

    monkeypatch.setattr(generative_graphs, "CapturedCandidates", Made)
    fake_gpu(monkeypatch)
    build_graphs.release()
    geometry = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    ask = lambda n: generative_graphs.captured_strided_build(  # noqa: E731
        n, SHAPE, BATCH, geometry, torch.device("cuda", 0))
    assert ask(5000) is None and ask(5100) == 6144 and ask(4700) == 6144 and made == [6144]
    assert ask(MAX_ROWS) is None and ask(MAX_ROWS) == MAX_ROWS  # (no room past MAX_ROWS)
    build_graphs.release()


# (a grid of more than 2^31 cells: 64-bit keys, whose table keeps the rows apart)
BIG_SHAPE = (3000, 3000, 1500)


@pytest.mark.parametrize("kernel, shape", [(3, SHAPE), ((5, 5, 3), SHAPE), (3, BIG_SHAPE)],
                         ids=["k3", "k553", "k3-64bit-keys"])  # (k553: 75 offsets)
def test_replayed_map_builds_equal_eager_builds(device, kernel, shape, poisoned_empty):
    """build_graphs.CapturedMapBuild (a first sighting's unscheduled inference map, any number
    of offsets, either key width), run eagerly for several counts in one bucket, larger then
    smaller: the plan equals build_plan's unscheduled build and the torch planner's, its
    gather layout too."""
    geometry = ConvGeometry.make(kernel)
    cap = 256
    recorded = build_graphs.CapturedMapBuild(cap, shape, BATCH, geometry, torch.device(device),
                                             capture=False)
    for seed, n in enumerate((250, 100, cap, 40)):
        coords = random_coords(n, SHAPE, BATCH, generator=torch.Generator().manual_seed(seed),
                               device=device)
        if shape is BIG_SHAPE:  # (the same clusters far from the origin)
            coords[:, 1:] += torch.tensor([2900, 1500, 1400], dtype=torch.int32, device=device)
        plan = planner._submanifold_plan(coords, shape, BATCH, geometry, recorded.build(coords),
                                         None, False)
        eager = build_plan(coords, shape, BATCH, geometry, backend="triton", check=False,
                           training=False, scheduled=False)
        exact = build_plan(coords.cpu(), shape, BATCH, geometry, backend="torch",
                           training=False, scheduled=False)
        assert plan.schedule_deferred and eager.schedule_deferred and not plan.for_training
        _assert_same(plan, eager)
        _assert_same(plan, exact)
        assert torch.equal(sorted_map_t(plan.fwd).cpu(), sorted_map_t(exact.fwd).cpu())
        # its second sighting's schedule (plan_cache._served) as over the eager plan
        _assert_same(planner.scheduled_plan(plan), planner.scheduled_plan(eager))


def test_captured_map_build_is_asked_for_twice(monkeypatch):
    """captured_map_build: the second request of a bucket captures, a build within the room
    replays it, CPU tensors and small counts never get one, a training build of the same rows
    and geometry does not get it."""
    made = []
    monkeypatch.setattr(build_graphs, "CapturedMapBuild",
                        type("Made", (), {"graph_bytes": staticmethod(lambda cap, v: 1),
                                          "__new__": lambda cls, cap, *a: made.append(cap) or cap}))
    fake_gpu(monkeypatch)
    build_graphs.release()
    ask = lambda n, device=torch.device("cuda", 0): build_graphs.captured_map_build(  # noqa: E731
        n, SHAPE, BATCH, ConvGeometry.make(3), device)
    assert ask(5000, torch.device("cpu")) is None and ask(100) is None and ask(100) is None
    assert ask(5000) is None and ask(5100) == 6144 and ask(4700) == 6144 and made == [6144]
    # a training build of the same rows has its own key (its graph not the map build's)
    monkeypatch.setattr(build_graphs, "CapturedBuild", lambda *a: "training graph")
    train = lambda: build_graphs.captured_build(  # noqa: E731
        5000, SHAPE, BATCH, ConvGeometry.make(3), 0, torch.device("cuda", 0), 1 << 30)
    assert train() is None and train() == "training graph"
    build_graphs.release()


@pytest.mark.gpu
def test_captured_map_builds_on_the_gpu():
    """First sightings' inference maps through build_plan on fresh coordinates: captured at a
    bucket's second build, later ones replay; every plan equals the torch planner's, also
    after later replays, and a conv over a replayed plan equals one over an eager plan."""
    from flexplan.ops.conv import sparse_conv

    build_graphs.release()
    geometry, shape, batch = ConvGeometry.make(3), (120, 110, 40), 2
    plans = []
    for seed, n in enumerate((20000, 19000, 21000, 19500, 9000, 8800, 9100)):
        coords = random_coords(n, shape, batch, generator=torch.Generator().manual_seed(seed),
                               device="cuda")
        plans.append((coords, build_plan(coords, shape, batch, geometry, check=False,
                                         training=False, scheduled=False)))
    assert any(isinstance(b, build_graphs.CapturedMapBuild) for b in build_graphs.kept())
    for coords, plan in plans:
        exact = build_plan(coords.cpu(), shape, batch, geometry, backend="torch",
                           training=False, scheduled=False)
        _assert_same(plan, exact)
        assert torch.equal(sorted_map_t(plan.fwd).cpu(), sorted_map_t(exact.fwd).cpu())
    coords, replayed = plans[3]
    build_graphs.release()
    eager = build_plan(coords, shape, batch, geometry, check=False, training=False,
                       scheduled=False)
    x = torch.randn(coords.shape[0], 16, device="cuda", dtype=torch.float16)
    w = torch.randn(32, 3, 3, 3, 16, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        assert torch.equal(sparse_conv(x, replayed, w), sparse_conv(x, eager, w))
