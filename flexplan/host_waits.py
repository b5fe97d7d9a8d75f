"""Releases the host does while it waits for the GPU, at the bottom of the package (it imports
nothing of flexplan).

A step on new coordinates is host-bound, and its few host syncs (a strided build's output
count, the coordinate check's verdict) wait for kernels the host just queued: tens of
microseconds in which the host does nothing. Dropping a plan the cache no longer keeps costs
host time of about that size (its tensors' and views' deallocation, tens of microseconds on a
GPU host: scripts/results/host_costs.md, session 49), and nothing needs it to happen at once.
So the plan cache hands what it drops to release_later, and the syncs call release_now right
before they wait: the deallocation then fills a wait instead of lengthening the step.

At most MAX_PENDING objects wait here (a job with no such sync, or one of many drops between
them, releases the oldest at once), so memory is held back by a bounded amount: half the plan
cache's ring of recent plans (cache/memory.py, RECENT_PLANS) at most.
"""
from __future__ import annotations

import os
import threading
from collections import deque

MAX_PENDING = 8

_pending: deque = deque()
_lock = threading.Lock()
# What waited here at a fork stays referenced in the child (its device memory is the parent's:
# not freed there by this module; other objects the child drops are its own affair).
_inherited: list = []


def release_later(obj) -> None:
    """Keep obj (its last reference, typically) until the next release_now; past MAX_PENDING
    objects, the oldest is released here."""
    with _lock:
        _pending.append(obj)
        oldest = _pending.popleft() if len(_pending) > MAX_PENDING else None
    del oldest  # (released outside the lock: its deallocation may run callbacks)


def release_now() -> int:
    """Release what waits here (call right before a host wait on the GPU); how many."""
    with _lock:
        if not _pending:
            return 0
        objs = list(_pending)
        _pending.clear()
    count = len(objs)
    del objs
    return count


def pending() -> int:
    return len(_pending)


def _after_fork_in_child() -> None:
    global _pending, _lock
    _inherited.append(_pending)
    _pending, _lock = deque(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
