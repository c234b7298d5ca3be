"""A JSON record (a jsonl line, or an element of a JSON array) -> its text and kept fields, or a bad record.

:func:`parse_record` defines what a JSON record is: UTF-8, a JSON object (a leading byte-order mark and a
trailing ``\\r`` are tolerated), ``--text_key`` naming a non-empty string (dots reach into nested objects,
a key that exists as written wins: :func:`pipelines.inputs.keys.json_lookup`), and every ``--keep_fields``
value a string, an integer or null. Anything else is a bad record with one of :data:`BAD_REASONS` and a
detail; :func:`dead_letter` is its dead letter. Columnar rows become records in
:mod:`pipelines.inputs.rows` (the reasons ``null_text`` and ``bad_field`` are theirs too).
"""

from __future__ import annotations

import base64
import json
from typing import Any, Sequence

from reader.format.checks import json_headroom, json_nesting

from pipelines.inputs.keys import MISSING, json_lookup, keep_value
from pipelines.plan import MAX_JSON_DEPTH

# Reasons a record is dead-lettered (the keys of the ledger's "bad_records").
BAD_REASONS = (
    "blank_line",  # empty or whitespace-only line
    "invalid_utf8",  # the record's bytes (a columnar text's) are not UTF-8
    "invalid_json",  # not parseable as JSON
    "not_an_object",  # valid JSON but not an object
    "missing_text",  # object without the text key
    "text_not_string",  # the text value is not a string
    "empty_text",  # the text is the empty string
    "invalid_unicode",  # the text holds lone surrogates (from JSON escapes such as a lone high surrogate): not encodable as UTF-8
    "tokenizer_error",  # the tokenizer failed on the text for another reason
    "too_deep",  # arrays/objects nested deeper than config max_json_depth (counted on the text, valid or not)
    "too_long",  # the record is longer than config max_doc_bytes (its dead letter keeps the first 4 KiB and the size)
    "bad_field",  # a kept field is neither a string, an integer nor null (a columnar one: not UTF-8)
    "null_text",  # columnar: the text is null
)
NO_FIELDS: tuple = ()

try:  # a dependency of apache-beam; without it every record takes the standard parser
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover
    _orjson_loads = None


def parse_record(raw: bytes, text_key: str, keep_fields: Sequence[str] = (), max_depth: int = MAX_JSON_DEPTH,
                 floats: bool = False) -> tuple[str | None, tuple, str | None, str]:
    """``(text, fields, None, "")`` for a good record, ``(None, (), reason, detail)`` for a bad one.

    Good records take a fast path (orjson, about twice the standard parser's speed). Everything else, and
    every record orjson could read differently, goes through :func:`parse_record_json`, which defines the
    reasons and details: orjson is stricter than ``json`` (it rejects lone-surrogate escapes, NaN, integers
    beyond 64 bits, a byte-order mark and invalid UTF-8, and nesting beyond 1024 levels), so those records
    fail the fast path and fall back; a record it accepts yields the same object, except for integers beyond
    64 bits, which it turns into floats (a kept field that is not a string or an integer falls back, as does
    a text that is not a string). A record with more than ``max_depth`` brackets falls back too (it may nest
    that deep, even in a duplicate key's value orjson drops), and the standard parser measures it.
    """
    if _orjson_loads is not None and raw.count(b"[") + raw.count(b"{") <= max_depth:
        try:
            obj = _orjson_loads(raw)
        except Exception:  # noqa: BLE001 - any failure: the standard parser decides (reason and detail)
            obj = None
        if type(obj) is dict:
            text = obj.get(text_key, MISSING) if "." not in text_key else json_lookup(obj, text_key)
            if type(text) is str and text:
                if not keep_fields:
                    return text, NO_FIELDS, None, ""
                fields = _fields(obj, keep_fields, floats, fast=True)
                if fields is not None:
                    return text, fields, None, ""
    return parse_record_json(raw, text_key, keep_fields, max_depth, floats)


