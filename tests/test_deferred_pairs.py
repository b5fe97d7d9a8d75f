"""A submanifold training build on the Triton path makes no host sync: its valid_signal pairs get
room for the most there can be and their count stays pending (ConvPlan.pairs_pending) until the
backward asks. These tests hold the pending plan to the torch planner's exact one wherever a
plan leaves flexplan's hands (settled, tensors, files, pickles, devices), and its gradients to
float64 references."""
import io
import pickle

import pytest
import torch

from flexplan import ConvGeometry, build_plan
from flexplan import plan as plan_module
from flexplan import planner
from flexplan.cache.format import plan_problem, read_plan, write_plan
from flexplan.ops.conv import sparse_conv
from flexplan.plan import PendingCount
from flexplan.planner.segments_triton import deferred_pairs_bound
from flexplan.workloads import random_coords

SHAPE, BATCH = (10, 12, 9), 2


def _coords(n, seed, device):
    return random_coords(n, SHAPE, BATCH, generator=torch.Generator().manual_seed(seed),
                         device=device)


def _pending_plan(device, n=160, seed=3, kernel=3):
    coords = _coords(n, seed, device)
    geometry = ConvGeometry.make(kernel)
    plan = build_plan(coords, SHAPE, BATCH, geometry, backend="triton", check=False)
    exact = build_plan(coords, SHAPE, BATCH, geometry, backend="torch")
    return coords, plan, exact


def _assert_same(a, b):
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name].cpu(), tb[name].cpu()), name


@pytest.mark.parametrize("kernel", [3, (3, 1, 3)])
def test_pending_pairs_settle_to_the_exact_plan(device, kernel):
    coords, plan, exact = _pending_plan(device, kernel=kernel)
    assert plan.pairs_pending is not None
    # The views hold the bound's room: more than the pairs (the test would pass vacuously if
    # the build had synced and cut them).
    room = plan.valid_signal_i.numel()
    assert room >= deferred_pairs_bound(coords.shape[0], plan.signal_offsets)
    assert room > exact.valid_signal_i.numel()
    assert plan.num_pairs == exact.num_pairs
    settled = plan.settled()
    assert settled.pairs_pending is None and settled.settled() is settled
    for name in ("valid_signal_i", "valid_signal_o", "valid_signal_seg"):
        assert torch.equal(getattr(settled, name).cpu(), getattr(exact, name).cpu()), name
    _assert_same(plan, exact)  # tensors() settles


def test_pending_plan_crosses_boundaries_settled(device):
    _, plan, exact = _pending_plan(device, seed=4)
    moved = plan.to("cpu")
    assert moved.pairs_pending is None
    _assert_same(moved, exact)
    unpickled = pickle.loads(pickle.dumps(plan))
    assert unpickled.pairs_pending is None
    assert unpickled.valid_signal_i.numel() == exact.valid_signal_i.numel()
    for name in ("valid_signal_i", "valid_signal_o"):  # the room stayed behind
        t = getattr(unpickled, name)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
    _assert_same(unpickled, exact)
    assert plan_problem(plan.settled()) is None
    buf = io.BytesIO()
    write_plan(buf, plan, "k" * 64)
    path = _tmp_file(buf.getvalue())
    loaded, _ = read_plan(path, torch.device("cpu"), expect_key="k" * 64)
    assert loaded.pairs_pending is None
    _assert_same(loaded, exact)


def _tmp_file(data: bytes) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile(delete=False, suffix=".plan") as f:
        f.write(data)
    return f.name


def test_over_the_bound_limit_the_build_syncs(device, monkeypatch):
    coords = _coords(160, 5, device)
    monkeypatch.setattr(planner, "DEFERRED_PAIRS_MAX",
                        deferred_pairs_bound(coords.shape[0], 14) - 1)
    plan = build_plan(coords, SHAPE, BATCH, ConvGeometry.make(3), backend="triton", check=False)
    assert plan.pairs_pending is None
    exact = build_plan(coords, SHAPE, BATCH, ConvGeometry.make(3), backend="torch")
    assert plan.valid_signal_i.numel() == exact.valid_signal_i.numel()
    _assert_same(plan, exact)


def test_inference_and_checked_builds_keep_exact_pairs(device):
    coords = _coords(160, 6, device)
    geometry = ConvGeometry.make(3)
    assert build_plan(coords, SHAPE, BATCH, geometry, backend="triton").pairs_pending is None
    assert build_plan(coords, SHAPE, BATCH, geometry, backend="triton", check=False,
                      training=False).pairs_pending is None


