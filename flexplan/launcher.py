"""The one place kernels are launched: ahead-of-time binaries when a bundle matches, else JIT.

Every op calls `launch(kernel, grid, *args, **constexprs)` instead of `kernel[grid](...)`, so the
AOT runtime can swap in precompiled binaries without touching the ops: launched directly through
the CUDA driver where flexplan.aot.direct covers them, else through Triton (its JIT then takes
the binary from the bundle, or compiles, and the direct launcher adopts that binary for the next
calls). Set FLEXPLAN_AOT=0 to always JIT-compile and launch through Triton. Under
TRITON_INTERPRET=1 kernels are interpreter functions: launched as is.
"""
from __future__ import annotations

import os

AOT_ENV = "FLEXPLAN_AOT"


def _aot_enabled(kernel) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(kernel, JITFunction) and os.environ.get(AOT_ENV, "1") != "0"


def launch(kernel, grid, *args, **constexprs):
    if not _aot_enabled(kernel):
        kernel[grid](*args, **constexprs)
        return
    from .aot import direct, runtime

    if direct.launch(kernel, grid, args, constexprs):
        return
    runtime.install()
    compiled = kernel[grid](*args, **constexprs)
    if compiled is None:
        # The AOT hook put a prebuilt binary in the JIT's cache instead of compiling (Triton
        # then returns without launching): this launch runs from that cache.
        compiled = kernel[grid](*args, **constexprs)
    direct.adopt(kernel, args, constexprs, compiled)
