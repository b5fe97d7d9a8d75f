"""Bundle binaries launched straight through the CUDA driver API, with no Triton launcher.

Under Triton 3.6 even a kernel served from a bundle launches through a host launcher Triton
compiles with the system C compiler (one per kernel signature, plus its cuda_utils module when
its driver starts): seconds of gcc in a fresh process. Here a call is specialized by Triton's
own binder (the JIT's rules, so the same variant key as the JIT hook in runtime.py), the bundle's
cubin is loaded with the driver API (cuda_launch) and the parameter block is built as Triton
3.6's launcher builds it (kernel_params); Triton's driver is never started.

Left to Triton (flexplan.launcher then calls kernel[grid], where the JIT hook serves the bundle or
compiles): ROCm, Triton versions other than 3.6 (3.9's launcher needs no host compiler),
FLEXPLAN_AOT_LAUNCH=triton, calls no bundle serves, launch hooks (profilers), and binaries the
direct launcher does not cover (one log line per kernel).
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field

import torch
from triton import knobs

from . import launch_abi, runtime, served
from .cuda_launch import CudaKernel, libcuda
from .keys import kernel_name
from .kernel_params import ParamBlock, Unsupported, kernel_params, param_bytes

LAUNCH_ENV = "FLEXPLAN_AOT_LAUNCH"  # "triton": always launch through Triton's launcher
_MAX_TMEM_COLUMNS = 512  # Triton's tensor-memory limit (it raises OutOfResources above it)

_UNKNOWN = object()
_unavailable = _UNKNOWN
_states: dict[tuple[int, int], _KernelState] = {}
_not_bundled: set[int] = set()  # id() of kernels no installed bundle holds: always Triton's


def unavailable() -> str | None:
    """Why this process launches bundle binaries through Triton's launcher; None: directly."""
    global _unavailable
    if _unavailable is _UNKNOWN:
        _unavailable = _why_unavailable()
    return _unavailable


def _why_unavailable() -> str | None:
    import triton

    if os.environ.get(LAUNCH_ENV) == "triton":
        return f"{LAUNCH_ENV}=triton"
    if torch.version.hip:
        return "ROCm"
    if not launch_abi.mirrors_triton_launcher():
        return (f"Triton {triton.__version__}: the direct launcher mirrors Triton 3.6's "
                "(Triton 3.9's needs no host compiler anyway)")
    try:
        libcuda()
    except Exception as exc:  # no driver library, or it does not initialize
        return f"libcuda.so.1 unusable ({exc})"
    return None


def reset() -> None:
    """Forget loaded binaries and the availability check (runtime.reset calls this)."""
    global _unavailable
    _unavailable = _UNKNOWN
    _states.clear()
    _not_bundled.clear()


# The binaries loaded here came from the bundles runtime indexed: forget them with its index.
runtime.on_reset(reset)


def launch(fn, grid, args: tuple, kwargs: dict) -> DirectKernel | None:
    """Run fn[grid](*args, **kwargs) from a bundle binary through the driver API and return the
    binary (its launch(grid, stream, every parameter) repeats such calls); None when the call is
    left to Triton (nothing launched)."""
    kernel, bound = _kernel_for(fn, args, kwargs)
    if kernel is not None:
        kernel.launch(grid(bound) if callable(grid) else grid, current_stream(),
                      list(bound.values()))
    return kernel


def _kernel_for(fn, args: tuple, kwargs: dict) -> tuple[DirectKernel | None, dict | None]:
    """(the bundle binary that serves fn(*args, **kwargs) here, the call's bound arguments: every
    parameter, in order), or (None, None): the call is Triton's."""
    # JIT users (no bundle holds the kernel) return here, before any other per-launch cost.
    if id(fn) in _not_bundled:
        return None, None
    if not runtime.bundles_have(fn):
        _not_bundled.add(id(fn))  # kernels are module-level functions: their ids stay theirs
        return None, None
    if unavailable() is not None or triton_hooks_set(fn):
        return None, None
    device = torch.cuda.current_device()
    state = _state(fn, device)
    # The options JITFunction.run adds before binding, so the specialization (and key) match.
    kwargs = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, specialization, options = state.binder(*args, **kwargs)
    key = (tuple(specialization), str(options))
    kernel = state.kernels.get(key, _UNKNOWN)
    if kernel is _UNKNOWN:
        kernel = state.kernels[key] = _resolve(fn, state, device, kwargs, bound, specialization, options)
    return (kernel, bound) if kernel is not None else (None, None)


def current_stream(device: int | None = None) -> int:
    """The raw handle of the current stream of `device` (default: the current device), as
    Triton's CUDA driver reads it (no Stream object per launch)."""
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device() if device is None
                                              else device)


