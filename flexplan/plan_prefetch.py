"""A step's plans built at its first request, in the order the previous steps asked for them.

A network asks for its plans one layer at a time, and a strided layer's build waits for the GPU
(its output count sizes the output). Mid-forward, that wait covers all the work queued before it,
under DistributedDataParallel with SyncBatchNorm the other ranks' collectives too: every strided
layer of every step couples the ranks' hosts. The plans depend on the coordinates alone, so when
two steps in a row asked for the same sequence of plans (the same layers over fresh coordinates),
the next step's first request builds the whole sequence at once, before any of the step's kernels
or collectives are queued; the layers then find their plans here.

What a step asks is recorded per thread as requests (path, geometry, training): path names the
coordinates by the strided geometries that led from the step's input coordinates to them (the
input's is ()). A step begins with a request on coordinates the current step did not make, or
with a repeat of its first request. Nothing here changes which plan a layer gets: prefetched
plans are keyed by the coordinates' identity, device, grid and batch size and the geometry, as
the cache keys them, and handed to the first layer that asks (its tensor keeps it). A
sequence that differs from the last (another network, a branch) only builds what it asks;
a failed prefetch is dropped with a warning and not tried again for that kind of step (the
layers' own requests then build, or raise if the failure was real).

FLEXPLAN_PLAN_PREFETCH=0 turns it off (every plan built at its layer, as before).
FLEXPLAN_PLAN_PREFETCH=async (experimental; measured 13-29% slower than the default on the
host-bound e2e steps, scripts/results/bench_precision.md) builds the sequence on a worker
thread instead, while the step's forward runs: a layer waits only for its own plan. The
builds' host work then overlaps the forward's (torch releases the GIL inside op dispatch, Triton
around its launch) and their syncs block the worker alone. The worker launches on the same
CUDA stream as the layers (the current stream of the step's thread when the step began), so a
plan's kernels are queued before any kernel of the layer that waited for it, and its tensors
are allocated, freed and reused in that stream's order: no events, no cross-stream hazards.
"""
from __future__ import annotations

import os
import queue
import threading
import warnings
from collections import OrderedDict

import torch

from .cache import cached_plan
from .cache.key import derived_identity
from .geometry import ConvGeometry
from .plan import ConvPlan
from .planner.generative import output_spatial_shape

PREFETCH_ENV = "FLEXPLAN_PLAN_PREFETCH"
# A step asking for more plans than this is not recorded (nothing of its kind is prefetched).
MAX_REQUESTS = 256
# Sequences kept, by their first request (networks, or the branches of one, that alternate).
MAX_RECIPES = 8


def mode() -> str:
    """"off" (FLEXPLAN_PLAN_PREFETCH=0), "async" (=async) or "sync" (the default)."""
    value = os.environ.get(PREFETCH_ENV, "1").strip().lower()
    return "off" if value == "0" else "async" if value == "async" else "sync"


def enabled() -> bool:
    return mode() != "off"


class _Steps(threading.local):
    """This thread's current step and the sequences of the steps before it."""

    def __init__(self):
        self.paths: dict = {}          # node -> path, for the current step (_node)
        self.recording: list = []      # the current step's requests
        self.kind: tuple | None = None  # the current step's first request, grid and batch size
        self.prefetched: dict = {}     # (node, geometry) -> ConvPlan or _Pending, until taken
        self.job = None                # the step's job on the worker (async), to cancel
        self.failed: set = set()       # kinds whose prefetch raised: not tried again
        self.recipes: OrderedDict = OrderedDict()  # first request -> [requests, confirmed]


_steps = _Steps()


def plan_for(x, geometry: ConvGeometry, training: bool) -> ConvPlan:
    """The plan of `geometry` over x's coordinates: prefetched for this step, else from the
    cache (built there if new). Records the request."""
    if not enabled():
        return _cached(x.coords, x.grid_shape, x.batch_size, geometry, x.coords_identity(),
                       training)
    steps = _steps
    identity, device = x.coords_identity(), x.coords.device
    node = _node(identity, device, x.grid_shape, x.batch_size)
    path = steps.paths.get(node)
    request = (path, geometry, training)
    if path is None or (steps.recording and request == steps.recording[0]):
        request = (), geometry, training
        _begin_step(steps, x, node, request)
    if len(steps.recording) <= MAX_REQUESTS:
        steps.recording.append(request)
    plan = steps.prefetched.pop((node, geometry), None)  # the layer's tensor keeps it from here
    if isinstance(plan, _Pending):
        plan = _take(steps, plan)
    if plan is None or not plan.serves(training):
        plan = _cached(x.coords, x.grid_shape, x.batch_size, geometry, identity, training)
    if not geometry.submanifold:
        child = derived_identity(identity, x.grid_shape, x.batch_size, geometry)
        steps.paths[_node(child, device, plan.out_spatial_shape, x.batch_size)] = (
            request[0] + (geometry,))
    return plan