@pytest.mark.parametrize("algo", ["implicit", "masked", "implicit_splitk", "explicit"])
def test_gradients_over_a_pending_plan(device, algo):
    """Grad-weight reads the pairs through their seg (the room past them never), num_pairs
    through the pending count: the same gradients as float64 over the torch planner's plan."""
    coords, plan, exact = _pending_plan(device, n=200, seed=7)
    g = torch.Generator().manual_seed(11)
    ci, co = 5, 6
    feats = torch.randn(coords.shape[0], ci, generator=g, dtype=torch.float64)
    weight = torch.randn(co, 3, 3, 3, ci, generator=g, dtype=torch.float64) * 0.2
    bias = torch.randn(co, generator=g, dtype=torch.float64)
    grad = torch.randn(coords.shape[0], co, generator=g, dtype=torch.float64)

    def run(p, dtype, dev, algo):
        x, w, b = (t.to(dev, dtype).clone().requires_grad_() for t in (feats, weight, bias))
        out = sparse_conv(x, p, w, b, algo=algo)
        out.backward(grad.to(dev, dtype))
        return [t.detach().double().cpu() for t in (out, x.grad, w.grad, b.grad)]

    ref = run(exact.to("cpu"), torch.float64, "cpu", "explicit")
    got = run(plan, torch.float32, device, algo)
    for r, t, name in zip(ref, got, ("out", "grad_feats", "grad_weight", "grad_bias")):
        torch.testing.assert_close(t, r, rtol=1e-4, atol=1e-4, msg=name)
    assert plan.pairs_pending is not None  # the plan itself stays as built


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_training_build_makes_no_host_sync_on_gpu():
    """torch's sync debug mode raises on any synchronizing call: an unchecked submanifold
    training build makes none, and reads its count behind its event later."""
    shape = (64, 64, 64)
    coords = random_coords(30000, shape, 2, generator=torch.Generator().manual_seed(8),
                           device="cuda")
    geometry = ConvGeometry.make(3)
    build_plan(coords, shape, 2, geometry, backend="triton", check=False)  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = build_plan(coords, shape, 2, geometry, backend="triton", check=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert plan.pairs_pending is not None
    exact = build_plan(coords, shape, 2, geometry, backend="torch")
    assert plan.num_pairs == exact.num_pairs
    _assert_same(plan, exact)


class _SlowEvent:
    """A CUDA event stand-in whose wait lets another thread run meanwhile."""

    def __init__(self):
        self.waits = 0

    def synchronize(self):
        import time

        self.waits += 1
        time.sleep(0.05)


def _pending_with(event, value=42):
    count = PendingCount.__new__(PendingCount)
    count._host, count._event = torch.tensor([value]), event
    count._device, count._value = torch.device("cpu"), None
    return count


def test_pending_count_read_by_two_threads():
    import threading

    count, got = _pending_with(_SlowEvent()), []
    threads = [threading.Thread(target=lambda: got.append(count.value())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [42, 42] and count.value() == 42


def test_pending_count_refuses_a_wait_under_capture(monkeypatch):
    """The first read waits on an event, which a CUDA graph capture forbids: a clear error,
    not an invalidated capture. Once read, the count serves captures too."""
    event = _SlowEvent()
    count = _pending_with(event)
    monkeypatch.setattr(plan_module, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="before capturing"):
        count.value()
    assert event.waits == 0
    monkeypatch.setattr(plan_module, "capturing", lambda device: False)
    assert count.value() == 42
    monkeypatch.setattr(plan_module, "capturing", lambda device: True)
    assert count.value() == 42 and event.waits == 1


def test_lengths_left_on_the_device_read_in_one_sync(device, monkeypatch):
    """A strided training plan's schedule leaves its valid_kernel lengths on the device:
    viewing them all (a file write, a move) reads them in one host read (its bwd map has no
    schedule: planner.segments.SCHEDULE_BWD_MAPS)."""
    coords = _coords(160, 9, device)
    geometry = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    plan = build_plan(coords, SHAPE, BATCH, geometry, backend="triton", check=False)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real(self))
    tensors = plan.tensors()
    monkeypatch.undo()
    assert len(reads) == 1  # the fwd map's lengths
    exact = build_plan(coords, SHAPE, BATCH, geometry, backend="torch").tensors()
    assert tensors.keys() == exact.keys()
    for name in exact:
        assert torch.equal(tensors[name].cpu(), exact[name].cpu()), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pending_counts_share_pinned_chunks_without_sharing_slots(monkeypatch):
    """Counts copied to one-element views of shared pinned chunks (plan._pinned_slot): each
    reads its own source, across a chunk's end, also once the chunk's earlier counts are gone."""
    monkeypatch.setattr(plan_module, "_PINNED_CHUNK_SLOTS", 3)
    monkeypatch.setattr(plan_module, "_pinned_chunks", {})
    counts = []
    for value in range(8):
        counts.append(PendingCount(torch.tensor([value * 7], dtype=torch.int64, device="cuda")))
        if value == 4:
            del counts[:2]  # the first chunk's first two counts dropped before the rest are read
    assert [c.value() for c in counts] == [v * 7 for v in range(2, 8)]
    assert all(c._host.is_pinned() for c in counts)
    assert len({c._host.data_ptr() for c in counts}) == len(counts)
