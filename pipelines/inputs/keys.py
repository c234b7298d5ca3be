"""Finding a record's text and kept fields: ``--text_key`` and ``--keep_fields`` in JSON records and columns.

A key names a JSON key or a column; dots reach into nested objects or struct columns (``metadata.text``).
A key that exists as written wins over the nested reading, so a JSON key or column literally named
``metadata.text`` is still found.

Kept fields hold string and integer values: a string is kept as it is, an integer as its decimal text
(so ``1`` and ``"1"`` count as one value), a missing or null value as null. Any other JSON value (a float,
a boolean, an object, a list) cannot be kept; a column of another type is refused before the build.

When most records of a file lack the text key, :func:`missing_key_problem` says which keys they do have,
so ``--text_key content`` is one look away.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import re
from typing import Any, BinaryIO, Iterable, Mapping, Sequence

import pyarrow as pa

from pipelines.errors import BuildError, DamagedFile
from pipelines.inputs.json_array import ArrayRecords

MAX_LISTED = 12  # keys or columns named in a message
MAX_DEPTH = 3  # nested keys listed down to this depth
_NAME = re.compile(r"[^,\s]+")


def parse_keep_fields(text: str | None) -> tuple[str, ...]:
    """``"source,url"`` -> ``("source", "url")``; empty for None or ``""``. ValueError on a repeated name."""
    names = tuple(n.strip() for n in (text or "").split(",") if n.strip())
    for n in names:
        if not _NAME.fullmatch(n):
            raise ValueError(f"--keep_fields: {n!r} is not a field name")
    dup = [n for n, c in collections.Counter(names).items() if c > 1]
    if dup:
        raise ValueError(f"--keep_fields names {dup[0]!r} twice")
    return names


# -- JSON records -------------------------------------------------------------------------------------
MISSING = object()  # json_lookup: no such key


def json_lookup(obj: dict, key: str) -> Any:
    """``obj[key]``, else the nested value ``key`` names with dots; :data:`MISSING` if there is none."""
    if key in obj:
        return obj[key]
    if "." not in key:
        return MISSING
    value: Any = obj
    for part in key.split("."):
        if type(value) is not dict or part not in value:
            return MISSING
        value = value[part]
    return value


def keep_value(value: Any, floats: bool = False) -> tuple[str | None, bool]:
    """A JSON value as a kept field: ``(text or None, True)``, or ``(None, False)`` if it cannot be kept.
    Numbers are kept as their shortest exact text (``str``); floats only where ``floats`` (a cache of format
    version 4 and later, ``config.keep_floats``)."""
    if value is MISSING or value is None:
        return None, True
    if type(value) is str:
        return value, True
    if type(value) is int or (floats and type(value) is float):  # bool is not int here: True is not a count
        return str(value), True
    return None, False


def json_key_paths(obj: dict, prefix: str = "", depth: int = 1) -> Iterable[str]:
    """Every key of ``obj``, nested objects' keys with dots (down to :data:`MAX_DEPTH`)."""
    for k, v in obj.items():
        path = f"{prefix}{k}"
        yield path
        if type(v) is dict and depth < MAX_DEPTH:
            yield from json_key_paths(v, path + ".", depth + 1)


def missing_key_problem(path: str, key: str, objects: Sequence[dict], option: str = "--text_key",
                        kind: type = str) -> str | None:
    """The error for a file whose sampled records mostly lack ``key`` (None if at least half have it).

    Names the keys the records have (with how many have each) and suggests the one most often of type
    ``kind`` (a string for a text, a list for chat messages) for ``option``.
    """
    if not objects:
        return None
    lacking = sum(1 for o in objects if json_lookup(o, key) is MISSING)
    if lacking * 2 <= len(objects):
        return None
    counts: collections.Counter = collections.Counter()
    texts: collections.Counter = collections.Counter()
    for o in objects:
        for p in json_key_paths(o):
            counts[p] += 1
            if type(json_lookup(o, p)) is kind:
                texts[p] += 1
    listed = ", ".join(f"{p} ({n})" for p, n in counts.most_common(MAX_LISTED))
    more = f" and {len(counts) - MAX_LISTED} more" if len(counts) > MAX_LISTED else ""
    hint = f"; pass {option} {texts.most_common(1)[0][0]}?" if texts else ""
    if option == "--text_key":  # records of another kind (most records have the keys it reads)
        lists = collections.Counter(p for o in objects for p in json_key_paths(o) if _is_chat(json_lookup(o, p)))
        hint = record_format_hint(set(p for p, n in counts.items() if 2 * n >= len(objects)),
                                  [p for p, n in lists.most_common() if 2 * n >= len(objects)]) or hint
    return (f"input file {path}: {lacking} of the first {len(objects)} records have no key {key!r} ({option} "
            f"{key}). Their keys (records having each): {listed or 'none'}{more}{hint}")


