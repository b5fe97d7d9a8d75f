"""flexplan.nn.SyncBatchNorm (issue #26): torch.nn.SyncBatchNorm's semantics with one
all_reduce per forward and per backward and no host synchronization.

- one process (no process group, a world of 1): exactly torch's BatchNorm, float64;
- 2 gloo ranks on the CPU (spawned once for the whole file): outputs, input gradients,
  DDP-averaged weight / bias gradients and running statistics equal torch's BatchNorm over the
  ranks' concatenated rows (uneven row counts, a rank without rows, no rows anywhere,
  momentum None, fp32 / fp16 inputs around 100, [N, C, H, W]), and a DistributedDataParallel
  step equals one process on the whole batch. torch's own SyncBatchNorm cannot be the CPU
  reference (its training forward requires a GPU); the GPU test below compares the two;
- no host syncs: the forward and backward call no Tensor.item / tolist / __bool__ / __int__ /
  __float__ / __index__ and dispatch no sync-bound aten op (_local_scalar_dense, nonzero,
  masked_select, unique, boolean-mask indexing), with one all_reduce each;
- the CUDA path's two Triton kernels (through the interpreter) against the torch formulas;
- convert_sync_batchnorm over nested modules, the spconv namespace's included;
- on 2 GPUs (NCCL): equal to torch's nn.SyncBatchNorm with the Triton kernels and with torch ops,
  and no sync under torch.cuda.set_sync_debug_mode("error") (which does see torch's).
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode

import flexplan.nn.spconv as spconv
from flexplan.nn import SyncBatchNorm, convert_sync_batchnorm
from flexplan.nn.spconv_modules import FlexSparseSyncBatchNorm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

F64 = torch.float64


# --- the sync detector --------------------------------------------------------------------

_SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero",
             "aten::nonzero_static", "aten::masked_select", "aten::tolist"}


class _Ops(TorchDispatchMode):
    """Records every dispatched op; notes those that make the host wait for the data."""

    def __init__(self):
        super().__init__()
        self.names, self.syncs = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.names.append(name)
        boolean_index = name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if name in _SYNC_OPS or "unique" in name or boolean_index:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def _refuse(name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"Tensor.{name} called (a host sync)")
    return refuse


@contextlib.contextmanager
def no_host_syncs():
    """Tensor's Python-level host reads raise; yields the op recorder (check .syncs after)."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    saved = {n: torch.Tensor.__dict__.get(n) for n in names}
    for n in names:
        setattr(torch.Tensor, n, _refuse(n))
    try:
        with _Ops() as ops:
            yield ops
    finally:
        for n, f in saved.items():
            if f is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, f)


def test_the_detector_sees_host_syncs():
    x = torch.randn(8, 3)
    with pytest.raises(AssertionError, match="item"), no_host_syncs():
        x.sum().item()
    with no_host_syncs() as ops:
        x[x[:, 0] > 0]
    assert ops.syncs
    assert (x.sum() > 0).item() in (True, False)  # restored


# --- cases: every rank's rows, cut from one batch -----------------------------------------

# counts: rows per rank; steps: training steps (fresh data each), running stats after all.
CASES = {
    "uneven": dict(counts=(7, 12), steps=2),
    "empty_rank": dict(counts=(0, 9), steps=2),
    "all_empty": dict(counts=(0, 0), steps=1),
    "one_row": dict(counts=(1, 3)),  # a rank's variance is 0
    "cumulative": dict(counts=(5, 8), steps=3, momentum=None),
    "plain": dict(counts=(6, 4), affine=False, track=False),
    "fp32_at_100": dict(counts=(300, 200), dtype=torch.float32, offset=100.0),
    "fp16_at_100": dict(counts=(300, 200), dtype=torch.float16, offset=100.0),
    "fp16_model": dict(counts=(300, 200), dtype=torch.float16, offset=100.0, half_model=True),
    "bf16": dict(counts=(40, 30), dtype=torch.bfloat16),
    "nchw": dict(counts=(2, 3), spatial=(3, 2)),
}
# BatchNorm's `bias` argument (affine weight without a bias) is newer than torch 2.11: the case
# runs where torch's own BatchNorm takes it.
if "bias" in inspect.signature(_BatchNorm.__init__).parameters:
    CASES["no_bias"] = dict(counts=(6, 5), bias=False)
