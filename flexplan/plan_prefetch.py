"""A step's plans built at its first request, in the order the previous steps asked for them.

A network asks for its plans one layer at a time, and a strided layer's build waits for the GPU
(its output count sizes the output). Mid-forward, that wait covers all the work queued before it,
under DistributedDataParallel with SyncBatchNorm the other ranks' collectives too: every strided
layer of every step couples the ranks' hosts. The plans depend on the coordinates alone, so when
two steps in a row asked for the same sequence of plans (the same layers over fresh coordinates),
the next step's first request builds the whole sequence at once, before any of the step's kernels
or collectives are queued; the layers then find their plans here.

What a step asks is recorded per thread as requests (path, geometry, training, scheduled): path
names the coordinates by the strided geometries that led from the step's input coordinates to
them (the input's is ()). A step begins with a request on coordinates the current step did not make, or
with a repeat of its first request. Nothing here changes which plan a layer gets: prefetched
plans are keyed by the coordinates' identity, device, grid and batch size and the geometry, as
the cache keys them, and handed to the first layer that asks (its tensor keeps it). A
sequence that differs from the last (another network, a branch) only builds what it asks;
a failed prefetch is dropped with a warning and not tried again for that kind of step (the
layers' own requests then build, or raise if the failure was real).

FLEXPLAN_PLAN_PREFETCH=0 turns it off (every plan built at its layer, as before); any other
value leaves it on. A variant building the sequence on a worker thread while the forward ran was
measured 13-29% slower on these host-bound steps (scripts/results/bench_precision.md, "Async
plan prefetch on the GPU") and was removed.
"""
from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict

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
# Build a step's strided plans before its submanifold ones. A strided build waits for the GPU
# (its output count) and so for everything queued before it: a submanifold build queued
# first (whose own kernels make no host sync) would add its kernels to that wait. Strided
# plans depend only on the strided plans before them, so building them first leaves each
# wait its own kernels, and the submanifold builds' kernels run while the host goes on to
# the forward. False: the recorded order (for A/B runs, scripts/bench_precision.py).
STRIDED_FIRST = True


def mode() -> str:
    """"off" (FLEXPLAN_PLAN_PREFETCH=0) or "sync" (any other value, or unset: the default;
    "async", a removed variant, too, so that scripts setting it keep running)."""
    value = os.environ.get(PREFETCH_ENV, "1").strip().lower()
    return "off" if value == "0" else "sync"


def enabled() -> bool:
    return mode() != "off"


class _Steps(threading.local):
    """This thread's current step and the sequences of the steps before it."""

    def __init__(self):
        self.paths: dict = {}          # node -> path, for the current step (_node)
        self.recording: list = []      # the current step's requests (kinds handed out)
        self.kind: tuple | None = None  # the current step's first request, grid and batch size
        self.prefetched: dict = {}     # (node, geometry) -> ConvPlan, until taken
        self.failed: set = set()       # kinds whose prefetch raised: not tried again
        self.recipes: OrderedDict = OrderedDict()  # first request -> [requests, confirmed]


_steps = _Steps()


def plan_for(x, geometry: ConvGeometry, training: bool, scheduled: bool = True) -> ConvPlan:
    """The plan of `geometry` over x's coordinates: prefetched for this step, else from the
    cache (built there if new). Records the request. (training, scheduled: the kind asked,
    as cache.cached_plan takes them.)"""
    if not enabled():
        return cached_for(x, geometry, training, scheduled)
    steps = _steps
    identity, device = x.coords_identity(), x.coords.device
    node = _node(identity, device, x.grid_shape, x.batch_size)
    path = steps.paths.get(node)
    request = (path, geometry, training, scheduled)
    if path is None or (steps.recording and request == steps.kind[0]):
        request = (), geometry, training, scheduled
        _begin_step(steps, x, node, request)
    plan = steps.prefetched.pop((node, geometry), None)  # the layer's tensor keeps it from here
    if plan is None or not plan.serves(training, scheduled):
        plan = _cached(x.coords, x.grid_shape, x.batch_size, geometry, identity, training,
                       scheduled)
    if len(steps.recording) <= MAX_REQUESTS:
        # The kind handed out, which may be richer than the one asked (a pool's request given
        # the conv's plan of its geometry): a step whose prefetch built that richer plan then
        # records what the step before it did, the other layer's request being served from
        # the tensor's memo.
        steps.recording.append((request[0], geometry, training or plan.for_training,
                                scheduled or not plan.maps_only))
    if not geometry.submanifold:
        child = derived_identity(identity, x.grid_shape, x.batch_size, geometry)
        steps.paths[_node(child, device, plan.out_spatial_shape, x.batch_size)] = (
            request[0] + (geometry,))
    return plan


def cached_for(x, geometry: ConvGeometry, training: bool, scheduled: bool = True) -> ConvPlan:
    """The plan of `geometry` over x's coordinates from the cache alone (built there if new):
    no request of the step, nothing recorded."""
    return _cached(x.coords, x.grid_shape, x.batch_size, geometry, x.coords_identity(),
                   training, scheduled)


def clear() -> None:
    """Forget this thread's step and sequences (and the plans they hold)."""
    _steps.__init__()


