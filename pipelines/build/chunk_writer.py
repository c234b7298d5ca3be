"""Building one chunk: parse lines, tokenize, write the Parquet file, its dead letters and its sidecar.

Everything here is a pure function of (input lines, configuration): no clocks, no worker ids, no random
names in any file's *content* (temporary file *names* are random, and renamed away).
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import json
import tempfile
from typing import Any, Callable, Mapping

from reader.format import spec as fmt
from reader.format.chunk_file import make_sidecar

from pipelines.inputs import fsutil
from pipelines.plan import MAX_JSON_DEPTH
from pipelines.build.splits import SplitRouter, SplitSpec, cache_roots

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
    "too_deep",  # arrays/objects nested deeper than config max_json_depth (counted on the text, valid or not)
    "too_long",  # the line is longer than config max_doc_bytes (its dead letter keeps the first 4 KiB and the size)
)

# Every key a sidecar of this version holds; a sidecar missing one was written by older code.
SIDECAR_KEYS = ("path", "shard", "index_in_shard", "byte_range", "input_span", "input_checksum", "docs", "tokens",
                "bytes", "checksum", "row_groups", "row_group_index", "footer", "bad_records", "bad_reasons",
                "dead_letters", "dead_letters_checksum")
ENCODE_BATCH_DOCS = 256
ENCODE_BATCH_CHARS = 4 << 20
BAD_BUFFER_RECORDS = 4096  # dead letters held in memory before they are sorted into the spool
BAD_SPOOL_MEMORY = 4 << 20  # the spool moves to a local temporary file beyond this

try:  # a dependency of apache-beam; without it every line takes the standard parser
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover
    _orjson_loads = None


def parse_line(raw: bytes, text_key: str, max_depth: int = MAX_JSON_DEPTH) -> tuple[str | None, str | None, str]:
    """``(text, None, "")`` for a good record, ``(None, reason, detail)`` for a bad one.

    Good records take a fast path (orjson, about twice the standard parser's speed). Everything else, and
    every line orjson could read differently, goes through :func:`parse_line_json`, which defines the
    reasons and details: orjson is stricter than ``json`` (it rejects lone-surrogate escapes, NaN, integers
    beyond 64 bits, a byte-order mark and invalid UTF-8, and nesting beyond 1024 levels), so those lines
    fail the fast path and fall back; a line it accepts yields the same object, except for integers it
    turns into floats (only the text's type matters here, and a text that is not a string falls back).
    A line with more than ``max_depth`` brackets falls back too (it may nest that deep, even in a
    duplicate key's value orjson drops), and the standard parser measures it.
    """
    if _orjson_loads is not None and raw.count(b"[") + raw.count(b"{") <= max_depth:
        try:
            obj = _orjson_loads(raw)
        except Exception:  # noqa: BLE001 - any failure: the standard parser decides (reason and detail)
            obj = None
        if type(obj) is dict:
            text = obj.get(text_key)
            if type(text) is str and text:
                return text, None, ""
    return parse_line_json(raw, text_key, max_depth)


def parse_line_json(raw: bytes, text_key: str, max_depth: int = MAX_JSON_DEPTH) -> tuple[str | None, str | None, str]:
    """:func:`parse_line` with the standard library alone: the definition of every reason and detail.

    Nesting is measured on the text before parsing (``json`` recurses once per level, and how deep it can
    go depends on the caller's stack): a line nested deeper than ``max_depth`` is ``too_deep``, valid
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
    depth = fsutil.json_nesting(s, max_depth)
    if depth is None:
        return None, "too_deep", f"arrays or objects nested more than {max_depth} deep"
    fsutil.json_headroom(depth)
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


def dead_letter(file: str, shard: int, offset: int, reason: str, detail: str, raw: bytes,
                size: int | None = None) -> dict[str, Any]:
    """A bad line's record; ``size`` (the whole line's) when ``raw`` is only its first bytes (``too_long``)."""
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


class Counters:
    """Local tallies flushed to Beam metrics once per chunk (not per document)."""

    def __init__(self, inc: Callable[[str, int], None] | None = None):
        self.inc = inc or (lambda name, n: None)


class ChunkBuilder:
    """Accumulates the lines of chunk ``k`` of a shard and writes it.

    Call :meth:`add` for each line (in file order) whose first byte is in the chunk's byte range, then
    :meth:`finish` with the range's end and the span's end; it writes dead letters, the Parquet file and
    the sidecar (each atomically, in that order) and returns the sidecars, one per cache of the build.
    The sidecar records the span of input bytes the chunk was built from and their sha256
    (``input_span``, ``input_checksum``), so that a rerun can tell whether the input still holds those bytes.

    With ``split`` (a split build, :mod:`pipelines.build.splits`) each document is tokenized once and goes to the
    chunk of its split under ``root/train`` or ``root/validation``; both chunks record the same input span
    and checksum (each cache can be checked against the input alone); dead letters go to train only.

    ``expect``, if given, is called with the finished sidecars before anything is written; it raises to
    stop a chunk that must reproduce a recorded one (a finished cache being repaired) from being written.
    """

    def __init__(self, *, root: str, input_path: str, shard: int, index: int, lo: int, encoder,
                 config: Mapping[str, Any], eos_id: int | None, counters: Counters | None = None,
                 expect: Callable[[tuple[dict[str, Any], ...]], None] | None = None, split: SplitSpec | None = None):
        self.roots = cache_roots(root, split)
        self.input_path = input_path
        self.shard = shard
        self.index = index
        self.lo = lo
        self.encoder = encoder
        self.text_key = config["text_key"]
        # absent from a ledger written before these keys existed: its behaviour then (see plan.ChunkConfig)
        self.max_depth = config.get("max_json_depth") or MAX_JSON_DEPTH
        self.max_bytes = config.get("max_doc_bytes")
        self.eos_id = eos_id if config["append_eos"] else None
        self.counters = counters or Counters()
        self.expect = expect
        self.span = fsutil.SpanHasher()
        self.bad_buffer: list[tuple[int, bytes]] = []  # (offset, dead-letter JSON line), not yet spooled
        self.bad_spool = None  # SpooledTemporaryFile of sorted dead-letter lines (memory stays bounded)
        self.bad_reasons: collections.Counter = collections.Counter()
        self.pending_texts: list[str] = []
        self.pending_offsets: list[int] = []
        self.pending_raws: list[bytes] = []
        self.pending_chars = 0
        self.input_bytes = 0
        self.verified = 0  # documents re-encoded by the reference tokenizer (fast backend)
        self.router = SplitRouter(config, shard, self.eos_id, split)
        self.routed: dict[int, int] = {}  # offset -> cache index of each pending document not in the first cache

    # -- lines ------------------------------------------------------------------------------------
    def add(self, offset: int, raw: bytes | fsutil.LongLine) -> None:
        """Take the line at ``offset`` (a :class:`~pipelines.inputs.fsutil.LongLine` is hashed as it streams)."""
        self.span.add(offset, raw)
        self.take(offset, raw)

    def take(self, offset: int, raw: bytes | fsutil.LongLine) -> None:
        """:meth:`add` for a line already hashed into :attr:`span` (a replay)."""
        size = len(raw)
        self.input_bytes += size + 1
        if type(raw) is bytes and (self.max_bytes is None or size <= self.max_bytes):
            text, reason, detail = parse_line(raw, self.text_key, self.max_depth)
            if reason is not None:
                self._bad(offset, reason, detail, raw)
        else:  # streamed past by the line reader (a LongLine): only its first bytes are here
            text = None
            head = raw[:fsutil.LONG_LINE_HEAD] if type(raw) is bytes else raw.head
            self._bad(offset, "too_long", f"{size} bytes, over max_doc_bytes {self.max_bytes}", head, size)
        if text is None:
            if len(self.bad_buffer) >= BAD_BUFFER_RECORDS:
                self._encode_pending()  # its tokenizer errors precede every later line
                self._spool_bad()
            return
        self.pending_texts.append(text)
        self.pending_offsets.append(offset)
        self.pending_raws.append(raw)
        part = self.router.route(text)
        if part:
            self.routed[offset] = part
        self.pending_chars += len(text)
        if len(self.pending_texts) >= ENCODE_BATCH_DOCS or self.pending_chars >= ENCODE_BATCH_CHARS:
            self._encode_pending()

    def _bad(self, offset: int, reason: str, detail: str, raw: bytes, size: int | None = None) -> None:
        rec = dead_letter(self.input_path, self.shard, offset, reason, detail, raw, size)
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
        self.verified += self.encoder.verify(texts, offsets, arrays, self.input_path)
        for a, off in zip(arrays, offsets):
            if a is None:
                continue
            self.router.add(self.routed.pop(off, 0), a, off)

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

    # -- output -----------------------------------------------------------------------------------
    def finish(self, hi: int, end: int) -> tuple[dict[str, Any], ...]:
        """Write the chunk (in each cache of the build); ``hi`` ends its byte range, ``end`` its input span
        (the next line's offset). Returns its sidecars, in :func:`pipelines.build.splits.cache_names` order."""
        self._encode_pending()
        parquets = self.router.finish()
        self._spool_bad()
        dl_rel = dl_sum = None
        if self.bad_spool is not None:  # the first cache (train) keeps every dead letter
            dl_rel = fmt.dead_letter_path(self.shard, self.index)
            dl_sum = _stream_checksum(self.bad_spool)
        span, input_sum = self.span.finish(end)
        files, sidecars = [], []
        for i, parquet in enumerate(parquets):
            data, rg_index, footer = parquet.finish()
            first = i == 0
            sidecars.append(make_sidecar(
                shard=self.shard, index_in_shard=self.index, byte_range=[self.lo, hi], data=data,
                row_group_index=rg_index, footer=footer, docs=parquet.docs, tokens=parquet.tokens,
                bad_reasons=self.bad_reasons if first else None, dead_letters=dl_rel if first else None,
                dead_letters_checksum=dl_sum if first else None, input_span=span, input_checksum=input_sum))
            files.append(data)
        if self.expect is not None:
            self.expect(tuple(sidecars))
        if self.bad_spool is not None:
            self.bad_spool.seek(0)
            fsutil.write_atomic_stream(fmt.join(self.roots[0], dl_rel), self.bad_spool)
            self.bad_spool.close()
            self.bad_spool = None
        rel = fmt.chunk_path(self.shard, self.index)
        for root, data, sidecar in zip(self.roots, files, sidecars):
            fsutil.write_atomic(fmt.join(root, rel), data)
            fsutil.write_atomic(fmt.join(root, fmt.sidecar_path(self.shard, self.index)), fmt.sidecar_bytes(sidecar))
        self._count(sidecars, files)
        return tuple(sidecars)

    def _count(self, sidecars: list[dict[str, Any]], files: list[bytes]) -> None:
        """Counters of a written chunk: a split build's chunk counts once, with per-split document counts."""
        inc = self.counters.inc
        for name, sidecar, data in zip(self.router.names, sidecars, files):
            inc("documents", sidecar["docs"])
            inc("tokens", sidecar["tokens"])
            inc("output_bytes", len(data))
            if name is not None:
                inc(f"documents_{name}", sidecar["docs"])
                inc(f"tokens_{name}", sidecar["tokens"])
        inc("input_bytes", self.input_bytes)
        inc("bad_records", sum(self.bad_reasons.values()))
        for reason, n in self.bad_reasons.items():
            inc(f"bad_{reason}", n)
        inc("chunks_written", 1)
        inc("tokenizer_verified_docs", self.verified)


def _stream_checksum(f, block: int = 1 << 20) -> str:
    """``"sha256:<hex>"`` of a seekable file's whole content (read from the start)."""
    f.seek(0)
    h = hashlib.sha256()
    for b in iter(lambda: f.read(block), b""):
        h.update(b)
    return "sha256:" + h.hexdigest()


@dataclasses.dataclass(frozen=True)
class ChunkCheck:
    """What a rerun finds of one chunk: its sidecar if the chunk is complete, else why not."""

    sidecar: dict[str, Any] | None  # the complete chunk's sidecar
    sidecar_checksum: str | None  # "sha256:" of the sidecar file's bytes (what a finished ledger records)
    problem: str | None  # None if complete; "absent" if none of its files exists; else what is wrong

    @property
    def complete(self) -> bool:
        return self.sidecar is not None

    @property
    def absent(self) -> bool:
        return self.problem == "absent"


def verify_chunk(root: str, shard: int, index: int, byte_range: tuple[int, int] | None = None) -> ChunkCheck:
    """Check chunk ``index`` of ``shard`` in the cache at ``root`` against its sidecar.

    Complete means: the sidecar parses, names this chunk (and ``byte_range`` if given), carries every key
    this version writes, and agrees with the files: the Parquet file's size and sha256, its row-group
    index and footer (recomputed), its document and token counts, and the dead-letter file's sha256 and
    line count. The input bytes are the caller's to check (the sidecar's ``input_span`` and
    ``input_checksum``).
    """
    raw = fsutil.read_bytes_or_none(fmt.join(root, fmt.sidecar_path(shard, index)))
    if raw is None:
        present = fsutil.exists(fmt.join(root, fmt.chunk_path(shard, index)))
        return ChunkCheck(None, None, "sidecar missing" if present else "absent")

    def bad(problem: str) -> ChunkCheck:
        return ChunkCheck(None, None, problem)

    try:
        sidecar = fsutil.load_json(raw)
    except ValueError:
        return bad("sidecar is not valid JSON")
    if not isinstance(sidecar, dict) or sidecar.get("path") != fmt.chunk_path(shard, index):
        return bad("sidecar names another chunk")
    if any(k not in sidecar for k in SIDECAR_KEYS):
        return bad("sidecar written by an older chunkledger (no input checksum)")
    if sidecar["shard"] != shard or sidecar["index_in_shard"] != index:
        return bad("sidecar names another chunk")
    if byte_range is not None and sidecar["byte_range"] != list(byte_range):
        return bad("sidecar has another byte range")
    path = fmt.join(root, sidecar["path"])
    data = fsutil.read_bytes_or_none(path)
    if data is None:
        return bad("Parquet file missing")
    if len(data) != sidecar["bytes"] or fmt.checksum(data) != sidecar["checksum"]:
        return bad("Parquet file differs from its sidecar (size or sha256)")
    try:
        rg_index, footer = fmt.row_group_index(data)
    except Exception:  # noqa: BLE001 - not a chunkledger Parquet file
        return bad("Parquet file has no readable row-group index")
    if (rg_index != sidecar["row_group_index"] or footer != sidecar["footer"]
            or sidecar["row_groups"] != len(rg_index) or sidecar["docs"] != sum(e[2] for e in rg_index)
            or sidecar["tokens"] != sum(e[3] for e in rg_index)):
        return bad("sidecar counts or row-group index disagree with the Parquet file")
    if not _dead_letters_intact(root, sidecar):
        return bad("dead-letter file missing or changed")
    return ChunkCheck(sidecar, fmt.checksum(raw), None)


def _dead_letters_intact(root: str, sidecar: Mapping[str, Any]) -> bool:
    rel, bad = sidecar["dead_letters"], sidecar["bad_records"]
    if rel is None:
        return bad == 0 and sidecar["dead_letters_checksum"] is None
    if rel != fmt.dead_letter_path(sidecar["shard"], sidecar["index_in_shard"]):
        return False
    data = fsutil.read_bytes_or_none(fmt.join(root, rel))
    return (data is not None and fmt.checksum(data) == sidecar["dead_letters_checksum"]
            and data.count(b"\n") == bad)