CHANNELS = 4
EPS = 1e-3


def _cfg(name):
    return {"steps": 1, "momentum": 0.1, "affine": True, "track": True, "bias": True,
            "dtype": F64, "offset": 0.0, "half_model": False, "spatial": (), **CASES[name]}


def _batches(name):
    """Per step: the whole batch x (float64 values exact in the case's dtype) and dy."""
    cfg = _cfg(name)
    gen = torch.Generator().manual_seed(len(name))
    out = []
    for _ in range(cfg["steps"]):
        shape = (sum(cfg["counts"]), CHANNELS, *cfg["spatial"])
        x = (cfg["offset"] + 2 * torch.randn(shape, generator=gen, dtype=F64)).to(cfg["dtype"])
        dy = torch.randn(shape, generator=gen, dtype=F64).to(cfg["dtype"])
        out.append((x.to(F64), dy.to(F64)))
    return out


def _rows(name, rank):
    counts = _cfg(name)["counts"]
    return slice(sum(counts[:rank]), sum(counts[:rank + 1]))


def _module(name, cls):
    cfg = _cfg(name)
    extra = {} if cfg["bias"] else {"bias": False}
    m = cls(CHANNELS, eps=EPS, momentum=cfg["momentum"], affine=cfg["affine"],
            track_running_stats=cfg["track"], **extra)
    if cfg["affine"]:
        with torch.no_grad():
            m.weight.copy_(torch.linspace(0.5, 2.0, CHANNELS))
            if m.bias is not None:
                m.bias.copy_(torch.linspace(-1.0, 1.0, CHANNELS))
    if cfg["track"]:
        m.running_mean.fill_(0.5)
        m.running_var.fill_(2.0)
    return m


def _run_case(name, rank, device, cls=SyncBatchNorm):
    """This rank's outputs, input / weight / bias grads per step, then the running stats."""
    cfg = _cfg(name)
    m = _module(name, cls).to(device)
    if cfg["half_model"]:  # as ddp_train's fp16 models: parameters and buffers in fp16
        m = m.half()
    elif cfg["dtype"] == F64:
        m = m.double()

    def grad(t):  # torch's SyncBatchNorm leaves the grads of a rank without rows None
        return None if t is None else (torch.zeros_like(t) if t.grad is None else t.grad).cpu()

    steps = []
    for x, dy in _batches(name):
        xr = x[_rows(name, rank)].to(device, cfg["dtype"]).requires_grad_()
        y = m(xr)
        y.backward(dy[_rows(name, rank)].to(device, cfg["dtype"]))
        steps.append({"y": y.detach().cpu(), "gx": grad(xr), "gw": grad(m.weight),
                      "gb": grad(m.bias)})
        m.zero_grad()
    return {"steps": steps, "buffers": {k: v.cpu() for k, v in m.named_buffers()}}


def _reference(name):
    """torch's BatchNorm in float64 over the concatenated rows (loss: the sum over ranks)."""
    cfg = _cfg(name)
    cls = nn.BatchNorm2d if cfg["spatial"] else nn.BatchNorm1d
    m = _module(name, cls).double()
    steps = []
    for x, dy in _batches(name):
        x = x.clone().requires_grad_()
        y = m(x)
        y.backward(dy)
        steps.append({"y": y.detach(), "gx": x.grad,
                      "gw": None if m.weight is None else m.weight.grad.clone(),
                      "gb": None if m.bias is None else m.bias.grad.clone()})
        m.zero_grad()
    return {"steps": steps, "buffers": dict(m.named_buffers())}


# --- the ranks ------------------------------------------------------------------------------

def _ddp_step(rank, device):
    """Linear -> BatchNorm1d (converted) under DistributedDataParallel, uneven rows; the
    parameters' averaged grads and the BatchNorm buffers after one step."""
    torch.manual_seed(0)
    model = convert_sync_batchnorm(nn.Sequential(nn.Linear(3, CHANNELS), nn.BatchNorm1d(CHANNELS)))
    model = model.double().to(device)
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    x, dy = _ddp_data()
    rows = slice(0, 5) if rank == 0 else slice(5, 16)
    (ddp(x[rows].to(device)) * dy[rows].to(device)).sum().backward()
    return {"grads": {n: p.grad.cpu() for n, p in model.named_parameters()},
            "buffers": {n: b.cpu() for n, b in model.named_buffers()}}


