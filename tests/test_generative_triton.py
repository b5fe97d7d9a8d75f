"""The Triton generative planner (strided / transposed plans, one host sync) against the torch
oracle (flexplan.planner.generative): equal plans, tensor for tensor, under the interpreter on the
CPU and on the GPU."""
from __future__ import annotations

import pytest
import torch

from flexplan import ConvGeometry, build_plan
from flexplan.planner.generative_triton import candidate_slots
from flexplan.workloads import random_coords

# (kernel, stride, padding, dilation, transposed, in shape): the encoder's strided convs, the
# (3, 1, 1) / (2, 1, 1) head, a U-Net's transposed conv, dilation, and odd strides.
CASES = [
    (3, 2, 1, 1, False, (9, 8, 7)),
    (3, 2, (0, 1, 1), 1, False, (9, 8, 7)),
    ((3, 1, 1), (2, 1, 1), 0, 1, False, (9, 8, 7)),
    (2, 2, 0, 1, False, (8, 7, 6)),
    (3, 3, 2, 1, False, (10, 7, 8)),
    (3, 2, 0, 2, False, (9, 8, 7)),
    ((3, 2, 1), (2, 1, 3), (1, 0, 0), (1, 2, 1), False, (7, 6, 8)),
    (3, 2, 1, 1, True, (5, 4, 6)),
    (2, 2, 0, 1, True, (5, 4, 4)),
    (3, 1, 1, 1, False, (6, 5, 6)),
]
IDS = [f"k{c[0]}-s{c[1]}-p{c[2]}-d{c[3]}{'-T' if c[4] else ''}" for c in CASES]


def geometry(case):
    k, s, p, d, transposed, _ = case
    return ConvGeometry.make(k, dilation=d, stride=s, padding=p, submanifold=False,
                             transposed=transposed)


def assert_same_plans(a, b):
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name].cpu(), tb[name].cpu()), name
    assert (a.num_in, a.num_out, a.out_spatial_shape) == (b.num_in, b.num_out, b.out_spatial_shape)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_plan_equals_torch_oracle(case, device):
    shape, geom = case[5], geometry(case)
    gen = torch.Generator().manual_seed(len(str(case)))
    for density in (0.05, 0.3):
        coords = random_coords(int(2 * shape[0] * shape[1] * shape[2] * density), shape, 2,
                               generator=gen)
        oracle = build_plan(coords, shape, 2, geom, backend="torch")
        plan = build_plan(coords.to(device), shape, 2, geom, backend="triton")
        assert_same_plans(oracle, plan)


def test_kernels_read_valid_kernel_without_a_sync(device):
    """The fwd schedule's valid_kernel lengths stay on the device: the region the kernels read
    starts with the exact run (read later, on demand) and is at least as long."""
    geom = geometry(CASES[0])
    coords = random_coords(150, (9, 8, 7), 2, generator=torch.Generator().manual_seed(3))
    plan = build_plan(coords.to(device), (9, 8, 7), 2, geom, backend="triton")
    for block in plan.fwd.block_sizes:
        region = plan.fwd.kernel_offsets(block)
        exact = plan.fwd.valid_kernel[block]
        assert region.numel() >= exact.numel() > 0
        assert torch.equal(region[:exact.numel()], exact)
        assert int(plan.fwd.valid_kernel_seg[block][-1]) == exact.numel()


def test_no_output_and_no_input(device):
    """Inputs whose every tap misses the grid give an empty plan; no inputs too."""
    geom = ConvGeometry.make(3, stride=2, padding=0, submanifold=False)
    coords = torch.tensor([[0, 6, 6, 6]], dtype=torch.int32)  # (7 - 3) // 2 + 1 = 3: 6 -> none
    for c in (coords, coords[:0]):
        oracle = build_plan(c, (7, 7, 7), 1, geom, backend="torch")
        plan = build_plan(c.to(device), (7, 7, 7), 1, geom, backend="triton")
        assert plan.num_out == oracle.num_out
        assert_same_plans(oracle, plan)


@pytest.mark.parametrize("kernel, stride, dilation, transposed, slots", [
    (3, 2, 1, False, 8), ((3, 1, 1), (2, 1, 1), 1, False, 2), (2, 2, 1, False, 1),
    (3, 2, 2, False, 27), (3, 3, 1, False, 1), (3, 2, 1, True, 27)])
def test_candidate_slots(kernel, stride, dilation, transposed, slots):
    """Slots per input row: the taps that can share one input (a tight bound)."""
    geom = ConvGeometry.make(kernel, dilation=dilation, stride=stride, submanifold=False,
                             transposed=transposed)
    assert candidate_slots(geom) == slots
