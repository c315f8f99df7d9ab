"""The package's modules import only downward: its import graph, read from the source, has no cycle, and every
import goes to the importer's layer or one below it in the map of docs/design.md — whose lists of modules (one call's
walk through `forward/`, the layers) are the tree's.

Every `import` and `from ... import` counts, at module level and inside functions alike (a local import is an edge
that only runs later, not a missing one). An edge goes to each module of the package that a statement names: the
module it imports from, and a submodule imported by name (`from . import models`). A package's `__init__` runs
before its modules, so importing a module is not an edge to the package that holds it.
"""

from __future__ import annotations

import ast
import re

from tests.helpers.harness import ROOT

PACKAGE = ROOT / "vlmcp_patch"
DESIGN = ROOT / "docs" / "design.md"


def module_names() -> dict[str, object]:
    """Dotted module name -> its source file, for every module of the package."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_by(name: str, path, modules) -> set[str]:
    """The package's modules that module `name` (source `path`) imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported_by(name, path, modules) for name, path in modules.items()}


def a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as the modules along it (first repeated at the end), or None (depth-first search)."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph[node]):
            if cycle := visit(nxt):
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := visit(start):
            return cycle
    return None


def test_the_graph_sees_local_and_submodule_imports():
    """The reader finds what the graph must hold: a function's local import and a submodule imported by name."""
    graph = import_graph()
    assert "vlmcp_patch.planning" in graph["vlmcp_patch"]  # `from . import planning` inside a function
    assert "vlmcp_patch.models.qwen3_5" in graph["vlmcp_patch.models"]  # `from . import qwen3_5, qwen3_vl`
    assert "vlmcp_patch.collectives.order" in graph["vlmcp_patch.attention.ring"]


def test_a_cycle_is_found_where_there_is_one():
    assert a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert a_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_imports_without_a_cycle():
    cycle = a_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def map_blocks() -> tuple[list[str], list[str]]:
    """The two code blocks of design.md's map: one call's walk, the layers (their lines)."""
    section = DESIGN.read_text().split("\n## Map\n", 1)[1].split("\n## ", 1)[0]
    walk, layers = re.findall(r"```\n(.*?)```", section, flags=re.S)[:2]
    return walk.splitlines(), layers.splitlines()


def map_layers() -> list[list[str]]:
    """The map's layers, top first: each the top-level modules and packages it names (`models/` -> "models")."""
    return [[unit.strip().rstrip("/") for unit in line.split(None, 1)[1].split(",")] for line in map_blocks()[1]]


def unit_of(module: str) -> str:
    """The top-level module or package of the package that holds `module` ("__init__" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_maps_walk_names_every_module_of_the_forward():
    walked = {line.split()[0] for line in map_blocks()[0] if line.startswith("forward/")}
    tree = {f"forward/{p.name}" for p in (PACKAGE / "forward").glob("*.py") if p.name != "__init__.py"}
    assert walked == tree


def test_the_maps_layers_name_every_module_of_the_package_once():
    named = [unit for layer in map_layers() for unit in layer]
    tree = {"__main__" if p.stem == "__main__" else p.stem for p in PACKAGE.glob("*.py")}
    tree |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert sorted(named) == sorted(tree)


def test_every_import_goes_to_the_importers_layer_or_below():
    depth = {unit: i for i, layer in enumerate(map_layers()) for unit in layer}  # 0: the top
    upward = sorted(f"{module} -> {target}" for module, targets in import_graph().items() for target in targets
                    if depth[unit_of(target)] < depth[unit_of(module)])
    assert upward == []
