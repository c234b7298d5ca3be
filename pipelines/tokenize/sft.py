"""Supervised (SFT) records to tokens and a loss mask: prompt/completion pairs and chat conversations.

Pure functions (no Beam, no transformers); the rules are written out in docs/SFT.md.

* ``prompt_completion``: ``{"prompt": str, "completion": str}`` becomes the prompt's tokens, then the
  completion's, each encoded on its own as ordinary text, then EOS if given. Loss on the completion's tokens
  and the EOS.
* ``chat``: ``{"messages": [{"role", "content"}, ...]}`` is rendered with a Jinja2 chat template the way
  transformers renders it (:mod:`pipelines.tokenize.chat_template`). Loss on the tokens overlapping the template's
  ``{% generation %}`` output (transformers' ``return_assistant_tokens_mask`` rule), or, for a template
  without those marks, the assistant messages' rendered spans (see :func:`render_chat`).

Special tokens. A special-token string (any of the encoder's ``special_ids``) is a special token only where
the TEMPLATE writes it (its literals, ``bos_token``, ``eos_token``). In message content it stays ordinary
text, so data can never inject an end-of-sequence token or a role marker. Content occurrences are wrapped
in two private-use marker characters (absent from the record, the template and the special tokens) before
rendering; the rendered text is unwrapped after: wrapped strings are text, and only the special-token strings
outside the wrappers are special tokens. A template that cuts a wrapped string (slicing, ``split``) or
changes it so a wrapper is lost (``tojson(ensure_ascii=True)``) is a template error, never a silent mis-encode.

A bad record raises :class:`BadRecord` (a short reason and a detail); the builder sets it aside.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import re
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from . import chat_prefixes, chat_template, sandbox

ROLES = ("system", "user", "assistant", "tool")  # what Hugging Face chat templates render
ASSISTANT = "assistant"
# ShareGPT's messages ({"from": "human", "value": ...}) read as {"role": "user", "content": ...}; another "from"
# (tool, user, ...) is taken as the role it names.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
# Names a message's reasoning is passed under; transformers fills each from the first present (templates
# read "reasoning_content", gpt-oss's "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

REASONS = (
    "missing_prompt", "prompt_not_string", "missing_completion", "completion_not_string", "empty_completion",
    "missing_messages", "messages_not_list", "empty_messages", "message_not_object", "unknown_role",
    "missing_content", "content_not_string", "invalid_unicode", "template_error", "no_loss_tokens",
)


class BadRecord(ValueError):
    """A record that cannot become an example: ``reason`` (one of :data:`REASONS`) and a ``detail``."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}" if detail else reason)

    def __reduce__(self):  # picklable with its arguments (workers send exceptions to the launcher)
        return (BadRecord, (self.reason, self.detail))


class Encoder(Protocol):
    """What the encoding needs of a tokenizer (see :class:`TiktokenSft`, :class:`HFSft`)."""

    special_ids: Mapping[str, int]  # special-token string -> id: only these strings can become special ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Tokens of ``text`` as plain text: special-token strings in it are never special ids."""

    def encode_with_offsets(self, text: str) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
        """:meth:`encode_ordinary`'s tokens and each one's character span ``[start, end)`` in ``text`` (lists
        or arrays)."""


# --------------------------------------------------------------------------------------------------
# prompt / completion


def prompt_completion_of(record: Mapping[str, Any]) -> tuple[str, str]:
    """The record's prompt and completion, or :class:`BadRecord`. An empty prompt is allowed; an empty
    completion is not (it has nothing to learn but the EOS)."""
    for key in ("prompt", "completion"):
        if key not in record:
            raise BadRecord(f"missing_{key}", f"no key {key!r}")
        if not isinstance(record[key], str):
            raise BadRecord(f"{key}_not_string", f"{key!r} is {type(record[key]).__name__}")
        _check_unicode(record[key], key)
    if not record["completion"]:
        raise BadRecord("empty_completion", "'completion' is the empty string")
    return record["prompt"], record["completion"]


