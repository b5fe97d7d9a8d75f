"""Inference fusion: a conv -> BatchNorm (-> ReLU) run of a SparseSequential as one conv.

In eval mode a BatchNorm is a fixed per-channel affine map, y = (x - mean) * s + beta with
s = gamma / sqrt(var + eps), so it folds into the conv before it: weight * s (per output
channel) and bias (b - mean) * s + beta. The conv then writes the normalized features itself
(its bias epilogue) and a following ReLU runs in place on them. That drops the BatchNorm's and
the ReLU's module calls and torch launches from every such block: host time that decides
inference steps of small convs (OpenPCDet's post_act_block, the U-Net's blocks; measured in
scripts/results/bench_precision.md's notes).

The folded weight and bias are computed once and kept with the conv (recomputed when any
source tensor changes: another tensor, storage, dtype, device or in-place version). A run is
fused only when nothing can tell: the BatchNorm is in eval mode with running statistics,
nothing will be differentiated (no_grad, or no parameter nor input that requires grad), no
module of the run has hooks (nor are global module hooks set), and torch.compile is not
tracing. Set FLEXPLAN_FUSE_BN=0 to run every module as is. The results equal the unfused
ones up to rounding: one rounding of the conv's fp32 sums instead of two (conv, then BN) and
the folded weight's own rounding in 16-bit models (tests/test_eval_fusion.py).
"""
from __future__ import annotations

import os
import weakref

import torch
from torch.nn.modules import module as torch_module

from ..ops.conv import autocast_dtype
from .spconv_modules import (FlexSparseSyncBatchNorm, SparseBatchNorm, SparseReLU,
                             SparseSyncBatchNorm)
from .sync_batchnorm import SyncBatchNorm

FUSE_ENV = "FLEXPLAN_FUSE_BN"  # "0": never fuse
# Exact types: a subclass may compute something else in forward.
BATCH_NORMS = frozenset({torch.nn.BatchNorm1d, torch.nn.SyncBatchNorm, SyncBatchNorm,
                         SparseBatchNorm, SparseSyncBatchNorm, FlexSparseSyncBatchNorm})
RELUS = frozenset({torch.nn.ReLU, SparseReLU})
# conv module -> (stamp, sources, weight, bias): outside the module, so that state_dict, pickling
# and deepcopy never see it; gone with the module.
_folded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def enabled() -> bool:
    return os.environ.get(FUSE_ENV, "1") != "0"


def is_conv(module) -> bool:
    """A flexplan conv layer that can run with another weight and bias (conv_with)."""
    return hasattr(module, "conv_with")


def fusion_run(modules, i: int):
    """(conv, bn, relu or None) if modules[i:] starts a conv -> BatchNorm (-> ReLU) run, else
    None (by module types alone: whether it may be fused now is `fusable`)."""
    conv = modules[i]
    if not is_conv(conv) or i + 1 >= len(modules) or type(modules[i + 1]) not in BATCH_NORMS:
        return None
    relu = modules[i + 2] if i + 2 < len(modules) and type(modules[i + 2]) in RELUS else None
    return conv, modules[i + 1], relu


def _hooked(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def fusable(conv, bn, relu, x) -> bool:
    """May the run be fused on input x now (the module docstring's conditions)?"""
    if bn.training or bn.running_mean is None or bn.running_var is None:
        return False
    if torch.is_grad_enabled():
        params = (conv.weight, conv.bias, bn.weight, bn.bias)
        if x.feats.requires_grad or any(p is not None and p.requires_grad for p in params):
            return False
    if _hooked(conv) or _hooked(bn) or (relu is not None and _hooked(relu)):
        return False
    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or torch_module._global_backward_hooks):
        return False
    return not torch.compiler.is_compiling()


def _sources(conv, bn) -> tuple:
    return conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var


def _stamp(tensors, eps: float) -> tuple:
    """What the folded parameters depend on: each source's object, storage, dtype, device and
    in-place version (the entry holds the sources, so their ids stay theirs), and eps."""
    return (eps,) + tuple(None if t is None else (id(t), t.data_ptr(), t._version, t.dtype,
                                                  t.device) for t in tensors)


def folded(conv, bn, cast: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of the conv with the BatchNorm folded in: weight in conv_weight()'s layout
    and dtype, bias in the weight's dtype; cast: in that dtype instead (the autocast dtype the
    op would cast them to on every call). Computed in fp32 (fp64 for fp64 weights) and kept on
    the conv until a source changes."""
    sources = _sources(conv, bn)
    stamp = _stamp(sources, bn.eps) + (cast,)
    kept = _folded.get(conv)
    if kept is not None and kept[0] == stamp:
        return kept[2], kept[3]
    with torch.no_grad():
        w = conv.conv_weight()
        acc = torch.promote_types(w.dtype, torch.float32)
        scale = torch.rsqrt(bn.running_var.to(acc) + bn.eps)
        if bn.weight is not None:
            scale = scale * bn.weight.to(acc)
        shift = -bn.running_mean.to(acc) * scale
        if bn.bias is not None:
            shift = shift + bn.bias.to(acc)
        if conv.bias is not None:
            shift = shift + conv.bias.to(acc) * scale
        out_dtype = w.dtype if cast is None else cast
        weight = (w.to(acc) * scale.view(-1, *(1,) * (w.dim() - 1))).to(out_dtype)
        bias = shift.to(out_dtype)
    _folded[conv] = (stamp, sources, weight, bias)
    return weight, bias


def run_fused(conv, bn, relu, x):
    """conv -> bn (-> relu) on x as one conv with the folded parameters."""
    weight, bias = folded(conv, bn, autocast_dtype(x.feats))
    out = conv.conv_with(x, weight, bias)
    if relu is not None:
        out.feats.relu_()  # the conv's own new features: nothing else holds them
    return out
