"""flexplan: Triton sparse 3D convolution with cached execution plans and ahead-of-time kernels.

The names below load on first use (PEP 562): `import flexplan.aot.keys` or a kernel module of
flexplan.kernels_src costs no torch import, which the AOT build's one-process-per-binary edges
rely on; `from flexplan import SparseTensor` imports what it needs then.
"""
from __future__ import annotations

import importlib

# name -> the submodule that defines it
_EXPORTS = {
    "cached_plan": ".cache", "load_plans": ".cache", "plan_cache": ".cache", "save_plans": ".cache",
    "ConvGeometry": ".geometry",
    "PLAN_FORMAT_VERSION": ".plan", "ConvPlan": ".plan", "GatherMap": ".plan",
    "tensor_plan": ".plan_provider",
    "build_plan": ".planner",
    "SparseTensor": ".sparse_tensor", "SparseTensorError": ".sparse_tensor",
}

__all__ = sorted(_EXPORTS, key=str.lower)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif not name.startswith("__"):
        try:  # a subpackage or module named as an attribute (flexplan.nn, flexplan.ops, ...)
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'flexplan' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'flexplan' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
