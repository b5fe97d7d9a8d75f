"""The one place kernels are launched: ahead-of-time binaries when a bundle matches, else JIT.

Every op calls `launch(kernel, grid, *args, **constexprs)` instead of `kernel[grid](...)`, so the
AOT runtime can swap in precompiled binaries without touching the ops: launched directly through
the CUDA driver where flexplan.aot.direct covers them, else through Triton (its JIT then takes
the binary from the bundle, or compiles). Set FLEXPLAN_AOT=0 to always JIT-compile. Under
TRITON_INTERPRET=1 kernels are interpreter functions: launched as is.

Repeated calls skip the resolution: a call whose arguments fall in a class seen before goes
straight to the binary that served that class, without Triton's binder and cache lookup (which
the direct launcher reuses too). A Triton launch costs more host time than many planner kernels
run; this path roughly halves it, most of what is left being Triton's launcher, whose C part
Triton 3.6 repeat calls reach directly, handing it addresses rather than tensors, and the
class itself, computed by a function generated per kernel (measurements:
scripts/results/design_measurements.md).
The class refines Triton's specialization (dtype and 16-byte alignment of each tensor; whether
an int is 1, a multiple of 16, and its integer width; the constexprs), so two calls of one class
always take the same binary; and like Triton it leaves out what a kernel's decorator says not to
specialize (do_not_specialize: sizes and places that change from call to call), read from the
kernel itself (arg_specialization), so a new size is never a new class.
"""
from __future__ import annotations

import os
import threading

import torch
from torch import Tensor
from triton.runtime.jit import JITFunction

from . import launch_native
from .aot import direct, runtime
from .aot.launch_abi import mirrors_triton_launcher

AOT_ENV = "FLEXPLAN_AOT"
# Repeated launches hand the launcher each tensor's address instead of the tensor (_call_class
# says why). False: the tensors, as before (for A/B runs, scripts/bench_precision.py).
TENSORS_AS_ADDRESSES = True
# Classes of calls by functions generated per kernel (_class_function). False: argument by
# argument, as before (for A/B runs, scripts/bench_precision.py).
GENERATED_CLASSES = True

# (id(kernel), device, argument classes, constexprs) -> (how the binary launches, the values of
# the constexpr parameters: launchers take every parameter, in order). Kernels are module-level
# functions, so their ids stay theirs.
_calls: dict = {}
# Native launches (flexplan/launch_native.py): class -> the C record of the binary Triton's
# launcher ran for it, and id(kernel) -> (kernel, its id as an int object, its specialization
# codes as bytes, the C launch function) for the C call. False: every launch through the
# Python path (A/B runs, scripts/bench_precision.py; FLEXPLAN_NATIVE_LAUNCH=0: the C module
# is never built).
NATIVE_LAUNCHES = True
# Bundle binaries (aot.direct) through the native launcher too: records from the parameter
# layout direct launches use (launch_native.direct_record_of), bitwise equal to direct launches
# on an H200 (tests/test_aot_direct_gpu.py). False: bundle binaries launch through aot.direct's
# own path (A/B runs).
NATIVE_BUNDLE_LAUNCHES = True
_native_calls: dict = {}
_native_kernels: dict = {}


