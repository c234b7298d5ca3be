"""Chat templates rendered as Hugging Face transformers renders them, with Jinja2 alone.

The environment copies transformers' own (``_compile_jinja_template`` in ``transformers/utils/
chat_template_utils.py``, 5.x): an immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, ``tojson`` as ``json.dumps`` (no HTML escaping, ``ensure_ascii=False``),
``raise_exception``, and ``dict`` / ``namespace`` that refuse underscore names; plus the ``{% generation %}
... {% endgeneration %}`` tag, whose output character spans are recorded the way transformers records
them for ``return_assistant_tokens_mask``: the span starts at the length of everything the template had
emitted when the block finished (blocks inside macros or ``{% set %}`` capture are therefore misplaced,
exactly as in transformers).

Limits (a template is user code, run on every record): the work of one record's renders is counted inside
the sandbox (:data:`MAX_WORK` steps: a loop's pass, a call, a filter, an attribute or item looked up, an
operator; a step more per 64 characters or items a value holds), every value it builds is at most
``max_bytes`` characters or items long (checked before a multiplication, a power, a padding, a replace or a
join makes it, and after any call), and what it writes counts against the same ``max_bytes`` (the
``--max_doc_bytes`` rule: an over-long render is the bad record ``too_long``). Counting, not timing: a DoFn
does not run on the main thread (so no SIGALRM), and a verdict must not depend on the machine. Nothing is
folded at compile time: operators are evaluated when a record is rendered, under the limits
(``{{ (10 ** (10 ** 10)) % 7 }}`` no longer hangs the launcher). A template that breaks a limit is the
record's ``template_error``, never a hang. Loops are counted by a call the compiler adds at the start of
every loop's body (and a mark after each loop, for :mod:`pipelines.tokenize.sft`'s prefix renders).

Two deliberate differences: no ``strftime_now``. transformers returns today's date from it, and a cache
must not depend on the day it was built. Templates that test ``strftime_now is defined`` (Llama 3.1's)
fall back to their fixed date; a template that calls it unconditionally fails, a template error. And no
``lipsum`` (text of any size from one call: no chat template uses it).

transformers is never imported here: it is an optional extra.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import json
import re
from typing import Any, Iterator

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers' test for a template with generation marks (return_assistant_tokens_mask warns without one).
GENERATION_MARK = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class ChatTemplateError(ValueError):
    """A chat template that does not compile; the message names the problem and its line."""


class RenderError(Exception):
    """The template failed while rendering one conversation (a Jinja error or ``raise_exception``)."""


class RenderTooLong(RenderError):
    """The render is longer than ``max_bytes`` (``--max_doc_bytes``)."""


# Work of one record's renders (see the module doc): a 10,000-turn conversation takes about 206,000 steps
# (ChatML, with generation marks; 0.2 s), so the default leaves room for far more than the longest line
# (--max_doc_bytes) holds; a template that runs away stops within about 20 s.
MAX_WORK = 20_000_000
DEFAULT_MAX_BYTES = 32 << 20  # the longest value and render without a --max_doc_bytes (the builder's default)
MAX_INT_BITS = 1 << 16  # an integer a template computes has at most this many bits (65,536: 19,729 digits)
_STEP_BYTES = 64  # a step more per this many characters or items a value holds
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
        self.step(1 + n // _STEP_BYTES)
        return value

    def room(self, n: int, what: str) -> None:
        """Refuse to build ``what`` of about ``n`` characters or items beyond ``max_bytes``."""
        if n > self.max_bytes:
            raise TemplateLimit(f"the template would build {what} of about {n:,} characters or items, over the "
                                f"{self.max_bytes:,} of max_doc_bytes (a limit of the sandbox)")


_BUDGET: contextvars.ContextVar = contextvars.ContextVar("chat_template_budget", default=None)


def _budget() -> Budget:
    got = _BUDGET.get()
    return got if got is not None else Budget()  # compile-time folding: the size limits alone


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


def _checked_filter(name: str, f):
    """A filter under the limits: the result it would make first (where it can be far longer than what it is
    given), then its result."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # a context or environment comes first

    @functools.wraps(f)
    def checked(*args, **kwargs):
        b = _budget()
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
    extension), compiled into a plain call of the environment's method (:class:`_Codegen`)."""
    return jinja2.nodes.ExprStmt(jinja2.nodes.Const((kind, loop))).set_lineno(lineno)


