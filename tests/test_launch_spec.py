"""One description per kernel launch (issue #24): the launching code launches only through its
launch descriptions (flexplan/launch_spec.py), and the AOT build records those same functions
with example arguments (flexplan/aot/variants.py, `record`), refusing a description it would
misread. (That the registry reproduces the real launches: tests/test_aot.py.)"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flexplan.launch_spec import FEATURE, INT32, SIZE

FLEXPLAN = Path(__file__).resolve().parent.parent / "flexplan"


def _launch_calls(tree: ast.AST):
    """(line, enclosing function) of each call of launch / launcher.launch."""
    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                f = child.func
                if (isinstance(f, ast.Name) and f.id == "launch") or (
                        isinstance(f, ast.Attribute) and f.attr == "launch"
                        and isinstance(f.value, ast.Name) and f.value.id == "launcher"):
                    yield child.lineno, function
            yield from visit(child, inner)
    yield from visit(tree, None)


def test_kernels_are_launched_only_through_launch_descriptions():
    """No module calls launch(kernel, grid, ...) itself: it passes launch to a launch_* function
    (the one place that launch's arguments, constexprs and grid are written)."""
    found = []
    for path in sorted(FLEXPLAN.rglob("*.py")):
        name = path.relative_to(FLEXPLAN).as_posix()
        if name == "launcher.py" or name.startswith("aot/"):
            continue
        found += [f"{name}:{line} in {function}" for line, function
                  in _launch_calls(ast.parse(path.read_text()))]
    assert not found, found


def _kernel():
    from flexplan.kernels_src.conv_im2col import im2col_kernel

    return im2col_kernel


def test_record_runs_the_description_with_examples():
    from flexplan.aot.variants import INT_DIV16, INT_PLAIN, Variant, record

    def describe(run, src: FEATURE, nmap: INT32, out: FEATURE, row_start: SIZE, rows: SIZE,
                 k: int, v: int):
        run(_kernel(), (1, v), src, nmap, out, row_start, rows, k, v, BLOCK_M=32, BLOCK_K=32)

    got = record(describe, {"feature": "float16"}, k=64, v=27)
    assert got == Variant("im2col", (("tensor", "float16"), ("tensor", "int32"),
                                     ("tensor", "float16"), ("int", INT_PLAIN), ("int", INT_PLAIN),
                                     ("int", INT_DIV16), ("int", INT_PLAIN)),
                          (("BLOCK_K", 32), ("BLOCK_M", 32)))


def test_record_refuses_what_it_would_misread():
    from flexplan.aot.variants import record

    def size_specialized(run, src: FEATURE, nmap: INT32, out: FEATURE, k: SIZE):
        run(_kernel(), (1,), src, nmap, out, 0, 1, k, 27, BLOCK_M=32, BLOCK_K=32)

    with pytest.raises(TypeError, match="annotates 'K' of conv_im2col:im2col_kernel as SIZE"):
        record(size_specialized, {"feature": "float16"})

    def unknown_kind(run, src: FEATURE, nmap: INT32, out: FEATURE, k: int):
        run(_kernel(), (1,), src, nmap, out, 0, 1, k, 27, BLOCK_M=32, BLOCK_K=32)

    with pytest.raises(TypeError, match="the build must give 'k'"):
        record(unknown_kind, {"feature": "float16"})

    def short(run, src: FEATURE, nmap: INT32, out: FEATURE):
        run(_kernel(), (1,), src, nmap, out, 0, 1, 64, BLOCK_M=32, BLOCK_K=32)

    with pytest.raises(TypeError, match="passes 6 arguments"):
        record(short, {"feature": "float16"})
