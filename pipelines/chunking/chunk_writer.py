"""Building one chunk: parse records, tokenize, write the Parquet file, its dead letters and its sidecar.

:class:`ChunkBuilder` is the sink that writes: it takes a chunk's records in input order (JSON records as
their bytes, columnar rows as :class:`~pipelines.inputs.rows.Record`), and :meth:`ChunkBuilder.write` writes
the chunk with the input span and checksum its record source computed. :mod:`pipelines.chunking.sinks` holds
the other sinks (a chunk an earlier run left, verified or trusted). Everything here is a pure function of
(input records, configuration): no clocks, no worker ids, no random names in any file's *content*
(temporary file *names* are random, and renamed away).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import tempfile
from typing import Any, Callable, Mapping, Sequence


from reader.format import checks
from reader.format import spec as fmt
from reader.format.sidecar import (SIDECAR_KEYS, Disagreement, Layout, dead_letters_problem, file_loss_tokens,
                                   make_sidecar, sidecar_bytes)
from reader.format.splits import SplitSpec, cache_roots
from reader.storage.files import write_stream

from pipelines.chunking.records import dead_letter, has_lone_surrogate, parse_record
from pipelines.chunking.split_router import SplitRouter
from pipelines import filesystem
from pipelines.inputs import rows
from pipelines.inputs.lines import LONG_LINE_HEAD, LongLine, SpanHasher
from pipelines.inputs.rows import Record, SupervisedRecord
from pipelines.chunking.supervised import Supervised, canonical
from pipelines.plan import MAX_JSON_DEPTH
from pipelines.tokenize import sft

ENCODE_BATCH_DOCS = 256
ENCODE_BATCH_CHARS = 4 << 20
BAD_BUFFER_RECORDS = 4096  # dead letters held in memory before they are sorted into the spool
BAD_SPOOL_MEMORY = 4 << 20  # the spool moves to a local temporary file beyond this


class Counters:
    """Local tallies flushed to Beam metrics once per chunk (not per document)."""

    def __init__(self, inc: Callable[[str, int], None] | None = None):
        self.inc = inc or (lambda name, n: None)


class ChunkBuilder:
    """Accumulates the records of chunk ``index`` of a shard and writes it.

    Call :meth:`take` for each record in input order: a JSON record's bytes (a line, or an array element; a
    :class:`~pipelines.inputs.LongLine` or anything with ``head`` and ``len`` for one streamed past
    as over-long) at its byte offset, or a columnar row's :class:`~pipelines.inputs.rows.Record` (its row
    number is its position); then :meth:`write` with what the record source read (the chunk's
    ``input_span`` and ``input_checksum``). It writes dead letters, the Parquet file and the sidecar (each
    atomically, in that order) and returns the sidecars, one per cache of the build. :meth:`add` and
    :meth:`finish` do the same for the lines of a byte range, hashing them here.

    With ``split`` (a split build, :mod:`reader.format.splits`) each document is tokenized once and goes to the
    chunk of its split under ``root/train`` or ``root/validation``; both chunks record the same input span
    and checksum (each cache can be checked against the input alone); dead letters go to train only.

    ``expect``, if given, is called with the finished sidecars before anything is written; it raises to
    stop a chunk that must reproduce a recorded one (a finished cache being repaired) from being written.
    """

    def __init__(self, *, root: str, input_path: str, shard: int, index: int, lo: int, encoder,
                 config: Mapping[str, Any], eos_id: int | None, counters: Counters | None = None,
                 expect: Callable[[tuple[dict[str, Any], ...]], None] | None = None, split: SplitSpec | None = None,
                 supervised: Supervised | None = None):
        self.roots = cache_roots(root, split)
        self.input_path = input_path
        self.shard = shard
        self.index = index
        self.lo = lo
        self.encoder = encoder
        self.text_key = config["text_key"]
        self.keep_fields = tuple(config.get("keep_fields") or ())
        self.floats = config.get("keep_floats") is True
        # absent from a ledger written before these keys existed: its behaviour then (see plan.ChunkConfig)
        self.max_depth = config.get("max_json_depth") or MAX_JSON_DEPTH
        self.max_bytes = config.get("max_doc_bytes")
        self.eos_id = eos_id if config["append_eos"] else None
        self.counters = counters or Counters()
        self.expect = expect
        self.span = SpanHasher()  # add() / finish(): the lines of a byte range
        self.bad_buffer: list[tuple[int, bytes]] = []  # (position, dead-letter JSON line), not yet spooled
        self.bad_spool = None  # SpooledTemporaryFile of sorted dead-letter lines (memory stays bounded)
        self.bad_reasons: collections.Counter = collections.Counter()
        self.pending_texts: list[str] = []
        self.pending_pos: list[int] = []
        self.pending_records: list[Any] = []  # each document's record (its dead letter if tokenizing fails)
        self.pending_fields: list[tuple] = []
        self.pending_chars = 0
        self.input_bytes = 0
        self.verified = 0  # documents re-encoded by the reference tokenizer (fast backend)
        # supervised records (pipelines/chunking/supervised.py): their tokens hold the EOS they are given
        self.supervised = supervised
        self.router = SplitRouter(config, shard, None if supervised else self.eos_id, split)
        self.routed: dict[int, int] = {}  # position -> cache index of each pending document not in the first cache

    # -- records ----------------------------------------------------------------------------------
    def add(self, offset: int, raw: bytes | LongLine) -> None:
        """Take the line at ``offset``, hashing it into :attr:`span` (a LongLine is hashed as it streams)."""
        self.span.add(offset, raw)
        self.take(offset, raw)

    def take(self, pos: int, record: Any) -> None:
        """Take the record at ``pos`` (a byte offset, or a columnar row number)."""
        if self.supervised is not None:
            return self._take_supervised(pos, record)
        if type(record) is Record:
            text, fields = record.text, record.fields
            if record.reason is not None:
                self._bad(pos, rows.dead_letter(self.input_path, self.shard, record))
            elif self.max_bytes is not None and len(text) * 4 > self.max_bytes:  # a character is 1 to 4 bytes
                data = text.encode("utf-8", "surrogatepass")
                if len(data) > self.max_bytes:
                    text = None
                    self._bad(pos, rows.too_long(self.input_path, self.shard, record, data, self.max_bytes))
        else:
            text, fields, _ = self._json_line(pos, record, lambda raw: parse_record(
                raw, self.text_key, self.keep_fields, self.max_depth, self.floats))
        if text is None:
            return self._after_bad()
        self._pend(pos, text, record, fields, text, len(text))

    def _after_bad(self) -> None:
        if len(self.bad_buffer) >= BAD_BUFFER_RECORDS:
            self._encode_pending()  # its tokenizer errors precede every later record
            self._spool_bad()

    def _pend(self, pos: int, item: Any, record: Any, fields: tuple, routed_by: str, size: int) -> None:
        """A document to encode: ``item`` (a text, a supervised record), its ``record`` (for a dead letter)."""
        self.pending_texts.append(item)
        self.pending_pos.append(pos)
        self.pending_records.append(record)
        self.pending_fields.append(fields)
        part = self.router.route(routed_by)
        if part:
            self.routed[pos] = part
        self.pending_chars += size
        if len(self.pending_texts) >= ENCODE_BATCH_DOCS or self.pending_chars >= ENCODE_BATCH_CHARS:
            self._encode_pending()

    def _take_supervised(self, pos: int, record: Any) -> None:
        """:meth:`take` of a supervised record: its fields read (a JSON record's, a columnar row's), checked
        against the length limit, routed by its canonical form (pipelines/chunking/supervised.py)."""
        sup, item = self.supervised, None
        if type(record) is SupervisedRecord:
            if record.reason is not None:
                self._bad(pos, rows.supervised_dead_letter(self.input_path, self.shard, record, record.reason,
                                                           record.detail, None))
                return self._after_bad()
            try:
                item = sup.from_values(record.values)
            except sft.BadRecord as e:
                value = dict(zip(sup.keys, record.values))
                self._bad(pos, rows.supervised_dead_letter(self.input_path, self.shard, record, e.reason, e.detail,
                                                           value))
                return self._after_bad()
            form = canonical(item)
            size = len(form.encode("utf-8", "surrogatepass"))
            if self.max_bytes is not None and size > self.max_bytes:
                head = form.encode("utf-8", "surrogatepass")[:LONG_LINE_HEAD].decode("utf-8", "ignore")
                letter = rows.supervised_dead_letter(self.input_path, self.shard, record, "too_long",
                                                     f"{size} bytes, over max_doc_bytes {self.max_bytes}", head)
                self._bad(pos, {**letter, "size": size})
                return self._after_bad()
            return self._pend(pos, item, record, record.fields, form, size)
        item, fields, size = self._json_line(pos, record, sup.from_json)
        if item is None:
            return self._after_bad()
        self._pend(pos, item, record, fields, canonical(item) if self.router.spec is not None else "", size)

    def _json_line(self, pos: int, record: Any, parse) -> tuple[Any, tuple, int]:
        """``(item, fields, size)`` of a JSON line read by ``parse``; a bad or over-long line is dead-lettered
        (item None)."""
        size = len(record)
        self.input_bytes += size + 1
        if type(record) is bytes and (self.max_bytes is None or size <= self.max_bytes):
            item, fields, reason, detail = parse(record)
            if reason is not None:
                self._bad(pos, dead_letter(self.input_path, self.shard, pos, reason, detail, record))
            return item, fields, size
        head = record[:LONG_LINE_HEAD] if type(record) is bytes else record.head  # streamed past by its reader
        self._bad(pos, dead_letter(self.input_path, self.shard, pos, "too_long",
                                   f"{size} bytes, over max_doc_bytes {self.max_bytes}", head, size))
        return None, (), size

    def _bad(self, pos: int, letter: dict[str, Any]) -> None:
        line = json.dumps(letter, sort_keys=True, ensure_ascii=False, default=rows.json_value)
        self.bad_buffer.append((pos, (line + "\n").encode("utf-8")))
        self.bad_reasons[letter["reason"]] += 1

    def _spool_bad(self) -> None:
        """Move buffered dead letters, sorted by position, to the spool (all earlier records are settled)."""
        if not self.bad_buffer:
            return
        if self.bad_spool is None:
            self.bad_spool = tempfile.SpooledTemporaryFile(max_size=BAD_SPOOL_MEMORY)
        self.bad_buffer.sort(key=lambda r: r[0])
        self.bad_spool.write(b"".join(line for _, line in self.bad_buffer))
        self.bad_buffer = []

    def _encode_pending(self) -> None:
        texts, positions, recs, fields = self.pending_texts, self.pending_pos, self.pending_records, self.pending_fields
        self.pending_texts, self.pending_pos, self.pending_records, self.pending_fields = [], [], [], []
        self.pending_chars = 0
        if not texts:
            return
        if self.supervised is not None:
            return self._encode_supervised(texts, positions, recs, fields)
        try:
            arrays = self.encoder.encode_many(texts)
        except BaseException as e:  # noqa: BLE001 - pyo3 panics derive from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            arrays = self._encode_one_by_one(texts, positions, recs)
        self.verified += self.encoder.verify(texts, positions, arrays, self.input_path)
        for a, pos, f in zip(arrays, positions, fields):
            if a is None:
                continue
            self.router.add(self.routed.pop(pos, 0), a, pos, f)

    def _encode_supervised(self, items: list, positions: list[int], recs: list, fields: list) -> None:
        verified = self.supervised.verified
        encoded = self.supervised.encode_many(items, positions, self.input_path)
        self.verified += self.supervised.verified - verified
        for out, pos, rec, f in zip(encoded, positions, recs, fields):
            if isinstance(out, sft.BadRecord):
                self.routed.pop(pos, None)
                if type(rec) is SupervisedRecord:
                    value = dict(zip(self.supervised.keys, rec.values))
                    self._bad(pos, rows.supervised_dead_letter(self.input_path, self.shard, rec, out.reason,
                                                               out.detail, value))
                else:
                    self._bad(pos, dead_letter(self.input_path, self.shard, pos, out.reason, out.detail, rec))
                continue
            self.router.add(self.routed.pop(pos, 0), out[0], pos, f, out[1])

    def _encode_one_by_one(self, texts: Sequence[str], positions: Sequence[int], recs: Sequence[Any]):
        out = []
        for t, pos, rec in zip(texts, positions, recs):
            try:
                out.append(self.encoder.encode_many([t])[0])
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                    raise
                reason = "invalid_unicode" if has_lone_surrogate(t) else "tokenizer_error"
                detail = f"{type(e).__name__}: {e}"[:500]
                if type(rec) is Record:
                    letter = rows.dead_letter(self.input_path, self.shard, rec._replace(
                        text=None, reason=reason, detail=detail, value=t))
                else:
                    letter = dead_letter(self.input_path, self.shard, pos, reason, detail, rec)
                self._bad(pos, letter)
                self.routed.pop(pos, None)
                out.append(None)
        return out

    # -- output -----------------------------------------------------------------------------------
    def finish(self, hi: int, end: int) -> tuple[dict[str, Any], ...]:
        """:meth:`write` a chunk of lines taken with :meth:`add`: ``hi`` ends its byte range, ``end`` its
        input span (the next line's offset)."""
        span, checksum = self.span.finish(end)
        return self.write(byte_range=[self.lo, hi], input_span=span, input_checksum=checksum)

    def write(self, *, byte_range: Sequence[int] | None, input_span: Sequence[int], input_checksum: str,
              row_range: Sequence[int] | None = None) -> tuple[dict[str, Any], ...]:
        """Write the chunk (in each cache of the build). ``byte_range``: ``[lo, hi)`` of a byte-offset input
        (None for a columnar one, which has ``row_range``); ``input_span`` and ``input_checksum``: what the
        chunk was built from. Returns its sidecars, in :func:`reader.format.splits.cache_names` order."""
        self._encode_pending()
        parquets = self.router.finish()
        self._spool_bad()
        dl_rel = dl_sum = None
        if self.bad_spool is not None:  # the first cache (train) keeps every dead letter
            dl_rel = fmt.dead_letter_path(self.shard, self.index)
            dl_sum = _stream_checksum(self.bad_spool)
        files, sidecars = [], []
        for i, parquet in enumerate(parquets):
            data, rg_index, footer = parquet.finish()
            first = i == 0
            sidecars.append(make_sidecar(
                shard=self.shard, index_in_shard=self.index, byte_range=byte_range, row_range=row_range, data=data,
                row_group_index=rg_index, footer=footer, docs=parquet.docs, tokens=parquet.tokens,
                bad_reasons=self.bad_reasons if first else None, dead_letters=dl_rel if first else None,
                dead_letters_checksum=dl_sum if first else None, input_span=input_span,
                input_checksum=input_checksum, loss_tokens=parquet.loss_tokens if parquet.masked else None))
            files.append(data)
        if self.expect is not None:
            self.expect(tuple(sidecars))
        if self.bad_spool is not None:
            self.bad_spool.seek(0)
            write_stream(filesystem.BEAM, fmt.join(self.roots[0], dl_rel), self.bad_spool)
            self.bad_spool.close()
            self.bad_spool = None
        rel = fmt.chunk_path(self.shard, self.index)
        for root, data, sidecar in zip(self.roots, files, sidecars):
            filesystem.write_atomic(fmt.join(root, rel), data)
            filesystem.write_atomic(fmt.join(root, fmt.sidecar_path(self.shard, self.index)), sidecar_bytes(sidecar))
        self._count(sidecars, files)
        return tuple(sidecars)

    def _count(self, sidecars: list[dict[str, Any]], files: list[bytes]) -> None:
        """Counters of a written chunk: a split build's chunk counts once, with per-split document counts."""
        inc = self.counters.inc
        for name, sidecar, data in zip(self.router.names, sidecars, files):
            inc("documents", sidecar["docs"])
            inc("tokens", sidecar["tokens"])
            inc("loss_tokens", sidecar.get("loss_tokens", 0))
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


def verify_chunk(root: str, shard: int, index: int, byte_range: Sequence[int] | None = None,
                 row_range: Sequence[int] | None = None, masked: bool = False) -> ChunkCheck:
    """Check chunk ``index`` of ``shard`` in the cache at ``root`` against its sidecar.

    Complete means: the sidecar parses, names this chunk (and ``byte_range`` or ``row_range`` if given),
    carries every key this version writes, and agrees with the files: the Parquet file's size and sha256,
    its row-group index and footer (recomputed), its document and token counts, and the dead-letter file's
    sha256 and line count; in a ``masked`` cache, the sidecar's ``loss_tokens`` and the loss spans. The input
    bytes are the caller's to check (the sidecar's ``input_span`` and ``input_checksum``).
    """
    raw = filesystem.read_or_none(fmt.join(root, fmt.sidecar_path(shard, index)))
    if raw is None:
        present = filesystem.BEAM.exists(fmt.join(root, fmt.chunk_path(shard, index)))
        return ChunkCheck(None, None, "sidecar missing" if present else "absent")

    def bad(problem: str) -> ChunkCheck:
        return ChunkCheck(None, None, problem)

    try:
        sidecar = checks.load_json(raw, checks.STATUS_JSON_DEPTH)
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
    if row_range is not None and sidecar.get("row_range") != list(row_range):
        return bad("sidecar has another row range")
    data = filesystem.read_or_none(fmt.join(root, sidecar["path"]))
    if data is None:
        return bad("Parquet file missing")
    try:
        lay = Layout.of(sidecar, sidecar["bytes"], sidecar["docs"], sidecar["tokens"])
        lay.check_file(data, sidecar["checksum"])
    except Disagreement as e:
        return bad(f"{'sidecar' if e.sidecar else 'Parquet file'} disagrees: {e}")
    if masked and sidecar.get("loss_tokens") != file_loss_tokens(data):
        return bad("sidecar loss_tokens disagree with the Parquet file's loss_spans")
    wrong = dead_letters_problem(sidecar, lambda rel: filesystem.read_or_none(fmt.join(root, rel)))
    if wrong:
        return bad(wrong)
    return ChunkCheck(sidecar, fmt.checksum(raw), None)
