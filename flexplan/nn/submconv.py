"""SubMConv3d: submanifold sparse 3D convolution as a torch module."""
from __future__ import annotations

import math

import torch

from ..geometry import ConvGeometry
from ..ops.conv import BatchNormReLU, bn_relu_torch, sparse_conv
from ..plan_provider import tensor_plan
from ..sparse_tensor import SparseTensor


class SubMConv3d(torch.nn.Module):
    """Output voxels = input voxels; out[i] = bias + sum_v W_v @ x[i + offset_v].

    weight: Parameter [Co, Kx, Ky, Kz, Ci]. The plan comes from plan_provider.tensor_plan(x,
    geometry), so all layers over the same coordinates and geometry share one plan (built or
    cached once).
    algo: "auto" or one of flexplan.kernel_configs.ALGORITHMS; allow_tf32: float32 via plain
    TF32 (default: fp32-grade 3xTF32; None follows torch.backends.cudnn.allow_tf32).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size=3, dilation=1,
                 bias: bool = True, algo: str = "auto", allow_tf32: bool | None = False,
                 device=None, dtype=None):
        super().__init__()
        self.geometry = ConvGeometry.submanifold_conv(kernel_size, dilation)
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.algo, self.allow_tf32 = algo, allow_tf32
        factory = dict(device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(
            torch.empty((out_channels, *self.geometry.kernel_size, in_channels), **factory))
        self.bias = torch.nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # torch.nn.Conv3d's default: uniform in +-1/sqrt(fan_in) for weight and bias.
        bound = 1.0 / math.sqrt(self.in_channels * self.geometry.volume)
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def conv_weight(self) -> torch.Tensor:
        """The weight the op takes, [Co, Kx, Ky, Kz, Ci] (a subclass may store another view)."""
        return self.weight

    def forward(self, x: SparseTensor, *, bn_relu: BatchNormReLU | None = None) -> SparseTensor:
        """bn_relu: an eval BatchNorm and ReLU applied to the output (nn/conv_epilogue.py)."""
        if not isinstance(x, SparseTensor):
            raise TypeError(f"SubMConv3d expects a SparseTensor, got {type(x).__name__}")
        if self.geometry.volume == 1:
            # One tap, the centre: a linear map of each voxel's features, with no plan (what
            # spconv's 1x1 path does); torch's linear follows autocast like the op does.
            if x.num_channels != self.in_channels:
                raise ValueError(f"SubMConv3d expects {self.in_channels} input channels, got "
                                 f"features of shape {tuple(x.feats.shape)}")
            weight = self.conv_weight().reshape(self.out_channels, self.in_channels)
            feats = torch.nn.functional.linear(x.feats, weight, self.bias)
            return x.replace_feats(feats if bn_relu is None else bn_relu_torch(feats, bn_relu))
        # Under no_grad / inference_mode nothing will be differentiated: an inference plan.
        plan = tensor_plan(x, self.geometry, training=torch.is_grad_enabled(), asker=self)
        feats = sparse_conv(x.feats, plan, self.conv_weight(), self.bias, self.algo,
                            self.allow_tf32, bn_relu)
        return x.replace_feats(feats)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.geometry.kernel_size}, "
                f"dilation={self.geometry.dilation}, bias={self.bias is not None}, algo={self.algo!r}")
