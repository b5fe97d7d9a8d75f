"""Which targets `python -m aot` builds when none are named: this machine's GPUs, else a list.

A GPU's target is named as flexplan.tuning.device names its arch ("sm_90" from the CUDA
capability, "gfx942" from ROCm's gcnArchName), the names flexplan.aot.keys.TARGETS uses.
"""
from __future__ import annotations

from flexplan.aot.keys import TARGETS

# Without a GPU (a build machine, CI): every target flexplan knows, CUDA and ROCm.
DEFAULT_TARGETS = tuple(TARGETS)


def local_targets() -> list[str]:
    """The targets of this machine's GPUs, in device order without repeats; [] without a GPU."""
    import torch

    from flexplan.tuning.device import device_key

    if not torch.cuda.is_available():
        return []
    found = [device_key(index).arch for index in range(torch.cuda.device_count())]
    return list(dict.fromkeys(found))


def default_targets() -> tuple[list[str], str]:
    """(targets, where they come from) for a build that names none. A GPU whose target flexplan
    has no settings for (flexplan.aot.keys.TARGETS) is an error: building others would not
    serve it."""
    local = local_targets()
    unknown = [t for t in local if t not in TARGETS]
    if unknown:
        raise SystemExit(f"aot: this machine's GPU target {', '.join(unknown)} is not one flexplan "
                         f"builds for ({', '.join(TARGETS)}); name targets with --targets")
    if local:
        return local, "this machine's GPUs"
    return list(DEFAULT_TARGETS), "no GPU here: the default list"
