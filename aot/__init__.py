"""Ahead-of-time kernel build: `python -m aot` / `make aot` (see aot/__main__.py).

Runs from the repository root; the runtime side lives in flexplan.aot. Its per-binary compiles
(forks of the compile server, or one process each without it) import flexplan.aot.keys and the
kernel modules of flexplan.kernels_src as they are: flexplan's package imports its names lazily,
so none of them pulls in torch.
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
