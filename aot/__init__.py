"""Ahead-of-time kernel build: `python -m aot` / `make aot` (see aot/__main__.py).

Runs from the repository root; the runtime side lives in flexplan.aot.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def light_flexplan() -> None:
    """Make flexplan's submodules importable without running flexplan/__init__.py (which imports
    torch, seconds per process): ninja starts one process per artifact, and those only need the
    kernel sources and flexplan.aot.keys."""
    for name, path in (("flexplan", REPO / "flexplan"), ("flexplan.kernels_src", REPO / "kernels_src")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(path)]
            sys.modules[name] = pkg
