"""Eval-mode conv -> BatchNorm -> ReLU blocks as one kernel: which blocks qualify.

OpenPCDet's post_act_block and most sparse U-Nets are SparseSequential(conv, BatchNorm1d, ReLU).
In inference the BatchNorm is a per-channel affine map of its running statistics, so the
convolution's kernel applies it and the ReLU to its accumulator before storing
(ops.conv.BatchNormReLU): two module calls and two kernels fewer per block, host time that
decides inference steps of small convolutions. The kernel reads the BatchNorm's own tensors
at each launch, so nothing is copied that could go stale (unlike fuse_conv_bn's folding, which
is a snapshot and stays opt-in).

A block is fused only where that gives what the three modules give (but for rounding: the
fused block rounds once): nothing is differentiated (no grad mode), the conv is one of
flexplan's layers running its own forward with no bias and no activation of its own, the
BatchNorm is an exact BatchNorm type in eval mode with running statistics, a weight and a bias
for the conv's output channels, the ReLU a plain ReLU, and none of the three has hooks (a hook
on the conv would see the fused output) or a forward of its own. Switch: FUSE_BN_RELU.
"""
from __future__ import annotations

import torch

from ..ops.conv import BatchNormReLU
from .spconv_layers import SparseConvolution
from .spconv_layers import SubMConv3d as SpconvSubMConv3d
from .spconv_modules import (FlexSparseSyncBatchNorm, SparseBatchNorm, SparseReLU,
                             SparseSyncBatchNorm)
from .submconv import SubMConv3d
from .sync_batchnorm import SyncBatchNorm

# Whether SparseSequential fuses eval-mode conv -> BatchNorm -> ReLU blocks (False: the
# modules one by one, as before; for A/B runs).
FUSE_BN_RELU = True

# Exact types: a subclass may compute something else in forward.
BATCH_NORMS = frozenset({torch.nn.BatchNorm1d, torch.nn.SyncBatchNorm, SyncBatchNorm,
                         SparseBatchNorm, SparseSyncBatchNorm, FlexSparseSyncBatchNorm})
RELUS = frozenset({torch.nn.ReLU, SparseReLU})
# The conv forwards whose output is sparse_conv(x, plan, conv_weight(), bias) and that take the
# epilogue (their bn_relu keyword).
CONV_FORWARDS = frozenset({SubMConv3d.forward, SpconvSubMConv3d.forward,
                           SparseConvolution.forward})


def hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def bn_relu_epilogue(conv, bn, relu) -> BatchNormReLU | None:
    """The epilogue that makes conv's output what conv, bn and relu give one after the other
    (see the module's docstring for when), else None."""
    if (type(relu) not in RELUS or type(bn) not in BATCH_NORMS
            or type(conv).forward not in CONV_FORWARDS):
        return None
    if (bn.training or bn.weight is None or bn.bias is None or bn.running_mean is None
            or not bn.eps > 0  # (torch judges: some versions refuse 0)
            or bn.running_var is None or conv.bias is not None
            or getattr(conv, "act_type", None) is not None
            or bn.num_features != conv.out_channels or "forward" in conv.__dict__
            or "forward" in bn.__dict__ or "forward" in relu.__dict__
            or hooked(conv) or hooked(bn) or hooked(relu)):
        return None
    return BatchNormReLU(bn.running_mean, bn.running_var, bn.weight, bn.bias, float(bn.eps))


_module = torch.nn.modules.module


def fusing() -> bool:
    """Whether blocks may fuse now: inference (nothing differentiated), eager, and no global
    module hooks (they would miss the BatchNorm's and the ReLU's calls)."""
    return (FUSE_BN_RELU and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not (_module._global_forward_hooks or _module._global_forward_pre_hooks))
