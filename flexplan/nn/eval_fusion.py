"""fuse_conv_bn: fold eval-mode BatchNorms into the convs before them, for inference.

In eval mode a BatchNorm is a fixed per-channel affine map, y = (x - mean) * s + beta with
s = gamma / sqrt(var + eps), so it folds into the conv before it: weight * s (per output
channel) and bias (b - mean) * s + beta. `fuse_conv_bn(model)` does that, in place, for every
conv -> BatchNorm pair of every SparseSequential in the model (OpenPCDet's post_act_block, a
U-Net's blocks), and leaves a FoldedBatchNorm in the BatchNorm's place (the module indices and
the other modules' state_dict keys stay). The BatchNorm's module call and kernel go from every
such block: host time that decides inference steps of small convs
(scripts/results/bench_precision.md's notes).

Explicit, like torch.fx's conv-bn fusion: the folded weights are a snapshot of the parameters
and running statistics at the call. Train, load a state dict or update an EMA copy afterwards
and the model no longer follows: fuse again from the unfused model. A pair is folded only
where the result equals the unfused run up to rounding: the BatchNorm (exact torch or flexplan
type) is in eval mode with running statistics and as many features as the conv has outputs,
the conv is one of flexplan's layers running its own forward, and neither has hooks. Blocks
that call their BatchNorm themselves (OpenPCDet's SparseBasicBlock) are not touched.
"""
from __future__ import annotations

import torch

from .conv_epilogue import BATCH_NORMS, CONV_FORWARDS as _CONV_FORWARDS, hooked as _hooked
from .sparse_sequential import SparseSequential
from .spconv_layers import SparseConvolution, SparseModule
from .spconv_layers import SubMConv3d as SpconvSubMConv3d
from .spconv_layers4d import SparseConvolution4d
from .submconv import SubMConv3d

# The conv_weight()s that are views of the weight parameter as stored (the forwards whose
# output is conv(x, conv_weight(), bias) and nothing else: conv_epilogue.CONV_FORWARDS).
_CONV_WEIGHTS = frozenset({SubMConv3d.conv_weight, SpconvSubMConv3d.conv_weight,
                           SparseConvolution.conv_weight, SparseConvolution4d.conv_weight})


class FoldedBatchNorm(SparseModule):
    """Where fuse_conv_bn folded a BatchNorm into the conv before it: passes the tensor on."""

    def __init__(self, num_features: int):
        super().__init__()
        self.num_features = num_features

    def forward(self, x):
        return x

    def extra_repr(self) -> str:
        return f"{self.num_features} (folded into the conv before)"


def foldable(conv, bn) -> bool:
    """Would folding bn into conv leave the pair's output unchanged (but for rounding)?"""
    return (isinstance(conv, (SubMConv3d, SparseConvolution))
            and type(conv).forward in _CONV_FORWARDS and "forward" not in conv.__dict__
            and type(conv).conv_weight in _CONV_WEIGHTS and "conv_weight" not in conv.__dict__
            # plain parameters (torch.nn.utils.parametrize computes weight from others)
            and conv._parameters.get("weight") is conv.weight
            and (conv.bias is None or conv._parameters.get("bias") is conv.bias)
            and type(bn) in BATCH_NORMS and "forward" not in bn.__dict__
            and not bn.training and bn.running_mean is not None and bn.running_var is not None
            and bn.num_features == conv.out_channels and conv.weight.shape[0] == bn.num_features
            and not _hooked(conv) and not _hooked(bn))


def fold_into(conv, bn) -> bool:
    """conv's weight and bias (made if it had none) take bn's eval-mode map; computed in fp32
    (fp64 for fp64 weights), stored in the weight's dtype. False, and nothing changed, where a
    folded value does not fit that dtype (a 16-bit weight times a huge 1 / sqrt(var + eps))."""
    # Parameters made under torch.inference_mode change only inside it; others outside it
    # (a bias made here is then of the weight's kind, whatever mode the caller is in).
    with torch.inference_mode(conv.weight.is_inference()), torch.no_grad():
        return _fold(conv, bn)


def _fold(conv, bn) -> bool:
    w = conv.weight
    acc = torch.promote_types(w.dtype, torch.float32)
    scale = torch.rsqrt(bn.running_var.to(acc) + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.to(acc)
    shift = -bn.running_mean.to(acc) * scale
    if bn.bias is not None:
        shift = shift + bn.bias.to(acc)
    if conv.bias is not None:
        shift = shift + conv.bias.to(acc) * scale
    weight = (w.to(acc) * scale.view(-1, *(1,) * (w.dim() - 1))).to(w.dtype)
    bias = shift.to(w.dtype if conv.bias is None else conv.bias.dtype)
    if not (torch.isfinite(weight).all() and torch.isfinite(bias).all()):  # (one-off syncs)
        return False
    w.copy_(weight)
    if conv.bias is None:
        conv.bias = torch.nn.Parameter(bias, requires_grad=w.requires_grad)
    else:
        conv.bias.copy_(bias)
    return True


def fuse_conv_bn(model: torch.nn.Module) -> int:
    """Fold every foldable conv -> BatchNorm pair of the model's SparseSequentials (the model's
    own included) in place; returns how many. Call it on a model in eval mode (model.eval()):
    BatchNorms in training mode are left as they are."""
    folded = 0
    # A conv's weight or bias whose storage is met twice in the model (a conv in two places, a
    # parameter tied to another module's, two parameters over one storage) is folded nowhere:
    # the fold would change the other user's values too.
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        key = p.untyped_storage().data_ptr()
        uses[key] = uses.get(key, 0) + 1

    def alone(t) -> bool:
        return t is None or uses.get(t.untyped_storage().data_ptr()) == 1

    # Only SparseSequential's own forward runs its modules one after another.
    sequences = [m for m in model.modules() if isinstance(m, SparseSequential)
                 and type(m).forward is SparseSequential.forward and "forward" not in m.__dict__]
    for seq in sequences:
        names = list(seq._modules)
        for first, second in zip(names, names[1:]):
            conv, bn = seq._modules[first], seq._modules[second]
            if foldable(conv, bn) and alone(conv.weight) and alone(conv.bias) \
                    and fold_into(conv, bn):
                seq._modules[second] = FoldedBatchNorm(bn.num_features)
                folded += 1
    return folded
