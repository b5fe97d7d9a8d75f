"""Which kernel variants this process launched from a bundle and which Triton compiled.

The AOT runtime notes each specialization once, when it first resolves it (runtime.py's JIT
hook: a bundle binary put in Triton's cache, or left to the JIT; direct.py: a bundle binary
launched through the driver API). `python -m flexplan doctor --workload` runs a workload and
prints report_lines(), which says what a bundle missed and why.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

BUNDLE, DIRECT, COMPILED = "bundle", "bundle-direct", "compiled"
_HOW = {BUNDLE: "through Triton's launcher", DIRECT: "through the CUDA driver API"}


@dataclass(frozen=True)
class Served:
    """One specialization: kernel (short name), its description (describe()), where its binary
    came from (BUNDLE, DIRECT, COMPILED) and, when compiled, why no bundle served it; spec: a
    digest of the whole specialization (spec_digest: what the description leaves out, the
    classes of ints and pointers, tells two records apart)."""

    kernel: str
    variant: str
    source: str
    reason: str = ""
    spec: str = ""


_lock = threading.Lock()
_records: dict[tuple[str, str, str], Served] = {}


def note(record: Served) -> None:
    with _lock:
        _records.setdefault((record.kernel, record.variant, record.spec), record)


def spec_digest(signature: dict, constants: dict, attrs: dict) -> str:
    """Triton's compile inputs of one specialization, hashed (flexplan.aot.keys.canonical_spec)."""
    import hashlib
    import json

    from .keys import canonical_spec

    blob = json.dumps(canonical_spec(signature, constants, attrs), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def records() -> list[Served]:
    with _lock:
        return list(_records.values())


def clear() -> None:
    with _lock:
        _records.clear()


def describe(arg_names, signature: dict, constants: dict, options: dict) -> str:
    """A specialization in words: the feature pointers' dtype, the constexprs, warps and stages
    (what tells two variants of a kernel apart in a report), e.g.
    "*fp16 BLOCK_M=128 BLOCK_N=64 ... num_warps=4 num_stages=5"."""
    pointers = sorted({t for t in signature.values() if isinstance(t, str) and t.startswith("*")
                       and t not in ("*i32", "*i64")})
    names = []
    for path, value in sorted(constants.items(), key=lambda item: item[0]):
        value = getattr(value, "value", value)
        if len(path) == 1 and path[0] < len(arg_names) and value is not None:
            name = arg_names[path[0]]
            if signature.get(name) == "constexpr":
                names.append(f"{name}={value}")
    launch = [f"{k}={options[k]}" for k in ("num_warps", "num_stages") if k in options]
    return " ".join([",".join(pointers) or "-", *names, *launch])


def report_lines(served: list[Served]) -> list[str]:
    """The report after a workload: counts, then each compiled variant with the reason (grouped
    by reason), then the bundle-served kernels."""
    if not served:
        return ["launched: nothing recorded (no kernel was resolved in this process: "
                "FLEXPLAN_AOT=0, the interpreter, or nothing ran on the GPU)"]
    from_bundles = [s for s in served if s.source != COMPILED]
    compiled = [s for s in served if s.source == COMPILED]
    lines = [f"launched: {len(served)} kernel variants, {len(from_bundles)} from bundles, "
             f"{len(compiled)} compiled"]
    by_reason: dict[str, list[Served]] = {}
    for s in compiled:
        by_reason.setdefault(s.reason, []).append(s)
    for reason, group in sorted(by_reason.items()):
        lines.append(f"compiled ({reason}):")
        lines += [f"  {s.kernel} {s.variant}" for s in sorted(group, key=lambda s: (s.kernel, s.variant))]
    counts: dict[tuple[str, str], int] = {}
    for s in from_bundles:
        counts[(s.source, s.kernel)] = counts.get((s.source, s.kernel), 0) + 1
    for source, how in _HOW.items():
        kernels = [f"{k} x{n}" for (src, k), n in sorted(counts.items()) if src == source]
        if kernels:
            lines.append(f"from bundles, launched {how}: " + ", ".join(kernels))
    return lines
