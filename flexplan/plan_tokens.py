"""A plan named by one of its own tensors, so that an op inside a torch.compile graph can find it.

A torch.library custom op takes tensors, numbers and strings, not a ConvPlan. The ops that
torch.compile keeps in its graphs (flexplan/ops/conv.py, pool.py) therefore take the plan's
forward map as its token: a graph input like any tensor (its row count, the output's, is what the
ops' fake implementations need), from which the op's real implementation finds the plan again.
The token is recognised by its storage (the storage object, which every alias of a tensor
shares: AOTAutograd hands a backward new aliases of the tensors it saved), its offset and shape,
not as the same Python object nor by address (empty maps all have address 0). Every plan is
indexed here when it is made (ConvPlan.__post_init__), weakly: the index keeps nothing alive.

Between a graph's forward and its backward only tensors travel, and nothing else may hold the
plan (a layer's output tensor, which did, is often gone by then). So a graph's forward op also
returns a keeper: a one-byte tensor whose storage holds the plan (`keeper`); the backward's ops
take it and read the plan from it (`kept_plan`). It lives as long as autograd saves it, and
nothing the plan holds refers to it, so it makes no reference cycle. Limits: saved-tensor hooks
that copy what autograd saves (torch.autograd.graph.save_on_cpu, offloading) hand the backward
a keeper without the plan, and activation checkpointing inside a compiled graph re-runs the
forward op when the plan may be gone; both get a clear error (the eager ops have neither limit).
"""
from __future__ import annotations

import os
import threading
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

# storage of a forward map -> weak references to the plans over it (copies of one plan, e.g. a
# settled one, share the map), most recent last. Entries go with their storage.
_plans = WeakIdKeyDictionary()
_lock = threading.Lock()
_NOT_FOUND = (" A saved-tensor hook that copies saved tensors (torch.autograd.graph."
              "save_on_cpu, offloading) or activation checkpointing inside a compiled graph "
              "separates a flexplan op from its plan: run those parts eagerly.")


def register(plan) -> None:
    """Index `plan` under its token (its fwd.neighbor_map)."""
    storage = plan.fwd.neighbor_map.untyped_storage()
    with _lock:
        refs = [r for r in _plans.get(storage, ()) if r() is not None]
        refs.append(weakref.ref(plan))
        _plans[storage] = refs


def token(plan) -> torch.Tensor:
    """The tensor that names `plan` in a graph."""
    return plan.fwd.neighbor_map


def plan_of(token: torch.Tensor):
    """The live plan `token` names: the most recent one that serves training (a training plan
    serves both), else the most recent one (whose op then says why it cannot serve)."""
    with _lock:
        refs = list(_plans.get(token.untyped_storage(), ()))
    plans = [p for p in (r() for r in reversed(refs)) if p is not None
             and p.fwd.neighbor_map.shape == token.shape
             and p.fwd.neighbor_map.storage_offset() == token.storage_offset()]
    for plan in plans:
        if plan.for_training:
            return plan
    if plans:
        return plans[0]
    raise LookupError("no live flexplan plan has this forward map: a compiled graph's sparse op "
                      "received a tensor that is not a live plan's fwd.neighbor_map." + _NOT_FOUND)


_KEPT = "_flexplan_plan"


def keeper(plan, device: torch.device) -> torch.Tensor:
    """A new one-byte tensor on `device` that keeps `plan` alive while it (or an alias) lives.
    (A tensor's storage object stays the same for every alias of it, and takes attributes.)"""
    keep = torch.empty(1, dtype=torch.uint8, device=device)
    setattr(keep.untyped_storage(), _KEPT, plan)
    return keep


def kept_plan(keep: torch.Tensor):
    """The plan a keeper holds."""
    plan = getattr(keep.untyped_storage(), _KEPT, None)
    if plan is None:
        raise LookupError("this tensor keeps no flexplan plan: a compiled graph's backward op "
                          "received a copy of its forward op's keeper." + _NOT_FOUND)
    return plan


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # (a fork while another thread held it would leave it held)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
