"""The one place kernels are launched: ahead-of-time binaries when a bundle matches, else JIT.

Every op calls `launch(kernel, grid, *args, **constexprs)` instead of `kernel[grid](...)`, so the
AOT runtime can swap in precompiled binaries without touching the ops.
"""
from __future__ import annotations


def launch(kernel, grid, *args, **constexprs):
    return kernel[grid](*args, **constexprs)
