"""The shape of pipelines/: no import cycle between its modules, no module using another's private names.

Read from the source (ast), so it covers imports inside functions too and needs none of the modules'
dependencies.
"""

from __future__ import annotations

import ast
import os

import pytest

PKG = "pipelines"
PKG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PKG)


def modules() -> dict[str, ast.Module]:
    out = {}
    for name in sorted(os.listdir(PKG_DIR)):
        if name.endswith(".py"):
            mod = PKG if name == "__init__.py" else f"{PKG}.{name[:-3]}"
            with open(os.path.join(PKG_DIR, name), encoding="utf-8") as f:
                out[mod] = ast.parse(f.read(), filename=name)
    return out


def resolve_from(current: str, node: ast.ImportFrom) -> str:
    """The module an ``from X import ...`` statement names, made absolute."""
    if not node.level:
        return node.module or ""
    parts = current.split(".")
    package = parts if current == PKG else parts[:-1]  # __init__ is its own package
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def references(current: str, tree: ast.Module, known: set[str]) -> tuple[set[str], list[str]]:
    """The package modules ``current`` imports, and its uses of their private names (as messages)."""
    imported: set[str] = set()
    private: list[str] = []
    aliases: dict[str, str] = {}  # local name -> package module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    imported.add(a.name)
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            src = resolve_from(current, node)
            for a in node.names:
                sub = f"{src}.{a.name}"
                if sub in known:  # from . import fsutil
                    imported.add(sub)
                    aliases[a.asname or a.name] = sub
                elif src in known:
                    imported.add(src)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(f"{current}: from {src} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = aliases.get(node.value.id)
            if target and target != current and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(f"{current}: {node.value.id}.{node.attr} (private name of {target})")
    imported.discard(current)
    return imported, private


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    trees = modules()
    known = set(trees)
    graph, private = {}, []
    for mod, tree in trees.items():
        graph[mod], p = references(mod, tree, known)
        private += p
    return graph, private


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_pipelines_modules_import_no_cycle_and_no_private_names():
    graph, private = import_graph()
    assert len(graph) >= 10 and graph[f"{PKG}.build_cache"], "the package's modules were not found"
    assert find_cycle(graph) is None, f"import cycle in {PKG}/: {' -> '.join(find_cycle(graph))}"
    assert not private, "modules use other modules' private names:\n" + "\n".join(private)


def test_the_checks_catch_a_cycle_and_a_private_name():
    """The checks above fail when the rule is broken (a real source snippet, checked the same way)."""
    known = {f"{PKG}.a", f"{PKG}.b", f"{PKG}.c"}
    a = ast.parse("from . import b\nfrom .c import _hidden\n")
    b = ast.parse("def f():\n    from .c import visible\n")
    c = ast.parse("import pipelines.a\nfrom pipelines import b as bee\nx = bee._state\n")
    graph, private = {}, []
    for name, tree in ((f"{PKG}.a", a), (f"{PKG}.b", b), (f"{PKG}.c", c)):
        graph[name], p = references(name, tree, known)
        private += p
    assert graph == {f"{PKG}.a": {f"{PKG}.b", f"{PKG}.c"}, f"{PKG}.b": {f"{PKG}.c"},
                     f"{PKG}.c": {f"{PKG}.a", f"{PKG}.b"}}
    assert find_cycle(graph) in ([f"{PKG}.a", f"{PKG}.b", f"{PKG}.c", f"{PKG}.a"],)
    assert sorted(private) == [f"{PKG}.a: from {PKG}.c import _hidden",
                               f"{PKG}.c: bee._state (private name of {PKG}.b)"]
    del graph[f"{PKG}.c"]
    assert find_cycle(graph) is None


@pytest.mark.parametrize("relative, expected", [((1, "plan"), f"{PKG}.plan"), ((1, None), PKG)])
def test_relative_imports_resolve_inside_the_package(relative, expected):
    level, module = relative
    node = ast.ImportFrom(module=module, names=[], level=level)
    assert resolve_from(f"{PKG}.build_cache", node) == expected
