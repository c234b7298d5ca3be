"""The shape of reader/ and pipelines/, read from the sources (ast, so imports inside functions count and no
dependency needs to be installed):

- no import cycle between the modules of either package, and no import loop between two subfolders of one
  (``reader/storage`` -> ``reader/format`` -> ``reader/storage``, if only through other modules);
- no module uses a private name (``_x``) that another module of the packages defines;
- reader/ never imports pipelines/, Beam, transformers or a tokenizer library outside its one tokenizer
  module; numpy, pyarrow and fsspec anywhere, each optional library in the one module that owns it;
- pipelines/ imports from reader/ only the modules reader shares with it (docs/ARCHITECTURE.md);
- the batch schema is defined once;
- no module over 800 lines (sizes are reported, not limited, below that: past 600, split by concept).

The last test feeds the checks broken code to show that they fail then.
"""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("reader", "pipelines")
# Sizes are guidance: a module grows as long as its concept needs. Past SPLIT_LINES, split it by concept
# (the report below names such modules); past MAX_LINES the check fails.
SPLIT_LINES = 600
MAX_LINES = 800
# Third-party modules reader/ may import (everything else must be the standard library): its base install
# anywhere, and each optional library in the one module that owns it.
BASE_LIBRARIES = {"numpy", "pyarrow", "fsspec"}
OWNED_LIBRARIES = {"jax": "reader.jax", "torch": "reader.torch", "zarr": "reader.interop.flat_tokens",
                   "numcodecs": "reader.interop.flat_tokens",
                   # the one tokenizer resolver; huggingface_hub only fetches a hub tokenizer's files for it
                   "tiktoken": "reader.tokenizers.tokenizer_lib", "tiktoken_ext": "reader.tokenizers.tokenizer_lib",
                   "tokenizers": "reader.tokenizers.tokenizer_lib", "huggingface_hub": "reader.tokenizers.tokenizer_files",
                   "matplotlib": "reader.report.page"}  # the report page's figures
# What reader/ shares with pipelines/: the on-disk format, the tokenizer resolver, the global chunk order,
# opening a cache (the export reads one), the atomic write every writer uses, the interop readers and writers
# both exports and the importers use, and the command line's error messages. Everything else in reader/ is the
# reader's own.
SHARED_WITH_PIPELINES = ("reader.format", "reader.tokenizers", "reader.order.streams", "reader.storage.cache",
                         "reader.storage.files", "reader.storage.finish", "reader.storage.attributes",
                         "reader.storage.progress", "reader.interop", "reader.cli.support")
# batch keys: a tuple or list literal naming several of them outside reader/batch/schema.py is a second schema
SCHEMA_MODULE = "reader.batch.schema"
SCHEMA_KEYS = {"inputs", "targets", "segment_ids", "positions", "loss_mask", "tokens", "first_positions",
               "num_tokens", "example_ids", "epochs", "valid", "components"}


