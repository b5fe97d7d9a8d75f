"""Sparse convolution ops: one module per op, each a kernel launcher + autograd Function."""
from .sparse_conv import SparseConvFunction, sparse_conv

__all__ = ["SparseConvFunction", "sparse_conv"]