class _Codegen(CodeGenerator):
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


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' immutable sandbox, with the limits (see the module doc)."""

    code_generator_class = _Codegen
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})  # also: never folded at compile time

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        if operator == "+" and type(left) is str and type(right) is str:  # the common case, first
            n = len(left) + len(right)
            if n > b.max_bytes:
                b.room(n, "a joined string (+)")
            b.work -= 1 + n // _STEP_BYTES
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
        b = _budget()
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
        b = _budget()
        b.step()
        if b.trace is not None:
            b.trace.append(("body", loop, b.emitted))

    @staticmethod
    def loop_end(loop: int) -> None:
        b = _budget()
        if b.trace is not None:
            b.trace.append(("end", loop, b.emitted))

    def concat_checked(self, parts) -> str:
        texts = [str(p) for p in parts]
        b = _budget()
        b.room(sum(len(t) for t in texts), "a joined string (~)")
        return b.sized("".join(texts))


def _instrumented(env: jinja2.Environment, source: str) -> jinja2.nodes.Template:
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


# The spans of the render in progress in this thread (None: not tracking). A context variable, not an
# attribute of the shared compiled template, because Beam runs bundles on several threads.
_TRACKING: contextvars.ContextVar = contextvars.ContextVar("chat_template_tracking", default=None)


class _Tracking:
    def __init__(self):
        self.emitted = 0  # characters of output consumed so far
        self.spans: list[tuple[int, int]] = []


class _GenerationTag(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

    def _generation(self, caller):
        out = caller()
        tracking = _TRACKING.get()
        if tracking is not None:
            tracking.spans.append((tracking.emitted, tracking.emitted + len(out)))
        return out


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    # ``dict(...)`` without access to the dict type's attributes.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces that refuse underscore attributes (no path to CPython internals).
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        b = _budget()
        if b.trace is not None:
            b.trace.append(("ns", None, b.emitted))
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached per source); :class:`ChatTemplateError` if it does not compile."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, optimized=False,
                   extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _checked_filter(name, f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = _raise_exception
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(_instrumented(env, source))
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e.message} (line {e.lineno})") from e


@functools.lru_cache(maxsize=16)
def literal_text(source: str) -> str:
    """The template's literal strings (its raw text and every string constant) joined by NUL characters, so
    a search cannot match across two: where transformers looks for the added tokens a template writes."""
    ast = compile_template(source).environment.parse(source)
    literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(sorted(literals))


def has_generation_marks(source: str) -> bool:
    """Whether the template marks its loss text with ``{% generation %}`` (transformers' test)."""
    return GENERATION_MARK.search(source) is not None


def render(source: str, variables: dict, track_generation: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """``(text, generation spans)`` of the template with ``variables``; spans only if ``track_generation``.

    Any failure of the template (Jinja errors, ``raise_exception``, a Python error inside an expression
    such as adding a string to a number, a limit of the sandbox) raises :class:`RenderError` with the
    template's message; a render longer than the budget's ``max_bytes`` :class:`RenderTooLong`. Runs under
    the record's :func:`budget` (or a budget of its own).
    """
    template = compile_template(source)
    if _BUDGET.get() is None:  # a render of its own: limits of its own
        with budget():
            return render(source, variables, track_generation)
    b = _budget()
    start = b.emitted
    tracking = _Tracking() if track_generation else None
    token = _TRACKING.set(tracking) if tracking is not None else None
    try:
        blocks = []
        limit = start + b.max_bytes
        for block in template.generate(**variables):
            blocks.append(block)
            if tracking is not None:
                tracking.emitted += len(block)
            b.emitted += len(block)
            b.work -= len(block) // _STEP_BYTES
            if b.work < 0:
                b.step(0)
            if b.emitted > limit:
                raise RenderTooLong(f"the rendered conversation is over max_doc_bytes {b.max_bytes} (more than "
                                    f"{b.emitted - start:,} characters)")
        return "".join(blocks), tracking.spans if tracking is not None else []
    except RenderTooLong:
        raise
    except Exception as e:  # noqa: BLE001 - a template is user code: any failure is this record's template error
        raise RenderError(f"{type(e).__name__}: {e}") from e
    finally:
        if token is not None:
            _TRACKING.reset(token)


def template_from_config(config_text: str) -> str | None:
    """The ``chat_template`` of a tokenizer_config.json text: a string, or the entry named "default" of a
    list of ``{"name", "template"}``; None if there is none."""
    try:
        template = json.loads(config_text).get("chat_template")
    except (ValueError, AttributeError):
        return None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
