"""A repeated launch in one C call: the call's class, the lookup of its binary and the driver
launch, for launches flexplan.launcher has resolved through Triton 3.6's CUDA launcher.

Inside a host-bound training step a launch through flexplan.launcher costs about 25 us of host
time, of which Triton's C launcher about 10; the rest is Python: the class key, the memo
lookup, argument tuples (scripts/results/host_costs.md, sessions 42 and 43). Here one C
function computes the same class as launcher._generic_call_class (the definition; a test holds
the two equal), finds the binary recorded for it, packs the parameter block as Triton 3.6's
launcher does (flexplan/aot/kernel_params.py: one value per non-constexpr argument, then the
global and profile scratch pointers) and calls cuLaunchKernel.

It is compiled from the source below by Triton's own helper (triton.runtime.build, the system C
compiler) the first time a process JIT-resolves a launch through Triton's launcher, as Triton
3.6 compiles its own launchers, and kept in flexplan's cache (paths.native_launch_dir, one file
per source and Python build; read only where no other user can write it, file_trust). A process
whose binaries all come from AOT bundles (aot/direct.py) never compiles it: it loads the
library where `python -m aot --install` (or an earlier JIT process on the machine) left it,
and launches bundle binaries through it (unless launcher.NATIVE_BUNDLE_LAUNCHES is off).
Anything unusual (a tensor on another device, an int past 64 bits, an unknown argument kind,
a list grid, no current CUDA context, an unrecorded class) returns False and the caller takes
the Python path, which stays the definition. FLEXPLAN_NATIVE_LAUNCH=0 switches it off.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
import threading
from pathlib import Path

from .atomic_write import atomic_write
from .file_trust import untrusted_reason
from .paths import native_launch_dir

NATIVE_ENV = "FLEXPLAN_NATIVE_LAUNCH"
MODULE_NAME = "flexplan_native_launch"

# The C source. A kernel's `spec` bytes hold launcher.arg_specialization's codes per parameter
# (0 SPECIALIZED, 1 NO_ALIGNMENT, 2 NOT_SPECIALIZED); the class codes (7, 10-13, 16, a pointer's
# address & 15) are launcher._generic_call_class's.
_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#define MAX_ARGS 96
#define SCRATCH 2

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*ctx_fn)(void **);
static launch_fn cu_launch = NULL;
static ctx_fn cu_ctx_current = NULL;
static PyObject *tensor_type = NULL;
static unsigned long long launched = 0;  /* launches made here (tests: the path was taken) */
static PyObject *str_data_ptr, *str_dtype, *str_get_device;
static PyObject *codes[17];

/* A recorded binary: the driver function, block threads, shared bytes, and for each parameter
   of the block the argument it takes and its C storage (p pointer, b/B/h/H/i/I/q/Q ints,
   f fp32, d fp64, e fp16 bits, g bf16 bits). */
typedef struct {
    void *function;
    unsigned threads, shared;
    int count;
    int index[MAX_ARGS];
    char kind[MAX_ARGS];
} Record;

static void free_record(PyObject *capsule) {
    PyMem_Free(PyCapsule_GetPointer(capsule, "flexplan.Record"));
}

typedef struct {
    int is_int;      /* else double */
    long long i;
    double d;
} Value;

/* The call's class as launcher._generic_call_class builds it, and each argument's value; NULL
   (no error set) where the call is not for this path. */
static PyObject *call_class(PyObject *kid, PyObject *spec, long device, PyObject *args,
                            PyObject *constexprs, Value *values) {
    Py_ssize_t n = PyTuple_GET_SIZE(args), nspec = PyBytes_GET_SIZE(spec);
    const char *how = PyBytes_AS_STRING(spec);
    if (n > MAX_ARGS || n > nspec) return NULL;
    Py_ssize_t extra = PyDict_GET_SIZE(constexprs);
    PyObject *key = PyList_New(0);
    if (key == NULL) return NULL;
    PyObject *dev = PyLong_FromLong(device);
    if (dev == NULL || PyList_Append(key, kid) < 0 || PyList_Append(key, dev) < 0) goto fail;
    Py_CLEAR(dev);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *a = PyTuple_GET_ITEM(args, j);
        char h = how[j];
        if (PyBool_Check(a)) {
            values[j].is_int = 1; values[j].i = (a == Py_True);
            if (PyList_Append(key, a) < 0) goto fail;
        } else if (PyLong_CheckExact(a)) {
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
            if (overflow || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); goto miss; }
            values[j].is_int = 1; values[j].i = v;
            int code;
            if (v == 1 && h != 2) code = 7;
            else code = ((v >= -2147483648LL && v < 2147483648LL) ? 10 : 12)
                        + (h == 0 && (v & 15) == 0);
            if (PyList_Append(key, codes[code]) < 0) goto fail;
        } else if (PyFloat_CheckExact(a)) {
            values[j].is_int = 0; values[j].d = PyFloat_AS_DOUBLE(a);
            if (PyList_Append(key, codes[16]) < 0) goto fail;
        } else {
            int is_tensor = PyObject_IsInstance(a, tensor_type);
            if (is_tensor < 0) { PyErr_Clear(); goto miss; }
            if (!is_tensor) goto miss;
            PyObject *gd = PyObject_CallMethodNoArgs(a, str_get_device);
            if (gd == NULL) { PyErr_Clear(); goto miss; }
            long on = PyLong_AsLong(gd);
            Py_DECREF(gd);
            if (on == -1 && PyErr_Occurred()) { PyErr_Clear(); goto miss; }
            if (on != device) goto miss;
            PyObject *p = PyObject_CallMethodNoArgs(a, str_data_ptr);
            if (p == NULL) { PyErr_Clear(); goto miss; }
            unsigned long long address = PyLong_AsUnsignedLongLong(p);
            Py_DECREF(p);
            if (PyErr_Occurred()) { PyErr_Clear(); goto miss; }
            values[j].is_int = 1; values[j].i = (long long)address;
            PyObject *dt = PyObject_GetAttr(a, str_dtype);
            if (dt == NULL) { PyErr_Clear(); goto miss; }
            int bad = PyList_Append(key, dt);
            Py_DECREF(dt);
            if (bad < 0) goto fail;
            if (h == 0 && PyList_Append(key, codes[address & 15]) < 0) goto fail;
        }
    }
    if (extra) {
        PyObject *items = PyDict_Items(constexprs);
        if (items == NULL) goto fail;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(items); j++) {
            if (PyList_Append(key, PyList_GET_ITEM(items, j)) < 0) { Py_DECREF(items); goto fail; }
        }
        Py_DECREF(items);
    }
    PyObject *tuple = PyList_AsTuple(key);
    Py_DECREF(key);
    if (tuple == NULL) PyErr_Clear();
    return tuple;
miss:
    Py_DECREF(key);
    return NULL;
fail:
    Py_XDECREF(dev);
    Py_DECREF(key);
    PyErr_Clear();
    return NULL;
}

/* call_class(kid, spec, device, args, constexprs) -> the class tuple, or None */
static PyObject *py_call_class(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    Value values[MAX_ARGS];
    if (n != 5 || !PyBytes_Check(a[1]) || !PyTuple_Check(a[3]) || !PyDict_Check(a[4])) {
        PyErr_SetString(PyExc_TypeError, "call_class(kid, spec, device, args, constexprs)");
        return NULL;
    }
    long device = PyLong_AsLong(a[2]);
    if (device == -1 && PyErr_Occurred()) return NULL;
    PyObject *key = call_class(a[0], a[1], device, a[3], a[4], values);
    if (key == NULL) Py_RETURN_NONE;
    return key;
}

/* record(function, threads, shared, indices, kinds) -> a binary's record (a capsule) */
static PyObject *py_record(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    if (n != 5 || !PyTuple_Check(a[3]) || !PyBytes_Check(a[4])
            || PyTuple_GET_SIZE(a[3]) != PyBytes_GET_SIZE(a[4])
            || PyTuple_GET_SIZE(a[3]) > MAX_ARGS - SCRATCH) {
        PyErr_SetString(PyExc_TypeError, "record(function, threads, shared, indices, kinds)");
        return NULL;
    }
    Record *r = PyMem_Malloc(sizeof(Record));
    if (r == NULL) return PyErr_NoMemory();
    r->function = (void *)(uintptr_t)PyLong_AsUnsignedLongLong(a[0]);
    r->threads = (unsigned)PyLong_AsUnsignedLong(a[1]);
    r->shared = (unsigned)PyLong_AsUnsignedLong(a[2]);
    r->count = (int)PyTuple_GET_SIZE(a[3]);
    const char *kinds = PyBytes_AS_STRING(a[4]);
    for (int j = 0; j < r->count; j++) {
        long index = PyLong_AsLong(PyTuple_GET_ITEM(a[3], j));
        if (index < 0 || index >= MAX_ARGS) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "argument index out of range");
            PyMem_Free(r);
            return NULL;
        }
        r->index[j] = (int)index;
        r->kind[j] = kinds[j];
    }
    if (PyErr_Occurred()) { PyMem_Free(r); return NULL; }
    PyObject *capsule = PyCapsule_New(r, "flexplan.Record", free_record);
    if (capsule == NULL) PyMem_Free(r);
    return capsule;
}

static int pack(char kind, Value *v, uint64_t *slot) {
    *slot = 0;
    if (kind == 'p' || kind == 'q' || kind == 'Q') {
        if (!v->is_int) return -1;
        *slot = (uint64_t)v->i;
    } else if (kind == 'i' || kind == 'I') {
        /* (a signed value out of range: Triton's launcher raises; the Python path then does) */
        if (!v->is_int || (kind == 'i' && (v->i < INT32_MIN || v->i > INT32_MAX))) return -1;
        uint32_t x = (uint32_t)v->i; memcpy(slot, &x, 4);
    } else if (kind == 'h' || kind == 'H') {
        if (!v->is_int || (kind == 'h' && (v->i < INT16_MIN || v->i > INT16_MAX))) return -1;
        uint16_t x = (uint16_t)v->i; memcpy(slot, &x, 2);
    } else if (kind == 'b' || kind == 'B') {
        if (!v->is_int || (kind == 'b' && (v->i < INT8_MIN || v->i > INT8_MAX))) return -1;
        uint8_t x = (uint8_t)v->i; memcpy(slot, &x, 1);
    } else if (kind == 'f') {  /* (an int through double first, as Triton's pack_fp32) */
        float x = v->is_int ? (float)(double)v->i : (float)v->d; memcpy(slot, &x, 4);
    } else if (kind == 'd') {
        double x = v->is_int ? (double)v->i : v->d; memcpy(slot, &x, 8);
    } else {
        return -1;
    }
    return 0;
}

/* launch(calls, kid, spec, device, stream, grid, args, constexprs) -> True when launched here;
   False: the caller takes the Python path (nothing was launched). */
static PyObject *py_launch(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    Value values[MAX_ARGS];
    uint64_t slots[MAX_ARGS];
    void *params[MAX_ARGS];
    if (n != 8 || !PyDict_Check(a[0]) || !PyBytes_Check(a[2]) || !PyTuple_Check(a[6])
            || !PyDict_Check(a[7])) {
        PyErr_SetString(PyExc_TypeError,
                        "launch(calls, kid, spec, device, stream, grid, args, constexprs)");
        return NULL;
    }
    if (cu_launch == NULL || !PyTuple_Check(a[5])) Py_RETURN_FALSE;  /* (a list grid: Python) */
    long device = PyLong_AsLong(a[3]);
    if (device == -1 && PyErr_Occurred()) { PyErr_Clear(); Py_RETURN_FALSE; }
    PyObject *key = call_class(a[1], a[2], device, a[6], a[7], values);
    if (key == NULL) Py_RETURN_FALSE;
    PyObject *capsule = PyDict_GetItemWithError(a[0], key);
    Py_DECREF(key);
    if (capsule == NULL) { PyErr_Clear(); Py_RETURN_FALSE; }
    Py_INCREF(capsule);  /* held to the end: the grid's ints or another thread may drop it */
    PyObject *result = Py_False;
    Record *r = PyCapsule_GetPointer(capsule, "flexplan.Record");
    if (r == NULL) { PyErr_Clear(); goto done; }
    Py_ssize_t nargs = PyTuple_GET_SIZE(a[6]), ngrid = PyTuple_GET_SIZE(a[5]);
    unsigned grid[3] = {1, 1, 1};
    if (ngrid < 1 || ngrid > 3) goto done;
    for (Py_ssize_t g = 0; g < ngrid; g++) {
        PyObject *item = PyTuple_GET_ITEM(a[5], g);
        if (!PyLong_CheckExact(item)) goto done;  /* (no Python code runs in here) */
        long value = PyLong_AsLong(item);
        if (value < 0 || value > INT32_MAX || PyErr_Occurred()) { PyErr_Clear(); goto done; }
        grid[g] = (unsigned)value;
    }
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) {  /* as Triton: nothing to run */
        result = Py_True;
        goto done;
    }
    for (int j = 0; j < r->count; j++) {
        int i = r->index[j];
        if (i >= nargs || pack(r->kind[j], &values[i], &slots[j]) < 0) goto done;
        params[j] = &slots[j];
    }
    for (int j = r->count; j < r->count + SCRATCH; j++) {
        slots[j] = 0;
        params[j] = &slots[j];
    }
    void *context = NULL;
    if (cu_ctx_current(&context) != 0 || context == NULL) goto done;
    void *stream = (void *)(uintptr_t)PyLong_AsUnsignedLongLong(a[4]);
    if (PyErr_Occurred()) { PyErr_Clear(); goto done; }
    int err;
    Py_BEGIN_ALLOW_THREADS  /* as Triton's launchers: a full launch queue blocks here */
    err = cu_launch(r->function, grid[0], grid[1], grid[2], r->threads, 1, 1, r->shared, stream,
                    params, NULL);
    Py_END_ALLOW_THREADS
    if (err != 0) {
        Py_DECREF(capsule);
        PyErr_Format(PyExc_RuntimeError, "flexplan native launch: cuLaunchKernel error %d", err);
        return NULL;
    }
    launched++;
    result = Py_True;
done:
    Py_DECREF(capsule);
    Py_INCREF(result);
    return result;
}

/* setup(tensor_type) -> None where the driver library was found, else the reason */
static PyObject *py_setup(PyObject *self, PyObject *type) {
    Py_XINCREF(type);
    Py_XSETREF(tensor_type, type);
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) return PyUnicode_FromString("libcuda.so.1 not found");
    cu_launch = (launch_fn)dlsym(lib, "cuLaunchKernel");
    cu_ctx_current = (ctx_fn)dlsym(lib, "cuCtxGetCurrent");
    if (cu_launch == NULL || cu_ctx_current == NULL) {
        cu_launch = NULL;
        return PyUnicode_FromString("cuLaunchKernel not in libcuda.so.1");
    }
    Py_RETURN_NONE;
}

static PyObject *py_launched(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(launched);
}

static PyMethodDef methods[] = {
    {"launched", py_launched, METH_NOARGS, NULL},
    {"call_class", (PyCFunction)(void (*)(void))py_call_class, METH_FASTCALL, NULL},
    {"record", (PyCFunction)(void (*)(void))py_record, METH_FASTCALL, NULL},
    {"launch", (PyCFunction)(void (*)(void))py_launch, METH_FASTCALL, NULL},
    {"setup", py_setup, METH_O, NULL},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "flexplan_native_launch", NULL, -1,
                                    methods};

PyMODINIT_FUNC PyInit_flexplan_native_launch(void) {
    for (int c = 0; c < 17; c++) {
        codes[c] = PyLong_FromLong(c);
        if (codes[c] == NULL) return NULL;
    }
    str_data_ptr = PyUnicode_InternFromString("data_ptr");
    str_dtype = PyUnicode_InternFromString("dtype");
    str_get_device = PyUnicode_InternFromString("get_device");
    if (!str_data_ptr || !str_dtype || !str_get_device) return NULL;
    return PyModule_Create(&module);
}
"""

