"""Supervised records in a build: a record's fields read, encoded into tokens and loss spans, or set aside.

With ``--record_format prompt_completion`` or ``chat`` a chunk's records are supervised (SFT) records; the
rules are :mod:`pipelines.tokenize.sft`'s (docs/SFT.md). This module is the build's side of them:

* reading: a JSON record (a line, an array element) or a columnar row
  (:class:`~pipelines.inputs.rows.SupervisedRecord`) becomes the record :mod:`~pipelines.tokenize.sft` takes,
  ``{"prompt": ..., "completion": ...}`` or ``{"messages": [...]}``, whatever the keys or the file format;
* its canonical form, the split hash's input (docs/FORMAT.md, "Split builds");
* encoding with the build's encoder (the fast backend where the text path would use it: a measured win, see
  docs/SFT.md), a sample re-encoded by the reference as the fast backend's documents are;
* the loss mask as ``loss_spans`` (maximal runs of loss tokens, flattened).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np

from pipelines.chunking.records import kept_fields, parse_object_json
from pipelines.inputs.keys import CHAT, MISSING, PROMPT_COMPLETION, json_lookup
from pipelines.plan import MAX_JSON_DEPTH
from pipelines.tokenize import sft
from pipelines.tokenize.sft_encoders import HFSft, TiktokenSft
from pipelines.tokenize.guarded_encoder import MISMATCH_MARKER, TokenMismatchError, sampled

try:  # a dependency of apache-beam, as in records.py
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover
    _orjson_loads = None

REASONS = sft.REASONS  # the bad-record reasons of the encoding, besides the parsing ones (records.py)


def canonical(record: Mapping[str, Any]) -> str:
    """The record's canonical form: its fields as JSON with sorted keys, no spaces, UTF-8 text (not
    escaped), keys whose value is null left out at any depth (a Parquet struct has every field, a JSON object
    only those it holds), so a record reads the same from any file format."""
    return json.dumps(_without_nulls(record), sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                      default=str)


def _without_nulls(obj: Any) -> Any:
    if type(obj) is dict:
        return {k: _without_nulls(v) for k, v in obj.items() if v is not None}
    if type(obj) is list:
        return [_without_nulls(v) for v in obj]
    return obj


def spans_of(mask: np.ndarray) -> np.ndarray:
    """The loss mask as ``loss_spans``: the maximal runs of True, flattened ``[s0, e0, s1, e1, ...]`` (int32)."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)], axis=1).reshape(-1).astype(np.int32)


def _has_float(obj: Any) -> bool:
    if type(obj) is float:
        return True
    if type(obj) is dict:
        return any(_has_float(v) for v in obj.values())
    if type(obj) is list:
        return any(_has_float(v) for v in obj)
    return False


