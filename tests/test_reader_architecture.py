"""The shape of reader/: no import cycle between its modules, no module using another's private names,
third-party libraries only where allowed (numpy, pyarrow, fsspec anywhere; jax, torch and zarr each in one
module), one definition of the batch schema, small modules, and the deprecated reader.order.examples names still
import.

The checks parse the sources (ast); the last test feeds them broken code to show that they fail then.
"""

from __future__ import annotations

import ast
import os
import sys
import warnings

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reader")
MAX_LINES = 450
# jax and torch may each be imported by one module only (a TPU host may have one of them and not the other),
# so those two modules hold everything that touches their library.
ONE_IMPORTER_MAX_LINES = {"jax": 500, "torch": 500}
# Third-party modules reader/ may import (everything else must be the standard library): its base install
# anywhere, and each optional library in the one module that owns it. Never Beam, a tokenizer library,
# transformers or pipelines.
BASE_LIBRARIES = {"numpy", "pyarrow", "fsspec"}
OWNED_LIBRARIES = {"jax": "jax", "torch": "torch", "zarr": "flat_tokens", "numcodecs": "flat_tokens"}
# batch keys: a tuple or list literal naming several of them outside reader/schema.py is a second schema
SCHEMA_KEYS = {"inputs", "targets", "segment_ids", "positions", "loss_mask", "tokens", "first_positions",
               "num_tokens", "example_ids", "epochs", "valid", "components"}


def read_modules(root: str = ROOT) -> dict[str, str]:
    return {f[:-3]: open(os.path.join(root, f)).read() for f in sorted(os.listdir(root)) if f.endswith(".py")}