_lock = threading.Lock()
_UNKNOWN = object()
_module = _UNKNOWN
why_not: str | None = None  # why the native path is off in this process, once asked


def enabled() -> bool:
    return os.environ.get(NATIVE_ENV, "1") != "0"


def module(driver: bool = True, build: bool = True):
    """The module (set up with torch's Tensor type and the CUDA driver), or None; why_not then
    says why. driver=False: the module even where no driver was found (its call_class, for
    tests on machines without a GPU). build=False: only a library already built (a bundle-served
    process compiles nothing); asked again with build=True, it is built then. Loaded once per
    process."""
    global _module, why_not, _tried_building
    if _module is _UNKNOWN or (_module is None and build and not _tried_building):
        with _lock:
            if _module is _UNKNOWN or (_module is None and build and not _tried_building):
                _module, why_not = _load(build)
                _tried_building = _tried_building or build
    return _module if (why_not is None or not driver) else None


_tried_building = False  # whether _load ran with building allowed in this process
_NOT_BUILT = ("not built yet (python -m aot --install builds it; so does the first JIT launch "
              "on this machine)")


def library_path() -> Path:
    """Where the module's library is kept between processes: one file per source, Python build
    and machine."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    digest = hashlib.sha256("\0".join((_SOURCE, sys.version, platform.machine(), suffix))
                            .encode()).hexdigest()[:20]
    return native_launch_dir() / f"{MODULE_NAME}-{digest}{suffix}"


def build() -> Path:
    """Compile the module and keep its library at library_path(); that path (raises where it
    cannot be compiled or kept)."""
    return _keep(_compile())


def _compile():
    """The module compiled by Triton's helper (the system C compiler), loaded."""
    from triton.runtime.build import compile_module_from_src

    return compile_module_from_src(_SOURCE, MODULE_NAME)


