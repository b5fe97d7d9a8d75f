"""The generative planner's host-light paths (issue #20): its candidates padded for a sort of a
fixed size, the run starts' one-launch scan, and (GPU) the captured sort of the candidates."""
from __future__ import annotations

import pytest
import torch

from flexplan import ConvGeometry, build_plan
from flexplan.launch_spec import UNREAD_ADDRESS
from flexplan.launcher import launch
from flexplan.planner import generative_triton as gen
from flexplan.planner import rank_sort
from flexplan.workloads import random_coords

DOWN = ConvGeometry.make(3, stride=2, padding=1, submanifold=False)


def _same_plans(a, b):
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name].cpu(), tb[name].cpu()), name
    assert (a.num_in, a.num_out) == (b.num_in, b.num_out)


def test_candidates_kernel_pads_the_keys(device):
    """Keys padded to a sort's fixed size: the padding holds the sentinel, what lies past it is
    untouched, and the candidates equal an unpadded launch's."""
    coords = random_coords(150, (9, 8, 7), 2, generator=torch.Generator().manual_seed(1)).to(device)
    n, slots, shape = coords.shape[0], gen.candidate_slots(DOWN), (5, 4, 4)
    total, padded = n * slots, n * slots + 37
    sent = gen.SENTINEL[torch.int32]
    plain = torch.empty(total, dtype=torch.int32, device=device)
    keys = torch.full((padded + 50,), 7, dtype=torch.int32, device=device)
    taps = torch.empty(total, dtype=torch.int32, device=device)
    gen.launch_candidates(launch, coords, plain, taps, n, UNREAD_ADDRESS, total, *shape, DOWN,
                          slots, sent)
    gen.launch_candidates(launch, coords, keys, taps, n, UNREAD_ADDRESS, padded, *shape, DOWN,
                          slots, sent)
    assert torch.equal(keys[:total], plain)
    assert (keys[total:padded] == sent).all() and (keys[padded:] == 7).all()


def test_run_starts_scan_over_many_tiles(monkeypatch, device):
    """Small scan tiles (forced here): the look-back spans several windows; same plans."""
    monkeypatch.setattr(gen, "RUN_STARTS_LAUNCH", dict(BLOCK=16, LOOK_BACK=4, num_warps=1))
    shape = (9, 8, 7)
    coords = random_coords(200, shape, 2, generator=torch.Generator().manual_seed(2))
    assert gen.run_starts_tiles(coords.shape[0] * gen.candidate_slots(DOWN)) > 4 * 4
    for training in (False, True):
        oracle = build_plan(coords, shape, 2, DOWN, backend="torch", training=training)
        _same_plans(oracle, build_plan(coords.to(device), shape, 2, DOWN, backend="triton",
                                       training=training))


@pytest.mark.gpu
def test_captured_candidate_sort_gpu():
    """Strided and transposed builds sort their candidates through a graph captured at a
    bucket's second request (row counts of one bucket in turn: the padding, not an earlier
    build's keys, sorts last); the plans equal the torch planner's, training ones too (whose
    schedules sort ranks while the candidates' sort is held)."""
    rank_sort.release()
    shape = (40, 40, 40)
    up = ConvGeometry.make(2, stride=2, submanifold=False, transposed=True)
    down2 = ConvGeometry.make(2, stride=2, submanifold=False)  # one slot: as many keys as rows
    for geometry, rows in ((DOWN, (1500, 1400, 1300)), (up, (700, 650)),
                           (down2, (9000, 8500, 8000))):
        for i, num in enumerate(rows):
            coords = random_coords(num, shape, 2, generator=torch.Generator().manual_seed(i))
            for training in (False, True):
                oracle = build_plan(coords, shape, 2, geometry, backend="torch", training=training)
                _same_plans(oracle, build_plan(coords.cuda(), shape, 2, geometry,
                                               backend="triton", training=training))
    torch.cuda.synchronize()
    assert any(key[4] == rank_sort.CANDIDATES for key in rank_sort._sorts.kept())
    rank_sort.release()
