"""Where torch.compile stops tracing: flexplan's host-side work and kernel launches.

Dynamo cannot trace the plan provider (hashing, cache lookups, host syncs), the coordinate check
or the ops' launches (Triton kernels through flexplan's launcher), so those entry points run
eagerly inside a compiled model: each is a graph break, and the torch code between them (batch
norms, activations, heads) compiles. `opaque` marks them. Eager calls must not pay for it: torch.compiler.disable's wrapper
switches the frame evaluation on every call (a measurable share of a host-bound step with
dozens of such calls), so the disabled version is taken only under torch.compile: while Dynamo
traces (is_compiling), or while its frame callback is set (a frame run after a graph break,
whose callees Dynamo would otherwise try to compile, Triton's interpreter included).
"""
from __future__ import annotations

import functools

import torch

try:  # the callback Dynamo installs while a compiled function runs (None: no torch.compile)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback
except ImportError:  # another torch: always through torch.compiler.disable
    _dynamo_callback = None


def opaque(fn):
    """fn runs eagerly when called from torch.compile'd code (a graph break around it); an
    eager call outside torch.compile costs two flag checks."""
    disabled = torch.compiler.disable(fn)
    if _dynamo_callback is None:
        return disabled
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def boundary(*args, **kwargs):
        if is_compiling() or _dynamo_callback() is not None:
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)
    return boundary
