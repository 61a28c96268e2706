"""The package's shape, checked: no import circle between gcache modules, no module
importing from a room on its own row or above it (LAYERS, lowest first), and no gcache module
importing the repository's `bench` or `tests`.

A room is the longest prefix in LAYERS that names a module; a module may import its own room
and rooms on lower rows only. Imports under `if TYPE_CHECKING:` are for annotations and do not
count for the rooms; imports inside functions do (a late import hides a dependency, it does not
remove it). Circles are refused with annotation imports too: a circle that only the type
checker sees still ties the modules into one knot (a contract belongs below both sides).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.support.layers import NEVER_IMPORTED_BY_GCACHE, PYTHON_LAYERS, rooms, rows
from tests.support.package_source import PACKAGE, parsed

LAYERS = rooms(PYTHON_LAYERS)  # lowest first (tests/support/layers.py)
ROW = rows(PYTHON_LAYERS)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in ROW:
            return ".".join(parts[:end])
    raise AssertionError(f"{module} is in no room of LAYERS: add it there")


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports_of(path: Path, modules: set[str], annotations: bool = False) -> set[str]:
    """The gcache modules `path` imports; `annotations`: with those under `if TYPE_CHECKING:`."""
    tree = parsed()[path]
    skip = set() if annotations else _type_checking_nodes(tree)
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "gcache")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.split(".")[0] != "gcache":
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    found.discard(me)
    return found


@functools.cache  # one parse of the package for the tests
def graph(annotations: bool = False) -> dict[str, set[str]]:
    paths = {module_name(p): p for p in parsed()}
    modules = set(paths) | {"gcache._native"}
    return {m: imports_of(p, modules, annotations) for m, p in paths.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: the strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in edges:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_room():
    for module in graph():
        room_of(module)


def test_no_module_imports_a_room_above_or_beside_its_own():
    wrong = []
    for module, targets in graph().items():
        mine = room_of(module)
        for target in targets:
            theirs = room_of(target)
            if theirs != mine and ROW[theirs] >= ROW[mine]:
                wrong.append(f"{module} -> {target} ({mine} row {ROW[mine]}, {theirs} row {ROW[theirs]})")
    assert not wrong, "imports that run up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_circle():
    found = circles(graph())
    assert not found, f"import circles: {found}"


def test_no_import_circle_even_through_annotation_imports():
    found = circles(graph(annotations=True))
    assert not found, (
        f"import circles through `if TYPE_CHECKING:` imports: {found}; move the shared contract "
        "(an ABC, a Protocol, a NamedTuple) below the modules that use it"
    )


def test_circles_finds_a_circle_and_only_the_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_gcache_never_imports_bench_or_tests():
    wrong = []
    for path, tree in parsed().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.split(".")[0] in NEVER_IMPORTED_BY_GCACHE:
                    wrong.append(f"{module_name(path)} -> {name} (line {node.lineno})")
    assert not wrong, "gcache imports what it does not ship:\n" + "\n".join(sorted(wrong))
