"""What the ops that torch.compile keeps in its graphs share (ops/conv.py, ops/pool.py): their
tags and the context their eager implementations run in."""
from __future__ import annotations

import contextlib

import torch

from ..device_guard import on_device_of

# The graphs' ops launch kernels over a plan found from Python: never inside a CUDA graph that
# torch.compile(mode="reduce-overhead") records (its replays would skip the lookup).
GRAPH_OP_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


@contextlib.contextmanager
def op_context(tensor: torch.Tensor):
    """Where a graph's op runs its eager implementation: on tensor's device, autocast off
    (the graph cast the inputs; the op's own torch ops must not cast again)."""
    with on_device_of(tensor), torch.autocast(tensor.device.type, enabled=False):
        yield
