"""SyncBatchNorm without host synchronization (issue #26).

torch.nn.SyncBatchNorm all-gathers each rank's (mean, invstd, count) and then drops the ranks
that had no rows with a boolean mask (torch/nn/modules/_functions.py). The mask's result has a
data-dependent shape, so the host waits for the GPU there, in every training forward: 21 times
per step of the LiDAR encoder. Two host-bound DDP ranks then run in lockstep with their GPUs
and the 2-GPU step lost to one GPU (0.94x its throughput; 1.28x with per-rank BatchNorm).

Here every collective is one all_reduce(SUM) of a fixed-size tensor, and nothing on the host
depends on tensor values:
- forward: each rank packs [count * mean (C), count * (var + mean^2) (C), count (1)] (sums of x
  and x^2 over its rows, built from its local mean and biased variance) and all-reduces the
  2C + 1 numbers once. A rank without rows adds zeros, so no rank has to be filtered out. The
  packing and the global mean / variance are float64: the global variance is E[x^2] - mean^2,
  whose cancellation at |x| ~ 100 would cost fp32 about four digits, while in float64 it stays
  below fp32's rounding. The local statistics themselves are centred (Welford on CUDA, two-pass
  var_mean elsewhere, fp32; fp64 for fp64 inputs), so large offsets cost nothing there.
- running statistics: updated on the device like torch's (unbiased variance with the global
  count; momentum, or the cumulative average 1 / num_batches_tracked when momentum is None,
  which torch reads with .item()), with weight 0 where no rank had rows, so such a step leaves
  them as they were instead of writing NaN.
- backward: sum(dy) and sum(dy * (x - mean)) of all ranks through one all_reduce of 2C
  numbers, as torch; grad_weight / grad_bias are the rank's own sums, as torch returns them
  (DistributedDataParallel then averages them, giving the same parameter gradients as torch's
  SyncBatchNorm). A rank without rows returns zero grads for weight and bias (torch returns
  None, which leaves DDP waiting for a gradient that never comes on that rank).

Host cost. The ranks this is for are host-bound, so every launch counts (on the 2-GPU machine
of issue #26 a kernel launch cost the host ~10 us, a small all_reduce ~45 us, and the same
statistics as ~25 torch ops cost more host time than torch's SyncBatchNorm with its sync). So a
CUDA training forward is torch's own batch_norm_stats, one Triton kernel packing the sums, the
all_reduce, one Triton kernel turning the sums into mean / invstd and updating the running
statistics and num_batches_tracked (kernels_src/batchnorm_stats.py), and torch's
batch_norm_elemt; a backward is torch's batch_norm_backward_reduce, a cat, the all_reduce and
batch_norm_backward_elemt (the kernels torch's SyncBatchNorm uses). That is the default on NVIDIA GPUs (module attribute use_kernels;
FLEXPLAN_SYNC_BN_KERNELS=0 turns it off, =1 on, also on ROCm, where it has not run); CPU
tensors, and ROCm by default, use plain torch ops with the same formulas: more launches, no
Triton. Step times: scripts/results/bench_ddp.md.

Not synchronized (plain F.batch_norm, no collective), as torch: eval mode, world size 1, no
initialized process group. The module subclasses _BatchNorm, not torch.nn.SyncBatchNorm:
DistributedDataParallel refuses torch's class on the CPU, and torch's
SyncBatchNorm.convert_sync_batchnorm still treats this one as a BatchNorm to convert.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ..device_guard import on_device_of
from ..graph_capture import device_constant
from ..kernels_src import batchnorm_stats as kernels
from ..launch_spec import FLOAT64, INT32, INT64, SIZE, Tensor
from ..launcher import launch

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]

_BLOCK = 256  # channels per program of the two statistics kernels
# CUDA inputs take the Triton kernels (kernels_src/batchnorm_stats.py) unless
# FLEXPLAN_SYNC_BN_KERNELS=0; on ROCm, where they have not run, only with =1. Both paths are
# checked against nn.SyncBatchNorm on 2 GPUs (tests/test_sync_batchnorm.py, gpu marker).
use_kernels = os.environ.get("FLEXPLAN_SYNC_BN_KERNELS",
                             "0" if torch.version.hip is not None else "1").strip() == "1"


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    """Statistics in fp32 for fp16 / bf16 / fp32 inputs, fp64 for fp64 (as torch)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))  # every dim but the channels


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A [C] tensor shaped to broadcast against x ([N, C, *])."""
    return t.view([1, -1] + [1] * (x.dim() - 2))





def _consts(device: torch.device, eps: float, momentum: float) -> torch.Tensor:
    """[eps, momentum] as a float64 tensor on `device`, made once per value pair by fills (no
    host-to-device copy; Triton would take Python floats as fp32, and flexplan.launcher's cheap
    repeat launch takes tensors and ints only)."""
    def make():
        consts = torch.full((2,), eps, dtype=torch.float64, device=device)
        consts[1:].fill_(momentum)
        return consts
    return device_constant(("sync_bn_consts", eps, momentum), device, make)


# Launch descriptions (flexplan/launch_spec.py): the kernel path launches through these, the AOT
# build (flexplan/aot/variants.py) records them with example arguments.
# FLOAT64: the packed sums and [eps, momentum]; the two roles below are this op's own.
STATS = Tensor("stats")  # batch_norm_stats' mean / invstd and ours: _stats_dtype of the input
RUNNING = Tensor("running")  # running_mean / running_var: the module's buffers' dtype


def launch_pack(run, mean: STATS, invstd: STATS, out: FLOAT64, channels: int,
                rows: SIZE) -> None:
    """out [2C + 1] = the sums of one rank's `rows` rows from its mean and invstd [C]."""
    run(kernels.pack_kernel, (-(-channels // _BLOCK),), mean, invstd, out, channels, rows,
        BLOCK=_BLOCK)


def launch_finalize(run, packed: FLOAT64, consts: FLOAT64, num_batches_tracked: INT64,
                    stats: STATS, count: INT32, running_mean: RUNNING, running_var: RUNNING,
                    channels: int, track: bool, cumulative: bool) -> None:
    """stats [2, C] and count [1] from the all-reduced sums; track: also num_batches_tracked
    incremented and the running statistics, weighted by 1 / num_batches_tracked with
    cumulative, else by consts' momentum. The kernel reads no pointer its flags turn off: those
    take `packed` / `stats` (any tensor would do, these keep their dtypes fixed per
    specialization). One program (the increment made once)."""
    run(kernels.finalize_kernel, (1,), packed, consts,
        num_batches_tracked if track else packed, stats, count,
        running_mean if track else stats, running_var if track else stats, channels,
        TRACK=track, CUMULATIVE=cumulative, BLOCK=_BLOCK)


def pack_sums(mean: torch.Tensor, invstd: torch.Tensor, rows: int) -> torch.Tensor:
    """The kernel path's [rows * mean, rows * (var + mean^2), rows], float64 (see kernels.pack_kernel)."""
    channels = mean.shape[0]
    packed = torch.empty(2 * channels + 1, dtype=torch.float64, device=mean.device)
    launch_pack(launch, mean, invstd, packed, channels, rows)
    return packed


def finalize_sums(packed: torch.Tensor, stats_dtype: torch.dtype, eps: float, momentum,
                  num_batches_tracked, running_mean, running_var):
    """The kernel path's (stats [2, C]: mean and invstd, count int32 [1]) from the all-reduced
    sums; with running statistics, num_batches_tracked incremented and the running statistics
    updated (see kernels.finalize_kernel)."""
    channels = (packed.shape[0] - 1) // 2
    stats = torch.empty(2, channels, dtype=stats_dtype, device=packed.device)
    count = torch.empty(1, dtype=torch.int32, device=packed.device)
    track = _tracking(running_mean, num_batches_tracked)
    consts = _consts(packed.device, float(eps), 0.0 if momentum is None else float(momentum))
    launch_finalize(launch, packed, consts, num_batches_tracked, stats, count, running_mean,
                    running_var, channels, track, track and momentum is None)
    return stats, count


# --- elsewhere: the same formulas in torch ops ----------------------------------------------

def _torch_local_sums(x: torch.Tensor, rows: int) -> torch.Tensor:
    var, mean = torch.var_mean(x.to(_stats_dtype(x)), dim=_reduce_dims(x), correction=0)
    mean, var = mean.double(), var.double()
    return torch.cat([mean, torch.addcmul(var, mean, mean), mean.new_ones(1)]).mul_(rows)


def _tracking(running_mean, num_batches_tracked) -> bool:
    """Whether a finalize updates running statistics (then it counts the batch too)."""
    if running_mean is not None and num_batches_tracked is None:
        raise ValueError("running statistics are tracked with num_batches_tracked")
    return running_mean is not None


def _torch_finalize(packed, sd, eps, momentum, num_batches_tracked, running_mean, running_var):
    """(mean, var, invstd) in `sd` from the all-reduced sums; with running statistics,
    num_batches_tracked incremented and the running statistics updated."""
    channels = (packed.shape[0] - 1) // 2
    if _tracking(running_mean, num_batches_tracked):
        num_batches_tracked.add_(1)
    total = packed[2 * channels:]
    moments = packed[:2 * channels].view(2, channels) / total.clamp(min=1)
    mean64 = moments[0]
    var64 = torch.addcmul(moments[1], mean64, mean64, value=-1).clamp_(min=0)
    if running_mean is not None:
        factor = (num_batches_tracked.to(torch.float64).reciprocal() if momentum is None
                  else momentum)
        w = total.clamp(max=1) * factor  # no rows anywhere: weight 0
        running_mean.lerp_(mean64.to(running_mean.dtype), w.to(running_mean.dtype))
        unbiased = var64 * (total / (total - 1).clamp(min=1))
        running_var.lerp_(unbiased.to(running_var.dtype), w.to(running_var.dtype))
    mean, var = mean64.to(sd), var64.to(sd)
    return mean, var, torch.rsqrt(var + eps)


def all_reduce_sum(tensor: torch.Tensor, group) -> None:
    """dist.all_reduce(tensor, SUM, group) (synchronous: asyncOp False where torch has the
    option, the work waited for where the backend returns one), through the group's own
    allreduce: what dist.all_reduce calls after its Python argument checks and logging
    wrappers, skipped here (two collectives per BatchNorm layer and step, host time in
    host-bound ranks). dist.all_reduce itself under torch.compile (Dynamo traces it, not a
    process group object); inside a coalescing manager (which would only queue it) an error."""
    if group in getattr(dist.distributed_c10d._world, "pg_coalesce_state", ()):
        # (dist.all_reduce would only queue it: the layer would go on with this rank's sums)
        raise RuntimeError("flexplan's SyncBatchNorm needs its all-reduced statistics at once: "
                           "it cannot run inside torch.distributed's coalescing manager")
    if direct_all_reduce and hasattr(group, "allreduce") and not torch.compiler.is_compiling():
        work = group.allreduce([tensor], _sum_options())
        if work is not None:  # (a backend that synced in C++ returns none)
            work.wait()
    else:
        dist.all_reduce(tensor, dist.ReduceOp.SUM, group)


# False (or FLEXPLAN_SYNC_BN_DIRECT=0): every collective through dist.all_reduce (A/B runs).
direct_all_reduce = os.environ.get("FLEXPLAN_SYNC_BN_DIRECT", "1").strip() != "0"


@functools.cache
def _sum_options():
    """One AllreduceOptions for every call (the process group copies what it reads): a sum,
    synchronous as dist.all_reduce(async_op=False) asks (torch >= 2.12 then runs NCCL on the
    current stream, with no events between streams)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False
    return opts


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over the rows of every rank of `group` (group None: this
    process alone, no collective). Updates running_mean / running_var in place when given, and
    increments num_batches_tracked then (momentum None: the cumulative average over it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, eps,
                momentum, group):
        if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)
                or x.is_contiguous(memory_format=torch.channels_last_3d)):
            x = x.contiguous()
        channels = x.shape[1]
        rows = x.numel() // channels  # a host number (shapes are on the host): no sync
        sd = _stats_dtype(x)
        # (torch.compile traces the torch-op path: its launches are not Triton's traced ones)
        cuda = x.is_cuda and use_kernels and not torch.compiler.is_compiling()
        if rows == 0:  # an empty rank still joins the collective (its peers wait), with zeros
            packed = torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
        elif cuda:
            # one Welford pass over x in its own dtype; eps 0: invstd = 1/sqrt(var) exactly
            packed = pack_sums(*torch.batch_norm_stats(x, 0.0), rows)
        else:
            packed = _torch_local_sums(x, rows)
        if group is not None:
            # sums are what an all_reduce combines over uneven parts (torch all-gathers the
            # per-rank means and then masks out the empty ranks: the sync)
            all_reduce_sum(packed, group)
        if cuda:
            stats, count = finalize_sums(packed, sd, eps, momentum, num_batches_tracked,
                                         running_mean, running_var)
            mean, invstd = stats.unbind(0)
            if rows == 0:
                out = torch.empty_like(x)
            else:
                if weight is not None and weight.dtype not in (x.dtype, sd):
                    weight, bias = weight.to(sd), None if bias is None else bias.to(sd)
                out = torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)
        else:
            mean, var, invstd = _torch_finalize(packed, sd, eps, momentum, num_batches_tracked,
                                                running_mean, running_var)
            count = packed[2 * channels:]
            # Inference-mode batch_norm with the global statistics: one fused pass; fp16 / bf16
            # inputs take fp32 parameters (the mixed-type kernel), so nothing is rounded to the
            # input dtype before the output.
            out = torch.empty_like(x) if rows == 0 else F.batch_norm(
                x, mean, var, None if weight is None else weight.to(sd),
                None if bias is None else bias.to(sd), False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.kernels = cuda  # torch's CUDA-only backward kernels (they take the int32 count)
        ctx.group = group
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        x, weight, mean, invstd, count = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_weight = need_weight and weight is not None
        need_bias = need_bias and ctx.has_bias
        if not (grad_output.is_contiguous()
                or grad_output.is_contiguous(memory_format=torch.channels_last)
                or grad_output.is_contiguous(memory_format=torch.channels_last_3d)):
            grad_output = grad_output.contiguous()
        channels = x.shape[1]
        rows = x.numel() // channels
        sd = mean.dtype
        grad_input = grad_weight = grad_bias = None
        if rows > 0:
            if ctx.kernels:
                sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
                    grad_output, x, mean, invstd, weight, need_input, need_weight, need_bias)
            else:
                dy = grad_output.to(sd)
                xmu = x.to(sd) - _per_channel(mean, x)
                dims = _reduce_dims(x)
                sum_dy = dy.sum(dims)
                sum_dy_xmu = (dy * xmu).sum(dims)
                if need_weight:
                    grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
                if need_bias:
                    grad_bias = sum_dy.to(weight.dtype if weight is not None else x.dtype)
        else:
            sum_dy = sum_dy_xmu = torch.zeros(channels, dtype=sd, device=x.device)
            if need_weight:  # zeros, not None: DDP waits for every parameter's gradient
                grad_weight = torch.zeros_like(weight)
            if need_bias:
                grad_bias = torch.zeros(channels, dtype=weight.dtype if weight is not None
                                        else x.dtype, device=x.device)
        if need_input:
            combined = torch.cat([sum_dy, sum_dy_xmu])
            if ctx.group is not None:
                all_reduce_sum(combined, ctx.group)
            sum_dy, sum_dy_xmu = combined.split(channels)
            if rows == 0:
                grad_input = torch.empty_like(x)
            elif ctx.kernels:
                w = weight if weight is None or weight.dtype == sd else weight.to(sd)
                grad_input = torch.batch_norm_backward_elemt(
                    grad_output, x, mean, invstd, w, sum_dy, sum_dy_xmu, count)
            else:
                n = count.to(sd)
                scale = invstd if weight is None else invstd * weight.to(sd)
                grad_input = (dy - _per_channel(sum_dy / n, x)
                              - xmu * _per_channel(invstd * invstd * sum_dy_xmu / n, x))
                grad_input = (grad_input * _per_channel(scale, x)).to(x.dtype)
        if not need_weight:
            grad_weight = None
        if not need_bias:
            grad_bias = None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """torch.nn.SyncBatchNorm's drop-in (same arguments, buffers and state dict) whose training
    forward and backward never wait for the GPU: one all_reduce each, see the module docstring.
    Inputs [N, C, *], any floating dtype; the output has the input's dtype."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None, *, bias: bool = True) -> None:
        # `bias` only when it is not the default: torch versions without it still work.
        extra = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, **extra)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _group(self):
        """The process group to synchronize over, or None where torch would not sync."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")
        tracking = self.training and self.track_running_stats
        # Batch statistics in training, and in eval mode without running statistics (as torch).
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None
        group = self._group()
        if group is None and not (tracking and self.momentum is None):
            if tracking:  # (the Function below counts the batch itself, in its finalize)
                self.num_batches_tracked.add_(1)
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, 0.0 if self.momentum is None else self.momentum,
                                self.eps)
        # Synchronized; or the cumulative average (momentum None) alone, which torch weighs
        # with 1 / num_batches_tracked.item() (a sync) and this Function on the device.
        args = (input, self.weight, self.bias, running_mean, running_var,
                self.num_batches_tracked if tracking else None, self.eps, self.momentum, group)
        with on_device_of(input):  # the Triton kernels launch on the current device
            if torch.is_autocast_enabled(input.device.type):
                # torch's batch norm is not autocast: the input's dtype in and out
                with torch.autocast(input.device.type, enabled=False):
                    return _SyncBatchNormFunction.apply(*args)
            return _SyncBatchNormFunction.apply(*args)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group=None):
        """torch.nn.SyncBatchNorm.convert_sync_batchnorm's counterpart (see the function)."""
        return convert_sync_batchnorm(module, process_group)


# convert_sync_batchnorm builds this class for a BatchNorm; a BatchNorm class may name another
# through the attribute (spconv's SparseBatchNorm names SparseSyncBatchNorm, which keeps
# mapping SparseConvTensor features).
SyncBatchNorm._sync_batchnorm_class = SyncBatchNorm


def convert_sync_batchnorm(module: torch.nn.Module, process_group=None) -> torch.nn.Module:
    """Every BatchNorm1d/2d/3d (any torch _BatchNorm: torch's SyncBatchNorm and this module's
    too) in `module` replaced by flexplan's SyncBatchNorm, in place; the module itself
    replaced (and returned) if it is one. As torch's convert_sync_batchnorm: the new layer
    takes over the old one's weight and bias Parameters (the same objects, so an optimizer
    built before still holds them; requires_grad goes with them), its running statistics and
    num_batches_tracked, eps, momentum, affine, track_running_stats and training mode."""
    output = module
    if isinstance(module, _BatchNorm):
        target = getattr(type(module), "_sync_batchnorm_class", SyncBatchNorm)
        output = target(module.num_features, module.eps, module.momentum, module.affine,
                        module.track_running_stats, process_group,
                        bias=not module.affine or module.bias is not None)
        if module.affine:
            with torch.no_grad():
                output.weight = module.weight
                output.bias = module.bias
        output.running_mean = module.running_mean
        output.running_var = module.running_var
        output.num_batches_tracked = module.num_batches_tracked
        output.training = module.training
        if hasattr(module, "qconfig"):
            output.qconfig = module.qconfig
    for name, child in module.named_children():
        output.add_module(name, convert_sync_batchnorm(child, process_group))
    return output
