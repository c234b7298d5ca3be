"""The docs match the code: docs/ARCHITECTURE.md lists every module of reader/ and pipelines/ (the reader
table in import order), every relative link of README.md and docs/*.md reaches a file and a heading, every
`reader.x` / `pipelines.x` name they give imports and every repository path exists, the builder options
table of docs/RUNNING.md is the builder's parser (the code blocks run in test_snippets.py).

The checks parse the Markdown; the last test feeds them broken docs to show that they fail then.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import pytest

import test_structure as structure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a link or a heading in a code block is code)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(text):
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(path: str, text: str, exists=os.path.exists, read_target=read) -> list[str]:
    """Relative links of ``text`` (the file at ``path``) whose file or heading does not exist."""
    problems = []
    for line in prose_lines(text):
        for target in LINK.findall(re.sub(r"`[^`]*`", "``", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            name = os.path.relpath(path, ROOT)
            if not exists(dest):
                problems.append(f"{name}: {target}: no file {os.path.relpath(dest, ROOT)}")
            elif anchor and dest.endswith(".md") and anchor not in anchors(read_target(dest)):
                problems.append(f"{name}: {target}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    return problems


def section(text: str, heading: str) -> str:
    """The text from the heading line ``heading`` to the next heading of the same or a higher level."""
    lines = text.splitlines()
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end = next((i for i in range(start + 1, len(lines))
                if HEADING.match(lines[i]) and len(HEADING.match(lines[i]).group(1)) <= level), len(lines))
    return "\n".join(lines[start:end])


def table_rows(text: str) -> list[str]:
    """First cells of a Markdown table's body rows."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [r.split("|")[1] for r in rows[2:] if not set(r) <= set("|-: ")]


def modules_in_table(text: str) -> list[list[str]]:
    """The modules each table row names, as paths in the package (``` `a.py`, `sub/b.py` ``` ->
    ['a', 'sub/b']), in order."""
    return [re.findall(r"`([\w/]+)\.py`", cell) for cell in table_rows(text)]


def package_modules(package: str) -> set[str]:
    """The package's modules as paths inside it (``sub/b``), without ``__init__`` and ``__main__``."""
    out = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
        rel = os.path.relpath(dirpath, os.path.join(ROOT, package))
        out |= {os.path.normpath(os.path.join(rel, f[:-3])) for f in files
                if f.endswith(".py") and f not in ("__init__.py", "__main__.py")}
    return out


def out_of_order(rows: list[list[str]], imports: dict[str, set[str]]) -> list[str]:
    """Modules of the table that import a module of their own folder not listed above them (or before them
    in their row). Across folders the packages' layering (tests/project/test_structure.py) decides."""
    listed: set[str] = set()
    problems = []
    for row in rows:
        for m in row:
            folder = os.path.dirname(m)
            later = sorted(i for i in imports.get(m, ()) if i not in listed and i != m
                           and os.path.dirname(i) == folder)
            if later:
                problems.append(f"{m} imports {', '.join(later)}, listed below it")
            listed.add(m)
    return problems


def options_in_table(text: str) -> set[str]:
    return {o for cell in table_rows(text) for o in re.findall(r"`(--[\w-]+)", cell)}


def parser_options() -> set[str]:
    from pipelines.options import build_arg_parser

    return {s for a in build_arg_parser()._actions for s in a.option_strings if s.startswith("--")} - {"--help"}


def architecture(package: str) -> str:
    return section(read(os.path.join(DOCS, "ARCHITECTURE.md")), f"## {package}/")


def markdown_files() -> list[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))


@pytest.mark.parametrize("package", ["reader", "pipelines"])
def test_architecture_md_lists_every_module_and_no_other(package):
    listed = [m for row in modules_in_table(architecture(package)) for m in row]
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({m for m in listed if listed.count(m) > 1})}"
    have = package_modules(package)
    assert {"missing from docs/ARCHITECTURE.md": sorted(have - set(listed)),
            "listed but not in the package": sorted(set(listed) - have)} == {
        "missing from docs/ARCHITECTURE.md": [], "listed but not in the package": []}