def triton_hooks_set(fn) -> bool:
    # Launch hooks are HookChains (a list of calls), or a plain callable when assigned directly.
    # (Spelled out, no generator: this runs on every launch.)
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(fn.pre_run_hooks or getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_))


@dataclass
class _KernelState:
    """Per (kernel, device): Triton's binder for this GPU and the resolved calls."""
    fn: object  # kept alive: the state is keyed by id(fn)
    target: object
    backend: object
    binder: object
    kernels: dict = field(default_factory=dict)  # call key -> DirectKernel, or None: Triton's


def _state(fn, device: int) -> _KernelState:
    state = _states.get((id(fn), device))
    if state is None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        major, minor = torch.cuda.get_device_capability(device)
        target = GPUTarget("cuda", major * 10 + minor, 32)  # what Triton's CUDA driver reports
        backend = make_backend(target)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        state = _states[(id(fn), device)] = _KernelState(fn, target, backend, binder)
    return state


def _resolve(fn, state: _KernelState, device: int, kwargs, bound, specialization, options):
    """The DirectKernel for this specialization, or None (no bundle binary, or not coverable)."""
    name = kernel_name(fn)
    try:
        options, signature, constants, attrs = fn._pack_args(state.backend, dict(kwargs), bound,
                                                             specialization, options)
        bundle, entry = runtime.lookup(fn, state.target, signature, constants, attrs, options.__dict__)
        if bundle is None or bundle.entry_files_ok(entry) is not None:
            return None  # the JIT hook logs why and compiles
        metadata = json.loads((bundle.root / entry["metadata"]).read_text())
        kernel = DirectKernel(signature, metadata, (bundle.root / entry["file"]).read_bytes(),
                              entry.get("param_bytes"), device)
    except Exception as exc:  # whatever it is, Triton's launcher still runs the call correctly
        runtime.log_once(f"direct {name}", "%s: launching it through Triton's launcher: %s",
                         name.rsplit(".", 1)[-1], f"{exc.__class__.__name__}: {exc}")
        return None
    runtime.stats["aot"] += 1
    runtime.stats["direct"] += 1
    served.note(served.Served(name.rsplit(".", 1)[-1], served.describe(
        fn.arg_names, signature, constants, options.__dict__), served.DIRECT,
        spec=served.spec_digest(signature, constants, attrs)))
    return kernel


class DirectKernel:
    """A bundle binary loaded for one device, with its parameter block and launch settings."""

    def __init__(self, signature: dict, metadata: dict, cubin: bytes, binary_param_bytes, device: int):
        params = kernel_params(signature)
        if binary_param_bytes is None:
            raise Unsupported("its bundle entry has no parameter layout (rebuild with `python -m aot`)")
        if param_bytes(params) != binary_param_bytes:
            raise Unsupported(f"parameter sizes {param_bytes(params)} differ from the binary's "
                              f"{binary_param_bytes}")
        if metadata.get("tmem_size", 0) > _MAX_TMEM_COLUMNS:
            raise Unsupported(f"{metadata['tmem_size']} tensor-memory columns")
        self.metadata, self.signature = metadata, signature
        self.block = ParamBlock(params)
        self._lock = threading.Lock()  # one parameter block: one launch at a time packs it
        self.scratch_kinds = [kind for kind in ("global", "profile") if metadata[f"{kind}_scratch_size"]]
        self.cuda = CudaKernel(cubin, metadata["name"], device, shared=metadata["shared"],
                               num_warps=metadata["num_warps"], num_ctas=metadata["num_ctas"],
                               cooperative=metadata["launch_cooperative_grid"], pdl=metadata["launch_pdl"])

    def launch(self, grid, stream: int, args: list) -> None:
        grid = (*grid, 1, 1)[:3]
        blocks = grid[0] * grid[1] * grid[2] * self.cuda.num_ctas
        if blocks == 0:
            return  # Triton launches nothing for an empty grid
        scratch, _buffers = self._scratch(blocks, stream) if self.scratch_kinds else ((0, 0), None)
        with self._lock:
            self.cuda.launch(grid, stream, self.block.pack(args, scratch))

    def _scratch(self, blocks: int, stream: int):
        """Scratch pointers as Triton 3.6's CudaLauncher allocates them, and the buffers (keep
        them alive over the launch)."""
        from triton.runtime import _allocation

        allocators = {"global": _allocation._allocator, "profile": _allocation._profile_allocator}
        buffers = {kind: allocators[kind].get()(blocks * self.metadata[f"{kind}_scratch_size"],
                                                self.metadata[f"{kind}_scratch_align"], stream)
                   for kind in self.scratch_kinds}
        return tuple(buffers[kind].data_ptr() if kind in buffers else 0 for kind in allocators), buffers