def clear() -> None:
    """Forget this thread's step and sequences (and the plans they hold)."""
    _steps.__init__()


def _node(identity: bytes, device, grid_shape, batch_size: int) -> tuple:
    """A set of coordinates as the plan cache tells them apart: the same rows under another
    grid or batch size have other plans (a strided output's border, its grid)."""
    return identity, device, tuple(int(s) for s in grid_shape), int(batch_size)


def _cached(coords, grid_shape, batch_size, geometry, identity, training) -> ConvPlan:
    return cached_plan(coords, grid_shape, batch_size, geometry, check=False, identity=identity,
                       training=training)


def _begin_step(steps: _Steps, x, node: tuple, first: tuple) -> None:
    """End the current step (its requests become the sequence of their kind) and begin one on
    x's coordinates (node); prefetch its plans if the two steps before it asked the same."""
    _remember(steps)
    if steps.job is not None:  # the last step's builds not taken yet: not wanted any more
        steps.job.cancelled = True
        steps.job = None
    steps.paths = {node: ()}
    steps.recording, steps.prefetched = [], {}
    kind = steps.kind = _kind(first, x.grid_shape, x.batch_size)
    entry = steps.recipes.get(kind)
    if entry is not None and entry[1] and kind not in steps.failed:
        try:
            if mode() == "async":
                _submit(steps, x, node, entry[0])
            else:
                _prefetch(steps, x, node, entry[0])
        except Exception as exc:  # noqa: BLE001 - the layers' own requests build (or raise)
            _failed(steps, kind, exc)


def _failed(steps: _Steps, kind: tuple, exc: BaseException) -> None:
    if steps.job is not None:  # the worker's other builds of the step: the layers make them
        steps.job.cancelled = True
    steps.prefetched = {}
    steps.failed.add(kind)
    warnings.warn(f"flexplan: prefetching a step's plans failed ({type(exc).__name__}: "
                  f"{exc}); this network's plans are built at its layers from now on",
                  RuntimeWarning, stacklevel=3)


def _kind(first: tuple, grid_shape, batch_size: int) -> tuple:
    return first, tuple(grid_shape), int(batch_size)


def _remember(steps: _Steps) -> None:
    """The ended step's requests become the sequence of its kind, confirmed if they repeat it."""
    recording = steps.recording
    if not recording or len(recording) > MAX_REQUESTS:
        return
    kind = steps.kind
    entry = steps.recipes.get(kind)
    if entry is not None and entry[0] == recording:
        entry[1] = True
        steps.recipes.move_to_end(kind)
    else:
        steps.recipes[kind] = [recording, False]
        while len(steps.recipes) > MAX_RECIPES:
            steps.recipes.popitem(last=False)


def _prefetch(steps: _Steps, x, node: tuple, recipe: list) -> None:
    """Build (or find in the cache) every plan of `recipe` over x's coordinates and the
    coordinates its strided plans make, in the recorded order, here; the first failure
    raises."""
    def put(key, plan, error):
        if error is not None:
            raise error
        steps.prefetched[key] = plan

    _build_in_order(x.coords, x.batch_size, _plan_entries(steps, x, node, recipe), put)


def _plan_entries(steps: _Steps, x, node: tuple, recipe: list) -> list:
    """The requests of `recipe` that this step's coordinates reach, in order, as (path,
    geometry, training, grid, identity, key): keyed on the host before any is built (a
    strided request's output coordinates take their identity and grid from its input's), and
    their paths noted for the layers (steps.paths)."""
    device, batch_size = x.coords.device, x.batch_size
    sets = {(): (node[0], tuple(x.grid_shape))}  # path -> identity, grid
    entries = []
    for path, geometry, training in recipe:
        at = sets.get(path)
        if at is None:  # recorded on coordinates this sequence does not make: stop here
            break
        ident, grid = at
        entries.append((path, geometry, training, grid, ident,
                        (_node(ident, device, grid, batch_size), geometry)))
        if not geometry.submanifold:
            child = derived_identity(ident, grid, batch_size, geometry)
            out_grid = output_spatial_shape(grid, geometry)
            sets[path + (geometry,)] = (child, out_grid)
            steps.paths[_node(child, device, out_grid, batch_size)] = path + (geometry,)
    return entries


