"""Sparse max / average pooling over a ConvPlan, and global pooling per batch entry.

The window of a pool is a convolution's: a strided (or submanifold) plan of the pool's kernel,
stride, padding and dilation gives the output coordinates (spconv's rules) and, per output row,
the input rows of its window (plan.fwd); the backward reads the plan's bwd map (a submanifold
plan: its fwd map; an inference plan: its fwd map transposed, backward_map), so any plan
serves both directions. Kernels: kernels_src/sparse_pool.py.

    max: the largest value of the window's inputs, per channel; its gradient goes to the first
         input (in tap order) holding it. zero_floor=True: max(0, that), which is what spconv's
         SparseMaxPool computes (its kernels start the max at 0), i.e. relu(max)
    avg: the mean over the inputs present (spconv's SparseAvgPool: the real point count)
"""
from __future__ import annotations

import torch

from .. import plan_tokens, plan_views
from ..compile_boundary import opaque
from ..device_guard import on_device_of
from ..kernels_src.sparse_pool import sparse_pool_bwd_kernel, sparse_pool_fwd_kernel
from ..launch_spec import FEATURE, FLOAT32, INT32, SIZE
from ..launcher import launch
from ..plan import ConvPlan, kernels_run_on
from . import torch_fallback
from .graph_ops import GRAPH_OP_TAGS, op_context

POOL_MODES = ("max", "avg")
# One launch shape for both directions: rows x channels tiles, the taps looped in the kernel.
POOL_LAUNCH = dict(BLOCK_M=64, BLOCK_C=32, num_warps=4)
POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------- launch descriptions
# Each launch written once (flexplan/launch_spec.py): the op launches through these, the AOT
# build (flexplan/aot/variants.py) records them with example arguments.

