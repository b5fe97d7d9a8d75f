"""Realistic inputs to tune on: sphere shells (surface-like occupancy), one case per op part.

A Case is a problem plus a function that runs that part of the convolution through the ops'
own launch code (so the measured time includes split-K reduction and workspace allocation);
the config it runs is whatever select_config returns, which the tuner forces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..geometry import ConvGeometry
from ..kernel_configs import Problem, config_dtype, runtime_is_hip
# The ops' per-part launchers: the code a real call runs, config chosen by select_config.
from ..ops.conv import _dtype_name, dgrad_map, gather_gemm, resolve_algo, wgrad
from ..planner import build_plan
from ..workloads import sphere_shell

# Voxels of sphere_shell(R) ~ SHELL_DENSITY * R^2 (a band of width 2 around radius 0.45 R).
SHELL_DENSITY = 8 * math.pi * 0.45 ** 2


def torch_dtype(name: str) -> tuple[torch.dtype, bool]:
    """(tensor dtype, allow_tf32) of a Problem dtype name."""
    if name == "tf32":
        return torch.float32, True
    return getattr(torch, name), False


@dataclass
class Workload:
    """Fresh random data over one shell plan."""

    plan: object
    feats: torch.Tensor
    grad_out: torch.Tensor
    weight: torch.Tensor  # [Co, V, Ci]
    dtype: str


def shell_workload(resolution: int, ci: int, co: int, dtype: str, device, kernel_size: int = 3,
                   seed: int = 0) -> Workload:
    coords = sphere_shell(resolution, 1, device=device)
    plan = build_plan(coords, (resolution,) * 3, 1, ConvGeometry.submanifold_conv(kernel_size))
    tdtype, _ = torch_dtype(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(tdtype)

    v = kernel_size ** 3
    return Workload(plan, randn(plan.num_in, ci), randn(plan.num_out, co),
                    randn(co, v, ci, scale=(v * ci) ** -0.5), dtype)


def part_case(work: Workload, part: str, algo: str = "auto") -> "Case":
    """The case of one part (fwd / dgrad / wgrad) of the convolution over `work`."""
    plan, w = work.plan, work.weight
    co, v, ci = w.shape
    _, allow_tf32 = torch_dtype(work.dtype)
    if part == "fwd":
        n = plan.num_out
    elif part == "dgrad":
        n = plan.num_in
    elif part == "wgrad":
        n = plan.num_pairs
    else:
        raise ValueError(f"unknown part {part!r}")
    # The problem as dispatch asks for it (ops.conv.shape_config): the call's dtype name (tf32
    # where the GPU has TF32 dots, else float32), in its config dtype (float32 on NVIDIA is
    # tuned in tf32's buckets, whose one config serves both); the run stays the call's kernels.
    run_dtype = _dtype_name(work.feats.dtype, allow_tf32, work.feats.device)
    algo = resolve_algo(algo, part, n, ci, co, v, run_dtype)
    problem = Problem(n, ci, co, v, config_dtype(run_dtype, runtime_is_hip()), algo, part)
    if part == "fwd":
        def run():
            return gather_gemm(work.feats, w, None, plan.fwd, False, "fwd", algo, allow_tf32)
    elif part == "dgrad":
        gmap, reverse = dgrad_map(plan)

        def run():
            return gather_gemm(work.grad_out, w, None, gmap, reverse, "dgrad", algo, allow_tf32)
    else:
        def run():
            return wgrad(work.grad_out, work.feats, plan, w.shape, algo, allow_tf32)
    return Case(problem, run, run_dtype)


@dataclass
class Case:
    problem: Problem  # as dispatch asks for it: in the config dtype
    run: Callable[[], torch.Tensor]
    # the dtype the run computes in (ops.conv._dtype_name: "float32" runs 3xTF32 on NVIDIA
    # though its problem says "tf32"); None: the problem's
    run_dtype: str | None = None


def case_for(problem: Problem, device) -> "Case | None":
    """A shell case whose problem falls in `problem`'s bucket region (run-time tuning), or None
    when no submanifold shell has its kernel volume (v must be an odd cube)."""
    k = round(problem.v ** (1 / 3))
    if k ** 3 != problem.v or k % 2 == 0:
        return None
    rows = problem.n
    if problem.part == "wgrad":  # n counts pairs: ~ rows times the neighbours per voxel
        rows = max(problem.n // max(_pairs_per_voxel(k, device), 1.0), 1)
    resolution = max(8, round(math.sqrt(rows / SHELL_DENSITY)))
    work = shell_workload(resolution, problem.ci, problem.co, problem.dtype, device, k)
    return part_case(work, problem.part, problem.algo)


def _pairs_per_voxel(kernel_size: int, device) -> float:
    probe = shell_workload(32, 1, 1, "float32", device, kernel_size)
    return probe.plan.num_pairs / max(probe.plan.num_in, 1)
