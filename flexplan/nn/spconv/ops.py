"""spconv.pytorch.ops, as far as user code calls it: the output-size helpers (what detection
heads and data pipelines compute grids with). spconv's low-level pair and GEMM functions
(get_indice_pairs, indice_conv, implicit_gemm, indice_maxpool, ...) hand spconv's own pair
tables between its kernels; flexplan's plans are another layout, so those names raise with the
layer or function to use instead rather than return something shaped differently."""
from __future__ import annotations

from typing import Sequence

__all__ = ["get_conv_output_size", "get_deconv_output_size"]


def get_conv_output_size(input_size: Sequence[int], kernel_size: Sequence[int],
                         stride: Sequence[int], padding: Sequence[int],
                         dilation: Sequence[int]) -> list[int]:
    """Grid of a strided (regular) conv per axis, as spconv: a kernel size of -1 spans the axis
    (output 1)."""
    out = []
    for size, k, s, p, d in zip(input_size, kernel_size, stride, padding, dilation, strict=True):
        out.append(1 if k == -1 else (size + 2 * p - d * (k - 1) - 1) // s + 1)
    return out


def get_deconv_output_size(input_size: Sequence[int], kernel_size: Sequence[int],
                           stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                           output_padding: Sequence[int]) -> list[int]:
    """Grid of a transposed conv per axis, as spconv (which ignores dilation here too)."""
    if any(k == -1 for k in kernel_size):
        raise ValueError("a transposed conv cannot span an axis (kernel size -1)")
    return [(size - 1) * s - 2 * p + k + op for size, k, s, p, op
            in zip(input_size, kernel_size, stride, padding, output_padding, strict=True)]


_INSTEAD = {
    "get_indice_pairs": "the layers (SubMConv3d, SparseConv3d, ...) or flexplan.build_plan",
    "get_indice_pairs_implicit_gemm": "the layers or flexplan.build_plan",
    "indice_conv": "the layers or flexplan.sparse_conv",
    "fused_indice_conv": "the layers or flexplan.sparse_conv",
    "indice_conv_backward": "autograd through flexplan.sparse_conv",
    "implicit_gemm": "the layers or flexplan.sparse_conv",
    "implicit_gemm_backward": "autograd through flexplan.sparse_conv",
    "indice_maxpool": "SparseMaxPool3d",
    "indice_maxpool_backward": "autograd through SparseMaxPool3d",
    "indice_maxpool_implicit_gemm": "SparseMaxPool3d",
    "indice_maxpool_implicit_gemm_backward": "autograd through SparseMaxPool3d",
    "indice_avgpool_implicit_gemm": "SparseAvgPool3d",
    "indice_avgpool_implicit_gemm_backward": "autograd through SparseAvgPool3d",
    "global_pool_rearrange": "SparseGlobalMaxPool / SparseGlobalAvgPool",
}


def __getattr__(name: str):
    if name in _INSTEAD:
        raise NotImplementedError(
            f"spconv.pytorch.ops.{name} works on spconv's own pair tables, which flexplan does "
            f"not make; use {_INSTEAD[name]} (docs/migrating_from_spconv.md)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
