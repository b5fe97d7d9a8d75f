"""SparseSequential and ToDense: spconv's containers over SparseConvTensor."""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..sparse_tensor import SparseTensor
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
        for module in self:
            if is_sparse_module(module) or not isinstance(x, SparseTensor):
                x = module(x)
            elif x.num_voxels:
                x = x.replace_feats(module(x.feats))
        return x


class ToDense(SparseModule):
    """spconv.ToDense: [B, C, D0, D1, D2]."""

    def forward(self, x: SparseTensor) -> torch.Tensor:
        return x.dense()
