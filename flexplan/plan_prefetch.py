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
plans are keyed by the coordinates' identity, device and geometry, as the cache keys them. A
sequence that differs from the last (another network, a branch) only builds what it asks;
a failed prefetch is dropped (the layer's own request then raises, if the failure was real).

FLEXPLAN_PLAN_PREFETCH=0 turns it off (every plan built at its layer, as before).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict

from .cache import cached_plan
from .cache.key import derived_identity
from .geometry import ConvGeometry
from .plan import ConvPlan

PREFETCH_ENV = "FLEXPLAN_PLAN_PREFETCH"
# A step asking for more plans than this is not recorded (nothing of its kind is prefetched).
MAX_REQUESTS = 256
# Sequences kept, by their first request (networks, or the branches of one, that alternate).
MAX_RECIPES = 8


def enabled() -> bool:
    return os.environ.get(PREFETCH_ENV, "1").strip() != "0"


class _Steps(threading.local):
    """This thread's current step and the sequences of the steps before it."""

    def __init__(self):
        self.paths: dict = {}          # (identity, device) -> path, for the current step
        self.recording: list = []      # the current step's requests
        self.kind: tuple | None = None  # the current step's first request, grid and batch size
        self.prefetched: dict = {}     # (identity, device, geometry) -> ConvPlan
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
    path = steps.paths.get((identity, device))
    request = (path, geometry, training)
    if path is None or (steps.recording and request == steps.recording[0]):
        request = (), geometry, training
        _begin_step(steps, x, identity, request)
    if len(steps.recording) <= MAX_REQUESTS:
        steps.recording.append(request)
    plan = steps.prefetched.get((identity, device, geometry))
    if plan is None or not plan.serves(training):
        plan = _cached(x.coords, x.grid_shape, x.batch_size, geometry, identity, training)
    if not geometry.submanifold:
        child = derived_identity(identity, x.grid_shape, x.batch_size, geometry)
        steps.paths[(child, device)] = request[0] + (geometry,)
    return plan


def clear() -> None:
    """Forget this thread's step and sequences (and the plans they hold)."""
    _steps.__init__()


def _cached(coords, grid_shape, batch_size, geometry, identity, training) -> ConvPlan:
    return cached_plan(coords, grid_shape, batch_size, geometry, check=False, identity=identity,
                       training=training)


def _begin_step(steps: _Steps, x, identity: bytes, first: tuple) -> None:
    """End the current step (its requests become the sequence of their kind) and begin one on
    x's coordinates; prefetch its plans if the two steps before it asked the same."""
    _remember(steps)
    steps.paths = {(identity, x.coords.device): ()}
    steps.recording, steps.prefetched = [], {}
    kind = steps.kind = _kind(first, x.grid_shape, x.batch_size)
    entry = steps.recipes.get(kind)
    if entry is not None and entry[1]:
        try:
            _prefetch(steps, x, identity, entry[0])
        except Exception:  # noqa: BLE001 - the layers' own requests build (or raise) as before
            steps.prefetched = {}
            del steps.recipes[kind]


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


def _prefetch(steps: _Steps, x, identity: bytes, recipe: list) -> None:
    """Build (or find in the cache) every plan of `recipe` over x's coordinates and the
    coordinates its strided plans make, in the recorded order."""
    device, batch_size = x.coords.device, x.batch_size
    nodes = {(): (x.coords, x.grid_shape, identity)}
    for path, geometry, training in recipe:
        node = nodes.get(path)
        if node is None:  # recorded on coordinates this sequence does not make: stop here
            return
        coords, grid_shape, ident = node
        plan = _cached(coords, grid_shape, batch_size, geometry, ident, training)
        steps.prefetched[(ident, device, geometry)] = plan
        if not geometry.submanifold:
            child = derived_identity(ident, grid_shape, batch_size, geometry)
            nodes[path + (geometry,)] = (plan.out_coords, plan.out_spatial_shape, child)
            steps.paths[(child, device)] = path + (geometry,)