def _ddp_data():
    gen = torch.Generator().manual_seed(7)
    return torch.randn(16, 3, generator=gen, dtype=F64) * 3 + 5, torch.randn(
        16, CHANNELS, generator=gen, dtype=F64)


def _sync_check(rank, device):
    """One training forward + backward (rank 1 without rows, cumulative average) under the
    detector: the sync-bound calls it saw and its all_reduce count."""
    m = SyncBatchNorm(CHANNELS, momentum=None).to(device)
    x = torch.randn(6 if rank == 0 else 0, CHANNELS, device=device, requires_grad=True)
    dy = torch.randn(x.shape, device=device)
    with no_host_syncs() as ops:
        m(x).backward(dy)
    return {"syncs": ops.syncs,
            "all_reduces": sum("allreduce" in n for n in ops.names)}


def _autocast_check(rank, device):
    """Under CPU autocast (bf16) BatchNorm keeps the input's dtype, as torch's."""
    m = SyncBatchNorm(CHANNELS)
    x = torch.randn(5 + rank, CHANNELS) * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
        y16 = m(x.bfloat16())
    plain = SyncBatchNorm(CHANNELS)(x)
    return {"dtypes": (y.dtype, y16.dtype), "same": bool(torch.equal(y, plain))}


def _gloo_rank(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        cpu = torch.device("cpu")
        result = {name: _run_case(name, rank, cpu) for name in CASES}
        result["ddp"] = _ddp_step(rank, cpu)
        result["sync_check"] = _sync_check(rank, cpu)
        result["autocast"] = _autocast_check(rank, cpu)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _spawn(fn, world, start_method="spawn"):
    """Runs fn(rank, world, init_file, out_dir) in `world` processes; what each saved."""
    with tempfile.TemporaryDirectory(prefix="flexplan-syncbn-") as tmp:
        mp.start_processes(fn, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world,
                           join=True, start_method=start_method)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


@pytest.fixture(scope="module")
def gloo_ranks():
    # fork: the CPU ranks need no fresh interpreter, and spawn's re-imports (torch, flexplan)
    # would take ~10 s of the 2-core budget
    return _spawn(_gloo_rank, 2, "fork" if "fork" in mp.get_all_start_methods() else "spawn")


# --- tests ------------------------------------------------------------------------------------

TOL = {F64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-4),
       torch.float16: dict(rtol=5e-3, atol=5e-3), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


@pytest.mark.parametrize("name", list(CASES))
def test_two_gloo_ranks_equal_batchnorm_over_the_whole_batch(gloo_ranks, name):
    cfg = _cfg(name)
    got = [r[name] for r in gloo_ranks]
    tol = TOL[cfg["dtype"]]
    if name == "all_empty":  # nothing to normalize: shapes kept, running stats untouched
        f64 = {"dtype": F64}
        for r in got:
            step = r["steps"][0]
            assert step["y"].shape == step["gx"].shape == (0, CHANNELS)
            assert step["gw"].shape == (CHANNELS,) and not step["gw"].any()
            assert torch.equal(r["buffers"]["running_mean"], torch.full((CHANNELS,), 0.5, **f64))
            assert torch.equal(r["buffers"]["running_var"], torch.full((CHANNELS,), 2.0, **f64))
            assert r["buffers"]["num_batches_tracked"] == 1
        return
    want = _reference(name)
    for s, ref in enumerate(want["steps"]):
        for rank, r in enumerate(got):
            step = r["steps"][s]
            assert step["y"].dtype == cfg["dtype"]
            torch.testing.assert_close(step["y"].double(), ref["y"][_rows(name, rank)], **tol)
            torch.testing.assert_close(step["gx"].double(), ref["gx"][_rows(name, rank)], **tol)
        for key in ("gw", "gb"):
            if ref[key] is None:
                assert all(r["steps"][s][key] is None for r in got)
                continue
            # each rank's own sum, as torch's SyncBatchNorm; DDP averages them over the ranks
            averaged = sum(r["steps"][s][key].double() for r in got) / len(got)
            torch.testing.assert_close(averaged, ref[key] / len(got), **tol)
    for r in got:
        assert r["buffers"].keys() == want["buffers"].keys()
        for key, buf in want["buffers"].items():
            torch.testing.assert_close(r["buffers"][key].to(buf.dtype), buf, **tol, msg=key)


def test_a_ddp_step_equals_one_process_on_the_whole_batch(gloo_ranks):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, CHANNELS), nn.BatchNorm1d(CHANNELS)).double()
    x, dy = _ddp_data()
    (model(x) * dy).sum().div(2).backward()  # DDP: the mean of the 2 ranks' losses
    for r in gloo_ranks:
        got = r["ddp"]
        for n, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][n], p.grad, rtol=1e-10, atol=1e-10, msg=n)
        for n, b in model.named_buffers():
            torch.testing.assert_close(got["buffers"][n], b, rtol=1e-10, atol=1e-10, msg=n)


