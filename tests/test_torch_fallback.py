"""CPU tensors where Triton's kernels are compiled ones (no TRITON_INTERPRET, e.g. a GPU
machine): every op runs in torch alone (flexplan/ops/torch_fallback.py) instead of failing in a
launch. A child process without the interpreter runs a small network (submanifold, strided,
inverse convs, max and avg pools) forward and backward in float64; its outputs and gradients
must equal this process's, where the same network runs the kernels through the interpreter."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

import flexplan.nn.spconv as spconv
from flexplan.workloads import random_coords

SHAPE = (9, 8, 7)


def run_network():
    """(output features, input gradient, weight gradients) of a seeded network, float64."""
    torch.manual_seed(0)
    net = spconv.SparseSequential(
        spconv.SubMConv3d(3, 5, 3, indice_key="s"),
        spconv.SparseConv3d(5, 6, 3, 2, 1, indice_key="d"),
        spconv.SubMConv3d(6, 6, 3, indice_key="s2"),
        spconv.SparseInverseConv3d(6, 4, 3, indice_key="d"),
        spconv.SparseMaxPool3d(3, 2, 1),
        spconv.SparseAvgPool3d(2, 1, 0),
    ).double()
    coords = random_coords(50, SHAPE, 2, generator=torch.Generator().manual_seed(1))
    feats = torch.randn(coords.shape[0], 3, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(2)).requires_grad_()
    out = net(spconv.SparseConvTensor(feats, coords, SHAPE, 2))
    grad = torch.randn(out.features.shape, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(3))
    out.features.backward(grad)
    return [out.features.detach(), out.indices, feats.grad] + [p.grad for p in net.parameters()]


CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_torch_fallback import run_network
from flexplan.plan import kernels_run_on
assert not kernels_run_on(torch.zeros(1)), "the child must run compiled (non-interpreted) kernels"
torch.save(run_network(), {path!r})
"""


def test_cpu_tensors_without_interpreter_match_the_kernels(tmp_path):
    path = str(tmp_path / "fallback.pt")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tensors even on a GPU machine
    child = CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)), path=path)
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(path)
    ours = run_network()
    assert len(theirs) == len(ours)
    for a, b in zip(theirs, ours):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_max_pool_fallback_matches_the_kernel_at_the_edges():
    """Windows with +inf, only -inf, a max of exactly 0 (spconv's floor: no gradient there) and
    NaN: the torch fallback gives the kernel's values and gradients (interpreted here)."""
    from flexplan.geometry import ConvGeometry
    from flexplan.ops import torch_fallback
    from flexplan.ops.pool import sparse_pool
    from flexplan.planner import build_plan

    coords = torch.tensor([[0, 0, 0, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 3, 0, 0],
                           [0, 4, 0, 0], [0, 6, 0, 0], [0, 7, 0, 0]], dtype=torch.int32)
    plan = build_plan(coords, (8, 2, 2), 1, ConvGeometry.make(2, 1, 2, 0, submanifold=False))
    inf, nan = float("inf"), float("nan")
    feats = torch.tensor([[1.0, inf], [2.0, -3.0], [-inf, 0.0], [-inf, -1.0], [-inf, nan],
                          [0.0, -2.0], [-1.0, 5.0]], dtype=torch.float64)
    for zero_floor in (False, True):
        a, b = feats.clone().requires_grad_(), feats.clone().requires_grad_()
        want = sparse_pool(a, plan, "max", zero_floor)
        got = torch_fallback.pool(b, plan.fwd.neighbor_map, "max", zero_floor)
        torch.testing.assert_close(got, want, equal_nan=True)
        grad = torch.arange(want.numel(), dtype=torch.float64).reshape(want.shape) + 1
        want.backward(grad)
        got.backward(grad)
        torch.testing.assert_close(b.grad, a.grad, equal_nan=True)