def _grid(rows: int, channels: int) -> tuple[int, int]:
    return -(-rows // POOL_LAUNCH["BLOCK_M"]), -(-channels // POOL_LAUNCH["BLOCK_C"])


def launch_pool_forward(run, feats: FEATURE, nmap: INT32, out: FEATURE, arg: INT32,
                        count: FLOAT32, rows: SIZE, channels: int, mode: str, volume: int,
                        write_arg: bool, dtype: torch.dtype, zero_floor: bool) -> None:
    """out [rows, channels] over the windows of nmap [rows, volume]; write_arg: also what the
    backward reads (arg: max, count: avg). dtype: feats'."""
    run(sparse_pool_fwd_kernel, _grid(rows, channels), feats, nmap, out, arg, count, rows,
        channels, V=volume, IS_MAX=mode == "max", ZERO_FLOOR=zero_floor and mode == "max",
        WRITE_ARG=write_arg, FP64=dtype == torch.float64, **POOL_LAUNCH)


def launch_pool_backward(run, grad_out: FEATURE, bmap: INT32, arg: INT32, count: FLOAT32,
                         grad_in: FEATURE, rows: SIZE, channels: int, mode: str, volume: int,
                         dtype: torch.dtype) -> None:
    """grad_in [rows, channels] through bmap [rows, volume]. dtype: grad_out's."""
    run(sparse_pool_bwd_kernel, _grid(rows, channels), grad_out, bmap, arg, count, grad_in, rows,
        channels, V=volume, IS_MAX=mode == "max", FP64=dtype == torch.float64, **POOL_LAUNCH)


def pool_forward(feats: torch.Tensor, plan: ConvPlan, mode: str, zero_floor: bool,
                 write_arg: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [N_out, C], arg, count): write_arg: also what the backward reads, the winner of
    each output and channel (max: arg) or each output's count (avg: count); else those are
    one-element placeholders. feats contiguous."""
    n_out, channels = plan.num_out, feats.shape[1]
    out = feats.new_empty((n_out, channels))
    arg = torch.empty((n_out, channels) if write_arg and mode == "max" else (1,),
                      dtype=torch.int32, device=feats.device)
    count = torch.empty((n_out,) if write_arg and mode == "avg" else (1,),
                        dtype=torch.float32, device=feats.device)
    if n_out and channels:
        # (the kernels index the maps as [rows, V] rows: contiguous)
        launch_pool_forward(launch, feats, plan.fwd.neighbor_map.contiguous(), out, arg, count,
                            n_out, channels, mode, plan.geometry.volume, write_arg, feats.dtype,
                            zero_floor)
    return out, arg, count


def pool_backward(grad_out: torch.Tensor, arg: torch.Tensor, count: torch.Tensor,
                  plan: ConvPlan, mode: str, num_in: int) -> torch.Tensor:
    """grad_in [num_in, C] of grad_out [N_out, C] (contiguous), through the backward map."""
    channels = grad_out.shape[1]
    bmap = backward_map(plan)
    grad_in = grad_out.new_empty((num_in, channels))
    if num_in and channels:
        launch_pool_backward(launch, grad_out, bmap, arg, count, grad_in, num_in, channels,
                             mode, plan.geometry.volume, grad_out.dtype)
    return grad_in


class SparsePoolFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, feats: torch.Tensor, plan: ConvPlan, mode: str, zero_floor: bool):
        # (what the backward needs is written only when a gradient will be asked for)
        out, arg, count = pool_forward(feats, plan, mode, zero_floor, ctx.needs_input_grad[0])
        ctx.plan, ctx.mode, ctx.num_in = plan, mode, feats.shape[0]
        ctx.save_for_backward(arg, count)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # a kernel: no graph for second derivatives
    def backward(ctx, grad_out):
        arg, count = ctx.saved_tensors
        return (pool_backward(grad_out.contiguous(), arg, count, ctx.plan, ctx.mode, ctx.num_in),
                None, None, None)


def backward_map(plan: ConvPlan) -> torch.Tensor:
    """[N_in, V]: per input row, the output rows whose windows hold it. A submanifold plan's fwd
    map serves as is (its window is symmetric, and the pool's backward sums over the whole set);
    a strided training plan has it (its bwd map); an inference plan's is derived from its fwd
    map on first use (plan_views.transposed_map: one launch, kept with the plan), so a pool
    that trains needs only an inference plan, cheaper to build than a training plan on new
    coordinates (no pairs, no bwd map; scripts/results/bench_pool.md)."""
    if plan.geometry.submanifold:
        return plan.fwd.neighbor_map.contiguous()
    if plan.bwd is not None:
        return plan.bwd.neighbor_map.contiguous()
    return plan_views.transposed_map(plan.fwd, plan.num_in)


def _check(feats, plan, mode):
    if not isinstance(plan, ConvPlan):
        raise TypeError(f"plan must be a ConvPlan, got {type(plan).__name__}")
    if mode not in POOL_MODES:
        raise ValueError(f"unknown pooling mode {mode!r}; choose one of {POOL_MODES}")
    if not isinstance(feats, torch.Tensor) or feats.dim() != 2:
        raise ValueError(f"feats must be a [N, C] tensor, got "
                         f"{tuple(feats.shape) if isinstance(feats, torch.Tensor) else type(feats)}")
    if feats.dtype not in POOL_DTYPES:
        raise TypeError(f"feats must be float16, bfloat16, float32 or float64, got {feats.dtype}")
    if feats.shape[0] != plan.num_in:
        raise ValueError(f"feats has {feats.shape[0]} rows but the plan expects "
                         f"{plan.num_in} input voxels")
    if feats.device != plan.device:
        raise ValueError(f"feats is on {feats.device} but the plan is on {plan.device}; "
                         "move the plan with plan.to(device)")
    if plan.geometry.transposed:
        raise ValueError("pooling takes a strided or submanifold plan, not a transposed one")


def sparse_pool(feats: torch.Tensor, plan: ConvPlan, mode: str = "max",
                zero_floor: bool = False) -> torch.Tensor:
    """Pool feats [N_in, C] over the windows of `plan` (a plan of the pool's kernel, stride,
    padding and dilation); returns [N_out, C] in feats' dtype. mode: "max" or "avg".
    zero_floor (max): outputs max(0, window max), spconv's SparseMaxPool."""
    if torch.compiler.is_compiling():  # the graph's op (below), not a graph break
        return _graph_sparse_pool(feats, plan, mode, zero_floor)
    return _eager_sparse_pool(feats, plan, mode, zero_floor)


@opaque
def _eager_sparse_pool(feats, plan, mode, zero_floor):
    _check(feats, plan, mode)
    if not kernels_run_on(feats):  # CPU tensors and compiled kernels: torch alone
        return torch_fallback.pool(feats, plan.fwd.neighbor_map, mode, bool(zero_floor))
    with on_device_of(feats):
        return SparsePoolFunction.apply(feats.contiguous(), plan, mode, bool(zero_floor))


def sparse_max_pool(feats: torch.Tensor, plan: ConvPlan) -> torch.Tensor:
    return sparse_pool(feats, plan, "max")


def sparse_avg_pool(feats: torch.Tensor, plan: ConvPlan) -> torch.Tensor:
    return sparse_pool(feats, plan, "avg")


def global_pool(feats: torch.Tensor, batch_index: torch.Tensor, batch_size: int,
                mode: str = "max") -> torch.Tensor:
    """[batch_size, C]: the max or mean of each batch entry's rows (batch_index [N], the
    coordinates' batch column). An entry with no rows gives zeros (and no gradient). Plain
    torch ops (scatter_reduce), no host sync; differentiable."""
    if mode not in POOL_MODES:
        raise ValueError(f"unknown pooling mode {mode!r}; choose one of {POOL_MODES}")
    if feats.dim() != 2 or batch_index.shape != feats.shape[:1]:
        raise ValueError(f"feats [N, C] and batch_index [N] expected, got {tuple(feats.shape)} "
                         f"and {tuple(batch_index.shape)}")
    index = batch_index.long()[:, None].expand_as(feats)
    out = feats.new_zeros((batch_size, feats.shape[1]))
    # include_self=False: an entry's result is its rows' alone; empty entries keep the zeros.
    return out.scatter_reduce(0, index, feats, "amax" if mode == "max" else "mean",
                              include_self=False)


# ---------------------------------------------------------------- torch.compile
# As flexplan::sparse_conv (ops/conv.py): under torch.compile the pool is the custom op
# flexplan::sparse_pool (backward: _backward), the plan passed as its token.

def _graph_sparse_pool(feats, plan, mode, zero_floor):
    token = plan_tokens.token(plan)
    if not kernels_run_on(feats):  # torch alone: traced as it is
        _check(feats, plan, mode)
        return torch_fallback.pool(feats, token, mode, bool(zero_floor))
    write_arg = torch.is_grad_enabled() and feats.requires_grad
    return torch.ops.flexplan.sparse_pool(feats, token, mode, bool(zero_floor), write_arg)[0]


@torch.library.custom_op("flexplan::sparse_pool", mutates_args=(), tags=GRAPH_OP_TAGS)
def _pool_op(feats: torch.Tensor, plan_token: torch.Tensor, mode: str, zero_floor: bool,
             write_arg: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, arg, count, the plan's keeper for the backward: plan_tokens.keeper)."""
    plan = plan_tokens.plan_of(plan_token)
    _check(feats, plan, mode)
    with op_context(feats):
        out, arg, count = pool_forward(feats.contiguous(), plan, mode, zero_floor, write_arg)
    return out, arg, count, plan_tokens.keeper(plan, feats.device)


@_pool_op.register_fake
def _(feats, plan_token, mode, zero_floor, write_arg):
    n_out, channels = plan_token.shape[0], feats.shape[1]
    arg = feats.new_empty((n_out, channels) if write_arg and mode == "max" else (1,),
                          dtype=torch.int32)
    count = feats.new_empty((n_out,) if write_arg and mode == "avg" else (1,),
                            dtype=torch.float32)
    return (feats.new_empty((n_out, channels)), arg, count,
            feats.new_empty((1,), dtype=torch.uint8))


@torch.library.custom_op("flexplan::sparse_pool_backward", mutates_args=(), tags=GRAPH_OP_TAGS)
def _pool_backward_op(grad_out: torch.Tensor, arg: torch.Tensor, count: torch.Tensor,
                      plan_keeper: torch.Tensor, mode: str, num_in: int) -> torch.Tensor:
    plan = plan_tokens.kept_plan(plan_keeper)
    with op_context(grad_out):
        return pool_backward(grad_out.contiguous(), arg, count, plan, mode, num_in)


@_pool_backward_op.register_fake
def _(grad_out, arg, count, plan_keeper, mode, num_in):
    return grad_out.new_empty((num_in, grad_out.shape[1]))


def _pool_op_setup(ctx, inputs, output):
    feats, plan_token, mode, zero_floor, write_arg = inputs
    ctx.save_for_backward(output[1], output[2], output[3])
    ctx.mode, ctx.num_in = mode, feats.shape[0]


def _pool_op_backward(ctx, grad_out, grad_arg, grad_count, grad_keeper):
    arg, count, keeper = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    return (torch.ops.flexplan.sparse_pool_backward(grad_out, arg, count, keeper, ctx.mode,
                                                    ctx.num_in), None, None, None, None)


_pool_op.register_autograd(_pool_op_backward, setup_context=_pool_op_setup)
