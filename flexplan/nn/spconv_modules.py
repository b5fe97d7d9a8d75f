"""The rest of spconv 2.x's module surface: feature-wise wrappers, tables, sparse addition.

spconv's tables check only that their inputs have the same number of voxels, and then add or
concatenate rows that may belong to different coordinates; here inputs must share their
coordinates (the same tensor, or equal indices: checked), otherwise a clear error. Adding
tensors of different coordinates is sparse_add's job (the union of the coordinates).
"""
from __future__ import annotations

import enum

import torch

from ..coords4d import pack_keys_4d, unpack_keys_4d
from ..planner.keys import pack_coords, unpack_keys
from .sparse_conv_tensor import SparseConvTensor
from .spconv_layers import SparseModule
from .sync_batchnorm import SyncBatchNorm


class ConvAlgo(enum.Enum):
    """spconv's algorithm names, accepted by every layer's `algo` and mapped to flexplan's "auto"
    (flexplan picks its kernels per shape)."""

    Native = 0
    MaskImplicitGemm = 1
    MaskSplitImplicitGemm = 2


def assign_name_for_sparse_modules(module: torch.nn.Module) -> None:
    """spconv's helper: each SparseModule gets its qualified name (for benchmark records)."""
    for name, child in module.named_modules():
        if isinstance(child, SparseModule):
            child._sparse_unique_name = name


def _feature_wise(base, name: str):
    """A torch module that maps a SparseConvTensor's features (and plain tensors as before)."""

    class FeatureWise(base):
        def forward(self, input):
            if isinstance(input, SparseConvTensor):
                return input.replace_feature(super().forward(input.features))
            return super().forward(input)

    FeatureWise.__name__ = FeatureWise.__qualname__ = name
    owner = base.__module__.split(".")[0]  # torch, or flexplan (its SyncBatchNorm)
    FeatureWise.__doc__ = f"spconv's {name}: {owner}'s {base.__name__} on the features."
    return FeatureWise


SparseBatchNorm = _feature_wise(torch.nn.BatchNorm1d, "SparseBatchNorm")
SparseSyncBatchNorm = _feature_wise(torch.nn.SyncBatchNorm, "SparseSyncBatchNorm")
# flexplan.nn.convert_sync_batchnorm (opt-in: flexplan's SyncBatchNorm, no host syncs) turns
# either into this one, which keeps mapping features. spconv's name stays torch's module.
FlexSparseSyncBatchNorm = _feature_wise(SyncBatchNorm, "FlexSparseSyncBatchNorm")
for _cls in (SparseBatchNorm, SparseSyncBatchNorm, FlexSparseSyncBatchNorm):
    _cls._sync_batchnorm_class = FlexSparseSyncBatchNorm
SparseReLU = _feature_wise(torch.nn.ReLU, "SparseReLU")
SparseIdentity = _feature_wise(torch.nn.Identity, "SparseIdentity")


class Identity(torch.nn.Module):
    def forward(self, input):
        return input

    def input_spatial_size(self, out_size):
        return out_size


class RemoveGrid(SparseModule):
    """spconv's RemoveGrid: drops the (unused here) pre-allocated grid."""

    def forward(self, x: SparseConvTensor) -> SparseConvTensor:
        x.grid = None
        return x


def _same_grid(tensors, what: str) -> None:
    first = tensors[0]
    for t in tensors[1:]:
        if not isinstance(t, SparseConvTensor):
            raise TypeError(f"{what} takes SparseConvTensors, got {type(t).__name__}")
        if t.batch_size != first.batch_size or t.grid_shape != first.grid_shape:
            raise ValueError(f"{what}: inputs differ in batch size or spatial shape")


def _same_sites(a: SparseConvTensor, b: SparseConvTensor) -> bool:
    """The same coordinates in the same row order (shared ones need no device compare)."""
    return a.coords is b.coords or a._plans is b._plans or (
        a.coords.shape == b.coords.shape and bool(torch.equal(a.coords, b.coords)))


def _check_same_sites(tensors, what: str) -> None:
    _same_grid(tensors, what)
    for t in tensors[1:]:
        if not _same_sites(tensors[0], t):
            raise ValueError(f"{what} needs inputs over the same coordinates (in the same row "
                             "order); add tensors of different coordinates with "
                             "functional.sparse_add (AddTableMisaligned)")


class JoinTable(SparseModule):
    """Concatenates the features of tensors over the same coordinates."""

    def forward(self, input: list) -> SparseConvTensor:
        _check_same_sites(input, "JoinTable")
        return input[0].replace_feature(torch.cat([t.features for t in input], 1))

    def input_spatial_size(self, out_size):
        return out_size


class AddTable(SparseModule):
    """Adds the features of tensors over the same coordinates."""

    def forward(self, input: list) -> SparseConvTensor:
        _check_same_sites(input, "AddTable")
        channels = {t.features.shape[1] for t in input}
        if len(channels) != 1:
            raise ValueError(f"AddTable: inputs have different channel counts {sorted(channels)}")
        return input[0].replace_feature(sum(t.features for t in input))

    def input_spatial_size(self, out_size):
        return out_size


class AddTableMisaligned(SparseModule):
    """Adds tensors of different coordinates (their union): functional.sparse_add."""

    def forward(self, input: list) -> SparseConvTensor:
        return sparse_add(*input)

    def input_spatial_size(self, out_size):
        return out_size


class ConcatTable(SparseModule):
    """Runs each child on the input: a list of their outputs."""

    def forward(self, input):
        return [module(input) for module in self._modules.values()]

    def add(self, module):
        self._modules[str(len(self._modules))] = module
        return self

    def input_spatial_size(self, out_size):
        return self._modules["0"].input_spatial_size(out_size)


def sparse_add(*tensors: SparseConvTensor) -> SparseConvTensor:
    """spconv's functional.sparse_add: the sum over the union of the tensors' coordinates (a
    site present in several adds their features). Tensors over the same coordinates keep their
    rows, plans and indice_dict; otherwise the output's rows are in coordinate order and it has
    no indice_dict (as spconv, an inverse conv cannot follow it)."""
    if not tensors:
        raise ValueError("sparse_add needs at least one tensor")
    first = tensors[0]
    _same_grid(tensors, "sparse_add")
    if any(t.features.shape[1] != first.features.shape[1] for t in tensors):
        raise ValueError("sparse_add: inputs have different channel counts")
    if all(_same_sites(first, t) for t in tensors[1:]):
        return first.replace_feature(sum(t.features for t in tensors))
    grid, batch = first.grid_shape, first.batch_size
    four_d = first.ndim == 4  # [N, 5] coords: 4D keys
    keys = torch.cat([pack_keys_4d(t.coords, grid) if four_d else pack_coords(t.coords, grid, batch)
                      for t in tensors])
    feats = torch.cat([t.features for t in tensors])
    uniq, rows = torch.unique(keys, return_inverse=True)
    out = feats.new_zeros((uniq.shape[0], feats.shape[1])).index_add(0, rows, feats)
    coords = (unpack_keys_4d(uniq, grid) if four_d else unpack_keys(uniq, grid)).to(torch.int32)
    result = SparseConvTensor(out, coords, grid, batch, check=False)
    if first.ndim < 3:  # the same 2D / 1D view as the inputs
        result = SparseConvTensor(out, coords[:, :1 + first.ndim], grid[:first.ndim], batch,
                                  check=False)
    return result
