"""Serve Triton's JIT from AOT bundles: when a flexplan kernel is about to be compiled, look for a
prebuilt binary of exactly that specialization and hand it to the JIT's kernel cache instead.

Triton calls `knobs.runtime.jit_cache_hook` right before compiling, with the signature,
constexprs, attrs and options its own specialization rules produced (Triton 3.6 and 3.9 alike).
The hook turns those into a variant key (flexplan.aot.keys); if an installed bundle has that key
for this GPU target and Triton version, it builds Triton's CompiledKernel from the stored
metadata + binary (no compilation), stores it in the JIT's cache and returns True (Triton then
skips the compile; flexplan.launcher launches again, now from the cache). Otherwise the JIT
compiles as usual, after one log line per kernel saying why. On CUDA with Triton 3.6,
flexplan.aot.direct launches bundle hits before Triton sees the call; this hook serves the rest.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from typing import Callable

from . import served
from .bundle import Bundle, bundle_dirs, read_bundle
from .keys import (BINARY_EXT, canonical_spec, kernel_name, source_hash, target_name, triton_version,
                   variant_key)

log = logging.getLogger("flexplan.aot")

KERNEL_PREFIX = "flexplan.kernels_src."

_lock = threading.Lock()
_installed = False
_previous_hook = None
_index: dict[str, tuple[Bundle, dict]] | None = None  # variant key -> (bundle, entry)
_sources: dict[str, set[str]] = {}                   # kernel -> source hashes in the bundles
_refused: list[str] = []
_logged: set[str] = set()
# "aot": bundle binaries loaded; "direct": those of them launched through the driver API
# (flexplan.aot.direct); "jit": compiles left to Triton's JIT.
stats = Counter()
# Resets of the caches built on top of the index (flexplan.aot.direct's loaded binaries,
# flexplan.launcher's resolved calls), which register here when imported: reset() clears them
# while this module, below both in the launch layer, imports neither.
_dependent_resets: list[Callable[[], None]] = []


def install() -> None:
    """Register the hook (idempotent; keeps and calls any hook set before)."""
    global _installed, _previous_hook
    if _installed:
        return
    from triton import knobs

    with _lock:
        if not _installed:
            _previous_hook = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = _jit_cache_hook
            _installed = True


def on_reset(forget: Callable[[], None]) -> None:
    """Have reset() also call `forget` (a cache of what the bundles served; registered once)."""
    with _lock:
        if forget not in _dependent_resets:
            _dependent_resets.append(forget)


def reset() -> None:
    """Forget loaded bundles and logged messages, and what the layers above resolved from them
    (tests; after installing a new bundle)."""
    global _index
    with _lock:
        _index = None
        _sources.clear()
        _refused.clear()
        _logged.clear()
        stats.clear()
        served.clear()
        forgets = list(_dependent_resets)
    for forget in forgets:
        forget()


def load_index() -> dict[str, tuple[Bundle, dict]]:
    """Variant key -> (bundle, entry) over every usable bundle; refused bundles are logged once."""
    global _index
    with _lock:
        if _index is None:
            index = {}
            for root in bundle_dirs():
                bundle = read_bundle(root)
                if bundle.problem:
                    _refused.append(bundle.problem)
                    log.warning("flexplan.aot: %s", bundle.problem)
                    continue
                for entry in bundle.entries:
                    index.setdefault(entry["key"], (bundle, entry))
                    _sources.setdefault(entry["kernel"], set()).add(entry["source_hash"])
            _index = index
        return _index


def bundles_have(fn) -> bool:
    """Whether an installed bundle holds this kernel's source (any variant of it)."""
    load_index()
    return source_hash(fn) in _sources.get(kernel_name(fn), ())


def refused_bundles() -> list[str]:
    load_index()
    return list(_refused)


def log_once(topic: str, message: str, *args) -> None:
    if topic not in _logged:
        _logged.add(topic)
        log.warning("flexplan.aot: " + message, *args)


def lookup(fn, target, signature: dict, constants: dict, attrs: dict, options: dict):
    """(bundle, entry) for these compile inputs of JITFunction fn on target, or (None, reason)."""
    name, tname = kernel_name(fn), target_name(target)
    spec = canonical_spec(signature, constants, attrs)
    key = variant_key(tname, name, source_hash(fn), spec, options)
    index = load_index()
    if key in index:
        return index[key]
    if name not in _sources:
        reason = "no installed bundle has this kernel"
    elif source_hash(fn) not in _sources[name]:
        reason = "the bundles were built from another version of its source"
    else:
        reason = "this specialization / target was not built"
    return None, f"{reason} ({tname}, Triton {triton_version()})"


def load_compiled(fn, compile_args: dict, bundle: Bundle, entry: dict):
    """Triton's CompiledKernel from a bundle entry: no compilation, just the stored files."""
    from triton.compiler import ASTSource, CompiledKernel

    metadata_path = bundle.root / entry["metadata"]
    binary_path = bundle.root / entry["file"]
    metadata = json.loads(metadata_path.read_text())
    ext = BINARY_EXT[metadata["target"]["backend"]]
    src = ASTSource(fn, compile_args["signature"], compile_args["constants"], compile_args["configs"][0])
    group = {f"{metadata['name']}.json": str(metadata_path), f"{metadata['name']}.{ext}": str(binary_path)}
    return CompiledKernel(src, group, metadata["hash"])


def _jit_cache_hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
    if _previous_hook is not None:
        handled = _previous_hook(key=key, repr=repr, fn=fn, compile=compile,
                                 is_manual_warmup=is_manual_warmup, already_compiled=already_compiled)
        if handled:
            return handled
    jit_fn = fn.jit_function
    name = kernel_name(jit_fn)
    if not name.startswith(KERNEL_PREFIX):
        return None
    short, variant, spec = name.rsplit(".", 1)[-1], "?", ""
    try:
        kernel_cache, _, target, _, _ = jit_fn.device_caches[compile["device"]]
        options = json.loads(compile["specialization_data"])["options"]
        variant = served.describe(jit_fn.arg_names, compile["signature"], compile["constants"], options)
        spec = served.spec_digest(compile["signature"], compile["constants"], compile["configs"][0])
        bundle, entry = lookup(jit_fn, target, compile["signature"], compile["constants"], compile["configs"][0],
                               options)
        if bundle is None:
            reason = entry
        else:
            reason = bundle.entry_files_ok(entry)
            if reason is None:
                kernel_cache[key] = load_compiled(jit_fn, compile, bundle, entry)
                stats["aot"] += 1
                served.note(served.Served(short, variant, served.BUNDLE, spec=spec))
                return True
            log_once(reason, "%s; skipping it", reason)
    except Exception as exc:  # a broken bundle must never break a launch: JIT instead
        reason = f"AOT lookup failed ({exc.__class__.__name__}: {exc})"
    stats["jit"] += 1
    served.note(served.Served(short, variant, served.COMPILED, reason, spec))
    log_once(name, "%s: %s: compiling it with Triton's JIT", name.rsplit(".", 1)[-1], reason)
    return None


def bundle_summary() -> list[Bundle]:
    """Every bundle found, usable or refused (Bundle.problem), for the doctor."""
    return [read_bundle(root) for root in bundle_dirs()]
