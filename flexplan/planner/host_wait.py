"""Host work done while a plan build waits for the GPU.

A strided or transposed build reads its output and pair counts back (its one host sync,
generative_triton.py) and so waits for its own kernels: the candidates' sort and run starts,
some hundreds of microseconds of GPU time in which the host of a host-bound step sits idle.
A caller holding other host work that is ready (the step's plan prefetch: the submanifold
builds whose coordinates exist already) hands it here for the block around one build. The
build's wait (read_counts) then queues the counts' copy to pinned memory behind an event,
runs the work, and waits for the event only: for the build's own kernels, not for the
work's, which the GPU runs after them while the host goes on.

The work runs once, at the block's first wait, on the thread that handed it; a build the
work itself makes waits plainly. An error in the work propagates from the build (the caller's
to handle: it is the work's error, the build is abandoned with it).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

import torch

_local = threading.local()


@contextmanager
def filled_with(work: Callable[[], None]):
    """Within the block, the first build wait on this thread runs work() before it waits."""
    was = getattr(_local, "work", None)
    _local.work = work
    try:
        yield
    finally:
        _local.work = was


def read_counts(values: torch.Tensor) -> list[int]:
    """values (a few integers a build's kernels leave on its device) as host ints: the build's
    host sync, with the work handed to filled_with, if any, run before the wait."""
    work = getattr(_local, "work", None)
    if work is None:
        return values.tolist()
    _local.work = None  # (once: a build inside the work waits plainly)
    if not values.is_cuda:  # (the interpreter's kernels ran already: nothing to overlap)
        work()
        return values.tolist()
    host = _pinned(values.dtype, values.numel())
    host.copy_(values.reshape(-1), non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    work()
    done.synchronize()
    return host.tolist()


def _pinned(dtype: torch.dtype, size: int) -> torch.Tensor:
    """This thread's pinned host buffer of `size` dtype elements (read before the thread's next
    wait, so one per thread serves every wait)."""
    buffers = getattr(_local, "pinned", None)
    if buffers is None:
        buffers = _local.pinned = {}
    host = buffers.get((dtype, size))
    if host is None:
        host = buffers[(dtype, size)] = torch.empty(size, dtype=dtype, pin_memory=True)
    return host