def _keep(compiled) -> Path:
    """Write compiled's library to library_path(): a directory and file only this user can
    write (as the plan cache's: file_trust), through a private temporary file and an atomic
    rename, so that no reader sees a partial library."""
    path = library_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # (atomic_write's temp file has mkstemp's mode 0600)
    with atomic_write(path, prefix=f".{path.name}.") as out, \
            open(compiled.__file__, "rb") as library:
        shutil.copyfileobj(library, out)
    return path


def _load(build_if_missing: bool):
    """(module or None, why not): the kept library where it is trusted and loads; else, where
    building is allowed, a fresh build (kept if the cache takes it: a cache that cannot be
    written costs the next process a build, not this one its native launches). A library that
    does not load (damaged) is rebuilt the same way."""
    if not enabled():
        return None, f"{NATIVE_ENV}=0"
    try:
        import torch

        path = library_path()
        distrust = (untrusted_reason(path.parent) or untrusted_reason(path)
                    or ("it is a symbolic link" if path.is_symlink() else None))
        if distrust is not None:
            return None, f"{path} not loaded: {distrust}"
        loaded, failure = None, _NOT_BUILT
        if path.is_file():
            try:
                spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
                loaded = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(loaded)
            except Exception as exc:  # a damaged library: built again where allowed
                loaded, failure = None, f"{path} does not load ({type(exc).__name__}: {exc})"
        if loaded is None:
            if not build_if_missing:
                return None, failure
            loaded = _compile()
            with contextlib.suppress(Exception):  # (kept for the next process where it can be)
                _keep(loaded)
        return loaded, loaded.setup(torch.Tensor)
    except Exception as exc:  # no C compiler, no Python headers: the Python path
        return None, f"not built ({type(exc).__name__}: {exc})"


