"""Building one chunk: parse lines, tokenize, write the Parquet file, its dead letters and its sidecar.

Everything here is a pure function of (input lines, configuration): no clocks, no worker ids, no random
names in any file's *content* (temporary file *names* are random, and renamed away).
"""

from __future__ import annotations

import base64
import collections
import json
import tempfile
from typing import Any, Callable, Mapping

import numpy as np

from reader import format as fmt
from reader.chunk_file import ChunkParquet, make_sidecar, row_group_table

from . import fsutil

# Reasons a line is dead-lettered (the keys of the ledger's "bad_records").
BAD_REASONS = (
    "blank_line",  # empty or whitespace-only line
    "invalid_utf8",  # the line's bytes are not UTF-8
    "invalid_json",  # not parseable as JSON
    "not_an_object",  # valid JSON but not an object
    "missing_text",  # object without the text key
    "text_not_string",  # the text value is not a string
    "empty_text",  # the text is the empty string
    "invalid_unicode",  # the text holds lone surrogates (from JSON escapes such as a lone high surrogate): not encodable as UTF-8
    "tokenizer_error",  # the tokenizer failed on the text for another reason
)

ENCODE_BATCH_DOCS = 256
ENCODE_BATCH_CHARS = 4 << 20
BAD_BUFFER_RECORDS = 4096  # dead letters held in memory before they are sorted into the spool
BAD_SPOOL_MEMORY = 4 << 20  # the spool moves to a local temporary file beyond this


