"""Sparse convolution ops: one module per op, each a kernel launcher + autograd Function."""
from .conv import BatchNormReLU, SparseConvFunction, sparse_conv
from .pool import SparsePoolFunction, global_pool, sparse_pool

__all__ = ["BatchNormReLU", "SparseConvFunction", "SparsePoolFunction", "global_pool", "sparse_conv", "sparse_pool"]
