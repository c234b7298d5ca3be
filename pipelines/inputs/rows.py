"""Decoded columns -> records: one per row, a document or a bad row with its reason (columnar inputs).

:func:`records` turns the arrays of one group (the text column first, then the kept fields) into
:class:`Record` values, a slice of rows at a time. A null text is ``null_text``, an empty one ``empty_text``,
bytes that are not UTF-8 ``invalid_utf8`` (a binary column, or a string column holding invalid UTF-8), and
a kept field that is not UTF-8 ``bad_field``. Kept fields are strings as they are and integers as their
decimal text. :func:`dead_letter` is a bad row's dead letter (docs/FORMAT.md).
"""

from __future__ import annotations

import base64
from typing import Any, Iterator, NamedTuple

import pyarrow as pa

from pipelines.inputs import keys

SLICE_ROWS = 1024  # rows turned into Python values at a time
LONG_HEAD = 4 << 10  # bytes of an over-long text kept in its dead letter (lines.LONG_LINE_HEAD)


class Record(NamedTuple):
    """One row: a document (``reason`` None) or a bad record (``text`` None, ``value`` the raw value)."""

    row: int
    text: str | None
    reason: str | None
    detail: str
    value: Any  # the text column's value of a bad record (None, "", bytes)
    fields: tuple[str | None, ...]  # the kept fields, in --keep_fields order


class SupervisedRecord(NamedTuple):
    """One row of a supervised input: its ``values`` (the record's columns as Python values: a prompt and a
    completion, or a list of messages) or a bad record (``values`` None; ``reason``, ``detail``)."""

    row: int
    values: tuple | None
    reason: str | None
    detail: str
    fields: tuple[str | None, ...]


def binary_view(arr: pa.Array) -> pa.Array:
    t = arr.type
    if pa.types.is_string(t):
        return arr.view(pa.binary())
    if pa.types.is_large_string(t):
        return arr.view(pa.large_binary())
    return arr


def dead_letter(file: str, shard: int, rec: Record) -> dict[str, Any]:
    """The dead letter of a bad row: ``file``, ``shard``, ``row``, ``reason``, ``detail`` and the text column's
    value (``value``: a string or null; ``value_base64`` for bytes that are not UTF-8)."""
    out = {"file": file, "shard": shard, "row": rec.row, "reason": rec.reason, "detail": rec.detail}
    if type(rec.value) is bytes:
        out["value_base64"] = base64.b64encode(rec.value).decode("ascii")
    else:
        out["value"] = rec.value
    return out


def json_value(v: Any) -> dict[str, str]:
    """A value of a record that JSON cannot hold, as its dead letter keeps it: bytes as
    ``{"type": "bytes", "base64": ...}``, anything else (a timestamp, a decimal, ...) as its type and its
    text, ``{"type": "datetime", "value": "2024-01-01 00:00:00"}``; so any bad record can be set aside."""
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"type": "bytes", "base64": base64.b64encode(bytes(v)).decode("ascii")}
    return {"type": type(v).__name__, "value": str(v)}


def too_long(file: str, shard: int, rec: Record, data: bytes, limit: int) -> dict[str, Any]:
    """The dead letter of a row whose text (``data``, UTF-8) is longer than ``limit`` bytes (``max_doc_bytes``):
    its first :data:`LONG_HEAD` bytes (less a character cut at the end) and its ``size``."""
    head = data[:LONG_HEAD].decode("utf-8", "ignore")
    letter = dead_letter(file, shard, rec._replace(text=None, reason="too_long", value=head,
                                                   detail=f"{len(data)} bytes, over max_doc_bytes {limit}"))
    letter["size"] = len(data)
    return letter


