"""The sandbox chat templates render in (:mod:`pipelines.tokenize.chat_template`): transformers' immutable
sandbox, with limits. A template is user code, run on every record.

The work of one record's renders is counted inside the sandbox (:data:`MAX_WORK` steps: a loop's pass, a
call, a filter, an attribute or item looked up, an operator; a step more per 64 characters or items a value
holds; a call 2, a macro's 5: about a microsecond each), every value a template builds is at most
``max_bytes`` characters or items long (checked before a multiplication, a power, a padding, a replace or a
join makes it, and after any call and filter), and what it writes counts against the same ``max_bytes``
(the ``--max_doc_bytes`` rule). Counting, not timing: a DoFn does not run on the main thread (so no
SIGALRM), and a verdict must not depend on the machine. Nothing is folded at compile time: operators are
evaluated when a record is rendered, under the limits (``{{ (10 ** (10 ** 10)) % 7 }}`` no longer hangs the
launcher). Loops are counted by a mark the compiler adds at the start of every loop's body (and one after
each loop, for :mod:`pipelines.tokenize.chat_prefixes`); no ``lipsum`` (text of any size from one call).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import re
from typing import Any, Iterator

import jinja2
import jinja2.nodes
import jinja2.runtime
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Work of one record's renders (see the module doc): a 10,000-turn conversation takes about 206,000 steps
# (ChatML, with generation marks; 0.2 s), so the default leaves room for far more than the longest line
# (--max_doc_bytes) holds; a template that runs away stops within about 20 s.
MAX_WORK = 20_000_000
DEFAULT_MAX_BYTES = 32 << 20  # the longest value and render without a --max_doc_bytes (the builder's default)
MAX_INT_BITS = 1 << 16  # an integer a template computes has at most this many bits (65,536: 19,729 digits)
STEP_BYTES = 64  # a step more per this many characters or items a value holds
_CALL_STEPS, _MACRO_STEPS = 2, 5  # what a call and a macro's call cost, in steps (about a microsecond each)
_FORMAT_WIDTH = re.compile(r"%[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?|\{[^{}]*?(\d+)")


class TemplateLimit(jinja2.exceptions.SecurityError):
    """A template broke a limit of the sandbox (work, a value's size, an integer's size)."""


class Budget:
    """What is left of one record's limits, shared by all its renders: ``work`` steps, values and output of
    at most ``max_bytes``. ``trace`` (sft's prefix renders): a list the loops, the namespaces and the tracked
    messages append their events to, with :attr:`emitted` the output written so far."""

    def __init__(self, max_bytes: int | None = None, work: int = MAX_WORK):
        self.max_bytes, self.work = max_bytes or DEFAULT_MAX_BYTES, work
        self.trace: list | None = None
        self.emitted = 0

    def step(self, n: int = 1) -> None:
        self.work -= n
        if self.work < 0:
            raise TemplateLimit(f"the template did more than {MAX_WORK:,} steps of work on this record (a limit of "
                                "the sandbox: a loop or a recursion that does not end, or far too much work)")

    def sized(self, value: Any) -> Any:
        """``value``, charged for its size, refused over ``max_bytes``."""
        n = len(value) if isinstance(value, (str, bytes, list, tuple, dict, set)) else 0
        if n > self.max_bytes:
            raise TemplateLimit(f"the template built a value of {n:,} characters or items, over the {self.max_bytes:,} "
                                "of max_doc_bytes (a limit of the sandbox)")
        self.step(1 + n // STEP_BYTES)
        return value

    def room(self, n: int, what: str) -> None:
        """Refuse to build ``what`` of about ``n`` characters or items beyond ``max_bytes``."""
        if n > self.max_bytes:
            raise TemplateLimit(f"the template would build {what} of about {n:,} characters or items, over the "
                                f"{self.max_bytes:,} of max_doc_bytes (a limit of the sandbox)")


_BUDGET: contextvars.ContextVar = contextvars.ContextVar("chat_template_budget", default=None)


def current(own: bool = True) -> Budget | None:
    """The record's budget; without one, a budget of its own (compile-time folding: the size limits alone),
    or None if ``own`` is False."""
    got = _BUDGET.get()
    return got if got is not None or not own else Budget()


@contextlib.contextmanager
def budget(max_bytes: int | None = None, work: int = MAX_WORK) -> Iterator[Budget]:
    """The limits of one record: every render inside shares them."""
    b = Budget(max_bytes, work)
    token = _BUDGET.set(b)
    try:
        yield b
    finally:
        _BUDGET.reset(token)


def _ints(args, kwargs) -> Iterator[int]:
    return (v for v in itertools.chain(args, kwargs.values()) if type(v) is int)


def _widths(text: str, args=()) -> int:
    """The largest field width or precision a %-format or str.format string asks for (a ``*`` takes it from
    ``args``)."""
    widths = [int(w) for m in _FORMAT_WIDTH.finditer(text) for w in m.groups() if w and w != "*"]
    if "*" in text:
        widths += [abs(v) for v in (args if isinstance(args, tuple) else (args,)) if type(v) is int]
    return max(widths, default=0)


def _estimate(obj: Any, name: str, args, kwargs) -> int:
    """About how long the result of calling ``name`` (a str method, or a filter) on ``obj`` would be, for
    the calls whose result can be far longer than what they are given; 0 for the others."""
    if name in ("batch", "slice") and isinstance(obj, (str, list, tuple)):
        return len(obj) + max([0, *_ints(args, kwargs)])
    if not isinstance(obj, str):
        return 0
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = obj.count(args[0]) if args[0] else len(obj) + 1
        return len(obj) + count * max(0, len(args[1]) - len(args[0]))
    if name in ("center", "ljust", "rjust", "zfill"):
        return max([len(obj), *_ints(args, kwargs)])
    if name == "expandtabs":
        size = next(_ints(args, kwargs), 8)
        return len(obj) + obj.count("\t") * max(size, 0)
    if name == "indent":
        width = next((v for v in itertools.chain(args, kwargs.values()) if isinstance(v, (int, str))), 4)
        width = len(width) if isinstance(width, str) else max(width, 0)
        return len(obj) + (obj.count("\n") + 1) * width
    if name == "join" and args and isinstance(args[0], (list, tuple)):
        return len(obj) * len(args[0]) + sum(len(x) for x in args[0] if isinstance(x, str))
    if name in ("format", "format_map"):
        return len(obj) + _widths(obj, args)
    if name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        return len(obj) * max(longest, 1)
    return 0


def checked_filter(name: str, f):
    """A filter under the limits: the result it would make first (where it can be far longer than what it is
    given), then its result."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # a context or environment comes first

    @functools.wraps(f)
    def checked(*args, **kwargs):
        b = current()
        b.step()
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        if name == "join" and isinstance(value, (list, tuple)):
            sep = rest[0] if rest else kwargs.get("d", "")
            b.room(sum(len(x) for x in value if isinstance(x, str)) + len(str(sep)) * len(value), "a joined string")
        else:
            b.room(_estimate(value, name, rest, kwargs), f"the result of the filter {name}")
        return b.sized(f(*args, **kwargs))

    return checked


_MARKS = {"chunkledger-tick": "tick", "chunkledger-loop-end": "loop_end"}  # mark -> the environment's method


def _mark(kind: str, loop: int, lineno: int) -> jinja2.nodes.ExprStmt:
    """A loop mark in a syntax tree (an expression statement, which no template can write: it needs the ``do``
    extension), compiled into a plain call of the environment's method (:class:`Codegen`)."""
    return jinja2.nodes.ExprStmt(jinja2.nodes.Const((kind, loop))).set_lineno(lineno)


class Codegen(CodeGenerator):
    """Jinja's compiler with ``~`` (concatenation) under the limits, never folded at compile time, and the
    loop marks (:func:`_instrumented`) as plain calls of the environment."""

    def visit_ExprStmt(self, node, frame) -> None:
        value = node.node.value if isinstance(node.node, jinja2.nodes.Const) else None
        if isinstance(value, tuple) and len(value) == 2 and value[0] in _MARKS:
            self.writeline(f"environment.{_MARKS[value[0]]}({int(value[1])})", node)
        else:
            super().visit_ExprStmt(node, frame)

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.concat_checked((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class Sandbox(ImmutableSandboxedEnvironment):
    """transformers' immutable sandbox, with the limits (see the module doc)."""

    code_generator_class = Codegen
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})  # also: never folded at compile time

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        b = current()
        if operator == "+" and type(left) is str and type(right) is str:  # the common case, first
            n = len(left) + len(right)
            if n > b.max_bytes:
                b.room(n, "a joined string (+)")
            b.work -= 1 + n // STEP_BYTES
            if b.work < 0:
                b.step(0)
            return left + right
        b.step()
        ints = type(left) is int and type(right) is int
        if operator == "**" and ints and right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
            raise TemplateLimit(f"the template would compute an integer of about {left.bit_length() * right:,} bits "
                                f"(**), over the {MAX_INT_BITS:,} the sandbox allows")
        if operator == "*":
            if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimit(f"the template would compute an integer of more than {MAX_INT_BITS:,} bits (*)")
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and type(n) is int:
                    b.room(len(seq) * max(n, 0), "a repeated value (*)")
        if operator == "%" and isinstance(left, str):
            b.room(len(left) + _widths(left, right), "a formatted string (%)")
        return b.sized(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        b = current()
        b.step(_MACRO_STEPS if isinstance(__obj, jinja2.runtime.Macro) else _CALL_STEPS)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        b.room(_estimate(getattr(method, "__self__", None), getattr(method, "__name__", ""), args, kwargs),
               f"the result of {getattr(method, '__name__', 'a call')}")
        return b.sized(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        b = _BUDGET.get()
        if b is not None:
            b.step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        b = _BUDGET.get()
        if b is not None:
            b.step()
        if type(obj) is dict and type(argument) is str:  # a message's field: what a template reads most
            try:
                return obj[argument]
            except KeyError:
                pass
        return super().getitem(obj, argument)

    @staticmethod
    def tick(loop: int) -> None:
        """The start of a loop's body: a step of work, and an event for sft's prefix renders."""
        b = current()
        b.step()
        if b.trace is not None:
            b.trace.append(("body", loop, b.emitted))

    @staticmethod
    def loop_end(loop: int) -> None:
        b = current()
        if b.trace is not None:
            b.trace.append(("end", loop, b.emitted))

    def concat_checked(self, parts) -> str:
        texts = [str(p) for p in parts]
        b = current()
        b.room(sum(len(t) for t in texts), "a joined string (~)")
        return b.sized("".join(texts))


def instrumented(env: jinja2.Environment, source: str) -> jinja2.nodes.Template:
    """The template's syntax tree with a mark at the start of every loop's body (a step of work) and one after
    every loop (:func:`_mark`)."""
    tree = env.parse(source)
    loops = list(tree.find_all(jinja2.nodes.For))
    ids = {id(node): i for i, node in enumerate(loops)}

    for node in [tree, *tree.find_all(jinja2.nodes.Node)]:
        for field in node.fields:
            body = getattr(node, field, None)
            if isinstance(body, list) and any(isinstance(x, jinja2.nodes.For) for x in body):
                out = []
                for x in body:
                    out.append(x)
                    if isinstance(x, jinja2.nodes.For):
                        out.append(_mark("chunkledger-loop-end", ids[id(x)], x.lineno))
                setattr(node, field, out)
    for loop in loops:
        loop.body.insert(0, _mark("chunkledger-tick", ids[id(loop)], loop.lineno))
    return tree