def test_forward_and_backward_never_sync_with_the_host(gloo_ranks):
    for r in gloo_ranks:  # rank 1 has no rows
        assert r["sync_check"]["syncs"] == []
        assert r["sync_check"]["all_reduces"] == 2  # one in the forward, one in the backward


def test_autocast_keeps_the_input_dtype(gloo_ranks):
    for r in gloo_ranks:
        assert r["autocast"]["dtypes"] == (torch.float32, torch.bfloat16)
        assert r["autocast"]["same"]


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("world", ["none", "one"])
def test_one_process_equals_batchnorm(world, momentum, tmp_path, monkeypatch):
    """No process group, or a world of 1: torch's BatchNorm exactly, and no collective."""
    monkeypatch.setattr(dist, "all_reduce", _refuse("all_reduce"))
    if world == "one":
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                                world_size=1)
    try:
        gen = torch.Generator().manual_seed(3)
        ref = nn.BatchNorm1d(5, momentum=momentum).double()
        m = SyncBatchNorm(5, momentum=momentum).double()
        with torch.no_grad():
            ref.weight.uniform_(0.5, 2.0, generator=gen)
            ref.bias.uniform_(-1.0, 1.0, generator=gen)
        m.load_state_dict(ref.state_dict())
        for step in range(3):
            x = torch.randn(11, 5, generator=gen, dtype=F64) * 3 + 50
            dy = torch.randn(11, 5, generator=gen, dtype=F64)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yb = m(xa), ref(xb)
            ya.backward(dy)
            yb.backward(dy)
            torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-12, atol=1e-12)
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=n)
        for (n, b), c in zip(m.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-12, atol=1e-12, msg=n)
        m.eval()
        ref.eval()
        x = torch.randn(4, 5, generator=gen, dtype=F64)
        torch.testing.assert_close(m(x), ref(x), rtol=1e-12, atol=1e-12)
        assert m.num_batches_tracked.item() == ref.num_batches_tracked.item() == 3  # (eval: none)
    finally:
        if world == "one":
            dist.destroy_process_group()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors run the kernels only through the interpreter")
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("running_dtype", [torch.float32, torch.float16, F64])
def test_cuda_path_kernels_equal_the_torch_formulas(momentum, running_dtype):
    """The two Triton kernels of the CUDA path (through the interpreter) against the torch ops
    of the other devices: the packed sums, then mean / invstd / count and the running stats,
    for all-reduced sums with rows, with one row, and with none."""
    from flexplan.nn import sync_batchnorm as sbn

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(9, 5, generator=gen, dtype=F64) * 3 + 100
    var, mean = torch.var_mean(x, 0, correction=0)
    invstd = var.rsqrt()
    invstd[2] = 0.0  # batch_norm_stats' invstd where var is 0 (eps 0)
    got = sbn.pack_sums(mean.float(), invstd.float(), 9)
    var[2] = 0.0
    want = torch.cat([mean * 9, (var + mean * mean) * 9, torch.tensor([9.0], dtype=F64)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    single = torch.cat([x[0], x[0] * x[0], torch.ones(1, dtype=F64)])  # one row in all
    for packed in (want, single, torch.zeros(11, dtype=F64)):
        for sd in (torch.float32, F64):
            nbt, nbt_ref = torch.tensor(3), torch.tensor(3)
            run = [torch.linspace(-1, 1, 5, dtype=running_dtype),
                   torch.linspace(1, 2, 5, dtype=running_dtype)]
            ref = [t.clone() for t in run]
            stats, count = sbn.finalize_sums(packed, sd, EPS, momentum, nbt, *run)
            mean_w, _, invstd_w = sbn._torch_finalize(packed, sd, EPS, momentum, nbt_ref, *ref)
            assert nbt.item() == nbt_ref.item() == 4  # both count the batch
            assert stats.dtype == sd and count.dtype == torch.int32
            assert count.item() == packed[-1].item()
            torch.testing.assert_close(stats[0], mean_w, rtol=1e-12, atol=1e-12)
            # (E[x^2] - mean^2 at |x| ~ 100 rounds differently in the two: 1e-12 of 1e4)
            torch.testing.assert_close(stats[1], invstd_w, rtol=1e-6 if sd != F64 else 1e-8,
                                       atol=0)
            for a, b in zip(run, ref):
                assert torch.isfinite(a).all()
                torch.testing.assert_close(a, b, rtol=1e-12 if running_dtype == F64 else 1e-3,
                                           atol=1e-12 if running_dtype == F64 else 1e-3)
            if packed[-1] == 0:  # no rows anywhere: running statistics kept
                assert torch.equal(run[0], torch.linspace(-1, 1, 5, dtype=running_dtype))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_cuda_path_finalize_loops_over_wide_layers(momentum):
    """finalize_kernel is one program looping over blocks of channels: more channels than a
    block (and not a multiple of it) all get their statistics, and the batch is counted once."""
    from flexplan.nn import sync_batchnorm as sbn

    channels = 2 * sbn._BLOCK + 37
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(7, channels, generator=gen, dtype=F64) * 2 + 5
    packed = torch.cat([x.sum(0), (x * x).sum(0), torch.tensor([7.0], dtype=F64)])
    nbt, nbt_ref = torch.tensor(4), torch.tensor(4)
    run = [torch.zeros(channels), torch.ones(channels)]
    ref = [t.clone() for t in run]
    stats, count = sbn.finalize_sums(packed, torch.float32, EPS, momentum, nbt, *run)
    mean_w, _, invstd_w = sbn._torch_finalize(packed, torch.float32, EPS, momentum, nbt_ref,
                                              *ref)
    assert nbt.item() == nbt_ref.item() == 5 and count.item() == 7
    torch.testing.assert_close(stats[0], mean_w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats[1], invstd_w, rtol=1e-5, atol=0)
    for a, b in zip(run, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_convert_sync_batchnorm_keeps_parameters_buffers_and_settings():
    torch.manual_seed(0)
    frozen = nn.BatchNorm2d(3, eps=1e-3, momentum=None)
    frozen.weight.requires_grad_(False)
    frozen.eval()
    net = nn.Sequential(
        nn.Linear(4, 6),
        nn.BatchNorm1d(6, eps=1e-2, momentum=0.3),
        nn.Sequential(frozen, nn.BatchNorm3d(2, affine=False, track_running_stats=False)),
        nn.SyncBatchNorm(6),
        spconv.SparseSequential(spconv.SubMConv3d(4, 6, 3, indice_key="a"),
                                spconv.SparseBatchNorm(6), nn.ReLU()),
    )
    for m in net.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            m.running_mean.uniform_()
            m.running_var.uniform_(1, 2)
            m.num_batches_tracked.fill_(5)
    before = {n: m for n, m in net.named_modules()}
    params = dict(net.named_parameters())
    state = {k: v.clone() for k, v in net.state_dict().items()}
    out = convert_sync_batchnorm(net)
    assert out is net
    converted = dict(net.named_modules())
    assert converted.keys() == before.keys()
    for name, old in before.items():
        new = converted[name]
        if not isinstance(old, nn.modules.batchnorm._BatchNorm):
            assert new is old
            continue
        assert isinstance(new, SyncBatchNorm), name
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats",
                     "training"):
            assert getattr(new, attr) == getattr(old, attr), (name, attr)
        for attr in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert getattr(new, attr) is getattr(old, attr), (name, attr)
    assert type(net[4][1]) is FlexSparseSyncBatchNorm  # still maps SparseConvTensors
    assert not net[2][0].weight.requires_grad and net[2][0].training is False
    assert all(p is params[n] for n, p in net.named_parameters())
    assert dict(net.named_parameters()).keys() == params.keys()
    assert net.state_dict().keys() == state.keys()
    for k, v in net.state_dict().items():
        assert torch.equal(v, state[k]), k
    # a BatchNorm at the root is replaced and returned
    root = nn.BatchNorm1d(3)
    new_root = SyncBatchNorm.convert_sync_batchnorm(root, process_group=None)
    assert type(new_root) is SyncBatchNorm and new_root.weight is root.weight


def test_sparse_sync_batchnorm_maps_features():
    gen = torch.Generator().manual_seed(5)
    axes = [torch.randperm(20, generator=gen) for _ in range(3)]  # distinct sites
    coords = torch.stack([torch.zeros(20, dtype=torch.long), *axes], 1).to(torch.int32)
    x = spconv.SparseConvTensor(torch.randn(20, 3, generator=gen, dtype=F64), coords,
                                (20, 20, 20), 1)
    # spconv's name stays torch's module; flexplan's converter makes the feature-wise flexplan one
    assert issubclass(spconv.SparseSyncBatchNorm, nn.SyncBatchNorm)
    converted = convert_sync_batchnorm(nn.Sequential(spconv.SparseBatchNorm(3)))[0]
    assert type(converted) is FlexSparseSyncBatchNorm
    bn = FlexSparseSyncBatchNorm(3).double()
    assert isinstance(bn, SyncBatchNorm)
    y = bn(x)
    torch.testing.assert_close(y.features, nn.functional.batch_norm(
        x.features, None, None, bn.weight, bn.bias, training=True))
    assert bn(x.features).shape == (20, 3)  # plain tensors too


def test_ddp_train_job_converts_with_the_chosen_implementation():
    import ddp_train

    job = ddp_train.Job(small=True, device="cpu", dtype="fp32", sync_bn_impl="flexplan")
    net = ddp_train.make_model(job, torch.device("cpu"), distributed=True)
    norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and all(isinstance(m, SyncBatchNorm) for m in norms)
    job = ddp_train.Job(small=True, device="cpu", dtype="fp32")  # torch's: GPUs only
    net = ddp_train.make_model(job, torch.device("cpu"), distributed=True)
    assert not any(isinstance(m, (SyncBatchNorm, nn.SyncBatchNorm)) for m in net.modules())


# --- two GPUs: against torch's SyncBatchNorm, and CUDA's sync debug mode -------------------

GPU_CASES = ("uneven", "empty_rank", "one_row", "fp32_at_100", "fp16_at_100", "fp16_model",
             "nchw", "cumulative")
GPU_TOL = {F64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=1e-4, atol=1e-4),
           torch.float16: dict(rtol=5e-3, atol=5e-3)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("momentum", [0.1, None])
def test_cuda_module_without_group_counts_and_tracks_as_batchnorm(momentum):
    """One GPU, no process group: with momentum None the module takes the kernel path (its
    finalize counts the batch and weighs the running statistics by it), with a momentum plain
    F.batch_norm; over steps and a layer wider than a block (several warps read the count the
    kernel increments), both as torch's BatchNorm1d, and eval mode counts nothing."""
    from flexplan.nn import sync_batchnorm as sbn

    channels, device = 2 * sbn._BLOCK + 37, torch.device("cuda")
    ours = SyncBatchNorm(channels, momentum=momentum).to(device)
    ref = nn.BatchNorm1d(channels, momentum=momentum).to(device)
    gen = torch.Generator(device=device).manual_seed(3)
    for step in range(3):
        x = torch.randn(50 + step, channels, device=device, generator=gen) * 2 + step
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours, name), getattr(ref, name), rtol=1e-5,
                                   atol=1e-6, msg=name)
    ours.eval()
    ours(x)
    assert ours.num_batches_tracked.item() == 3