def parse_record_json(raw: bytes, text_key: str, keep_fields: Sequence[str] = (), max_depth: int = MAX_JSON_DEPTH,
                      floats: bool = False) -> tuple[str | None, tuple, str | None, str]:
    """:func:`parse_record` with the standard library alone: the definition of every reason and detail."""
    obj, reason, detail = parse_object_json(raw, max_depth)
    if obj is None:
        return None, NO_FIELDS, reason, detail
    text = json_lookup(obj, text_key)
    if text is MISSING:
        return None, NO_FIELDS, "missing_text", f"no key {text_key!r}"
    if not isinstance(text, str):
        return None, NO_FIELDS, "text_not_string", f"{text_key!r} is {type(text).__name__}"
    if not text:
        return None, NO_FIELDS, "empty_text", ""
    fields, reason, detail = kept_fields(obj, keep_fields, floats)
    if fields is None:
        return None, NO_FIELDS, reason, detail
    return text, fields, None, ""


def parse_object_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> tuple[dict | None, str | None, str]:
    """``(object, None, "")`` if ``raw`` is a JSON object (a leading byte-order mark and a trailing ``\\r``
    tolerated), else ``(None, reason, detail)``; the standard library alone.

    Nesting is measured on the text before parsing (``json`` recurses once per level, and how deep it can
    go depends on the caller's stack): a record nested deeper than ``max_depth`` is ``too_deep``, valid
    JSON or not, on any stack.
    """
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if not raw.strip():
            return None, "blank_line", ""
        return None, "invalid_utf8", f"{e.reason} at byte {e.start}"
    if s.startswith("\ufeff"):  # a byte-order mark (files saved by some Windows tools)
        s = s[1:]
    depth = json_nesting(s, max_depth)
    if depth is None:
        return None, "too_deep", f"arrays or objects nested more than {max_depth} deep"
    json_headroom(depth)
    try:
        obj = json.loads(s)
    except ValueError as e:
        if not raw.strip():  # checked only on failure: keeps the hot path free of a copy per line
            return None, "blank_line", ""
        return None, "invalid_json", str(e)
    if not isinstance(obj, dict):
        return None, "not_an_object", f"top-level JSON {type(obj).__name__}"
    return obj, None, ""


def kept_fields(obj: dict, keep_fields: Sequence[str], floats: bool = False) -> tuple[tuple | None, str | None, str]:
    """``(fields, None, "")``: the kept fields of ``obj``; or ``(None, "bad_field", detail)``."""
    fields = _fields(obj, keep_fields, floats) if keep_fields else NO_FIELDS
    if fields is not None:
        return fields, None, ""
    name = next(n for n in keep_fields if not keep_value(json_lookup(obj, n), floats)[1])
    kind = type(json_lookup(obj, name)).__name__
    kept = "strings, integers and floats" if floats else "strings and integers"
    return None, "bad_field", f"{name!r} is {kind}: --keep_fields keeps {kept}"


def _fields(obj: dict, keep_fields: Sequence[str], floats: bool = False, fast: bool = False) -> tuple | None:
    """The kept fields of ``obj`` (strings, numbers as their text, None), or None if one cannot be kept (or,
    ``fast``: an orjson float that may have been an integer literal beyond 64 bits, which the standard parser
    reads as an integer)."""
    out = []
    for name in keep_fields:
        raw = json_lookup(obj, name)
        if fast and type(raw) is float and raw.is_integer() and abs(raw) >= 2.0 ** 63:
            return None
        value, ok = keep_value(raw, floats)
        if not ok:
            return None
        out.append(value)
    return tuple(out)


def parse_line(raw: bytes, text_key: str, max_depth: int = MAX_JSON_DEPTH) -> tuple[str | None, str | None, str]:
    """``(text, None, "")`` for a good record, ``(None, reason, detail)`` for a bad one (no kept fields)."""
    text, _, reason, detail = parse_record(raw, text_key, (), max_depth)
    return text, reason, detail


def has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def dead_letter(file: str, shard: int, offset: int, reason: str, detail: str, raw: bytes,
                size: int | None = None) -> dict[str, Any]:
    """A bad JSON record's dead letter; ``size`` (the whole record's) when ``raw`` is only its first bytes
    (``too_long``)."""
    rec = {"file": file, "shard": shard, "offset": offset, "reason": reason, "detail": detail}
    if size is not None:
        rec["size"] = size
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.end == len(raw) and e.reason == "unexpected end of data":
                raw = raw[:e.start]  # the first bytes end inside a character: keep the text readable
    try:
        rec["line"] = raw.decode("utf-8")
    except UnicodeDecodeError:
        rec["line_base64"] = base64.b64encode(raw).decode("ascii")
    return rec
