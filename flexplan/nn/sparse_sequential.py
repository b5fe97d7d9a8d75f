"""SparseSequential and ToDense: spconv's containers over SparseConvTensor."""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..sparse_tensor import SparseTensor
from .conv_epilogue import bn_relu_epilogue, fusing
from .spconv_layers import SparseModule
from .submconv import SubMConv3d


def is_sparse_module(module: torch.nn.Module) -> bool:
    """Takes the sparse tensor itself (else it is applied to the features, like BN or ReLU)."""
    return isinstance(module, (SparseModule, SubMConv3d))


class SparseSequential(torch.nn.Sequential, SparseModule):
    """spconv.SparseSequential: sparse modules get the tensor, the others (BatchNorm1d, ReLU,
    Linear...) its features; an empty tensor skips the latter (BatchNorm fails on 0 rows)."""

    def __init__(self, *args, **kwargs):
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            super().__init__(args[0])
        else:
            super().__init__(*args)
        for name, module in kwargs.items():
            if name in self._modules:
                raise ValueError(f"SparseSequential already has a module named {name!r}")
            self.add_module(name, module)
        self.name = None

    def forward(self, x):
        # In inference a qualifying conv -> BatchNorm -> ReLU runs as the conv with their
        # epilogue, one kernel (nn/conv_epilogue.py); the two modules after it are skipped.
        fuse = fusing()
        modules = tuple(self._modules.values())
        skip = 0
        for i, module in enumerate(modules):
            if skip:
                skip -= 1
            elif is_sparse_module(module) or not isinstance(x, SparseTensor):
                bn = (bn_relu_epilogue(module, modules[i + 1], modules[i + 2])
                      if fuse and i + 2 < len(modules) and isinstance(x, SparseTensor) else None)
                x = module(x) if bn is None else module(x, bn_relu=bn)
                skip = 0 if bn is None else 2
            elif x.num_voxels:
                x = x.replace_feats(module(x.feats))
        return x


class ToDense(SparseModule):
    """spconv.ToDense: [B, C, D0, D1, D2]."""

    def forward(self, x: SparseTensor) -> torch.Tensor:
        return x.dense()
