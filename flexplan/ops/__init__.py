"""Sparse convolution ops: one module per op, each a kernel launcher + autograd Function."""