def _nccl_rank(rank, world, init_file, out_dir):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, device_id=device)
    try:
        from flexplan.nn import sync_batchnorm

        default = sync_batchnorm.use_kernels
        result = {}
        for name in GPU_CASES:
            result[name] = {"torch": _run_case(name, rank, device, nn.SyncBatchNorm)}
            for kernels in (True, False):  # the Triton kernels, or torch ops
                sync_batchnorm.use_kernels = kernels
                result[name][f"flexplan kernels={kernels}"] = _run_case(name, rank, device)
            sync_batchnorm.use_kernels = default
        result["ddp"] = _ddp_step(rank, device)
        x = torch.randn(1000 * (rank + 1), CHANNELS, device=device, requires_grad=True)
        errors = []
        for kernels in (True, False):
            sync_batchnorm.use_kernels = kernels
            m = SyncBatchNorm(CHANNELS).to(device)
            m(x).sum().backward()  # warm-up (first collectives, compiles, cached constants)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                y = m(x)
                y.backward(torch.ones_like(y))
            except RuntimeError as exc:
                errors.append(f"kernels={kernels}: {str(exc)[:300]}")
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        sync_batchnorm.use_kernels = default
        result["sync_errors"] = errors
        # torch's SyncBatchNorm, as a check that the mode sees its sync
        t = nn.SyncBatchNorm(CHANNELS).to(device)
        t(x).sum().backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            t(x)
            result["torch_syncs"] = False
        except RuntimeError:
            result["torch_syncs"] = True
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.gpu
@two_gpus
def test_two_nccl_ranks_equal_torch_sync_batchnorm_without_syncs():
    results = _spawn(_nccl_rank, 2)
    for rank, r in enumerate(results):
        for name, path in ((n, p) for n in GPU_CASES for p in r[n] if p != "torch"):
            got, want = r[name][path], r[name]["torch"]
            tol = GPU_TOL[_cfg(name)["dtype"]]
            for s, (a, b) in enumerate(zip(got["steps"], want["steps"])):
                for key in ("y", "gx", "gw", "gb"):
                    if b[key] is None:
                        assert a[key] is None
                        continue
                    assert a[key].dtype == b[key].dtype, (name, path, key)
                    torch.testing.assert_close(a[key].double(), b[key].double(), **tol,
                                               msg=f"{name} {path} rank {rank} step {s} {key}")
            for key, buf in want["buffers"].items():
                torch.testing.assert_close(got["buffers"][key].double(), buf.double(), **tol,
                                           msg=f"{name} {path} rank {rank} {key}")
        assert r["sync_errors"] == []
        assert r["torch_syncs"]  # the check does see torch's SyncBatchNorm's sync
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, CHANNELS), nn.BatchNorm1d(CHANNELS)).double()
    x, dy = _ddp_data()
    (model(x) * dy).sum().div(2).backward()
    for r in results:
        for n, p in model.named_parameters():
            torch.testing.assert_close(r["ddp"]["grads"][n], p.grad, rtol=1e-9, atol=1e-9)