def local_imports(name: str, tree: ast.Module, modules) -> dict[str, set[str]]:
    """``{module imported: names taken from it}`` for the package's own modules, at any depth (imports in
    functions count: they are still dependencies)."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 or (node.level == 0 and node.module and node.module.split(".")[0] == "reader"):
                base = node.module or ""
                if node.level == 0:
                    base = base.split(".", 1)[1] if "." in base else ""
                if base:
                    out.setdefault(base, set()).update(a.name for a in node.names)
                else:  # from . import x, y: modules
                    for a in node.names:
                        if a.name in modules:
                            out.setdefault(a.name, set())
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "reader" and len(parts) > 1:
                    out.setdefault(parts[1], set())
    out.pop(name, None)
    return {m: v for m, v in out.items() if m in modules}


def imported_modules(tree: ast.Module) -> list[tuple[str, int]]:
    """``(top-level module name, line)`` of every absolute import, at any depth (imports in functions count),
    and of ``importlib.import_module`` / ``__import__`` calls with a literal name."""
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


def third_party_imports(sources: dict[str, str]) -> list[str]:
    """Imports of modules that are neither the standard library, reader itself, the base install, nor an
    optional library imported by the module that owns it."""
    problems = []
    for m, s in sources.items():
        for name, line in imported_modules(ast.parse(s)):
            if name == "reader" or name in sys.stdlib_module_names or name in BASE_LIBRARIES:
                continue
            owner = OWNED_LIBRARIES.get(name)
            if owner != m:
                why = f"only reader/{owner}.py may" if owner else "reader/ needs numpy, pyarrow and fsspec only"
                problems.append(f"{m}:{line}: imports {name} ({why})")
    return problems


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
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


def defined_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, module globals and attributes it assigns."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            out.add(node.value)  # setattr(obj, "_x", ...) / __dict__.get("_x")
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def private_uses(sources: dict[str, str]) -> list[str]:
    """Uses in one module of a private name that another module of the package defines and it does not
    (other libraries' private attributes are not the package's business)."""
    trees = {m: ast.parse(s) for m, s in sources.items()}
    mine = {m: defined_private_names(t) for m, t in trees.items()}
    ours = set().union(*mine.values())
    problems = []
    for m, tree in trees.items():
        for other, names in local_imports(m, tree, trees).items():
            problems += [f"{m}: imports {n} from {other}" for n in names if n.startswith("_")]
        # other libraries' modules (os._exit ...) are not the package's business
        outside = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for a in node.names if a.name.split(".")[0] != "reader"}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in ours and node.attr not in mine[m]
                    and not (isinstance(node.value, ast.Name) and node.value.id in outside)):
                problems.append(f"{m}:{node.lineno}: uses .{node.attr}, private to another module")
    return problems


def schema_copies(sources: dict[str, str]) -> list[str]:
    problems = []
    for m, s in sources.items():
        if m == "schema":
            continue
        for node in ast.walk(ast.parse(s)):
            if isinstance(node, (ast.Tuple, ast.List)):
                keys = {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in SCHEMA_KEYS}
                if len(keys) >= 3:
                    problems.append(f"{m}:{node.lineno}: batch keys {sorted(keys)} (use reader.batch.schema)")
    return problems


def test_reader_modules_import_each_other_without_a_cycle():
    sources = read_modules()
    trees = {m: ast.parse(s) for m, s in sources.items()}
    graph = {m: set(local_imports(m, t, trees)) for m, t in trees.items()}
    assert graph["reader"] and "workers" in graph["reader"]  # the parser sees the imports
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_no_module_uses_another_modules_private_names():
    assert private_uses(read_modules()) == []


def test_reader_imports_only_its_own_libraries():
    sources = read_modules()
    seen = {m: {n for n, _ in imported_modules(ast.parse(s))} for m, s in sources.items()}
    # the parser sees imports at module level and inside functions
    assert "jax" in seen["jax"] and "zarr" in seen["flat_tokens"] and "numpy" in seen["reader"]
    assert third_party_imports(sources) == []


def test_the_batch_schema_is_defined_once():
    assert schema_copies(read_modules()) == []


def test_modules_are_small():
    sizes = {m: s.count("\n") for m, s in read_modules().items()}
    assert {m: n for m, n in sizes.items() if n > ONE_IMPORTER_MAX_LINES.get(m, MAX_LINES)} == {}


def test_the_checks_fail_on_broken_code():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    bad = {
        "a": "import os\nfrom .b import _helper, ok\nfrom . import b\n\ndef f(idx):\n    os._exit(b._x + idx._totals)\n",
        "b": "_x = 1\n\ndef _helper(): pass\n\ndef ok(): pass\n\nclass T:\n    def __init__(self):\n"
             "        self._totals = 0\n",
    }
    got = private_uses(bad)
    assert "a: imports _helper from b" in got
    assert any(".{}".format("_x") in p for p in got) and any("._totals" in p for p in got)
    assert not [p for p in got if p.startswith("b")]  # a module's own private names are its own
    assert not private_uses({"a": "def f(enc):\n    return enc._pat_str\n"})  # another library's object
    graph = {m: set(local_imports(m, ast.parse(s), bad)) for m, s in bad.items()}
    assert graph == {"a": {"b"}, "b": set()}
    assert schema_copies({"x": 'KEYS = ("inputs", "targets", "valid")\n'}) == [
        "x:1: batch keys ['inputs', 'targets', 'valid'] (use reader.batch.schema)"]
    libraries = {
        "a": "from __future__ import annotations\nimport os.path\nimport numpy as np\n\ndef f():\n"
             "    import tiktoken\n    from tokenizers import Tokenizer\n",
        "b": "from jax import numpy as jnp\nfrom . import jax\nfrom reader import torch\n",
        "jax": "import jax.numpy\n",
        "flat_tokens": "def f():\n    import numcodecs, zarr\n",
        "import_flat_tokens": "class S:\n    def g(self):\n        import zarr\n",
        "c": "import importlib\nimportlib.import_module('torch.nn')\n__import__('apache_beam')\n"
             "importlib.import_module('.x', 'reader')\n",
        "d": "import pyarrow.parquet as pq, fsspec\nfrom pipelines import tokenizer\n",
    }
    assert third_party_imports(libraries) == [
        "a:6: imports tiktoken (reader/ needs numpy, pyarrow and fsspec only)",
        "a:7: imports tokenizers (reader/ needs numpy, pyarrow and fsspec only)",
        "b:1: imports jax (only reader/jax.py may)",
        "import_flat_tokens:3: imports zarr (only reader/flat_tokens.py may)",
        "c:2: imports torch (only reader/torch.py may)",
        "c:3: imports apache_beam (reader/ needs numpy, pyarrow and fsspec only)",
        "d:2: imports pipelines (reader/ needs numpy, pyarrow and fsspec only)",
    ]


def test_the_former_reader_order_names_still_import_with_a_warning():
    from reader.order import shuffle
    from reader.order import streams

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from reader.order.examples import ShuffleConfig, round_robin_order
    assert ShuffleConfig is shuffle.ShuffleConfig and round_robin_order is streams.round_robin_order
    assert [str(w.message) for w in caught] == ["reader.order.examples.ShuffleConfig is now reader.order.shuffle.ShuffleConfig",
                                                "reader.order.examples.round_robin_order is now reader.order.streams.round_robin_order"]
    with pytest.raises(ImportError):
        from reader.order.examples import shuffle_group_of_rows  # noqa: F401  (renamed: reader.order.examples.shuffle.mix_of_rows)
