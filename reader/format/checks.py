"""Checks of what a user's file claims, before anything trusts it: JSON nested too deep, and integers out of
range (a shard of 2**40 or a count of 400 digits is damage, not a number to allocate for).

Used by :mod:`reader.format.spec` (ledgers and sidecars), the mixture file and the importers. Standard
library and numpy only.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Mapping, Sequence

import numpy as np

# Bounds of the integers a ledger, sidecar or _DONE.json may hold: anything outside is damage (and would
# overflow the numpy arrays the reader keeps them in).
MAX_INDEX = (1 << 31) - 1  # shard and chunk numbers, chunks per shard, token ids (int32 in the chunk table)
MAX_COUNT = 1 << 48  # documents, tokens or bytes of one chunk or input file
MAX_TOTAL = 1 << 62  # sums over a cache (int64 offsets)
STATUS_JSON_DEPTH = 32  # the project's own small JSON files (sidecars, _DONE.json, splits.json) nest a few levels
# A JSON string, or an unterminated one up to the end: always matches, so the text is scanned once.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def load_json(text: str | bytes, limit: int | None = None, **kw: Any) -> Any:
    """``json.loads`` for a file a user gives us: JSON nested too deep is a ``ValueError`` like any other
    malformed JSON (json raises ``RecursionError``, at a depth that depends on the caller's stack). With
    ``limit``, JSON nested deeper is refused from its text, before it is parsed."""
    if limit is not None:
        bound = json_nesting(text.decode("utf-8") if isinstance(text, bytes) else text, limit)
        if bound is None:
            raise ValueError(f"JSON nested more than {limit} deep")
        json_headroom(bound)
    try:
        return json.loads(text, **kw)
    except RecursionError:
        raise ValueError("nested too deep") from None


def json_nesting(text: str, limit: int) -> int | None:
    """A bound (at most ``limit``) on how deep ``text`` nests JSON arrays and objects, or None if deeper.

    Counted on the text, valid JSON or not, without recursion: brackets outside strings, exact on every
    prefix that is valid JSON (all a parser recurses into), so the verdict never depends on the stack.
    """
    bound = text.count("[") + text.count("{")
    if bound <= limit:
        return bound
    depth = top = 0
    for c in _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)):
        if c == "[" or c == "{":
            depth += 1
            if depth > top:
                if depth > limit:
                    return None
                top = depth
        else:
            depth -= 1
    return top


def json_headroom(depth: int) -> None:
    """Let ``json.loads`` parse ``depth`` levels from here: it recurses once per level, and the interpreter's
    recursion limit counts the caller's frames too (a deep Beam stack). Only ever raised, process-wide."""
    frames, f = 0, sys._getframe()
    while f is not None:
        frames += 1
        f = f.f_back
    need = frames + depth + 50
    if sys.getrecursionlimit() < need:
        sys.setrecursionlimit(need)


def is_int(value: Any, lo: int, hi: int) -> bool:
    """True if ``value`` is a JSON integer (not a bool) in ``[lo, hi]``."""
    return type(value) is int and lo <= value <= hi


def short(value: Any, limit: int = 40) -> str:
    """``repr(value)`` for a message, cut short (a number of 400 digits is named, not printed)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit // 2]}...({len(text)} characters)"


def header_problem(raw: Mapping[str, Any]) -> str | None:
    """What is wrong with a ledger's tokenizer, config, inputs and chunk list (the integers a reader uses
    are in range), or None."""
    tok, config, inputs = raw["tokenizer"], raw["config"], raw["inputs"]
    if not isinstance(tok, dict) or not isinstance(config, dict) or not isinstance(inputs, list):
        return "tokenizer and config must be objects, inputs a list"
    if not isinstance(raw.get("chunks", []), list):
        return "chunks must be a list"
    if not isinstance(raw.get("finished", False), bool):
        return f"finished {short(raw['finished'])} is not true or false"
    for key in ("totals", "bad_records"):  # (inspect and validate add and compare these)
        counts = raw.get(key, {})
        if not isinstance(counts, dict) or not all(is_int(v, 0, MAX_TOTAL) for v in counts.values()):
            return f"{key} must map names to integers in [0, {MAX_TOTAL}]"
    vocab = tok.get("vocab_size", MAX_INDEX + 1)
    if not is_int(vocab, 1, MAX_INDEX + 1):
        return f"tokenizer.vocab_size {short(vocab)} is not an integer in [1, {MAX_INDEX + 1}]"
    eos = tok.get("eos_id")
    if eos is not None and not is_int(eos, 0, vocab - 1):
        return f"tokenizer.eos_id {short(eos)} is not null or an id of the vocabulary [0, {vocab})"
    for key, hi in (("chunk_bytes", MAX_COUNT), ("row_group_tokens", MAX_INDEX)):
        if key in config and not is_int(config[key], 1, hi):
            return f"config.{key} {short(config[key])} is not an integer in [1, {hi}]"
    for i, inp in enumerate(inputs):
        if not isinstance(inp, dict) or inp.get("shard") != i or type(inp.get("shard")) is not int:
            return f"inputs[{i}] must be an object with \"shard\": {i}"
        for key, hi in (("size", MAX_COUNT), ("chunks", MAX_INDEX), ("uncompressed_bytes", MAX_COUNT)):
            v = inp.get(key)
            if (v is not None or key == "size") and not is_int(v, 0, hi):
                return f"inputs[{i}].{key} {short(v)} is not an integer in [0, {hi}]"
    return None


def first_malformed(entries: Sequence[Mapping[str, Any]]) -> tuple[int, str | None]:
    """``(i, what)``: the first chunk entry with a missing key or an integer numpy cannot hold (the error
    path only; ``what`` None if none is found)."""
    for i, e in enumerate(entries):
        if not isinstance(e, Mapping):
            return i, "not a JSON object"
        for key in ("path", "checksum", "shard", "index_in_shard", "docs", "tokens", "bytes"):
            if key not in e:
                return i, f"missing key {key!r}"
        for key in ("shard", "index_in_shard", "docs", "tokens", "bytes"):
            if not is_int(e[key], -MAX_TOTAL, MAX_TOTAL):
                return i, f"{key} {short(e[key])} is not an integer in range"
    return 0, None


def ranges_problem(entries: Sequence[Mapping[str, Any]], ints: dict[str, np.ndarray],
                   num_inputs: int | None) -> str | None:
    """The first chunk entry whose shard (below ``num_inputs``), index or counts are out of range, or None.
    ``ints``: each key's values, as int64 arrays."""
    top = {"shard": MAX_INDEX if num_inputs is None else num_inputs - 1, "index_in_shard": MAX_INDEX,
           "docs": MAX_COUNT, "tokens": MAX_COUNT, "bytes": MAX_COUNT}
    for key, hi in top.items():
        bad = np.flatnonzero((ints[key] < 0) | (ints[key] > hi))
        if bad.size:
            i = int(bad[0])
            scope = f" (the ledger has {num_inputs} inputs)" if key == "shard" and num_inputs is not None else ""
            return f"chunk entry {i}: {key} {short(entries[i][key])} is outside [0, {hi}]{scope}"
    for key in ("docs", "tokens", "bytes"):
        if float(ints[key].sum(dtype=np.float64)) > MAX_TOTAL:
            return f"the chunk entries' {key} add up to more than {MAX_TOTAL}"
    return None