def test_all_reduce_sum_goes_through_the_groups_own_allreduce(monkeypatch):
    """The layer's collectives call the process group's allreduce (a synchronous SUM, then the
    wait), not dist.all_reduce's Python wrapper; under torch.compile or with the switch off,
    dist.all_reduce."""
    from flexplan.nn import sync_batchnorm

    calls = []

    class Work:
        def wait(self):
            calls.append("wait")

    class Group:
        def allreduce(self, tensors, opts):
            calls.append((tensors, opts.reduceOp))
            return Work()

    t = torch.ones(3)
    sync_batchnorm.all_reduce_sum(t, Group())
    assert calls[0][0][0] is t and calls[0][1] == dist.ReduceOp.SUM and calls[1] == "wait"
    assert getattr(sync_batchnorm._sum_options(), "asyncOp", False) is False
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op, group: calls.append((tensor, op)))
    # under torch.compile Dynamo traces dist.all_reduce (a process group object breaks it)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    sync_batchnorm.all_reduce_sum(t, Group())
    assert calls[2] == (t, dist.ReduceOp.SUM) and len(calls) == 3
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(sync_batchnorm, "direct_all_reduce", False)
    sync_batchnorm.all_reduce_sum(t, Group())
    assert calls[3] == (t, dist.ReduceOp.SUM) and len(calls) == 4
    # inside a coalescing manager the collective would only be queued: a clear error
    group = Group()
    monkeypatch.setitem(dist.distributed_c10d._world.pg_coalesce_state, group, [])
    with pytest.raises(RuntimeError, match="coalescing manager"):
        sync_batchnorm.all_reduce_sum(t, group)