# Parameters a record can hold (the C code's MAX_ARGS less the two scratch pointers): a kernel
# with more launches through the Python path.
MAX_RECORD_PARAMS = 94


def record_of(native, compiled):
    """The native record of a Triton CompiledKernel, or None where the C path cannot launch it
    as Triton's launcher does (cluster or cooperative launches, PDL, scratch memory, a type it
    does not pack)."""
    metadata = compiled.metadata
    launcher = compiled.run
    if (getattr(metadata, "num_ctas", 1) != 1
            or getattr(launcher, "launch_cooperative_grid", False)
            or getattr(launcher, "launch_pdl", False)
            or getattr(launcher, "global_scratch_size", 0)
            or getattr(launcher, "profile_scratch_size", 0)
            or tuple(getattr(metadata, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) != (1, 1, 1)):
        return None
    return _record(native, compiled.function, 32 * metadata.num_warps, metadata.shared,
                   compiled.src.signature)


def direct_record_of(native, binary):
    """The native record of a bundle binary aot/direct.py loaded (a DirectKernel), or None
    where its launch is not a plain one (scratch, clusters, cooperative or PDL launches, a type
    the C code does not pack)."""
    cuda, metadata = binary.cuda, binary.metadata
    if (binary.scratch_kinds or cuda.num_ctas != 1 or metadata.get("launch_cooperative_grid")
            or metadata.get("launch_pdl")):
        return None
    return _record(native, cuda.function.value, cuda.threads, cuda.shared, binary.signature)


def _record(native, function: int, threads: int, shared: int, signature: dict):
    """A record of a binary whose compile signature is `signature`: its parameter block as
    Triton 3.6's launcher lays it out (aot.kernel_params, the one description of it, which the
    direct launch packs too), or None for a parameter the C code does not pack (16-bit floats,
    whose bits the launchers encode; descriptors; tuples) or more parameters than it holds."""
    from .aot.kernel_params import Unsupported, is_pointer, kernel_params, struct_code

    try:
        params = kernel_params(signature)
    except Unsupported:
        return None
    if len(params) > MAX_RECORD_PARAMS or any(
            p.encode is not None and not is_pointer(p) for p in params):
        return None
    # (the C code's kinds: 'p' for a pointer, else the struct code of the parameter's storage)
    kinds = "".join("p" if is_pointer(p) else struct_code(p) for p in params)
    return native.record(function, threads, shared, tuple(p.index for p in params),
                         kinds.encode())
