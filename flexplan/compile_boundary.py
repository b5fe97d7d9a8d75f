"""Where torch.compile stops tracing: flexplan's host-side work and kernel launches.

Dynamo cannot trace the plan provider (hashing, cache lookups, host syncs), the coordinate check
or the ops' launches (Triton kernels through flexplan's launcher), so those entry points run
eagerly inside a compiled model: each is a graph break, and the torch code between them (batch
norms, activations, heads) compiles. `opaque` marks them; outside torch.compile it costs a
context switch of about a microsecond.
"""
from __future__ import annotations

import torch


def opaque(fn):
    """fn runs eagerly when called from torch.compile'd code (a graph break around it)."""
    return torch.compiler.disable(fn)
