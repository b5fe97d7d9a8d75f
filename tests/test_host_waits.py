"""host_waits: what the plan cache drops is released at the next host wait, within a bound,
and the strided build's count read and the coordinate check's verdict read release first."""
import gc
import weakref

import torch

from flexplan import ConvGeometry, host_waits
from flexplan.workloads import random_coords


class Held:  # (a weakly referenceable object)
    pass


def test_release_later_keeps_until_release_now_within_a_bound(monkeypatch):
    host_waits.release_now()
    monkeypatch.setattr(host_waits, "MAX_PENDING", 3)
    objs = [Held() for _ in range(4)]
    refs = [weakref.ref(o) for o in objs]
    for o in objs:
        host_waits.release_later(o)
    del objs, o
    gc.collect()
    # the oldest went at the fourth (past the bound); the rest wait for release_now
    assert [r() is None for r in refs] == [True, False, False, False]
    assert host_waits.pending() == 3
    assert host_waits.release_now() == 3 and host_waits.release_now() == 0
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_strided_builds_count_read_releases_first(device, monkeypatch):
    """A graph-replayed strided build (its launches run eagerly on the CPU) releases what waits
    before it reads its counts (its host sync)."""
    from flexplan.planner import generative_graphs
    from flexplan.planner.generative import output_spatial_shape

    order = []
    real_release = generative_graphs.release_now
    monkeypatch.setattr(generative_graphs, "release_now",
                        lambda: order.append("release") or real_release())
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda self: order.append("read") or real_tolist(self))
    shape, batch = (20, 18, 16), 2
    geometry = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)
    first = generative_graphs.CapturedCandidates(
        256, output_spatial_shape(shape, geometry), batch, geometry, torch.device(device),
        capture=False)
    coords = random_coords(200, shape, batch, generator=torch.Generator().manual_seed(3),
                           device=device)
    first.build(coords, shape, batch, generative_graphs.TRAIN)
    assert order[:2] == ["release", "read"]