def read_sources(root: str = ROOT, packages=PACKAGES) -> dict[str, str]:
    """``{dotted module name: source}``; a package's ``__init__.py`` is the package itself."""
    out = {}
    for pkg in packages:
        for dirpath, dirnames, files in os.walk(os.path.join(root, pkg)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")))
            rel = os.path.relpath(dirpath, root).replace(os.sep, ".")
            for f in sorted(files):
                if f.endswith(".py"):
                    name = rel if f == "__init__.py" else f"{rel}.{f[:-3]}"
                    with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                        out[name] = fh.read()
    return out


def is_package(name: str, modules) -> bool:
    return any(m.startswith(name + ".") for m in modules)


def resolve_from(current: str, node: ast.ImportFrom, modules) -> str:
    """The module a ``from X import ...`` names, made absolute."""
    if not node.level:
        return node.module or ""
    parts = current.split(".")
    package = parts if is_package(current, modules) else parts[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def references(current: str, tree: ast.Module, modules) -> tuple[dict[str, set[str]], list[str]]:
    """``{package module imported: names taken from it}`` and the uses of other modules' private names."""
    imported: dict[str, set[str]] = {}
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    imported.setdefault(a.name, set())
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            src = resolve_from(current, node, modules)
            for a in node.names:
                sub = f"{src}.{a.name}"
                if sub in modules:  # from reader.order import streams
                    imported.setdefault(sub, set())
                    aliases[a.asname or a.name] = sub
                elif src in modules:
                    imported.setdefault(src, set()).add(a.name)
    private = [f"{current}: from {m} import {n}" for m, names in imported.items() for n in sorted(names)
               if n.startswith("_") and not n.startswith("__") and m != current]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = aliases.get(node.value.id)
            if target and target != current and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(f"{current}: {node.value.id}.{node.attr} (private name of {target})")
    imported.pop(current, None)
    return imported, private


def import_graph(sources: dict[str, str]) -> tuple[dict[str, set[str]], list[str]]:
    graph, private = {}, []
    for m, s in sources.items():
        refs, p = references(m, ast.parse(s), sources)
        graph[m] = set(refs)
        private += p
    return graph, private


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                got = visit(m)
                if got:
                    return got
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            got = visit(n)
            if got:
                return got
    return None


def folder_of(module: str, modules) -> str:
    """The subfolder a module stands in (``reader.storage`` for ``reader.storage.cache``); a package, or a
    module at the top of one (``reader.reader``), stands for itself."""
    parts = module.split(".")
    return module if is_package(module, modules) or len(parts) < 3 else ".".join(parts[:2])


def folder_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops that run through two subfolders or more of a package: the strongly connected parts
    of the graph of folders (a module at a package's top is a node of its own), each as its sorted nodes."""
    folders: dict[str, set[str]] = {}
    for m, ts in graph.items():
        a = folder_of(m, graph)
        folders.setdefault(a, set()).update(b for b in (folder_of(t, graph) for t in ts) if b != a)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    parts: list[list[str]] = []

    def visit(n):  # Tarjan's algorithm
        index[n] = low[n] = len(index)
        stack.append(n)
        for m in sorted(folders.get(n, ())):
            if m not in index:
                visit(m)
                low[n] = min(low[n], low[m])
            elif m in stack:
                low[n] = min(low[n], index[m])
        if low[n] == index[n]:
            part = []
            while not part or part[-1] != n:
                part.append(stack.pop())
            parts.append(sorted(part))

    for n in sorted(folders):
        if n not in index:
            visit(n)
    return sorted(p for p in parts if sum(f.count(".") == 1 and is_package(f, graph) for f in p) >= 2)


def imported_modules(tree: ast.Module) -> list[tuple[str, int]]:
    """``(top-level module name, line)`` of every absolute import at any depth, and of
    ``importlib.import_module`` / ``__import__`` calls with a literal name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.split(".")[0], node.lineno))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("import_module", "__import__") and not node.args[0].value.startswith("."):
                out.append((node.args[0].value.split(".")[0], node.lineno))
    return out


def reader_library_problems(sources: dict[str, str]) -> list[str]:
    problems = []
    for m, s in sources.items():
        if not (m == "reader" or m.startswith("reader.")):
            continue
        for name, line in imported_modules(ast.parse(s)):
            if name == "reader" or name in sys.stdlib_module_names or name in BASE_LIBRARIES:
                continue
            owner = OWNED_LIBRARIES.get(name)
            if owner != m:
                why = f"only {owner} may" if owner else "reader/ needs numpy, pyarrow and fsspec only"
                problems.append(f"{m}:{line}: imports {name} ({why})")
    return problems


def shared_only(sources: dict[str, str]) -> list[str]:
    """pipelines/ modules importing a reader/ module that reader does not share."""
    graph, _ = import_graph(sources)
    return [f"{m} imports {t}" for m, ts in sorted(graph.items()) if m.startswith("pipelines")
            for t in sorted(ts) if t.startswith("reader")
            and not any(t == s or t.startswith(s + ".") for s in SHARED_WITH_PIPELINES)]


def schema_copies(sources: dict[str, str]) -> list[str]:
    problems = []
    for m, s in sources.items():
        if m == SCHEMA_MODULE:
            continue
        for node in ast.walk(ast.parse(s)):
            if isinstance(node, (ast.Tuple, ast.List)):
                keys = {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in SCHEMA_KEYS}
                if len(keys) >= 3:
                    problems.append(f"{m}:{node.lineno}: batch keys {sorted(keys)} (use {SCHEMA_MODULE})")
    return problems


def test_no_import_cycle():
    sources = read_sources()
    graph, _ = import_graph(sources)
    # the parser sees imports at every depth: Reader's facade uses the worker pool, the builder its units
    assert "reader.workers.pool" in graph["reader.reader"]
    assert "pipelines.chunking.transforms" in graph["pipelines.build_cache"]
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_no_import_loop_between_two_subfolders():
    graph, _ = import_graph(read_sources())
    assert folder_of("reader.storage.cache", graph) == "reader.storage" and folder_of("reader.reader", graph) == \
        "reader.reader"
    assert folder_loops(graph) == []


def test_no_module_uses_another_modules_private_names():
    assert import_graph(read_sources())[1] == []


def test_reader_imports_only_its_own_libraries():
    sources = read_sources()
    seen = {m: {n for n, _ in imported_modules(ast.parse(s))} for m, s in sources.items()}
    assert "jax" in seen["reader.jax"] and "zarr" in seen["reader.interop.flat_tokens"]
    assert reader_library_problems(sources) == []


def test_pipelines_imports_only_what_reader_shares():
    assert shared_only(read_sources()) == []


def test_the_batch_schema_is_defined_once():
    assert schema_copies(read_sources()) == []


def module_sizes(sources: dict[str, str]) -> tuple[dict[str, int], dict[str, int]]:
    """``({module: lines}, {folder: modules})``: the sizes the structure reports."""
    lines = {m: s.count("\n") for m, s in sources.items()}
    folders: dict[str, int] = {}
    for m in sources:
        if not is_package(m, sources):
            folder = m.rsplit(".", 1)[0]
            folders[folder] = folders.get(folder, 0) + (not m.endswith("__main__"))
    return lines, folders


def test_no_module_is_past_the_hard_size_limit():
    """Module and folder sizes are reported (``-rP`` shows them), not limited, but one very long module has
    several concepts in it: past MAX_LINES the check fails."""
    lines, folders = module_sizes(read_sources())
    long = {m: n for m, n in sorted(lines.items()) if n > SPLIT_LINES}
    print(f"modules over {SPLIT_LINES} lines (split by concept): {long or 'none'}")
    print("largest folders:", sorted(folders.items(), key=lambda kv: -kv[1])[:5])
    assert {m: n for m, n in lines.items() if n > MAX_LINES} == {}


def test_the_checks_fail_on_broken_code():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    bad = {
        "reader": "from reader.a import f\n",
        "reader.a": "import os\nfrom reader.b import _helper, ok\nfrom reader import b\n\ndef f(idx):\n"
                    "    os._exit(b._x + idx._totals)\n",
        "reader.b": "_x = 1\n\ndef _helper(): pass\n\ndef ok():\n    from reader.a import f\n",
        "reader.c": "import numpy\nimport torch\n\ndef g():\n    import tiktoken\n    from pipelines import plan\n",
        "reader.d": 'KEYS = ("inputs", "targets", "valid")\n',
        "pipelines.plan": "from reader.order.examples import ExampleOrder\nfrom reader.format import spec\n",
    }
    graph, private = import_graph(bad)
    assert graph["reader.a"] == {"reader.b"} and graph["reader.b"] == {"reader.a"}
    assert find_cycle(graph) == ["reader.a", "reader.b", "reader.a"]
    assert sorted(private) == ["reader.a: b._x (private name of reader.b)", "reader.a: from reader.b import _helper"]
    assert reader_library_problems(bad) == [
        "reader.c:2: imports torch (only reader.torch may)",
        "reader.c:5: imports tiktoken (only reader.tokenizers.tokenizer_lib may)",
        "reader.c:6: imports pipelines (reader/ needs numpy, pyarrow and fsspec only)"]
    bad["reader.order.examples"] = bad["reader.format.spec"] = bad["reader.format"] = bad["reader.order"] = ""
    assert shared_only(bad) == ["pipelines.plan imports reader.order.examples"]
    assert schema_copies(bad) == [
        f"reader.d:1: batch keys ['inputs', 'targets', 'valid'] (use {SCHEMA_MODULE})"]
    # no module imports itself again, yet the folders loop: a -> b through one module, b -> a through another,
    # and c -> top -> a -> b -> c through a module at the package's top; d and its top-level facade loop
    # without a second subfolder
    loops = {"pipelines": "", "pipelines.a": "", "pipelines.b": "", "pipelines.c": "", "pipelines.d": "",
             "pipelines.a.x": "from pipelines.b import y\n", "pipelines.b.y": "", "pipelines.b.z": "import pipelines.a.w\n",
             "pipelines.a.w": "", "pipelines.c.v": "from pipelines import top\n", "pipelines.top": "from pipelines.a import w\n",
             "pipelines.b.u": "from pipelines.c import v\n", "pipelines.d.p": "from pipelines import facade\n",
             "pipelines.facade": "from pipelines.d import q\n", "pipelines.d.q": ""}
    graph, _ = import_graph(loops)
    assert find_cycle(graph) is None
    assert folder_loops(graph) == [["pipelines.a", "pipelines.b", "pipelines.c", "pipelines.top"]]
