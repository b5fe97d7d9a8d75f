"""Run-time tuning of buckets the tables miss (opted in with FLEXPLAN_TUNE, see dispatch).

The bucket is tuned on a synthetic sphere-shell case of its representative size, the result
is merged into this GPU's user table (so the next process finds it) and made visible to the
running one. dispatch reaches this module only through its tuning hook (tune_missing,
installed by the package's __init__): the tuner runs the ops, which sit above dispatch.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import warnings

import torch

from ..kernel_configs import KernelConfig
from . import dispatch
from .buckets import Bucket

_failed: set = set()    # buckets that could not be tuned: not retried in this process
_pending: set = set()   # buckets queued for the worker
_queue: "queue.Queue[tuple[int, Bucket]]" = queue.Queue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def tune_missing(index: int, bucket: Bucket, mode: str) -> KernelConfig | None:
    """dispatch's tuning hook: "ondemand" tunes now, "background" queues the bucket (None:
    dispatch's fallback meanwhile, a tuned neighbour's config or the heuristic)."""
    if mode == "ondemand":
        return tune_now(index, bucket)
    tune_in_background(index, bucket)
    return None


def tune_now(index: int, bucket: Bucket) -> KernelConfig | None:
    """Tune `bucket` in this thread; None when not possible now (graph capture, no case)."""
    if bucket in _failed or _capturing():
        return None
    try:
        return _tune(index, bucket)
    except Exception as err:  # tuning must never break the call that triggered it
        _failed.add(bucket)
        warnings.warn(f"flexplan: run-time tuning of {bucket} failed ({err}); using a "
                      "tuned neighbour's or the heuristic config", RuntimeWarning, stacklevel=2)
        return None


def _capturing() -> bool:
    """Inside CUDA graph capture nothing may synchronize: no tuning there."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def tune_in_background(index: int, bucket: Bucket) -> None:
    global _worker
    with _worker_lock:
        if bucket in _pending or bucket in _failed:
            return
        _pending.add(bucket)
        _queue.put((index, bucket))
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_work, name="flexplan-tuner", daemon=True)
            _worker.start()


def _work() -> None:
    while True:
        index, bucket = _queue.get()
        try:
            with _on_side_stream(index):
                tune_now(index, bucket)
        finally:
            with _worker_lock:
                _pending.discard(bucket)
            _queue.task_done()


@contextlib.contextmanager
def _on_side_stream(index: int):
    """The worker's kernels go to a stream of their own, not the caller's."""
    torch.cuda.set_device(index)
    with torch.cuda.stream(torch.cuda.Stream(index)):
        yield


def _tune(index: int, bucket: Bucket) -> KernelConfig | None:
    # Imported on first use: the package's __init__ imports this module, and the tuner's
    # cases pull in the ops and the planner, which a process that never tunes need not load.
    from .cases import case_for
    from .device import device_key
    from .table import TuningTable, merge_into, user_table_path
    from .tuner import tune_cases

    case = case_for(bucket.representative(), torch.device("cuda", index))
    if case is None:
        _failed.add(bucket)
        return None
    tuned = tune_cases([case], log=lambda msg: None)[0]
    entry = tuned.entry()
    key = device_key(index)
    # The synthetic case lands near, not always in, the bucket: file it under the asked one.
    merge_into(user_table_path(key), TuningTable(key, {bucket: entry}))
    dispatch.add_configs(index, {bucket: entry.config})
    return entry.config

