"""What identifies one ahead-of-time binary: the one place for targets and variant keys.

The build (aot/) and the runtime (flexplan.aot.runtime) both turn a kernel call into Triton's
own compile inputs (signature, constexprs, attrs, options) and hash them with `variant_key`;
a binary serves a call only when the two hashes agree, so the bundle follows the JIT's
specialization rules (pointer dtypes, divisibility by 16, ints equal to 1) by construction.
"""
from __future__ import annotations

import hashlib
import json
import os
from ..versions import triton_version  # (the build and the runtime name it here too)

# Targets flexplan builds for (`make aot`: this machine's GPUs, else all of these):
# name -> (Triton backend, arch, warp size).
TARGETS = {
    "sm_80": ("cuda", 80, 32),
    "sm_86": ("cuda", 86, 32),
    "sm_89": ("cuda", 89, 32),
    "sm_90": ("cuda", 90, 32),
    "gfx90a": ("hip", "gfx90a", 64),
    "gfx942": ("hip", "gfx942", 64),
    "gfx1100": ("hip", "gfx1100", 32),
}
# Shared memory (LDS) one program may use per target, in bytes: the heuristic's pipeline depth
# depends on it (kernel_configs.heuristic_config), so the build covers each target's choice.
TARGET_SHARED_MEMORY = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448,
                        "gfx90a": 65536, "gfx942": 65536, "gfx1100": 65536}

# Binary file suffix per Triton backend.
BINARY_EXT = {"cuda": "cubin", "hip": "hsaco"}

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1


def gpu_target(name: str):
    """GPUTarget for a target name such as "sm_90" or "gfx942" (unknown names are an error)."""
    from triton.backends.compiler import GPUTarget

    if name not in TARGETS:
        raise ValueError(f"unknown AOT target {name!r}; choose from {', '.join(TARGETS)}")
    return GPUTarget(*TARGETS[name])


def target_name(target) -> str:
    """"sm_90" / "gfx942" for a GPUTarget (the inverse of gpu_target, also for unlisted archs)."""
    if target.backend == "cuda":
        return f"sm_{target.arch}"
    return str(target.arch).split(":")[0]


def source_files(module_name: str) -> list[str]:
    """Source files of a kernel module's binaries: the module and, transitively, the modules of
    its package whose JIT helpers it uses (touching one rebuilds exactly the binaries using it)."""
    import importlib
    import sys
    import types

    package = module_name.rsplit(".", 1)[0] + "."
    files, todo, seen = set(), [module_name], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        module = importlib.import_module(name)
        files.add(module.__file__)
        for value in vars(module).values():
            if isinstance(value, types.ModuleType):
                origin = value.__name__
            else:
                origin = getattr(getattr(value, "fn", None), "__module__", None) or ""
            if origin.startswith(package) and origin in sys.modules:
                todo.append(origin)
    return sorted(files)


_source_hashes: dict[str, str] = {}


def source_hash(fn) -> str:
    """Hash of the source files a JITFunction compiles from (by file name and content). Not
    Triton's fn.cache_key: under Triton 3.6 that depends on which kernels were hashed first."""
    module = fn.fn.__module__
    if module not in _source_hashes:
        digest = hashlib.sha256()
        for path in source_files(module):
            digest.update(os.path.basename(path).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read() + b"\0")
        _source_hashes[module] = digest.hexdigest()
    return _source_hashes[module]


def kernel_name(fn) -> str:
    """Full name of a JITFunction, as Triton reports it in its compile hooks."""
    return f"{fn.fn.__module__}.{fn.fn.__qualname__}"


def canonical_options(options: dict) -> dict:
    """Options as JSON, without machine-specific absolute paths (ROCm's bitcode libraries), so a
    bundle built on one machine matches the same Triton on another."""
    options = json.loads(json.dumps(options, default=vars))
    libs = options.get("extern_libs")
    if libs:
        options["extern_libs"] = [[name, os.path.basename(path)] for name, path in libs]
    return options


def _constant_value(value):
    if hasattr(value, "value"):  # tl.constexpr
        value = value.value
    if value.__class__.__name__ == "dtype":
        return str(value)
    return value


def canonical_spec(signature: dict, constants: dict, attrs: dict) -> dict:
    """Triton's compile inputs ({name: type}, {(i,): value}, {(i,): [[attr, v]]}) as plain JSON."""
    return {
        "signature": dict(signature),
        "constants": sorted([list(path), _constant_value(v)] for path, v in constants.items()),
        "attrs": sorted([list(path), v] for path, v in attrs.items() if v),
    }


def variant_key(target: str, kernel: str, source_hash: str, spec: dict, options: dict) -> str:
    """Hash of everything that makes one binary: target, kernel, its source, specialization, options."""
    blob = json.dumps([target, kernel, source_hash, spec, canonical_options(options)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