def parse_line(raw: bytes, text_key: str) -> tuple[str | None, str | None, str]:
    """``(text, None, "")`` for a good record, ``(None, reason, detail)`` for a bad one."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if not raw.strip():
            return None, "blank_line", ""
        return None, "invalid_utf8", f"{e.reason} at byte {e.start}"
    if s.startswith("\ufeff"):  # a byte-order mark (files saved by some Windows tools)
        s = s[1:]
    try:
        obj = json.loads(s)
    except ValueError as e:
        if not raw.strip():  # checked only on failure: keeps the hot path free of a copy per line
            return None, "blank_line", ""
        return None, "invalid_json", str(e)
    if not isinstance(obj, dict):
        return None, "not_an_object", f"top-level JSON {type(obj).__name__}"
    if text_key not in obj:
        return None, "missing_text", f"no key {text_key!r}"
    text = obj[text_key]
    if not isinstance(text, str):
        return None, "text_not_string", f"{text_key!r} is {type(text).__name__}"
    if not text:
        return None, "empty_text", ""
    return text, None, ""


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def dead_letter(file: str, shard: int, offset: int, reason: str, detail: str, raw: bytes) -> dict[str, Any]:
    rec = {"file": file, "shard": shard, "offset": offset, "reason": reason, "detail": detail}
    try:
        rec["line"] = raw.decode("utf-8")
    except UnicodeDecodeError:
        rec["line_base64"] = base64.b64encode(raw).decode("ascii")
    return rec


class Counters:
    """Local tallies flushed to Beam metrics once per chunk (not per document)."""

    def __init__(self, inc: Callable[[str, int], None] | None = None):
        self.inc = inc or (lambda name, n: None)


class ChunkBuilder:
    """Accumulates the lines of chunk ``k`` of a shard and writes it.

    Call :meth:`add` for each line (in file order) whose first byte is in the chunk's byte range, then
    :meth:`finish` with the range's end; it writes dead letters, the Parquet file and the sidecar
    (each atomically, in that order) and returns the sidecar dict.
    """

    def __init__(self, *, root: str, input_path: str, shard: int, index: int, lo: int, encoder,
                 config: Mapping[str, Any], eos_id: int | None, counters: Counters | None = None):
        self.root = root
        self.input_path = input_path
        self.shard = shard
        self.index = index
        self.lo = lo
        self.encoder = encoder
        self.text_key = config["text_key"]
        self.row_group_tokens = int(config["row_group_tokens"])
        self.eos_id = eos_id if config["append_eos"] else None
        self.extra = 1 if self.eos_id is not None else 0
        self.counters = counters or Counters()
        self.bad_buffer: list[tuple[int, bytes]] = []  # (offset, dead-letter JSON line), not yet spooled
        self.bad_spool = None  # SpooledTemporaryFile of sorted dead-letter lines (memory stays bounded)
        self.bad_reasons: collections.Counter = collections.Counter()
        self.pending_texts: list[str] = []
        self.pending_offsets: list[int] = []
        self.pending_raws: list[bytes] = []
        self.pending_chars = 0
        self.rg_arrays: list[np.ndarray] = []
        self.rg_offsets: list[int] = []
        self.rg_tokens = 0
        self.input_bytes = 0
        self.parquet = ChunkParquet(config)

    # -- lines ------------------------------------------------------------------------------------
    def add(self, offset: int, raw: bytes) -> None:
        self.input_bytes += len(raw) + 1
        text, reason, detail = parse_line(raw, self.text_key)
        if reason is not None:
            self._bad(offset, reason, detail, raw)
            if len(self.bad_buffer) >= BAD_BUFFER_RECORDS:
                self._encode_pending()  # its tokenizer errors precede every later line
                self._spool_bad()
            return
        self.pending_texts.append(text)
        self.pending_offsets.append(offset)
        self.pending_raws.append(raw)
        self.pending_chars += len(text)
        if len(self.pending_texts) >= ENCODE_BATCH_DOCS or self.pending_chars >= ENCODE_BATCH_CHARS:
            self._encode_pending()

    def _bad(self, offset: int, reason: str, detail: str, raw: bytes) -> None:
        rec = dead_letter(self.input_path, self.shard, offset, reason, detail, raw)
        self.bad_buffer.append((offset, (json.dumps(rec, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")))
        self.bad_reasons[reason] += 1

    def _spool_bad(self) -> None:
        """Move buffered dead letters, sorted by offset, to the spool (all earlier lines are settled)."""
        if not self.bad_buffer:
            return
        if self.bad_spool is None:
            self.bad_spool = tempfile.SpooledTemporaryFile(max_size=BAD_SPOOL_MEMORY)
        self.bad_buffer.sort(key=lambda r: r[0])
        self.bad_spool.write(b"".join(line for _, line in self.bad_buffer))
        self.bad_buffer = []

    def _encode_pending(self) -> None:
        texts, offsets, raws = self.pending_texts, self.pending_offsets, self.pending_raws
        self.pending_texts, self.pending_offsets, self.pending_raws, self.pending_chars = [], [], [], 0
        if not texts:
            return
        try:
            arrays = self.encoder.encode_many(texts)
        except BaseException as e:  # noqa: BLE001 - pyo3 panics derive from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            arrays = self._encode_one_by_one(texts, offsets, raws)
        for a, off in zip(arrays, offsets):
            if a is None:
                continue
            self.rg_arrays.append(a)
            self.rg_offsets.append(off)
            self.rg_tokens += len(a) + self.extra
            if self.rg_tokens >= self.row_group_tokens:
                self._flush_row_group()

    def _encode_one_by_one(self, texts, offsets, raws):
        out = []
        for t, off, raw in zip(texts, offsets, raws):
            try:
                out.append(self.encoder.encode_many([t])[0])
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                    raise
                reason = "invalid_unicode" if _has_lone_surrogate(t) else "tokenizer_error"
                self._bad(off, reason, f"{type(e).__name__}: {e}"[:500], raw)
                out.append(None)
        return out

    def _flush_row_group(self) -> None:
        if not self.rg_arrays:
            return
        table = row_group_table(self.rg_arrays, self.shard, self.rg_offsets, self.eos_id)
        self.parquet.write(table, self.rg_tokens)
        self.rg_arrays, self.rg_offsets, self.rg_tokens = [], [], 0

    # -- output -----------------------------------------------------------------------------------
    def finish(self, hi: int) -> dict[str, Any]:
        self._encode_pending()
        self._flush_row_group()
        data, rg_index, footer = self.parquet.finish()
        self._spool_bad()
        dl_rel = None
        if self.bad_spool is not None:
            dl_rel = fmt.dead_letter_path(self.shard, self.index)
            self.bad_spool.seek(0)
            fsutil.write_atomic_stream(fmt.join(self.root, dl_rel), self.bad_spool)
            self.bad_spool.close()
            self.bad_spool = None
        rel = fmt.chunk_path(self.shard, self.index)
        fsutil.write_atomic(fmt.join(self.root, rel), data)
        sidecar = make_sidecar(shard=self.shard, index_in_shard=self.index, byte_range=[self.lo, hi], data=data,
                               row_group_index=rg_index, footer=footer, docs=self.parquet.docs,
                               tokens=self.parquet.tokens, bad_reasons=self.bad_reasons, dead_letters=dl_rel)
        fsutil.write_atomic(fmt.join(self.root, fmt.sidecar_path(self.shard, self.index)),
                            fmt.sidecar_bytes(sidecar))
        inc = self.counters.inc
        inc("documents", sidecar["docs"])
        inc("tokens", sidecar["tokens"])
        inc("input_bytes", self.input_bytes)
        inc("output_bytes", len(data))
        inc("bad_records", sidecar["bad_records"])
        for reason, n in self.bad_reasons.items():
            inc(f"bad_{reason}", n)
        inc("chunks_written", 1)
        return sidecar


def verify_chunk(root: str, shard: int, index: int) -> dict[str, Any] | None:
    """The sidecar of a complete chunk (its Parquet file matches size and checksum), else None."""
    raw = fsutil.read_bytes_or_none(fmt.join(root, fmt.sidecar_path(shard, index)))
    if raw is None:
        return None
    try:
        sidecar = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(sidecar, dict) or sidecar.get("path") != fmt.chunk_path(shard, index):
        return None
    if any(k not in sidecar for k in fmt.SIDECAR_ONLY_KEYS):
        return None  # written before sidecars carried the row-group index: rebuild the chunk
    path = fmt.join(root, sidecar["path"])
    if fsutil.file_size(path) != sidecar.get("bytes"):
        return None
    data = fsutil.read_bytes_or_none(path)
    if data is None or fmt.checksum(data) != sidecar.get("checksum"):
        return None
    if sidecar.get("dead_letters") and not fsutil.exists(fmt.join(root, sidecar["dead_letters"])):
        return None
    return sidecar
