"""Variant -> Triton compile inputs for one target, with the JIT's own binder (same rules as JIT)."""
from __future__ import annotations

import importlib
import json

import torch

from .keys import canonical_spec, gpu_target, kernel_name, source_hash, triton_version, variant_key
from .variants import Variant

_EXAMPLE_ELEMENTS = 64  # example tensors: small, 16-byte aligned, far below ROCm's 2 GiB range


def _example(arg):
    kind, value = arg
    if kind == "tensor":
        return torch.empty(_EXAMPLE_ELEMENTS, dtype=getattr(torch, value))
    return value


class Specializer:
    """Builds the compile spec (a JSON-able dict) of variants for one target."""

    def __init__(self, target: str):
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        self.target = target
        self._backend = make_backend(gpu_target(target))
        self._make_binder = create_function_from_signature
        self._binders = {}

    def _binder(self, fn):
        if fn not in self._binders:
            self._binders[fn] = self._make_binder(fn.signature, fn.params, self._backend)
        return self._binders[fn]

    def spec(self, variant: Variant) -> dict:
        module = importlib.import_module(variant.module)
        fn = getattr(module, variant.attr)
        kwargs = dict(variant.constexprs)
        bound, specialization, options = self._binder(fn)(*map(_example, variant.args), **kwargs)
        parsed, signature, constants, attrs = fn._pack_args(self._backend, dict(kwargs), bound,
                                                            specialization, options)
        canon = canonical_spec(signature, constants, attrs)
        name, digest = kernel_name(fn), source_hash(fn)
        launch_options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
        return {
            "key": variant_key(self.target, name, digest, canon, parsed.__dict__),
            "target": self.target,
            "kernel": name,
            "short_name": variant.kernel,
            "module": variant.module,
            "attr": variant.attr,
            "source_hash": digest,
            "triton_version": triton_version(),
            "launch_options": launch_options,
            **canon,
            # Every attr, empty ones included, exactly as the JIT hands them to ASTSource.
            "compile_attrs": sorted([list(p), v] for p, v in attrs.items()),
        }


def dumps(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True, indent=1)
