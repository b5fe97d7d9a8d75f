"""Values flexplan keeps for reuse (a plan's derived views, per-device constant tensors) must
never be first made while a CUDA graph is being captured.

Under capture a kernel is recorded, not run: a tensor made then holds its values only after the
graph replays. Kept for later calls, it would hand eager code (or another graph) memory that was
never written: a wrong answer, not an error. So a value missing during capture is made for the
capture alone (the graph keeps what it reads alive) and kept only once made eagerly, which is
what warming up before capture (torch's own advice) does anyway.
"""
from __future__ import annotations

import torch


def capturing(device: torch.device) -> bool:
    """Whether work queued now on `device` is recorded into a CUDA graph (the current stream of
    a CUDA device is capturing). Called only where a value is missing: the check costs a call
    (torch's C query itself, not its Python wrapper: a fresh plan's launches ask dozens of
    times a step)."""
    return device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()


_PER_DEVICE: dict = {}


def device_constant(name: str, device: torch.device, make):
    """The tensor(s) `make()` returns, made once per (name, device) and shared; made afresh,
    and not kept, when first asked for during capture."""
    key = (name, device)
    value = _PER_DEVICE.get(key)
    if value is None:
        value = make()
        if not capturing(device):
            _PER_DEVICE[key] = value
    return value
