"""Every op runs on its tensors' GPU, whatever device is current.

Triton launches, the AOT driver launcher, the planner's captured sorts and the tuned-table lookup
all act on the *current* CUDA device. The op entry points (sparse_conv, build_plan, the coordinate
check and hash) therefore make their tensors' device current for the duration of the op, the one
place this is decided; below them everything may read the current device. Autograd's backward
already runs each node with its device current (one engine thread per device).
"""
from __future__ import annotations

import contextlib

import torch

_ALREADY_THERE = contextlib.nullcontext()


def on_device_of(tensor: torch.Tensor):
    """A context in which tensor's CUDA device is the current one (nothing to do, the usual
    case, for a CPU tensor or one on the current device: a shared no-op context, no cost)."""
    if not tensor.is_cuda:
        return _ALREADY_THERE
    index = tensor.get_device()
    if index == torch._C._cuda_getDevice():
        return _ALREADY_THERE
    return torch.cuda.device(index)
