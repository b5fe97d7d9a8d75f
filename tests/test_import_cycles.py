"""Imports flow one way (issue #24): no import cycle among flexplan's modules.

The graph counts every import statement, those inside functions too: a deferred import only
moves a cycle from import time to call time, it still ties the two modules together. It follows
../shared/tools/import_cycles.py, so that both list the same cycles:
- an import depends on the modules it names, relative ones resolved against the importer:
  `import a.b.c` on a.b.c; `from a.b import c` on a.b (c is read from it) and on a.b.c where c
  is a submodule; `from a.b.c import name` on a.b.c;
- the package __init__s that merely run on the way (a.b for `import a.b.c`) are not counted,
  nor are the importer's own packages (they ran before it): that is package plumbing, like the
  re-exports below. (Counted, they merge packages into cycles, and the filter below then drops
  real ones: flexplan.ops' re-export of ops.conv.sparse_conv would hide ops.conv <-> tuning.)
- a cycle of packages and their own submodules only (an __init__ re-exporting its children) is
  not a cycle of logic.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The cycles still to break, each sorted; the test compares the list exactly, so a cycle that
# disappears must be removed here too (and a new one is never let in silently).
ALLOWED_CYCLES: list[list[str]] = []


def package_modules(repo: Path = REPO) -> dict[str, Path]:
    """Module name -> source file, for flexplan/ and kernels_src/ (imported as
    flexplan.kernels_src)."""
    roots = {"flexplan": repo / "flexplan"}
    if (repo / "kernels_src").is_dir() and not (repo / "flexplan" / "kernels").is_dir():
        roots["flexplan.kernels_src"] = repo / "kernels_src"
    modules = {}
    for package, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _ancestors(name: str) -> list[str]:
    """"a.b.c" -> ["a.b", "a"]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name `from <level dots><module> import ...` in `importer` refers to."""
    if not level:
        return module or ""
    base = importer.split(".")
    base = base[:len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([module] if module else []))


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    own_packages = set(_ancestors(name))
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(name, is_package, node.level, node.module)
            targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # A name imported from a module (not a submodule): the module itself.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if not target:
                continue  # outside the package (torch, triton, ...)
            if target != name and target not in own_packages:
                found.add(target)
    return found


def import_graph(repo: Path = REPO) -> dict[str, set[str]]:
    modules = package_modules(repo)
    return {name: module_imports(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Components of more than one node of a directed graph (Tarjan's algorithm, iterative),
    each sorted, the list sorted."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def _package_and_children_only(component: list[str]) -> bool:
    """Every member is a package of another member or inside one: __init__ re-exports."""
    return all(any(other.startswith(member + ".") or member.startswith(other + ".")
                   for other in component if other != member) for member in component)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    return [c for c in strongly_connected(graph) if not _package_and_children_only(c)]


def test_only_the_listed_import_cycles_remain():
    found = import_cycles(import_graph())
    new = [c for c in found if c not in ALLOWED_CYCLES]
    gone = [c for c in ALLOWED_CYCLES if c not in found]
    assert not new, f"new import cycles (make the imports flow one way): {new}"
    assert not gone, f"these cycles are gone or changed: update ALLOWED_CYCLES: {gone}"
    assert found == sorted(ALLOWED_CYCLES)


def test_the_launch_layer_and_the_schedule_import_downward_only():
    """The two cycles issue #24 broke: launcher -> aot.direct -> aot.runtime -> launch_abi, and
    segments -> segments_triton -> rank_sort -> segments_torch."""
    graph = import_graph()
    assert "flexplan.launcher" not in graph["flexplan.aot.direct"] | graph["flexplan.aot.runtime"]
    assert "flexplan.aot.direct" not in graph["flexplan.aot.runtime"]
    assert graph["flexplan.aot.launch_abi"] <= {"flexplan.versions"}
    assert graph["flexplan.versions"] == set()  # the bottom: one Triton version for everyone
    assert "flexplan.planner.segments" not in (graph["flexplan.planner.segments_triton"]
                                               | graph["flexplan.planner.rank_sort"])
    assert "flexplan.planner.segments_triton" not in graph["flexplan.planner.rank_sort"]
    assert graph["flexplan.planner.segments_torch"] <= {"flexplan.plan"}


def test_the_plan_value_asks_no_layer_above_it():
    """plan.py is a passive value module (issue #24): its GatherMap's views are derived by
    plan_views.py above it, which launches their kernels; plan.py imports neither the launcher
    nor the ops or the cache (not even inside functions)."""
    graph = import_graph()
    above = [m for m in graph["flexplan.plan"]
             if m == "flexplan.launcher" or m == "flexplan.plan_views"
             or m.split(".")[:2] in (["flexplan", "ops"], ["flexplan", "cache"])]
    assert not above, f"flexplan.plan imports layers above it: {sorted(above)}"
    assert {"flexplan.plan", "flexplan.launcher"} <= graph["flexplan.plan_views"]


def test_cycle_finder_on_small_graphs():
    line = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert import_cycles(line) == []
    loop = dict(line, c={"a"}, d={"a"}, e={"e"})  # d only reaches the loop; e imports itself
    assert import_cycles(loop) == [["a", "b", "c"]]
    two = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}}
    assert import_cycles(two) == [["a", "b"], ["c", "d"]]
    # A package importing its child and the child its package: re-exports, not a cycle ...
    reexport = {"p": {"p.x"}, "p.x": {"p"}}
    assert strongly_connected(reexport) == [["p", "p.x"]] and import_cycles(reexport) == []
    # ... unless the loop passes through a module outside that family.
    assert import_cycles({"p": {"p.x"}, "p.x": {"q"}, "q": {"p"}}) == [["p", "p.x", "q"]]
    # The allowlist comparison fails on a cycle it does not list.
    assert import_cycles(loop) not in ([], ALLOWED_CYCLES)


def test_import_graph_reads_every_kind_of_import(tmp_path):
    """Relative, absolute, inside functions, and submodules named by `from X import`."""
    files = {
        "flexplan/__init__.py": "",
        "flexplan/top.py": "def later():\n    from .pkg import leaf\n",
        "flexplan/pkg/__init__.py": "from ..top import later\n",
        "flexplan/pkg/leaf.py": "import torch\nfrom . import sibling\nfrom .sibling import NAME\n",
        "flexplan/pkg/sibling.py": "NAME = 1\ndef f():\n    import flexplan.deep.inner\n",
        "flexplan/deep/__init__.py": "",
        "flexplan/deep/inner.py": "from flexplan.kernels_src import kern\n",
        "kernels_src/__init__.py": "",
        "kernels_src/kern.py": "import triton\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph == {
        "flexplan": set(),
        "flexplan.top": {"flexplan.pkg", "flexplan.pkg.leaf"},
        "flexplan.pkg": {"flexplan.top"},
        # `from . import sibling`: the package is its own (no edge), the submodule is imported.
        "flexplan.pkg.leaf": {"flexplan.pkg.sibling"},
        "flexplan.pkg.sibling": {"flexplan.deep.inner"},  # (not the package it runs on the way)
        "flexplan.deep": set(),
        "flexplan.deep.inner": {"flexplan.kernels_src", "flexplan.kernels_src.kern"},
        "flexplan.kernels_src": set(),
        "flexplan.kernels_src.kern": set(),
    }
    assert import_cycles(graph) == [["flexplan.pkg", "flexplan.top"]]