def _is_chat(value: Any) -> bool:
    """A list of messages: objects with role and content, or ShareGPT's from and value."""
    return (type(value) is list and bool(value) and type(value[0]) is dict
            and any(role in value[0] and content in value[0] for role, content in MESSAGE_KEYS))


def record_format_hint(keys: set[str], chats: Sequence[str]) -> str:
    """For records without their text key: the --record_format they look like (``keys``: the keys most
    records have; ``chats``: those holding lists of messages), or ""."""
    if {"prompt", "completion"} <= keys:
        return "; these are prompt/completion records: pass --record_format prompt_completion?"
    if chats:
        key = "" if chats[0] == DEFAULT_KEYS["messages_key"] else f" --messages_key {chats[0]}"
        return f"; these are chat records: pass --record_format chat{key}?"
    return ""


# -- what a record is read from ----------------------------------------------------------------------
TEXT, PROMPT_COMPLETION, CHAT = "text", "prompt_completion", "chat"  # --record_format
RECORD_FORMATS = (TEXT, PROMPT_COMPLETION, CHAT)
DEFAULT_KEYS = {"prompt_key": "prompt", "completion_key": "completion", "messages_key": "messages"}
# A chat message's role and content keys: Hugging Face's, or ShareGPT's (pipelines/tokenize/sft.py maps these).
MESSAGE_KEYS = (("role", "content"), ("from", "value"))


@dataclasses.dataclass(frozen=True)
class RecordShape:
    """What a record is read from: ``format`` (``--record_format``) and its keys, each with the option that
    names it; a text (``str``) or a list of messages (``list``) is expected under each."""

    format: str = TEXT
    keys: tuple[tuple[str, str, type], ...] = (("text", "--text_key", str),)  # (key, option, kind)
    floats: bool = False  # kept fields may be floats (config.keep_floats: format version 4 on)

    @staticmethod
    def of(config: Mapping[str, Any]) -> "RecordShape":
        """The shape of a ledger ``config``."""
        fmt, floats = config.get("record_format", TEXT), config.get("keep_floats") is True
        if fmt == TEXT:
            return RecordShape(TEXT, ((config["text_key"], "--text_key", str),), floats)
        if fmt == PROMPT_COMPLETION:
            return RecordShape(fmt, ((config["prompt_key"], "--prompt_key", str),
                                     (config["completion_key"], "--completion_key", str)), floats)
        if fmt == CHAT:
            return RecordShape(fmt, ((config["messages_key"], "--messages_key", list),), floats)
        raise ValueError(f"unknown record_format {fmt!r}")


# -- columns (an Arrow schema: Parquet files are read through theirs) ----------------------------------
def schema_lookup(schema: pa.Schema, key: str) -> tuple[list[str], pa.DataType] | None:
    """``(names from the top-level column down, type)`` of the column ``key`` names, or None.

    Dots descend through struct columns; a column named exactly ``key`` wins.
    """
    if key in schema.names:
        return [key], schema.field(key).type
    parts = key.split(".")
    if len(parts) == 1 or parts[0] not in schema.names:
        return None
    typ = schema.field(parts[0]).type
    for part in parts[1:]:
        if not pa.types.is_struct(typ) or typ.get_field_index(part) < 0:
            return None
        typ = typ.field(part).type
    return parts, typ


def column_paths(schema: pa.Schema) -> list[str]:
    """Every column of ``schema``, struct children with dots, in schema order."""
    out: list[str] = []

    def walk(prefix: str, typ: pa.DataType, depth: int) -> None:
        if pa.types.is_struct(typ) and depth < MAX_DEPTH:
            for i in range(typ.num_fields):
                out.append(f"{prefix}.{typ.field(i).name}")
                walk(out[-1], typ.field(i).type, depth + 1)

    for f in schema:
        out.append(f.name)
        walk(f.name, f.type, 1)
    return out


def is_text_type(typ: pa.DataType) -> bool:
    return (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_binary(typ)
            or pa.types.is_large_binary(typ) or typ == pa.string_view() or typ == pa.binary_view())


