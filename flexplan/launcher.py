"""The one place kernels are launched: ahead-of-time binaries when a bundle matches, else JIT.

Every op calls `launch(kernel, grid, *args, **constexprs)` instead of `kernel[grid](...)`, so the
AOT runtime can swap in precompiled binaries without touching the ops: launched directly through
the CUDA driver where flexplan.aot.direct covers them, else through Triton (its JIT then takes
the binary from the bundle, or compiles). Set FLEXPLAN_AOT=0 to always JIT-compile. Under
TRITON_INTERPRET=1 kernels are interpreter functions: launched as is.
"""
from __future__ import annotations

import os

AOT_ENV = "FLEXPLAN_AOT"


def _aot_enabled(kernel) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(kernel, JITFunction) and os.environ.get(AOT_ENV, "1") != "0"


def launch(kernel, grid, *args, **constexprs):
    if _aot_enabled(kernel):
        from .aot import direct, runtime

        if direct.launch(kernel, grid, args, constexprs):
            return
        runtime.install()
        if kernel[grid](*args, **constexprs) is not None:
            return
        # The AOT hook put a prebuilt binary in the JIT's cache instead of compiling (Triton
        # then returns without launching): this launch runs from that cache.
    kernel[grid](*args, **constexprs)
