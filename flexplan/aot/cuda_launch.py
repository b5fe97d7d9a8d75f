"""CUDA driver API through ctypes (libcuda.so.1): load a cubin and launch its kernel on a stream.

The same driver calls Triton 3.6 makes from C code it compiles on the user's machine
(backends/nvidia/driver.c: load_binary; driver.py: the generated launcher's _launch), so a
precompiled binary launches with no host C compiler.
"""
from __future__ import annotations

import ctypes
from ctypes import byref, c_char, c_int, c_uint, c_void_p

# cuda.h enum values
_FUNC_MAX_THREADS_PER_BLOCK = 0
_FUNC_SHARED_SIZE_BYTES = 1
_FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
_FUNC_CACHE_PREFER_SHARED = 1
_DEVICE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_LAUNCH_COOPERATIVE = 2
_LAUNCH_CLUSTER_DIMENSION = 4
_LAUNCH_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 5
_LAUNCH_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CLUSTER_SCHEDULING_POLICY_SPREAD = 1

_STATIC_SHARED_LIMIT = 49152  # above this, dynamic shared memory needs an opt-in
WARP_SIZE = 32


class CudaError(RuntimeError):
    pass


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, 64-byte value union
    _fields_ = [("id", c_int), ("pad", c_char * 4), ("value", c_uint * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
                ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint),
                ("sharedMemBytes", c_uint), ("hStream", c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", c_uint)]


_lib = None


def libcuda():
    """The driver library, initialized (raises OSError where there is none)."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        _check(lib.cuInit(0), lib)
        _lib = lib
    return _lib


def _check(result: int, lib=None) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        (lib or libcuda()).cuGetErrorString(result, byref(text))
        raise CudaError(f"CUDA driver error {result}: {(text.value or b'unknown').decode()}")


def _device_handle(device: int) -> c_int:
    handle = c_int()
    _check(libcuda().cuDeviceGet(byref(handle), device))
    return handle


def ensure_context(device: int) -> None:
    """Make the device's primary context current on this thread if none is (Triton's
    ensureCudaContext, for the kernel's own device instead of device 0)."""
    lib = libcuda()
    context = c_void_p()
    _check(lib.cuCtxGetCurrent(byref(context)))
    if not context.value:
        _check(lib.cuDevicePrimaryCtxRetain(byref(context), _device_handle(device)))
        _check(lib.cuCtxSetCurrent(context))


def _function_attribute(function: c_void_p, attribute: int) -> int:
    value = c_int()
    _check(libcuda().cuFuncGetAttribute(byref(value), attribute, function))
    return value.value


def _attributes(num_ctas: int, cooperative: bool, pdl: bool) -> list[tuple[int, tuple[int, ...]]]:
    """The launch attributes Triton 3.6's _launch sets, in its order."""
    attrs = []
    if pdl:
        attrs.append((_LAUNCH_PROGRAMMATIC_STREAM_SERIALIZATION, (1,)))
    if cooperative:
        attrs.append((_LAUNCH_COOPERATIVE, (1,)))
    if num_ctas != 1:
        attrs.append((_LAUNCH_CLUSTER_DIMENSION, (num_ctas, 1, 1)))
        attrs.append((_LAUNCH_CLUSTER_SCHEDULING_POLICY_PREFERENCE, (_CLUSTER_SCHEDULING_POLICY_SPREAD,)))
    return attrs


class CudaKernel:
    """One kernel of a cubin, loaded into `device`'s primary context, launched the way Triton's
    launcher launches it: num_warps * 32 threads, `shared` bytes of dynamic shared memory,
    num_ctas-wide clusters, cooperative / programmatic-dependent launch from the metadata."""

    def __init__(self, cubin: bytes, name: str, device: int, *, shared: int, num_warps: int,
                 num_ctas: int = 1, cooperative: bool = False, pdl: bool = False):
        lib = libcuda()
        ensure_context(device)
        module, function = c_void_p(), c_void_p()
        _check(lib.cuModuleLoadData(byref(module), cubin))
        _check(lib.cuModuleGetFunction(byref(function), module, name.encode()))
        optin = c_int()
        _check(lib.cuDeviceGetAttribute(byref(optin), _DEVICE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                        _device_handle(device)))
        # Triton's OutOfResources checks: such a kernel is left to Triton, which reports it.
        if shared > optin.value:
            raise CudaError(f"needs {shared} bytes of shared memory, the device has {optin.value}")
        max_threads = _function_attribute(function, _FUNC_MAX_THREADS_PER_BLOCK)
        if num_warps * WARP_SIZE > max_threads:
            raise CudaError(f"needs {num_warps * WARP_SIZE} threads per block, the binary allows {max_threads}")
        if shared > _STATIC_SHARED_LIMIT and optin.value > _STATIC_SHARED_LIMIT:
            _check(lib.cuFuncSetCacheConfig(function, _FUNC_CACHE_PREFER_SHARED))
            static = _function_attribute(function, _FUNC_SHARED_SIZE_BYTES)
            _check(lib.cuFuncSetAttribute(function, _FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin.value - static))
        if num_ctas == 16:  # a non-portable cluster size (Triton sets it before every such launch)
            _check(lib.cuFuncSetAttribute(function, _FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
        attrs = _attributes(num_ctas, cooperative, pdl)
        self._attrs = (_LaunchAttribute * max(len(attrs), 1))()
        for slot, (attr_id, values) in zip(self._attrs, attrs):
            slot.id = attr_id
            slot.value[:len(values)] = values
        self._num_attrs = len(attrs)
        self.module, self.function, self.device = module, function, device
        self.threads, self.shared, self.num_ctas = num_warps * WARP_SIZE, shared, num_ctas

    def launch(self, grid: tuple[int, int, int], stream: int, params) -> None:
        """Launch on `stream` (a CUstream handle) with `params` (a void* array, one per parameter)."""
        ensure_context(self.device)
        # A fresh config per launch: launches from several threads must not share one.
        config = _LaunchConfig(grid[0] * self.num_ctas, grid[1], grid[2], self.threads, 1, 1, self.shared,
                               stream, self._attrs, self._num_attrs)
        _check(libcuda().cuLaunchKernelEx(byref(config), self.function, params, None))