def _node(identity: bytes, device, grid_shape, batch_size: int) -> tuple:
    """A set of coordinates as the plan cache tells them apart: the same rows under another
    grid or batch size have other plans (a strided output's border, its grid)."""
    return identity, device, tuple(int(s) for s in grid_shape), int(batch_size)


def _cached(coords, grid_shape, batch_size, geometry, identity, training,
            scheduled: bool = True) -> ConvPlan:
    return cached_plan(coords, grid_shape, batch_size, geometry, check=False, identity=identity,
                       training=training, scheduled=scheduled)


def _begin_step(steps: _Steps, x, node: tuple, first: tuple) -> None:
    """End the current step (its requests become the sequence of their kind) and begin one on
    x's coordinates (node); prefetch its plans if the two steps before it asked the same."""
    _remember(steps)
    steps.paths = {node: ()}
    steps.recording, steps.prefetched = [], {}
    kind = steps.kind = _kind(first, x.grid_shape, x.batch_size)
    entry = steps.recipes.get(kind)
    if entry is not None and entry[1] and kind not in steps.failed:
        try:
            _prefetch(steps, x, node, entry[0])
        except Exception as exc:  # noqa: BLE001 - the layers' own requests build (or raise)
            _failed(steps, kind, exc)


def _failed(steps: _Steps, kind: tuple, exc: BaseException) -> None:
    steps.prefetched = {}
    steps.failed.add(kind)
    warnings.warn(f"flexplan: prefetching a step's plans failed ({type(exc).__name__}: "
                  f"{exc}); this network's plans are built at its layers from now on",
                  RuntimeWarning, stacklevel=3)


def _kind(first: tuple, grid_shape, batch_size: int) -> tuple:
    return first, tuple(grid_shape), int(batch_size)


def _remember(steps: _Steps) -> None:
    """The ended step's requests become the sequence of its kind, confirmed if they repeat it."""
    if not steps.recording or len(steps.recording) > MAX_REQUESTS:
        return
    recording = _merged(steps.recording)
    kind = steps.kind
    entry = steps.recipes.get(kind)
    if entry is not None and entry[0] == recording:
        entry[1] = True
        steps.recipes.move_to_end(kind)
    else:
        steps.recipes[kind] = [recording, False]
        while len(steps.recipes) > MAX_RECIPES:
            steps.recipes.popitem(last=False)


def _merged(recording: list) -> list:
    """The requests with those of one plan (path and geometry) merged into the richest kind,
    at the first one's place: one plan per key is built (a pool and a conv of one geometry
    over the same coordinates share the conv's plan), and a step records the same sequence
    whether its layers built their plans or found them prefetched."""
    merged: dict = {}
    for path, geometry, training, scheduled in recording:
        was = merged.get((path, geometry))
        if was is not None:
            training, scheduled = training or was[0], scheduled or was[1]
        merged[(path, geometry)] = training, scheduled
    return [(path, geometry, training, scheduled)
            for (path, geometry), (training, scheduled) in merged.items()]


def _prefetch(steps: _Steps, x, node: tuple, recipe: list) -> None:
    """Build (or find in the cache) every plan of `recipe` over x's coordinates and the
    coordinates its strided plans make, here: the strided plans first, in the recorded order,
    then the submanifold ones (STRIDED_FIRST); the first failure raises."""
    coords_of = {(): x.coords}  # path -> coordinates (a strided entry builds them for later ones)
    entries = _plan_entries(steps, x, node, recipe)
    if STRIDED_FIRST:  # (stable: each strided entry still follows the ones it depends on)
        entries.sort(key=lambda entry: entry[1].submanifold)
    for path, geometry, training, scheduled, grid, ident, key in entries:
        plan = _cached(coords_of[path], grid, x.batch_size, geometry, ident, training, scheduled)
        if not geometry.submanifold:
            coords_of[path + (geometry,)] = plan.out_coords
        steps.prefetched[key] = plan


def _plan_entries(steps: _Steps, x, node: tuple, recipe: list) -> list:
    """The requests of `recipe` that this step's coordinates reach, in order, as (path,
    geometry, training, scheduled, grid, identity, key): keyed on the host before any is built
    (a strided request's output coordinates take their identity and grid from its input's), and
    their paths noted for the layers (steps.paths)."""
    device, batch_size = x.coords.device, x.batch_size
    sets = {(): (node[0], tuple(x.grid_shape))}  # path -> identity, grid
    entries = []
    for path, geometry, training, scheduled in recipe:
        at = sets.get(path)
        if at is None:  # recorded on coordinates this sequence does not make: stop here
            break
        ident, grid = at
        entries.append((path, geometry, training, scheduled, grid, ident,
                        (_node(ident, device, grid, batch_size), geometry)))
        if not geometry.submanifold:
            child = derived_identity(ident, grid, batch_size, geometry)
            out_grid = output_spatial_shape(grid, geometry)
            sets[path + (geometry,)] = (child, out_grid)
            steps.paths[_node(child, device, out_grid, batch_size)] = path + (geometry,)
    return entries


# A forked child (a DataLoader worker) starts with no step of its own: the parent's recorded
# sequences and prefetched plans (tensors of the parent's device) are not the child's.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=clear)
