"""Data-parallel training (issue #26): DistributedDataParallel ranks sharing one plan-cache
directory give the gradients of a single process, and every op runs on its tensors' own GPU
whatever device is current. The DDP runs go through scripts/ddp_train.py (also the benchmark's
driver): gloo on the CPU (kernels through the interpreter), NCCL on two GPUs."""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

import ddp_train  # noqa: E402

from flexplan import ConvGeometry, build_plan, tensor_plan  # noqa: E402
from flexplan.ops import sparse_conv  # noqa: E402
from flexplan.workloads import random_coords  # noqa: E402

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _assert_grads_close(got: dict, want: dict, rtol: float, atol: float):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors run the kernels only through the interpreter")
def test_gloo_ranks_sharing_a_cache_average_single_process_gradients(tmp_path):
    """2 CPU ranks (plain BatchNorm: per-rank statistics), fresh coordinates per rank, one cache
    directory: DDP's gradient is the mean of the two single-process gradients. One scan per
    rank. The ranks run without the interpreter (their CPU tensors take the ops' torch path,
    ops/torch_fallback.py; the plans are the same on the CPU either way), the references here
    through the interpreted kernels: two runs of the kernels instead of four, and the two
    paths checked against each other on the way. The U-Net (strided, submanifold and inverse
    convs, BatchNorm): what DDP averages is the same for any network (both networks' forward
    and backward are tested in test_bench_e2e.py)."""
    job = ddp_train.Job(network="unet", small=True, device="cpu", dtype="fp32",
                        scans_per_rank=1, record_grads=True, cache_dir=str(tmp_path / "cache"),
                        env={"TRITON_INTERPRET": None})  # (the spawned ranks' alone)
    # The references are computed here while the ranks (spawned processes) run.
    with ThreadPoolExecutor(1) as pool:
        ranks = pool.submit(ddp_train.run, 2, job)
        per_rank = [ddp_train.single_process_grads(job, r, torch.device("cpu")) for r in range(2)]
        results = ranks.result()
    want = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in per_rank[0]}
    assert any(g.abs().max() > 0 for g in want.values())
    for result in results:  # every rank holds the same averaged gradient
        _assert_grads_close(result["grads"], want, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@two_gpus
def test_nccl_step_equals_the_single_process_step(tmp_path):
    """2 GPU ranks with SyncBatchNorm equal one process on the combined batch (fp32)."""
    job = ddp_train.Job(network="encoder", small=True, dtype="fp32", record_grads=True,
                        cache_dir=str(tmp_path / "cache"))
    results = ddp_train.run(2, job)
    want = ddp_train.combined_grads(job, 2, torch.device("cuda", 0))
    for result in results:
        _assert_grads_close(result["grads"], want, rtol=1e-3, atol=1e-5)


def _conv_on(device: torch.device, current: int):
    """A strided and a submanifold conv (plan, forward, backward) on `device` while `current`
    is the current CUDA device; results on the CPU."""
    gen = torch.Generator().manual_seed(0)
    coords = random_coords(3000, (40, 40, 40), 2, generator=gen)
    feats = torch.randn(coords.shape[0], 16, generator=gen)
    weight = torch.randn(32, 3, 3, 3, 16, generator=gen) * 0.1
    outs = []
    with torch.cuda.device(current):
        for geometry in (ConvGeometry.make(3, stride=2, padding=1, submanifold=False),
                         ConvGeometry.submanifold_conv(3)):
            plan = build_plan(coords.to(device), (40, 40, 40), 2, geometry)
            x = feats.to(device).requires_grad_()
            w = weight.to(device).requires_grad_()
            y = sparse_conv(x, plan, w)
            y.square().sum().backward()
            outs += [plan.out_coords.cpu(), y.detach().cpu(), x.grad.cpu(), w.grad.cpu()]
    return outs


@pytest.mark.gpu
@two_gpus
def test_an_op_runs_on_its_tensors_gpu_whatever_device_is_current():
    want = _conv_on(torch.device("cuda", 0), current=0)
    got = _conv_on(torch.device("cuda", 1), current=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@two_gpus
def test_a_plan_of_one_gpu_is_never_used_on_the_other():
    import flexplan.nn.spconv as spconv

    coords = random_coords(2000, (30, 30, 30), 1, generator=torch.Generator().manual_seed(1))
    conv = spconv.SubMConv3d(4, 8, 3, indice_key="k")
    for index in (0, 1):
        device = torch.device("cuda", index)
        x = spconv.SparseConvTensor(torch.randn(coords.shape[0], 4, device=device),
                                    coords.to(device), (30, 30, 30), 1)
        y = conv.to(device)(x)
        assert y.features.device == device
        assert tensor_plan(x, ConvGeometry.submanifold_conv(3), training=False).device == device


@pytest.mark.gpu
@two_gpus
def test_inputs_on_two_gpus_get_a_clear_error():
    coords = random_coords(500, (20, 20, 20), 1, generator=torch.Generator().manual_seed(2))
    plan = build_plan(coords.cuda(0), (20, 20, 20), 1, ConvGeometry.submanifold_conv(3))
    with pytest.raises(ValueError, match="cuda:1"):
        sparse_conv(torch.randn(coords.shape[0], 4, device="cuda:1"), plan,
                    torch.randn(4, 3, 3, 3, 4, device="cuda:1"))


@pytest.mark.gpu
@two_gpus
def test_plans_load_and_invert_on_their_gpu_whatever_device_is_current(tmp_path):
    """A plan stored from cuda:1 and loaded back (its file check launches) while cuda:0 is
    current, and an inverse conv of an inference plan (its bwd map is scheduled then), equal
    the same on cuda:0."""
    import flexplan.nn.spconv as spconv
    from flexplan.cache import PlanCache
    from flexplan.cache.policy import Policy

    coords = random_coords(3000, (40, 40, 40), 2, generator=torch.Generator().manual_seed(4))
    geometry = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    outs = {}
    for index in (0, 1):
        device = torch.device("cuda", index)
        cache = PlanCache(tmp_path / f"cache{index}", Policy(mode="always"))
        with torch.cuda.device(0):
            built = cache.get_or_build(coords.to(device), (40, 40, 40), 2, geometry)
            cache.memory.clear()
            loaded = cache.get_or_build(coords.to(device), (40, 40, 40), 2, geometry)
            assert cache.stats()["disk_hits"] == 1 and loaded.device == device
            assert all(torch.equal(a, b) for a, b in zip(built.tensors().values(),
                                                         loaded.tensors().values()))
            torch.manual_seed(0)
            net = spconv.SparseSequential(
                spconv.SparseConv3d(4, 8, 3, 2, 1, indice_key="down"),
                spconv.SparseInverseConv3d(8, 4, 3, indice_key="down")).to(device).eval()
            feats = torch.randn(coords.shape[0], 4, generator=torch.Generator().manual_seed(5))
            with torch.no_grad():
                y = net(spconv.SparseConvTensor(feats.to(device), coords.to(device),
                                                (40, 40, 40), 2))
            outs[index] = y.features.cpu()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
