"""The launch layer's one Triton-version gate: which Triton's CUDA host launcher flexplan mirrors.

Two places lean on the internals of Triton 3.6's launcher: flexplan.launcher calls its C part
directly on repeat launches (CudaLauncher.__call__(grid, stream, function, *args) calls
launch(grid, stream, function, cooperative, pdl, global_scratch, profile_scratch, *args)), and
flexplan.aot.direct rebuilds its parameter block and driver launch (kernel_params, cuda_launch).
Both ask here, so a Triton that changes that launcher turns both off together.

This module sits at the bottom of the launch layer (launcher -> aot.direct -> aot.runtime): it
imports nothing from flexplan but flexplan.versions, so every one of them may import it.
"""
from __future__ import annotations

from ..versions import triton_version

# Prefixes of triton.__version__ whose launcher the two mirrors above follow. (A test that fakes
# a device sets this to the installed version, whose parameter ABI is checked to match.)
MIRRORED_VERSIONS = ("3.6.",)


def mirrors_triton_launcher() -> bool:
    """Whether the installed Triton's CUDA launcher is the one flexplan mirrors."""
    return triton_version().startswith(MIRRORED_VERSIONS)
