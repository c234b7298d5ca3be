"""Chat templates rendered as Hugging Face transformers renders them, with Jinja2 alone.

The environment copies transformers' own (``_compile_jinja_template`` in ``transformers/utils/
chat_template_utils.py``, 5.x): an immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, ``tojson`` as ``json.dumps`` (no HTML escaping, ``ensure_ascii=False``),
``raise_exception``, and ``dict`` / ``namespace`` that refuse underscore names; plus the ``{% generation %}
... {% endgeneration %}`` tag, whose output character spans are recorded the way transformers records
them for ``return_assistant_tokens_mask``: the span starts at the length of everything the template had
emitted when the block finished (blocks inside macros or ``{% set %}`` capture are therefore misplaced,
exactly as in transformers).

Limits (a template is user code, run on every record): every render runs in :mod:`pipelines.tokenize.sandbox`,
which counts a record's work, bounds every value and the render itself (``--max_doc_bytes``: an over-long
render is the bad record ``too_long``), and folds nothing at compile time; a template that breaks a limit
is the record's ``template_error``, never a hang.

Two deliberate differences: no ``strftime_now``. transformers returns today's date from it, and a cache
must not depend on the day it was built. Templates that test ``strftime_now is defined`` (Llama 3.1's)
fall back to their fixed date; a template that calls it unconditionally fails, a template error. And no
``lipsum`` (text of any size from one call: no chat template uses it).

transformers is never imported here: it is an optional extra.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

from pipelines.tokenize.sandbox import STEP_BYTES, Sandbox, budget, checked_filter, current, instrumented

# transformers' test for a template with generation marks (return_assistant_tokens_mask warns without one).
GENERATION_MARK = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class ChatTemplateError(ValueError):
    """A chat template that does not compile; the message names the problem and its line."""


class RenderError(Exception):
    """The template failed while rendering one conversation (a Jinja error or ``raise_exception``)."""


class RenderTooLong(RenderError):
    """The render is longer than ``max_bytes`` (``--max_doc_bytes``)."""


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
        b = current()
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
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, optimized=False,
                   extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: checked_filter(name, f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = _raise_exception
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(instrumented(env, source))
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
    if current(own=False) is None:  # a render of its own: limits of its own
        with budget():
            return render(source, variables, track_generation)
    b = current()
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
            b.work -= len(block) // STEP_BYTES
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