def _build_in_order(coords, batch_size: int, entries: list, put, cancelled=lambda: False):
    """Build (or find in the cache) the entries' plans in order over `coords` and the
    coordinates the strided ones make; put(target, plan, None) each, or put(target, None,
    exception) where it failed (its input missing, or cancelled()). target: an entry's last
    item."""
    coords_of = {(): coords}
    for path, geometry, training, grid, ident, target in entries:
        try:
            at = coords_of.get(path)
            if at is None or cancelled():
                raise RuntimeError("not built: the step ended or its input was not built")
            plan = _cached(at, grid, batch_size, geometry, ident, training)
            if not geometry.submanifold:
                coords_of[path + (geometry,)] = plan.out_coords
        except BaseException as exc:  # noqa: BLE001 - the caller's to raise or hand over
            put(target, None, exc)
            continue
        put(target, plan, None)


# ---------------------------------------------------------------- async: a worker thread

class _Pending:
    """A plan the worker builds: set once, with the plan or the exception that stopped it."""

    __slots__ = ("done", "plan", "error", "kind", "device", "stream")

    def __init__(self, kind: tuple, device, stream):
        self.done = threading.Event()
        self.plan = self.error = None
        self.kind, self.device = kind, device
        self.stream = stream  # where the worker launches (CUDA), or None


class _Job:
    """One step's sequence for the worker: (path, geometry, training, pending) in order, the
    step's input coordinates, and where to launch (device, stream)."""

    def __init__(self, coords, batch_size: int, entries: list, device, stream):
        self.coords, self.batch_size, self.entries = coords, batch_size, entries
        self.device, self.stream = device, stream
        self.cancelled = False


def _submit(steps: _Steps, x, node: tuple, recipe: list) -> None:
    """Queue the step's plans on the worker of its device: a pending plan per request (the
    first of a key; a layer's later request of it finds the cache)."""
    device = x.coords.device
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    entries = []
    for *entry, key in _plan_entries(steps, x, node, recipe):
        if key not in steps.prefetched:
            pending = steps.prefetched[key] = _Pending(steps.kind, device, stream)
            entries.append((*entry, pending))
    steps.job = _Job(x.coords, x.batch_size, entries, device, stream)
    _worker(device).put(steps.job)


def _take(steps: _Steps, pending: _Pending) -> ConvPlan | None:
    """The worker's plan (waiting for it), or None where its build failed or the worker is gone
    (then the layer builds it itself, and this kind of step is built at its layers from now
    on). A layer on another stream than the worker's first waits for the worker's stream."""
    while not pending.done.wait(timeout=1.0):
        if not _worker_alive(pending.device):
            pending.error = RuntimeError("the plan prefetch worker thread ended")
            break
    plan, error, pending.plan = pending.plan, pending.error, None
    if error is not None:
        if pending.kind not in steps.failed:
            _failed(steps, pending.kind, error)
        return None
    if pending.stream is not None:
        current = torch.cuda.current_stream(pending.stream.device)
        if current != pending.stream:  # (the worker's kernels are queued on its stream)
            current.wait_stream(pending.stream)
    return plan


def _run(job: _Job) -> None:
    """Build a job's plans in order (on the worker thread), each into its pending."""
    def put(pending, plan, error):
        pending.plan, pending.error = plan, error
        pending.done.set()

    _build_in_order(job.coords, job.batch_size, job.entries, put, lambda: job.cancelled)
    job.entries = job.coords = None  # (the plans are the layers' now)


_workers_lock = threading.Lock()
_workers: dict = {}  # device -> (queue, thread)


def _worker(device) -> queue.Queue:
    """The queue of `device`'s worker thread (started on first use, again if it ended; a
    daemon: it never holds a process open). One per device, so that one GPU's builds never
    wait behind another's; on one device jobs run in the order their steps began."""
    with _workers_lock:
        known = _workers.get(device)
        if known is None or not known[1].is_alive():
            jobs = queue.Queue()
            thread = threading.Thread(target=_serve, args=(jobs,), daemon=True,
                                      name=f"flexplan-plan-prefetch-{device}")
            thread.start()
            known = _workers[device] = jobs, thread
    return known[0]


def _worker_alive(device) -> bool:
    known = _workers.get(device)
    return known is not None and known[1].is_alive()


def _serve(jobs: queue.Queue) -> None:
    while True:
        job = jobs.get()
        try:
            if job.stream is not None:  # the step's device and stream: see the module docstring
                with torch.cuda.device(job.device), torch.cuda.stream(job.stream):
                    _run(job)
            else:
                _run(job)
        except BaseException as exc:  # noqa: BLE001 - (entering the stream failed): the
            for *_, pending in job.entries or ():  # layers build, none waits forever
                if not pending.done.is_set():
                    pending.error = exc
                    pending.done.set()


def _after_fork_in_child() -> None:
    """A forked child has this module's queue but not its worker thread, nor a lock another
    thread may have held: start afresh (and forget the parent's steps)."""
    global _workers_lock
    _workers_lock = threading.Lock()
    _workers.clear()
    _steps.__init__()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