def cdiv(a: int, b: int) -> int:
    """Grid size: ceil(a / b). (triton.cdiv is a constexpr function in Triton 3.6, about 2 us
    per host call.)"""
    return -(-a // b)


def _aot_enabled() -> bool:
    return os.environ.get(AOT_ENV, "1") != "0"


def forget_calls() -> None:
    """Resolve every call afresh (the AOT runtime's reset: bundles or settings changed)."""
    _calls.clear()
    _native_calls.clear()


# A call resolved to a bundle binary must be resolved again once the bundles change.
runtime.on_reset(forget_calls)


def _constexpr_tail(kernel, args: tuple, constexprs: dict) -> tuple | None:
    """Values of the parameters after the positional arguments, when those are all constexprs
    (given or defaulted); None when the call does not have that shape."""
    params = kernel.params
    if len(args) > len(params) or any(p.is_constexpr for p in params[:len(args)]):
        return None
    tail = []
    for p in params[len(args):]:
        if not p.is_constexpr:
            return None
        if p.name in constexprs:
            tail.append(constexprs[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


_UNIT_GRID = (1, 1, 1)  # a grid's missing dimensions
# Whether this Triton's CudaLauncher.__call__(grid, stream, function, *args) calls
# launch(grid, stream, function, cooperative, pdl, global_scratch, profile_scratch, *args):
# the gate the direct driver launch shares (launch_abi).
_SCRATCH_FREE_CUDA_LAUNCHER = mirrors_triton_launcher()


# What Triton specializes the argument of one parameter on, as its decorator says: everything
# (an int: == 1, divisible by 16, width; a tensor: dtype, 16-byte alignment), all but
# divisibility and alignment (do_not_specialize_on_alignment), or only an int's width and a
# tensor's dtype (do_not_specialize). Same rules in Triton 3.6 and 3.9.
SPECIALIZED, NO_ALIGNMENT, NOT_SPECIALIZED = 0, 1, 2
# id(kernel) -> (kernel, arg_specialization(kernel)); holding the kernel keeps its id its own.
_arg_specs: dict = {}
# ROCm: Triton also specializes tensors on whether their storage fits 2 GiB (buffer ops).
_HIP = bool(torch.version.hip)
_MAX_BUFFER_BYTES = 2**31 - 1


def jit_function(kernel) -> JITFunction:
    """The kernel as a JITFunction (whose params and binder say what Triton specializes): itself,
    or under TRITON_INTERPRET=1 one made from the interpreted function with the same decorator
    arguments."""
    if isinstance(kernel, JITFunction):
        return kernel
    options = getattr(kernel, "kwargs", {})
    return JITFunction(kernel.fn, do_not_specialize=options.get("do_not_specialize"),
                       do_not_specialize_on_alignment=options.get("do_not_specialize_on_alignment"))


def arg_specialization(kernel) -> tuple[int, ...]:
    """Per parameter, in order: SPECIALIZED, NO_ALIGNMENT or NOT_SPECIALIZED, from the kernel's
    decorator (the one place each kernel says what is specialized; constexpr parameters read
    SPECIALIZED)."""
    known = _arg_specs.get(id(kernel))
    if known is not None:
        return known[1]
    spec = tuple(NOT_SPECIALIZED if p.do_not_specialize else
                 NO_ALIGNMENT if p.do_not_specialize_on_alignment else SPECIALIZED
                 for p in jit_function(kernel).params)
    _arg_specs[id(kernel)] = kernel, spec
    return spec


def _call_key(kernel, device: int, args: tuple, constexprs: dict):
    """The call's class (see _call_class), None for arguments of other types."""
    return _call_class(kernel, device, args, constexprs)[0]


def _call_class(kernel, device: int, args: tuple, constexprs: dict) -> tuple:
    """(class, addressed): the call's class, what Triton specializes each runtime argument on
    or more, as one flat tuple, or None for arguments of other types; and the arguments with
    every tensor replaced by its address when every tensor is on the current GPU `device`,
    else the arguments as given. This runs on every launch:
    by a function generated per kernel and argument count (_class_function), else argument by
    argument (_generic_call_class).
    A tensor adds its dtype and, where specialized, its 16-byte alignment (and on ROCm whether
    its storage fits 2 GiB); an int one code for == 1, divisible by 16 (where specialized) and
    its width (never 0 or 1, which a bool argument adds: its value); a float the code 16.
    Why addresses: Triton's launchers take an int for a pointer argument as it is, whereas for
    a tensor they call its data_ptr method and ask the driver to check the address
    (cuPointerGetAttribute), per tensor and launch, host time the key's own data_ptr call
    already paid (measurements: scripts/results/host_costs.md, session 42). A call with a tensor
    on the CPU or on another GPU keeps its tensors: Triton's check then raises its error (the
    ops check devices before; a kernel must never read an address its GPU cannot)."""
    if GENERATED_CLASSES:
        entry = _class_fns.get((id(kernel), len(args)))
        if entry is None or entry[0] is not kernel:
            entry = _class_fns[(id(kernel), len(args))] = kernel, _class_function(kernel, args)
        if entry[1] is not None:
            try:
                found = entry[1](args, device, constexprs)
            except (AttributeError, TypeError):  # a tensor's place holds something else
                found = None
            if found is not None:
                return found
    return _generic_call_class(kernel, device, args, constexprs)


def _generic_call_class(kernel, device: int, args: tuple, constexprs: dict) -> tuple:
    """_call_class for any arguments, one at a time: the definition the generated functions
    (_class_function) follow, and what calls they do not fit take."""
    key = [id(kernel), device]
    append = key.append
    addressed = []
    put = addressed.append
    on_gpu = True
    known = _arg_specs.get(id(kernel))
    for arg, how in zip(args, known[1] if known is not None else arg_specialization(kernel)):
        kind = type(arg)
        if kind is int:  # most arguments are (a bool is not int here)
            if arg == 1 and how != NOT_SPECIALIZED:
                append(7)
            else:
                append((10 if -2**31 <= arg < 2**31 else 12 if -2**63 <= arg < 2**63 else 14)
                       + (how == SPECIALIZED and arg & 15 == 0))
            put(arg)
        elif kind is Tensor or isinstance(arg, Tensor):
            address = arg.data_ptr()
            append(arg.dtype)
            if how == SPECIALIZED:
                append(address & 15)
            if _HIP and how != NOT_SPECIALIZED:
                append(arg.untyped_storage().nbytes() <= _MAX_BUFFER_BYTES)
            on_gpu = on_gpu and arg.get_device() == device
            put(address)
        elif kind is bool:
            append(arg)
            put(arg)
        elif kind is float:  # fp32 to every Triton, never specialized on its value
            append(16)
            put(arg)
        else:
            return None, args
    key.extend(constexprs.items())
    return tuple(key), (tuple(addressed) if on_gpu else args)


# (id(kernel), number of arguments) -> (kernel, its generated _call_class or None); the kernel
# held, so that its id stays its own.
_class_fns: dict = {}
# An int's width code, as _generic_call_class writes it (Python source for the generated code).
_WIDTH = ("(10 if -2147483648 <= {a} < 2147483648 else 12 if -9223372036854775808 <= {a} < "
          "9223372036854775808 else 14)")


def _class_function(kernel, args: tuple):
    """_generic_call_class unrolled for calls whose arguments are of the kinds of `args`, place
    by place (tensor, int, bool or float), as Python source compiled once: no per-argument loop
    or type dispatch (the class of a 20-argument launch in about half the time). The function
    returns None where a call's kinds differ (its ints, bools and floats are checked; a tensor's
    place raises AttributeError), and the caller takes the generic path. None: the arguments
    hold another kind, or there are none, or more than the kernel has parameters."""
    spec = arg_specialization(kernel)
    guards, lines, key, addressed, on_gpu = [], [], ["kid", "device"], [], []
    for i, (arg, how) in enumerate(zip(args, spec)):
        a, kind = f"a{i}", type(arg)
        if kind is int:
            guards.append(f"type({a}) is int")
            width = _WIDTH.format(a=a)
            key.append(width if how == NOT_SPECIALIZED else
                       f"(7 if {a} == 1 else {width})" if how == NO_ALIGNMENT else
                       f"(7 if {a} == 1 else {width} + ({a} & 15 == 0))")
            addressed.append(a)
        elif kind is Tensor or isinstance(arg, Tensor):
            lines.append(f"p{i} = {a}.data_ptr()")
            key.append(f"{a}.dtype")
            if how == SPECIALIZED:
                key.append(f"p{i} & 15")
            if _HIP and how != NOT_SPECIALIZED:
                key.append(f"{a}.untyped_storage().nbytes() <= {_MAX_BUFFER_BYTES}")
            addressed.append(f"p{i}")
            on_gpu.append(f"{a}.get_device() == device")
        elif kind is bool or kind is float:
            guards.append(f"type({a}) is {kind.__name__}")
            key.append(a if kind is bool else "16")
            addressed.append(a)
        else:
            return None
    if not args or len(args) > len(spec):
        return None
    source = [f"def call_class(args, device, constexprs, kid={id(kernel)}):",
              f"    {', '.join(f'a{i}' for i in range(len(args)))}, = args"]
    if guards:
        source += [f"    if not ({' and '.join(guards)}):", "        return None"]
    source += [f"    {line}" for line in lines]
    source += [f"    key = ({', '.join(key)}, *constexprs.items())",
               f"    return key, (({', '.join(addressed)},) if {' and '.join(on_gpu) or 'True'}"
               " else args)"]
    namespace: dict = {}
    exec("\n".join(source), namespace)  # noqa: S102 - source made above from fixed pieces
    return namespace["call_class"]


def _triton_run(compiled):
    """Launch through Triton's own launcher for this compiled kernel, as JITFunction.run does
    (no launch metadata: only launch hooks read it, and calls with hooks never come here)."""
    launcher = compiled.run
    if _SCRATCH_FREE_CUDA_LAUNCHER and type(launcher).__name__ == "CudaLauncher" and not (
            launcher.global_scratch_size or launcher.profile_scratch_size):
        # Triton 3.6's C launcher, without CudaLauncher.__call__ around it (which only
        # allocates scratch, none here): a cheaper launch
        # (measurements: scripts/results/design_measurements.md).
        c_launch = launcher.launch
        fixed = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                 None, None, compiled.packed_metadata, None, None, None)

        def run(grid, stream, args):
            c_launch(*grid, *_UNIT_GRID[len(grid):], stream, *fixed, *args)
        return run

    fixed = (compiled.function, compiled.packed_metadata, None, None, None)

    def run(grid, stream, args):
        launcher(*grid, *_UNIT_GRID[len(grid):], stream, *fixed, *args)
    return run


def _resolve_and_launch(kernel, grid, args: tuple, constexprs: dict):
    """Launch the slow way; return (how this call's binary launches, or None: not repeatable;
    what ran it: the Triton CompiledKernel, or aot.direct's DirectKernel for a bundle binary)."""
    if _aot_enabled():
        binary = direct.launch(kernel, grid, args, constexprs)
        if binary is not None:
            return binary.launch, binary
        runtime.install()
        compiled = kernel[grid](*args, **constexprs)
        if compiled is None:
            # The AOT hook put a prebuilt binary in the JIT's cache instead of compiling (Triton
            # then returns without launching): this launch runs from that cache.
            compiled = kernel[grid](*args, **constexprs)
    else:
        compiled = kernel[grid](*args, **constexprs)
    return (_triton_run(compiled), compiled) if compiled is not None else (None, None)


def _record_native(kernel, device: int, args: tuple, constexprs: dict, served) -> None:
    """Record the binary that `served` this call for its class with the native launcher, where
    it can launch it: a binary Triton 3.6's CUDA launcher ran without scratch (the one
    _triton_run calls directly), or a bundle binary aot.direct launched (where the native
    library is built already: a bundle-served process compiles nothing)."""
    if not NATIVE_LAUNCHES:
        return
    if isinstance(served, direct.DirectKernel):
        native = launch_native.module(build=False) if NATIVE_BUNDLE_LAUNCHES else None
        make = launch_native.direct_record_of
    elif _SCRATCH_FREE_CUDA_LAUNCHER and type(served.run).__name__ == "CudaLauncher":
        native, make = launch_native.module(), launch_native.record_of
    else:
        return
    if native is None:
        return
    entry = _native_kernels.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        spec = bytes(arg_specialization(kernel))
        entry = _native_kernels[id(kernel)] = kernel, id(kernel), spec, native.launch
    key = native.call_class(entry[1], entry[2], device, args, constexprs)
    record = make(native, served) if key is not None else None
    if record is not None:
        _native_calls[key] = record


# Triton's interpreter patches triton.language while it runs a kernel: two threads interpreting
# at once (a user's threads, each running layers) break each other's kernels. One at a time.
_INTERPRETER_LOCK = threading.RLock()


def launch(kernel, grid, *args, **constexprs):
    if not isinstance(kernel, JITFunction):  # the interpreter's functions
        with _INTERPRETER_LOCK:
            kernel[grid](*args, **constexprs)
        return
    device = torch._C._cuda_getDevice()  # CUDA is initialized: the arguments are CUDA tensors
    native = _native_kernels.get(id(kernel))
    if native is not None and native[0] is kernel and NATIVE_LAUNCHES and not callable(grid) \
            and not direct.triton_hooks_set(kernel) and native[3](
                _native_calls, native[1], native[2], device, direct.current_stream(device),
                grid, args, constexprs):
        return
    key, addressed = (None, args) if callable(grid) else _call_class(kernel, device, args,
                                                                     constexprs)
    try:
        call = _calls.get(key) if key is not None else None
    except TypeError:  # an unhashable constexpr: resolve every time
        key = call = None
    if call is not None and not direct.triton_hooks_set(kernel):
        run, tail = call
        run(grid, direct.current_stream(device),
            (addressed if TENSORS_AS_ADDRESSES else args) + tail)
        return
    run, served = _resolve_and_launch(kernel, grid, args, constexprs)
    if key is not None and run is not None:
        tail = _constexpr_tail(kernel, args, constexprs)
        if tail is not None:
            _calls[key] = run, tail
            _record_native(kernel, device, args, constexprs, served)
