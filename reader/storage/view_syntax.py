"""The view syntax (``ReadOptions.view``): which documents a read keeps, as text a config file can hold.

A view is a conjunction of clauses, written as one string joined by ``and`` or as a list of such strings::

    not exact_duplicate and not near_duplicate(0.8) and language_score >= 0.9 and dump in ['CC-MAIN-2024-10']

Clauses (docs/CURATION.md, "Views"):

* ``exact_duplicate`` / ``exact_duplicate(SET)``: the document is marked in the exact-duplicate attribute set
  (``duplicates`` by default); ``near_duplicate(T)`` / ``near_duplicate(T, SET)``: marked in the near-duplicate
  set (``near_duplicates``) with an estimated Jaccard of at least ``T``. ``not`` before either negates it.
* ``FIELD OP VALUE`` with ``OP`` one of ``>= > <= < == !=`` and ``FIELD IN [V, ...]`` / ``FIELD not in [...]``
  on a kept field (``--keep_fields``). A number compares the field as a number, a quoted string as text. A
  document without the field fails every predicate on it.

Parsed here by a small tokenizer and recursive descent (never ``eval``); every error is one line naming the
clause. :attr:`ViewSpec.text` is the canonical text (clauses normalised and sorted), which names the view's
index files. Standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from typing import Sequence

EXACT_SET = "duplicates"  # the sets python -m pipelines.dedup writes by default
NEAR_SET = "near_duplicates"
MARKS = ("exact_duplicate", "near_duplicate")
OPS = (">=", ">", "<=", "<", "==", "!=", "in", "not in")
KEYWORDS = ("and", "not", "in") + MARKS
MAX_VIEW_CHARS = 1 << 16

_TOKEN = re.compile(r"\s*(?:(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)|(?P<str>'[^']*'|\"[^\"]*\")"
                    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)|(?P<op>>=|<=|==|!=|>|<)|(?P<punct>[()\[\],]))")


class ViewError(ValueError):
    """A view that cannot be read: bad syntax, or a clause the cache cannot answer (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Clause:
    """One clause. ``mark``: ``"exact_duplicate"``/``"near_duplicate"`` (then ``attr_set``, ``threshold``,
    ``negate``), or None for a field predicate (``field``, ``op``, ``value``: a float, a str, or a tuple of
    either). ``source``: the clause as written (for errors)."""

    source: str
    mark: str | None = None
    negate: bool = False
    attr_set: str | None = None
    threshold: float | None = None
    field: str | None = None
    op: str | None = None
    value: object = None

    @property
    def text(self) -> str:
        """The canonical text of the clause."""
        if self.mark is not None:
            args = [] if self.threshold is None else [_num(self.threshold)]
            default = EXACT_SET if self.mark == "exact_duplicate" else NEAR_SET
            if self.attr_set != default:
                args.append(self.attr_set)
            call = f"{self.mark}({', '.join(args)})" if args else self.mark
            return f"not {call}" if self.negate else call
        if isinstance(self.value, tuple):
            return f"{self.field} {self.op} [{', '.join(_lit(v) for v in self.value)}]"
        return f"{self.field} {self.op} {_lit(self.value)}"

    @property
    def numeric(self) -> bool:
        """A field predicate that compares the field as a number."""
        v = self.value
        return isinstance(v[0] if isinstance(v, tuple) else v, float)


@dataclasses.dataclass(frozen=True)
class ViewSpec:
    """A parsed view: its clauses (in canonical order) and canonical text."""

    clauses: tuple[Clause, ...]

    @property
    def text(self) -> str:
        return " and ".join(c.text for c in self.clauses)

    @property
    def key(self) -> str:
        """16 hex digits of the sha256 of :attr:`text`: what the view's index files are named by."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.field for c in self.clauses if c.mark is None))


def _num(x: float) -> str:
    return repr(int(x)) if x == int(x) and abs(x) < 1e15 else repr(x)


def _lit(v) -> str:
    return _num(v) if isinstance(v, float) else "'" + v + "'" if "'" not in v else '"' + v + '"'


def parse_view(view: str | Sequence[str] | None) -> ViewSpec | None:
    """The :class:`ViewSpec` of ``view`` (a string or a list of strings, each one or more clauses joined by
    ``and``); None for None, an empty string or an empty list. Raises :class:`ViewError` naming the clause."""
    if view is None:
        return None
    parts = [view] if isinstance(view, str) else list(view) if isinstance(view, (list, tuple)) else None
    if parts is None or not all(isinstance(p, str) for p in parts):
        raise ViewError(f"view must be a string or a list of strings, got {type(view).__name__}")
    if sum(len(p) for p in parts) > MAX_VIEW_CHARS:
        raise ViewError(f"view is longer than {MAX_VIEW_CHARS} characters")
    clauses: dict[str, Clause] = {}
    for part in parts:
        for c in _Parser(part).clauses():
            clauses.setdefault(c.text, c)
    if not clauses:
        return None
    return ViewSpec(tuple(clauses[t] for t in sorted(clauses)))


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks: list[tuple[str, str, int]] = []  # (kind, value, offset)
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                if not text[pos:].strip():
                    break
                at = len(text[pos:]) - len(text[pos:].lstrip()) + pos
                raise ViewError(f"view {text!r}: cannot read {text[at:at + 20]!r} (at character {at})")
            kind = m.lastgroup
            self.toks.append((kind, m.group(kind), m.start(kind)))
            pos = m.end()
        self.i = 0
        self.start = 0

    def peek(self, k: int = 0) -> tuple[str, str, int] | None:
        return self.toks[self.i + k] if self.i + k < len(self.toks) else None

    def take(self) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None:
            self.fail("ends too early")
        self.i += 1
        return tok

    def source(self) -> str:
        end = self.toks[self.i - 1][2] + len(self.toks[self.i - 1][1]) if self.i else 0
        return self.text[self.start:end].strip() or self.text.strip()

    def fail(self, what: str):
        tok = self.peek()
        where = f"at {tok[1]!r}" if tok is not None else "at its end"
        clause = self.text[self.start:].split(" and ")[0].strip() or self.text
        raise ViewError(f"view clause {clause!r}: {what} ({where}); see docs/CURATION.md, \"Views\"")

    def expect(self, value: str) -> None:
        tok = self.peek()
        if tok is None or tok[1] != value:
            self.fail(f"expected {value!r}")
        self.i += 1

    def clauses(self) -> list[Clause]:
        out = []
        if not self.toks:
            return out
        while True:
            tok = self.peek()
            self.start = tok[2] if tok is not None else len(self.text)
            out.append(self.clause())
            tok = self.peek()
            if tok is None:
                return out
            if tok[1] != "and":
                self.fail("expected 'and' between clauses (a view is a conjunction)")
            self.i += 1

    def clause(self) -> Clause:
        negate = False
        tok = self.peek()
        if tok is not None and tok[1] == "not":
            negate = True
            self.i += 1
            tok = self.peek()
            if tok is None or tok[1] not in MARKS:
                self.fail("'not' goes before exact_duplicate or near_duplicate(T) (for a field, use the opposite "
                          "comparison or 'not in')")
        if tok is None or tok[0] != "name":
            self.fail("expected a clause: exact_duplicate, near_duplicate(T) or a kept field")
        if tok[1] in MARKS:
            return self.mark(negate)
        if tok[1] in KEYWORDS:
            self.fail(f"{tok[1]!r} is a keyword, not a field")
        self.i += 1
        field = tok[1]
        op = self.peek()
        if op is not None and op[1] == "not" and (self.peek(1) or ("", "", 0))[1] == "in":
            self.i += 2
            value = self.values()
            return Clause(self.source(), field=field, op="not in", value=value)
        if op is not None and op[1] == "in":
            self.i += 1
            value = self.values()
            return Clause(self.source(), field=field, op="in", value=value)
        if op is None or op[0] != "op":
            self.fail(f"expected a comparison after field {field!r}: one of {', '.join(OPS)}")
        self.i += 1
        value = self.value()
        return Clause(self.source(), field=field, op=op[1], value=value)

    def values(self) -> tuple:
        self.expect("[")
        vals = [self.value()]
        while self.peek() is not None and self.peek()[1] == ",":
            self.i += 1
            if self.peek() is not None and self.peek()[1] == "]":
                break
            vals.append(self.value())
        self.expect("]")
        if len({type(v) for v in vals}) > 1:
            self.fail("a list mixes numbers and strings")
        return tuple(sorted(set(vals)))

    def value(self):
        tok = self.peek()
        if tok is None or tok[0] not in ("num", "str"):
            self.fail("expected a number or a quoted string")
        self.i += 1
        if tok[0] == "str":
            return tok[1][1:-1]
        x = float(tok[1])
        if not math.isfinite(x):
            self.fail("a number must be finite")
        return x

    def mark(self, negate: bool) -> Clause:
        name = self.take()[1]
        args: list = []
        if self.peek() is not None and self.peek()[1] == "(":
            self.i += 1
            while True:
                tok = self.take()
                if tok[0] not in ("num", "name"):
                    self.fail(f"{name}(...) takes {'a threshold and ' * (name == 'near_duplicate')}an attribute set name")
                args.append(float(tok[1]) if tok[0] == "num" else tok[1])
                if self.peek() is not None and self.peek()[1] == ",":
                    self.i += 1
                    continue
                self.expect(")")
                break
        if name == "exact_duplicate":
            if len(args) > 1 or (args and not isinstance(args[0], str)):
                self.fail("exact_duplicate takes at most an attribute set name: exact_duplicate(SET)")
            return Clause(self.source(), mark=name, negate=negate, attr_set=args[0] if args else EXACT_SET)
        if not args or not isinstance(args[0], float) or len(args) > 2 or (len(args) == 2 and not isinstance(args[1], str)):
            self.fail("near_duplicate takes a Jaccard threshold and optionally a set: near_duplicate(0.8)")
        if not 0 < args[0] <= 1:
            self.fail(f"the Jaccard threshold must lie in (0, 1], got {_num(args[0])}")
        return Clause(self.source(), mark=name, negate=negate, threshold=args[0],
                      attr_set=args[1] if len(args) == 2 else NEAR_SET)
