"""`make test-fast` runs `pytest -m "not slow"`: every folder of tests/ keeps tests in it (read from the sources:
a test is slow when it, or its module's ``pytestmark``, carries ``pytest.mark.slow``), and `make test` runs
them all. The last test shows that the check sees both kinds of mark.
"""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")


def _is_slow(node: ast.AST) -> bool:
    """``pytest.mark.slow`` (or a list or call of marks holding it)."""
    return any(isinstance(n, ast.Attribute) and n.attr == "slow" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "mark" for n in ast.walk(node))


def fast_tests(source: str) -> list[str]:
    """The test functions of a module that ``-m "not slow"`` keeps."""
    tree = ast.parse(source)
    if any(isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in s.targets)
           and _is_slow(s.value) for s in tree.body):
        return []
    return [f.name for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.name.startswith("test") and not any(_is_slow(d) for d in f.decorator_list)]


def test_every_test_folder_keeps_tests_in_the_fast_lane():
    empty = []
    for d, _, files in os.walk(TESTS):
        modules = [f for f in files if re.fullmatch(r"test_.*\.py", f)]
        if not modules:
            continue
        kept = [t for f in modules for t in fast_tests(open(os.path.join(d, f), encoding="utf-8").read())]
        if not kept:
            empty.append(os.path.relpath(d, ROOT))
    assert empty == [], "folders whose every test is marked slow (make test-fast would skip them)"


def test_the_makefile_has_both_lanes():
    make = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    assert re.search(r'^test-fast:\n(\t.*\n)*\t\$\(PY\) -m pytest -q -m "not slow" tests$', make, re.M)
    assert re.search(r"^test:\n(\t.*\n)*\t\$\(PY\) -m pytest -q tests$", make, re.M)


def test_the_check_sees_both_kinds_of_mark():
    src = ("import pytest\n@pytest.mark.slow\ndef test_a(): pass\n@pytest.mark.timeout(9)\ndef test_b(): pass\n"
           "@pytest.mark.parametrize('x', [1])\n@pytest.mark.slow\ndef test_c(x): pass\ndef helper(): pass\n")
    assert fast_tests(src) == ["test_b"]
    marked = "import pytest\npytestmark = [pytest.mark.timeout(9), pytest.mark.slow]\ndef test_a(): pass\n"
    assert fast_tests(marked) == []
    assert fast_tests("import pytest\npytestmark = pytest.mark.timeout(9)\ndef test_a(): pass\n") == ["test_a"]