def encode_prompt_completion(prompt: str, completion: str, encoder: Encoder,
                             eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``(token_ids int32, loss_mask bool)``: prompt tokens (no loss), completion tokens and EOS (loss)."""
    p = encoder.encode_ordinary(prompt)
    c = encoder.encode_ordinary(completion) + ([eos_id] if eos_id is not None else [])
    mask = np.zeros(len(p) + len(c), dtype=bool)
    mask[len(p):] = True
    return np.asarray(p + c, dtype=np.int32), mask


# --------------------------------------------------------------------------------------------------
# chat


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A rendered conversation: its text, the loss character spans (in template order, as transformers
    records them) and the character spans of the special-token strings the template wrote (sorted)."""

    text: str
    loss_spans: tuple[tuple[int, int], ...]
    specials: tuple[tuple[int, int], ...]


def check_messages(messages: Any, roles: Sequence[str] = ROLES) -> list[dict]:
    """The messages as the template sees them (keys whose value is null dropped, reasoning fields aliased,
    as transformers does), or :class:`BadRecord`."""
    if not isinstance(messages, list):
        raise BadRecord("messages_not_list", f"'messages' is {type(messages).__name__}")
    if not messages:
        raise BadRecord("empty_messages", "'messages' is an empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRecord("message_not_object", f"message {i} is {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        if "role" not in m and "content" not in m and "from" in m and "value" in m:  # ShareGPT
            rest = {k: v for k, v in m.items() if k not in ("from", "value")}
            m = {"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"], **rest}
        role = m.get("role")
        if not isinstance(role, str) or role not in roles:
            raise BadRecord("unknown_role", f"message {i} has role {role!r}; allowed: {', '.join(roles)}")
        if "content" not in m:
            raise BadRecord("missing_content", f"message {i} has no 'content'")
        if not isinstance(m["content"], str):
            raise BadRecord("content_not_string", f"message {i}: 'content' is {type(m['content']).__name__}")
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat(messages: Any, template_source: str, *, bos_token: str | None = None,
                eos_token: str | None = None, special_tokens: Sequence[str] = (),
                roles: Sequence[str] = ROLES) -> Rendered:
    """Render ``messages`` with the template (``add_generation_prompt=False``, ``tools`` and ``documents``
    None, ``bos_token`` / ``eos_token`` when given) and find its loss spans and template-written specials.

    Loss spans: the ``{% generation %}`` blocks' output if the template has any. Otherwise the span of
    assistant message i runs from the end of render(messages[:i], add_generation_prompt=True) to the end of
    render(messages[:i+1]); both must be prefixes of the full render, the first no longer than the second,
    or the record is a template error (the template renders a conversation's beginning differently when
    more follows, so its assistant text cannot be located: add generation marks). Those prefix renders are
    found in a few renders of the whole conversation where the template reads it front to back
    (:mod:`pipelines.tokenize.chat_prefixes`). A render over ``max_bytes`` is the bad record ``too_long``.
    """
    msgs = check_messages(messages, roles)
    blob = "\0".join(_strings(msgs))  # every key and string value, none joined to the next
    if _has_lone_surrogate(blob):
        i = next(i for i, m in enumerate(msgs) if _has_lone_surrogate("".join(_strings(m))))
        raise BadRecord("invalid_unicode", f"message {i} holds a lone surrogate (not encodable as UTF-8)")
    special_re = _special_pattern(tuple(special_tokens))
    variables = {"tools": None, "documents": None}
    variables.update({k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None})
    wrap = None
    if special_re is not None and special_re.search(blob):
        wrap = _pick_markers(blob + template_source + "".join(special_tokens))
        msgs_in = _substitute(msgs, special_re, wrap[0] + r"\g<0>" + wrap[1])
    else:
        msgs_in = msgs
    marked = chat_template.has_generation_marks(template_source)
    full, spans = _render(template_source, msgs_in, False, variables, track=marked)
    if not marked:
        try:
            spans = chat_prefixes.assistant_spans(
                lambda ms, agp: _render(template_source, ms, agp, variables)[0], msgs_in, full,
                [i for i, m in enumerate(msgs_in) if m["role"] == ASSISTANT])
        except chat_prefixes.Unlocated as e:
            raise BadRecord("template_error", f"message {e.message}: the template renders the conversation up to it "
                            "differently from the whole one's beginning, so the assistant text cannot be "
                            "located; mark it with {% generation %}") from None
    if wrap is None:
        specials = [m.span() for m in special_re.finditer(full)] if special_re is not None else []
        return Rendered(full, tuple(spans), tuple(specials))
    text, specials, markers = _unwrap(full, wrap, special_re)
    # The specials the template writes must not depend on which special-token strings the content holds:
    # render again with each content occurrence replaced by one marker character (no special-token string).
    plain, _ = _render(template_source, _substitute(msgs, special_re, wrap[0]), False, variables)
    if [m.group(0) for m in special_re.finditer(plain)] != [text[s:e] for s, e in specials]:
        raise BadRecord("template_error", "the template changed a special-token string of message content "
                        "(escaped or rebuilt it), so its tokens cannot be told from the template's")
    to_text = lambda p: p - bisect.bisect_left(markers, p)  # noqa: E731 - marker characters before p
    return Rendered(text, tuple((to_text(s), to_text(e)) for s, e in spans), tuple(specials))


def tokenize_rendered(rendered: Rendered, encoder: Encoder) -> tuple[np.ndarray, np.ndarray]:
    """``(token_ids int32, loss_mask bool)`` of a rendered conversation.

    The text is cut at the template-written specials; each special is its id, each piece between them is
    encoded as ordinary text. A token is a loss token if its character span overlaps a loss span, by
    transformers' own loop (``apply_chat_template(..., return_assistant_tokens_mask=True)``).
    """
    text = rendered.text
    ids: list = []
    starts: list = []
    ends: list = []
    pos = 0
    for s, e in list(rendered.specials) + [(len(text), len(text))]:
        if s > pos:
            piece_ids, ps, pe = encoder.encode_with_offsets(text[pos:s])
            ids.append(np.asarray(piece_ids, dtype=np.int64))
            starts.append(np.asarray(ps, dtype=np.int64) + pos)
            ends.append(np.asarray(pe, dtype=np.int64) + pos)
        if e > s:
            ids.append(np.array([encoder.special_ids[text[s:e]]], dtype=np.int64))
            starts.append(np.array([s], dtype=np.int64))
            ends.append(np.array([e], dtype=np.int64))
        pos = e
    if not ids:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=bool)
    return (np.concatenate(ids).astype(np.int32),
            loss_mask(np.concatenate(starts), np.concatenate(ends), rendered.loss_spans))


def loss_mask(starts: Sequence[int], ends: Sequence[int], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """transformers' assistant mask: token t is masked in if ``ends[t] > span start`` for the first span
    (in order) that does not end at or before ``starts[t]``. transformers walks spans and tokens in one
    loop; as token starts never decrease, that span is the first whose end exceeds ``starts[t]``, found
    here for every token at once through the running maximum of the span ends."""
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    if not len(spans):
        return np.zeros(len(starts), dtype=bool)
    span_starts, span_ends = np.asarray(spans, dtype=np.int64).reshape(-1, 2).T
    k = np.searchsorted(np.maximum.accumulate(span_ends), starts, side="right")
    inside = k < len(span_starts)
    return inside & (ends > span_starts[np.minimum(k, len(span_starts) - 1)])


def encode_chat(record: Mapping[str, Any], template_source: str, encoder: Encoder, *,
                bos_token: str | None = None, eos_token: str | None = None,
                roles: Sequence[str] = ROLES, max_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A chat record's ``(token_ids, loss_mask)``, or :class:`BadRecord`. ``bos_token`` / ``eos_token``
    must be special tokens of the encoder (a ValueError otherwise: it is the configuration, not the record).
    Every render of the record shares one :func:`~pipelines.tokenize.sandbox.budget` (``max_bytes``:
    ``--max_doc_bytes``)."""
    for name, tok in (("bos_token", bos_token), ("eos_token", eos_token)):
        if tok is not None and tok not in encoder.special_ids:
            raise ValueError(f"{name} {tok!r} is not a special token of the tokenizer")
    if "messages" not in record:
        raise BadRecord("missing_messages", "no key 'messages'")
    with sandbox.budget(max_bytes):
        rendered = render_chat(record["messages"], template_source, bos_token=bos_token, eos_token=eos_token,
                               special_tokens=tuple(encoder.special_ids), roles=roles)
    ids, mask = tokenize_rendered(rendered, encoder)
    if not mask.any():
        raise BadRecord("no_loss_tokens", "no token of the rendered conversation is a loss token "
                        "(no assistant text)")
    return ids, mask


# --------------------------------------------------------------------------------------------------
# helpers


def _has_lone_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _check_unicode(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRecord("invalid_unicode", f"{where}: a lone surrogate at character {e.start}") from None


@functools.lru_cache(maxsize=16)
def _special_pattern(special_tokens: tuple[str, ...]) -> re.Pattern | None:
    """Any special-token string, leftmost then longest (as tokenizers matches added tokens)."""
    tokens = sorted({t for t in special_tokens if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def _pick_markers(avoid: str) -> tuple[str, str]:
    """Two supplementary private-use characters that ``avoid`` does not hold (deterministic)."""
    free = (c for c in map(chr, range(0x10FFFD, 0xEFFFF, -1)) if c not in avoid)
    return next(free), next(free)


def _strings(obj: Any):
    """Every string in ``obj``: dict keys and values, list items, recursively."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _substitute(obj: Any, special_re: re.Pattern, repl: str) -> Any:
    """``obj`` with ``special_re.sub(repl, s)`` applied to every string value (not dict keys)."""
    if isinstance(obj, str):
        return special_re.sub(repl, obj)
    if isinstance(obj, dict):
        return {k: _substitute(v, special_re, repl) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_substitute(v, special_re, repl) for v in obj]
    return obj


def _unwrap(full: str, wrap: tuple[str, str], special_re: re.Pattern):
    """The rendered text without markers, the spans of the specials outside wrapped strings, and the
    positions (in ``full``) of the marker characters; a lone marker is a template error."""
    start, end = map(re.escape, wrap)
    pieces, specials, markers, n, pos = [], [], [], 0, 0
    for m in re.finditer(f"{start}([^{start}{end}]*){end}|[{start}{end}]", full):
        if m.group(1) is None:
            raise BadRecord("template_error", f"the template cut a special-token string of message content "
                            f"apart (character {m.start()} of the render), so its tokens cannot be told "
                            "from the template's")
        outside = full[pos:m.start()]
        specials.extend((n + s.start(), n + s.end()) for s in special_re.finditer(outside))
        pieces += [outside, m.group(1)]
        n += len(outside) + len(m.group(1))
        markers += [m.start(), m.end() - 1]
        pos = m.end()
    specials.extend((n + s.start(), n + s.end()) for s in special_re.finditer(full[pos:]))
    pieces.append(full[pos:])
    return "".join(pieces), specials, markers


def _render(source: str, messages: Any, add_generation_prompt: bool, variables: dict,
            track: bool = False) -> tuple[str, list[tuple[int, int]]]:
    try:
        return chat_template.render(source, {"messages": messages, "add_generation_prompt": add_generation_prompt,
                                             **variables}, track_generation=track)
    except chat_template.RenderTooLong as e:
        raise BadRecord("too_long", str(e)) from None
    except chat_template.RenderError as e:
        raise BadRecord("template_error", str(e)) from None