def is_messages_type(typ: pa.DataType) -> bool:
    """A list of structs with ``role`` and ``content`` fields, or ShareGPT's ``from`` and ``value`` (a chat's
    messages)."""
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_list_view(typ)
            or pa.types.is_large_list_view(typ)):
        return False
    item = typ.value_type
    return pa.types.is_struct(item) and any(item.get_field_index(role) >= 0 and item.get_field_index(content) >= 0
                                            for role, content in MESSAGE_KEYS)


def is_keepable_type(typ: pa.DataType, floats: bool = False) -> bool:
    return (pa.types.is_string(typ) or pa.types.is_large_string(typ) or typ == pa.string_view()
            or pa.types.is_integer(typ) or pa.types.is_null(typ) or (floats and pa.types.is_floating(typ)))


def missing_column_message(path: str, key: str, schema: pa.Schema, option: str) -> str:
    """The error for a column ``key`` that the file does not have: its columns, and the likely text one."""
    paths = column_paths(schema)
    listed = ", ".join(f"{p} ({schema_lookup(schema, p)[1]})" for p in paths[:MAX_LISTED])
    more = f" and {len(paths) - MAX_LISTED} more" if len(paths) > MAX_LISTED else ""
    texts = [p for p in paths if is_text_type(schema_lookup(schema, p)[1])]
    hint = f"; pass {option} {texts[0]}?" if texts and option == "--text_key" else ""
    if option == "--text_key":
        chats = [p for p in paths if is_messages_type(schema_lookup(schema, p)[1])]
        hint = record_format_hint(set(p for p in paths if is_text_type(schema_lookup(schema, p)[1])), chats) or hint
    return f"input file {path} has no column {key!r} ({option} {key}). Its columns: {listed}{more}{hint}"


# -- a file's first records, for the text key check before the build ----------------------------------
SAMPLE_RECORDS = 100
SAMPLE_BYTES = 64 << 10  # of every JSON file, before the build: on gs:// thousands of files are read


def sample_objects(stream: BinaryIO, path: str, array: bool) -> list[dict]:
    """The JSON objects among the first :data:`SAMPLE_RECORDS` records of a JSON Lines stream (or a JSON array,
    ``array``) within its first :data:`SAMPLE_BYTES`; records that are not objects are left out (they are bad
    records, reported by the build)."""
    data = stream.read(SAMPLE_BYTES)
    if array:
        raws = []
        try:
            for _, element, _ in ArrayRecords(io.BytesIO(data), path, keep_tails=False):
                raws.append(element)
                if len(raws) >= SAMPLE_RECORDS:
                    break
        except DamagedFile:  # the sample ends inside the array (or the file is damaged: the build says so)
            pass
    else:
        lines = data.split(b"\n")
        if len(data) == SAMPLE_BYTES:
            lines.pop()  # cut by the sample
        raws = [line for line in lines if line.strip()][:SAMPLE_RECORDS]
    out = []
    for raw in raws:
        try:
            obj = json.loads(raw.decode("utf-8-sig"))
        except (ValueError, RecursionError):
            continue
        if type(obj) is dict:
            out.append(obj)
    return out


def resolve_columns(path: str, schema: pa.Schema, shape: RecordShape, keep_fields: Sequence[str]) -> list[list[str]]:
    """The name paths of the record's columns (the text, or a supervised record's) and the kept fields, each
    checked (BuildError naming the fix)."""
    out = []
    for key, option, kind in list(shape.keys) + [(f, "--keep_fields", None) for f in keep_fields]:
        found = schema_lookup(schema, key)
        if found is None:
            raise BuildError(missing_column_message(path, key, schema, option))
        names, typ = found
        if kind is str and not is_text_type(typ):
            raise BuildError(f"input file {path}: column {key!r} is {typ}, not text; {option} must name a string "
                             "column")
        if kind is list and not is_messages_type(typ):
            raise BuildError(f"input file {path}: column {key!r} is {typ}; {option} must name a list of messages, "
                             "list<struct<role: string, content: string, ...>>")
        if option == "--keep_fields" and not is_keepable_type(typ, shape.floats):
            kinds = "string, integer and floating-point" if shape.floats else "string and integer"
            raise BuildError(f"input file {path}: column {key!r} is {typ}; --keep_fields keeps {kinds} columns only")
        out.append(names)
    return out
