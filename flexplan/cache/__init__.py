"""Plan cache: an in-memory LRU over a disk directory shared by every process of the user.

cached_plan(...) is what layers call to get a plan: it builds it, or finds an earlier build from
this process (memory) or any process (disk). Modules, one concept each:
    key.py        the 128-bit key (hash of coords on their device + geometry + versions)
    format.py     the plan file (versioned header, crc32, compact tensors, no pickle)
    memory.py     in-process LRU bounded by bytes
    disk.py       shared directory: atomic writes, build locks, LRU eviction, degrade to memory
    policy.py     settings, admission (disk only for keys seen twice) and the cost model
    admission.py  the keys seen so far: this process's and a journal shared through the directory
    plan_cache.py PlanCache, tying them together
    cli.py        `python -m flexplan cache {info,ls,verify,prune,clear}`
"""
from __future__ import annotations

from .plan_cache import PlanCache

plan_cache = PlanCache()


def cached_plan(coords, spatial_shape, batch_size, geometry, **kwargs):
    """The plan of `geometry` over `coords`, built at most once per cache directory.

    kwargs: backend ("auto" | "torch" | "triton"), check (validate coords first; default True),
    key (the plan's key, if the caller derived it: the coordinates are then not hashed),
    identity (the coordinates' identity, if the caller has it: the key derives from it).
    """
    return plan_cache.get_or_build(coords, spatial_shape, batch_size, geometry, **kwargs)


def refine_plan(plan, refined):
    """Later lookups of the plan cached_plan returned as `plan` get `refined` (the same plan
    with more made, e.g. an inverse conv's bwd map). Returns `refined`."""
    return plan_cache.refine(plan, refined)


def save_plans(directory, plans):
    """Ship plans with a model: write them (a {key: plan} mapping, or plans that cached_plan
    returned) as plan files into `directory`. Returns their keys."""
    return plan_cache.save_plans(directory, plans)


def load_plans(directory, device=None):
    """Load a directory written by save_plans onto `device`; later cached_plan calls over the
    same coordinates find them in memory. Returns {key: plan}."""
    return plan_cache.load_plans(directory, device)


__all__ = ["PlanCache", "cached_plan", "load_plans", "plan_cache", "refine_plan", "save_plans"]
