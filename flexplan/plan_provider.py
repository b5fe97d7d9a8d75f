"""The plan of a layer over a tensor: what layers ask, so that tensors stay passive values.

    tensor's Plans (memo shared by every tensor over the same coordinates)
      -> plan_prefetch (this step's plans, built at its first request when the steps before
         asked for the same sequence)
      -> cache.cached_plan (memory, disk, or planner.build_plan)

as torchsparse's functional conv owns its kernel-map cache. The coordinates' identity (hashed
once per user tensor, derived for a strided layer's output) names them for the cache.
"""
from __future__ import annotations

from .compile_boundary import opaque
from .geometry import ConvGeometry
from .geometry4d import ConvGeometry4d
from .plan import ConvPlan
from .plan_prefetch import cached_for, plan_for
from .planner.plan4d import build_plan_4d


@opaque
def tensor_plan(x, geometry: ConvGeometry, training: bool = True,
                scheduled: bool = True, asker=None) -> ConvPlan:
    """The plan of `geometry` over the coordinates of x (a SparseTensor): from its Plans, else
    built (or found in the plan cache) once and kept there. training=False accepts an inference
    plan (ConvPlan.for_training), cheaper to build; a training plan serves both, and replaces
    an inference plan when training asks. scheduled=False (a pool's request) accepts a
    maps-only plan too (ConvPlan.maps_only), which a convolution's request replaces.
    asker: the layer asking (its identity is what counts). A plan whose schedule the cache
    deferred (a first sighting's, ConvPlan.schedule_deferred) is asked for again when the same
    layer asks twice over the same tensor object: a later forward over a tensor kept from an
    earlier one (a layer applied twice in one forward gets another tensor the second time),
    the coordinates' second sighting, which the cache answers with the scheduled plan (straight
    from the cache: not a request of the step's prefetch)."""
    plans = x._plans
    plan = plans.get(geometry)
    if (plan is not None and asker is not None and scheduled and plan.schedule_deferred
            and _asked_before(plans, geometry, (id(asker), id(x)))):
        plan = plans[geometry] = cached_for(x, geometry, training, scheduled)
    if plan is None or not plan.serves(training, scheduled):
        plan = plan_for(x, geometry, training, scheduled)
        plans[geometry] = plan
        if asker is not None and plan.schedule_deferred:
            plans.askers[geometry] = {(id(asker), id(x))}
    return plan


def _asked_before(plans, geometry, ask: tuple) -> bool:
    """Whether `ask` (a layer and a tensor) asked for the deferred plan of `geometry` before
    (noting that it has)."""
    asks = plans.askers.setdefault(geometry, set())
    if ask in asks:
        asks.clear()
        return True
    asks.add(ask)
    return False


@opaque
def tensor_plan_4d(x, geometry: ConvGeometry4d, training: bool = True) -> ConvPlan:
    """tensor_plan for a 4D tensor (SparseConvTensor of [N, 5] indices) and a ConvGeometry4d:
    from its Plans, else built by the 4D planner and kept there. Not through the plan cache,
    whose keys and files are 3D: a 4D plan is made once per coordinates and geometry, and
    shared by every layer and tensor over those coordinates."""
    plans = x._plans
    plan = plans.get(geometry)
    if plan is None or not plan.serves(training):
        plan = build_plan_4d(x.coords, x.grid_shape, x.batch_size, geometry, training)
        plans[geometry] = plan
    return plan