def as_paths(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """An import graph of dotted names as paths inside ``package`` (``reader.order.streams`` -> ``order/streams``)."""
    def path(m):
        return m[len(package) + 1:].replace(".", "/") if m.startswith(package + ".") else None
    return {path(m): {path(t) for t in ts if path(t)} for m, ts in graph.items() if path(m)}


def test_the_reader_table_is_in_import_order():
    graph, _ = structure.import_graph(structure.read_sources())
    imports = as_paths(graph, "reader")
    assert imports["reader"]  # the parser sees the imports
    assert out_of_order(modules_in_table(architecture("reader")), imports) == []


# pipelines/ modules that read or write files, storage or the job (ARCHITECTURE.md: plan and ledger use none)
IO_MODULES = {"build_cache", "launcher", "lock", "chunking.transforms", "chunking.units", "chunking.chunk_writer",
              "inputs.decompress", "filesystem", "inputs.lines", "status", "inputs.gcs_check", "runners.choice", "faults", "demo",
              "tokenize.hf_resolve_memo", "runners.local_workers", "chunking.unit_queue", "export.job", "export.parts",
              "export.finalize"}


def imported_by(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module ``module`` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_plan_and_ledger_import_no_io_module():
    graph, _ = structure.import_graph(structure.read_sources())
    io = {f"pipelines.{m}" for m in IO_MODULES}
    assert io <= set(graph)  # the names are the package's modules
    for module in ("pipelines.plan", "pipelines.ledger"):
        assert sorted(m for m in imported_by(graph, module) if m in io) == [], module


@pytest.mark.parametrize("path", markdown_files(), ids=os.path.basename)
def test_relative_links_reach_a_file_and_a_heading(path):
    assert broken_links(path, read(path)) == []


NAME = re.compile(r"`((?:reader|pipelines)(?:\.\w+)+)")
PATH = re.compile(r"`((?:reader|pipelines|tests|tools|templates|benchmarks)/[^`\s*<]*)`")


def missing_names(text: str, unresolved) -> list[str]:
    """Backticked ``reader.x.y`` / ``pipelines.x`` names that do not import (``unresolved(names)`` says which),
    and repository paths that do not exist (``benchmarks/work/`` is made by the benchmarks)."""
    out = unresolved(sorted({n for n in NAME.findall(text) if not n.endswith(".py")}))
    for path in sorted(set(PATH.findall(text))):
        path = path.split("::")[0]
        if not path.startswith("benchmarks/work/") and not os.path.exists(os.path.join(ROOT, path)):
            out.append(path)
    return out


# Run in a child: importing reader.jax and reader.torch here would load jax and torch into the whole session.
RESOLVE = """
import importlib, json, sys
def ok(name):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False
print(json.dumps([n for n in json.loads(sys.argv[1]) if not ok(n)]))
"""


def unimportable(names: list[str]) -> list[str]:
    import json

    p = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(names)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=None)
def unimportable_in_docs() -> frozenset[str]:
    """The names of every page that do not import, resolved in one child process (importing takes seconds)."""
    return frozenset(unimportable(sorted({n for p in markdown_files() for n in NAME.findall(read(p))})))


@pytest.mark.parametrize("path", markdown_files(), ids=os.path.basename)
def test_named_modules_attributes_and_paths_exist(path):
    assert missing_names(read(path), lambda names: [n for n in names if n in unimportable_in_docs()]) == []


# Names ARCHITECTURE.md gives without their package: a module path (`chunking/units.py`), a class and its
# members (`ExampleOrder.stream_index()`), a module's function (`launcher.plan_build`), a call (`draft()`).
DEFINES = re.compile(r"^\s*(?:def|class)\s+(\w+)|^\s*(\w+)\s*(?::[^=\n]*)?=(?!=)|^\s+(\w+)\s*:", re.M)
EXTERNAL = {"StatefulDataLoader"}  # torchdata's, named where the reader's torch loader meets it
FILE_SUFFIXES = (".json", ".bin", ".idx", ".parquet", ".lock", ".log", ".md", ".txt", ".html")


@functools.lru_cache(maxsize=None)
def defined_names() -> tuple[dict[str, set[str]], frozenset[str]]:
    """``module -> names it defines`` (by basename and by path under its package, e.g. ``plan`` and
    ``pipelines/plan``), and every product module's path."""
    out: dict[str, set[str]] = {}
    paths = set()
    for package in ("reader", "pipelines"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, package)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.relpath(os.path.join(dirpath, name), ROOT)
                    found = {a or b or c for a, b, c in DEFINES.findall(read(os.path.join(ROOT, path)))}
                    out.setdefault(name[:-3], set()).update(found)
                    paths.add(path)
    return out, frozenset(paths)


def stale_names(text: str, defined: dict[str, set[str]], paths: frozenset[str]) -> list[str]:
    """The backticked names of ``text`` that name no product module, class, member or function."""
    everything = set().union(*defined.values()) | EXTERNAL
    out = []
    for name in sorted(set(re.findall(r"`([^`\n]+)`", text))):
        if name.startswith(("reader.", "pipelines.", "-")) or name.endswith(FILE_SUFFIXES) or " " in name:
            continue  # (dotted names and repository paths: test_named_modules_attributes_and_paths_exist)
        if re.fullmatch(r"[\w/]+\.py", name):
            if not name.startswith(("tests/", "tools/", "benchmarks/", "templates/")) and not any(
                    p == name or p.endswith("/" + name) for p in paths):
                out.append(name)
            continue
        m = re.fullmatch(r"(\w+)((?:\.\w+)*)(\(\))?", name)
        if m is None:
            continue
        parts = [m.group(1)] + [x for x in m.group(2).split(".") if x]
        if m.group(1)[0].islower() and m.group(1) in defined and len(parts) > 1:  # module.name
            stale = parts[1] not in defined[m.group(1)]
        elif re.fullmatch(r"[A-Z]\w*[a-z]\w*", m.group(1)) and re.search(r"[a-z][A-Z]|^[A-Z][a-z]+[A-Z]", m.group(1)):
            stale = any(x not in everything for x in parts)  # a CamelCase class, and its members
        elif m.group(3):
            stale = any(x not in everything for x in parts)
        else:
            continue
        if stale:
            out.append(name)
    return out


def test_architecture_md_names_only_what_exists():
    defined, paths = defined_names()
    assert stale_names(read(os.path.join(DOCS, "ARCHITECTURE.md")), defined, paths) == []


def test_the_builder_options_table_is_the_parser():
    table = options_in_table(section(read(os.path.join(DOCS, "RUNNING.md")), "## Builder options"))
    have = parser_options()
    assert {"missing from docs/RUNNING.md": sorted(have - table), "not an option": sorted(table - have)} == {
        "missing from docs/RUNNING.md": [], "not an option": []}


def test_the_checks_fail_on_broken_docs():
    # a heading's anchor, as GitHub makes it
    assert slug("Shuffle: the permutation π") == "shuffle-the-permutation-π"
    assert slug("Reader workers (`num_workers`)") == "reader-workers-num_workers"
    assert slug("_FAILED.json") == "_failedjson"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
    # links: a missing file, a missing heading, and what is not a link
    doc = os.path.join(DOCS, "X.md")
    files = {os.path.join(DOCS, "Y.md"): "# Title\n## Part two\n"}
    text = ("[ok](Y.md#part-two) [gone](Z.md) [bad](Y.md#part-2) [self](#intro) [web](https://x.org/a.md)\n"
            "`[code](Z.md)`\n```\n[fenced](Z.md)\n```\n# Intro\n")
    got = broken_links(doc, text, exists=lambda p: p in files or p == doc,
                       read_target=lambda p: files.get(p, text))
    assert got == ["docs/X.md: Z.md: no file docs/Z.md", "docs/X.md: Y.md#part-2: no heading #part-2 in docs/Y.md"]
    # a module table: a row naming two modules, the order check
    table = "| module | owns |\n|---|---|\n| `a.py` | x |\n| `b.py`, `s/c.py` | y |\n"
    assert modules_in_table(table) == [["a"], ["b", "s/c"]]
    assert out_of_order([["a"], ["b", "c"]], {"c": {"b", "a"}, "b": set()}) == []
    assert out_of_order([["a"], ["b", "c"]], {"a": {"c"}, "b": {"c"}}) == [
        "a imports c, listed below it", "b imports c, listed below it"]
    assert out_of_order([["s/a"], ["b"]], {"s/a": {"b"}}) == []  # another folder: the layering decides
    assert as_paths({"p.s.a": {"p.b", "q.c"}}, "p") == {"s/a": {"b"}}
    # names and paths
    text = "`reader.format.spec.Ledger`, `reader.nope`, `reader/format/spec.py`, `tests/gone.py::t`, `benchmarks/work/x`"
    assert missing_names(text, unimportable) == ["reader.nope", "tests/gone.py"]
    # names without their package: a renamed method, a module's function, a module path, a call
    text = ("`ExampleOrder.stream_index()`, `ExampleOrder.stream_idx()`, `launcher.plan_build`, `launcher.plan_it`, "
            "`chunking/units.py`, `chunking/unit.py`, `make_plan()`, `make_plans()`, `ledger.json`, `concat`")
    assert stale_names(text, *defined_names()) == ["ExampleOrder.stream_idx()", "chunking/unit.py",
                                                   "launcher.plan_it", "make_plans()"]
    # the I/O check follows imports through other modules
    assert imported_by({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}
    # an options table
    assert options_in_table("| option | d |\n|---|---|\n| `--x N`, `--y` | 1 |\n| `--z` | 2 |\n") == {"--x", "--y", "--z"}
    assert "--input" in parser_options() and "--help" not in parser_options()