def _values(arr: pa.Array) -> list:
    """Python values of a text or kept-field slice: str (bytes where not UTF-8), int, or None."""
    try:
        return arr.to_pylist()
    except UnicodeDecodeError:  # a string column holding invalid UTF-8: decided value by value
        out = []
        for v in binary_view(arr).to_pylist():
            try:
                out.append(None if v is None else v.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(v)
        return out


def _kept(values: list) -> list:
    """Kept field values: strings as they are, integers as decimal text (bytes: a value not UTF-8)."""
    return [v if v is None or type(v) is str or type(v) is bytes else str(v) for v in values]


def records(arrays: list[pa.Array], first_row: int, n_keys: int = 1) -> Iterator[Record]:
    """A text record per row: ``arrays`` are the text column, then the kept fields (``n_keys`` is 1)."""
    text, fields = arrays[0], arrays[1:]
    for a in range(0, len(text), SLICE_ROWS):
        texts = _values(text.slice(a, SLICE_ROWS))
        kept = [_kept(_values(f.slice(a, SLICE_ROWS))) for f in fields]
        per_row = list(zip(*kept)) if kept else None
        not_utf8 = {i for f in kept for i, v in enumerate(f) if type(v) is bytes} if kept else ()
        for i, t in enumerate(texts):
            row, fv = first_row + a + i, per_row[i] if per_row is not None else ()
            if type(t) is str and t and i not in not_utf8:  # nearly every row
                yield Record(row, t, None, "", None, fv)
                continue
            reason, detail = None, ""
            if type(t) is bytes:
                try:
                    t = t.decode("utf-8")
                except UnicodeDecodeError as e:
                    reason, detail = "invalid_utf8", f"{e.reason} at byte {e.start}"
            value = t
            if reason is None:
                if t is None:
                    reason = "null_text"
                elif not t:
                    reason = "empty_text"
                elif i in not_utf8:
                    reason, detail = "bad_field", "a kept field is not UTF-8"
            if reason is None:
                yield Record(row, t, None, "", None, fv)
            else:
                yield Record(row, None, reason, detail, value, fv)


def _nested_values(arr: pa.Array) -> list:
    """Python values of a nested slice (a list of messages); a row whose strings are not UTF-8 is
    :data:`NOT_UTF8`."""
    try:
        return arr.to_pylist()
    except UnicodeDecodeError:
        out = []
        for i in range(len(arr)):
            try:
                out.append(arr[i].as_py())
            except UnicodeDecodeError:
                out.append(NOT_UTF8)
        return out


NOT_UTF8 = object()  # a value whose strings are not UTF-8


def _text_values(arr: pa.Array) -> list:
    """A text column's values: str, None, or :data:`NOT_UTF8` (a binary column's bytes decoded)."""
    out = _values(arr)
    for i, v in enumerate(out):
        if type(v) is bytes:
            try:
                out[i] = v.decode("utf-8")
            except UnicodeDecodeError:
                out[i] = NOT_UTF8
    return out


def supervised_records(arrays: list[pa.Array], first_row: int, n_keys: int) -> Iterator[SupervisedRecord]:
    """A :class:`SupervisedRecord` per row: ``arrays`` are the record's ``n_keys`` columns (text columns, or
    one list of messages), then the kept fields. Values are as in a JSON record (a null is None); only text
    that is not UTF-8 makes a bad record here (``invalid_utf8``, or ``bad_field`` for a kept field); the
    record's own checks are the encoding's (:mod:`pipelines.tokenize.sft`)."""
    columns, fields = arrays[:n_keys], arrays[n_keys:]
    for a in range(0, len(arrays[0]), SLICE_ROWS):
        values = [_text_values(c.slice(a, SLICE_ROWS)) if keys.is_text_type(c.type)
                  else _nested_values(c.slice(a, SLICE_ROWS)) for c in columns]
        kept = [_kept(_values(f.slice(a, SLICE_ROWS))) for f in fields]
        for i, row_values in enumerate(zip(*values)):
            row, fv = first_row + a + i, tuple(f[i] for f in kept)
            if any(v is NOT_UTF8 for v in row_values):
                yield SupervisedRecord(row, None, "invalid_utf8", "a value of the record is not UTF-8", fv)
            elif any(type(v) is bytes for v in fv):
                yield SupervisedRecord(row, None, "bad_field", "a kept field is not UTF-8", fv)
            else:
                yield SupervisedRecord(row, row_values, None, "", fv)


def supervised_dead_letter(file: str, shard: int, rec: SupervisedRecord, reason: str, detail: str,
                           value: Any) -> dict[str, Any]:
    """The dead letter of a bad supervised row: ``file``, ``shard``, ``row``, ``reason``, ``detail`` and
    ``value`` (the record as far as it was read: an object of its fields, or null)."""
    return {"file": file, "shard": shard, "row": rec.row, "reason": reason, "detail": detail, "value": value}