class Supervised:
    """A build's supervised records: read, canonical form, encoding.

    Args:
      config: the ledger's configuration (``record_format``, the keys, ``chat_template``'s tokens,
        ``append_eos``, ``keep_fields``, ``max_json_depth``).
      encoder: the build's encoder (``pipelines.tokenize.fast_tokenizer.load_cached``).
      eos_id: the tokenizer's EOS id (appended to a completion with ``append_eos``).
      template: the chat template's source (chat only).
    """

    def __init__(self, config: Mapping[str, Any], encoder, eos_id: int | None, template: str = ""):
        self.format = config["record_format"]
        if self.format not in (PROMPT_COMPLETION, CHAT):
            raise ValueError(f"not a supervised record format: {self.format!r}")
        self.keys = ({"prompt": config["prompt_key"], "completion": config["completion_key"]}
                     if self.format == PROMPT_COMPLETION else {"messages": config["messages_key"]})
        self.keep_fields = tuple(config.get("keep_fields") or ())
        self.floats = config.get("keep_floats") is True
        self.max_depth = config.get("max_json_depth") or MAX_JSON_DEPTH
        self.max_bytes = config.get("max_doc_bytes")  # a chat template's values and render (its limits)
        self.eos_id = eos_id if config["append_eos"] else None
        tokens = config.get("chat_template") or {}
        self.bos_token, self.eos_token = tokens.get("bos_token"), tokens.get("eos_token")
        self.template = template
        if self.format == CHAT and not template:
            raise ValueError("a chat build needs its chat template")
        self.encoder, self.reference, self.verify_every = sft_encoders(encoder, template)
        # prompts and completions are encoded as ordinary text: by the build's encoder in one call per batch,
        # where it encodes ordinary text (tiktoken's); else record by record
        self.batched = encoder.encode_many if isinstance(self.encoder, TiktokenSft) else None
        self.verified = 0  # records re-encoded by the reference (fast backend)

    # -- reading -----------------------------------------------------------------------------------
    def record_of(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """The record of a parsed JSON object (``{"prompt", "completion"}`` or ``{"messages"}``, each present
        only if its key is), or :class:`~pipelines.tokenize.sft.BadRecord` for a missing key."""
        out = {}
        for name, key in self.keys.items():
            value = json_lookup(obj, key) if type(obj) is dict else MISSING
            if value is MISSING:
                raise sft.BadRecord(f"missing_{name}", f"no key {key!r}")
            out[name] = value
        if self.format == PROMPT_COMPLETION:  # its checks now: they name the user's keys
            try:
                sft.prompt_completion_of(out)
            except sft.BadRecord as e:
                detail = e.detail
                for name, key in self.keys.items():
                    detail = detail.replace(repr(name), repr(key))
                raise sft.BadRecord(e.reason, detail) from None
        return out

    def from_json(self, raw: bytes) -> tuple[dict | None, tuple, str | None, str]:
        """``(record, kept fields, None, "")`` of a JSON record's bytes, or ``(None, (), reason, detail)``.

        orjson reads the common case; the standard parser decides everything else, as for text records
        (:func:`pipelines.chunking.records.parse_record`). orjson turns integers beyond 64 bits into floats,
        so a chat record holding a float is parsed again by the standard parser (messages reach the
        template whole).
        """
        obj = None
        if _orjson_loads is not None and raw.count(b"[") + raw.count(b"{") <= self.max_depth:
            try:
                obj = _orjson_loads(raw)
            except Exception:  # noqa: BLE001 - the standard parser decides (reason and detail)
                obj = None
            if type(obj) is not dict or (self.format == CHAT and _has_float(json_lookup(obj, self.keys["messages"]))):
                obj = None
        if obj is None:
            obj, reason, detail = parse_object_json(raw, self.max_depth)
            if obj is None:
                return None, (), reason, detail
        try:
            record = self.record_of(obj)
        except sft.BadRecord as e:
            return None, (), e.reason, e.detail
        fields, reason, detail = kept_fields(obj, self.keep_fields, self.floats)
        if fields is None:
            return None, (), reason, detail
        return record, fields, None, ""

    def from_values(self, values: Sequence[Any]) -> dict[str, Any]:
        """The record of a columnar row's values (in key order), or :class:`~pipelines.tokenize.sft.BadRecord`."""
        return self.record_of(dict(zip(self.keys.values(), values)))

    # -- encoding ----------------------------------------------------------------------------------
    def encode(self, record: Mapping[str, Any], encoder=None) -> tuple[np.ndarray, np.ndarray]:
        """``(token_ids int32, loss_spans int32)`` of a record, or :class:`~pipelines.tokenize.sft.BadRecord`."""
        encoder = encoder or self.encoder
        if self.format == PROMPT_COMPLETION:
            ids, mask = sft.encode_prompt_completion(record["prompt"], record["completion"], encoder, self.eos_id)
        else:
            ids, mask = sft.encode_chat(record, self.template, encoder, bos_token=self.bos_token,
                                        eos_token=self.eos_token, max_bytes=self.max_bytes)
        return ids, spans_of(mask)

    def encode_many(self, records: Sequence[Mapping[str, Any]], positions: Sequence[int],
                    where: str) -> list[tuple[np.ndarray, np.ndarray] | sft.BadRecord]:
        """Each record's :meth:`encode`, or its BadRecord. With the fast backend, about one record in
        ``verify_every`` (by a hash of its position) is encoded again by the reference; a difference raises
        :class:`~pipelines.tokenize.guarded_encoder.TokenMismatchError` naming ``where`` and the position."""
        if self.format == PROMPT_COMPLETION and self.batched is not None:
            out = self._prompt_completions(records)
        else:
            out = []
            for i, record in enumerate(records):
                try:
                    out.append(self.encode(record))
                except sft.BadRecord as e:
                    out.append(e)
                except ValueError:  # the fast backend's tokens do not spell the text: a difference
                    if self.reference is None:
                        raise
                    self._reference(record)  # raises if the reference fails too
                    raise self._mismatch(positions[i], where) from None
        if self.reference is not None:
            for i in sampled(positions, self.verify_every).tolist():
                if not _same(out[i], self._reference(records[i])):
                    raise self._mismatch(positions[i], where)
                self.verified += 1
        return out

    def _reference(self, record: Mapping[str, Any]):
        try:
            return self.encode(record, self.reference)
        except sft.BadRecord as e:
            return e

    @staticmethod
    def _mismatch(position: int, where: str) -> TokenMismatchError:
        return TokenMismatchError(
            f"{MISMATCH_MARKER} on the supervised record at position {position} of {where}. The cache would not "
            "be the reference's; rerun with --tokenizer_backend reference (completed chunks are kept) and report "
            "the record.")


    def _prompt_completions(self, records: Sequence[Mapping[str, Any]]) -> list:
        """:meth:`encode` of checked prompt/completion records, every text in one call of the build's encoder."""
        arrays = self.batched([r[k] for r in records for k in ("prompt", "completion")])
        eos = np.array([] if self.eos_id is None else [self.eos_id], dtype=np.int32)
        out = []
        for p, c in zip(arrays[0::2], arrays[1::2]):
            out.append((np.concatenate([p, c, eos]).astype(np.int32, copy=False),
                        np.array([len(p), len(p) + len(c) + len(eos)], dtype=np.int32)))
        return out


def _same(a, b) -> bool:
    if isinstance(a, sft.BadRecord) or isinstance(b, sft.BadRecord):
        return isinstance(a, sft.BadRecord) and isinstance(b, sft.BadRecord) and a.reason == b.reason
    return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def sft_encoders(encoder, template: str = "") -> tuple[sft.Encoder, sft.Encoder | None, int]:
    """``(encoder, reference, verify_every)``: the :mod:`~pipelines.tokenize.sft` encoder over the build's
    encoder, and with the fast backend the reference's (None otherwise).

    tiktoken: ordinary text is encoded by the build's encoder (the fast backend's, or tiktoken cutting long
    texts as for documents, ``config.piece_chars``). Hugging Face: :class:`~pipelines.tokenize.sft_encoders.HFSft`,
    whose ordinary text is a copy of the tokenizer without its control tokens, which the build's encoder is
    not, so the reference library encodes it.
    """
    reference = getattr(encoder, "reference", encoder)  # a FastEncoder keeps its reference
    enc = getattr(reference, "enc", None)
    if enc is None:
        return HFSft(reference.tok, template or None), None, 0
    main = TiktokenSft(enc, ordinary=encoder.encode_many)
    if reference is encoder:
        return main, None, 0
    return main, TiktokenSft(enc, ordinary=reference.encode_many), int(getattr(encoder, "verify_every", 0))
