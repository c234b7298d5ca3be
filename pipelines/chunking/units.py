"""Building one work unit on a worker: read its records, hand them to a sink, skip chunks already complete.

A unit is one chunk of a randomly readable input, or a whole shard read in one pass:

- a byte range of an uncompressed JSON Lines shard: the lines starting in it, read with a seek;
- a columnar chunk (Parquet row groups, Arrow record batches): :class:`~pipelines.inputs.columnar.ChunkReader`;
- a compressed JSON Lines shard or a JSON array (plain or compressed), streamed once from the start and cut
  into chunks by uncompressed offset (:mod:`pipelines.inputs.single_pass`); a compressed one then writes the
  shard's ``_DONE.json``.

Each chunk's records go to a sink (:mod:`pipelines.chunking.sinks`): the writer, or, for a chunk an earlier run
left complete (its files agree with its sidecar, see :func:`~pipelines.chunking.chunk_writer.verify_chunk`), a
stand-in that keeps it if the input still holds what it was built from (the sidecar's ``input_span`` and
``input_checksum``, computed again without tokenizing) and rebuilds it otherwise. So a rerun after an input
was edited in place rebuilds exactly the chunks whose input changed. Inputs known unchanged by their Cloud
Storage CRC32C (``WorkUnit.trusted``) are not read again.

When the cache is already finished (``recorded`` holds its ledger's sidecar checksums) a rebuilt chunk
must reproduce the recorded one byte for byte: a repair never turns a finished cache into a cache of
other inputs.

In a split build every chunk is written into both caches (train and validation) from one read of its
records: it counts as complete only if it is complete in both and both record the same input; else it is
rebuilt in both (the one that was intact is rewritten with the same bytes).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Sequence

from reader.format import checks
from reader.format import spec as fmt
from reader.format import table as chunk_table
from reader.format.sidecar import ledger_entry, sidecar_bytes
from reader.format.splits import SplitSpec, cache_names, cache_roots

from pipelines.chunking.chunk_writer import ChunkBuilder, Counters, verify_chunk
from pipelines.chunking.sinks import Existing, Found, Sidecars, Trusted, Verifying
from pipelines.errors import BuildError, DamagedInput
from pipelines import filesystem
from pipelines.inputs.lines import RangeLines, SpanHasher
from pipelines.inputs.columnar import ChunkReader
from pipelines.inputs.decompress import open_input
from pipelines.inputs.formats import JSON_ARRAY
from pipelines.inputs.keys import RecordShape
from pipelines.chunking.supervised import Supervised
from pipelines.inputs.single_pass import ArrayStream, LineStream
from pipelines.plan import MAX_SHARD_BYTES, UnitResult, WorkUnit

LOG = logging.getLogger("chunkledger.build")
_CHUNK_FILE = re.compile(r"chunk-(\d+)\.(parquet|json|jsonl|entry)$")


class UnitBuilder:
    """Builds work units into the cache(s) under ``output``, one after the other, in one worker.

    Args:
      output: the cache root (the parent of the train and validation caches of a split build).
      encoder: the loaded tokenizer (``pipelines.tokenize.fast_tokenizer.load_cached``).
      config: the ledger's chunking configuration (``ChunkConfig.to_json()``).
      eos_id: the tokenizer's end-of-sequence id (appended only if ``config["append_eos"]``).
      counters: where chunk writers add their counts (Beam metrics on a worker).
      recorded: for each cache finished when the run was planned (by name: None for a plain build,
        ``"train"``/``"validation"``), ``(shard, index) -> sidecar_checksum`` from its ledger; rebuilt chunks
        must reproduce those sidecars exactly. None (or empty) while no cache is finished.
      split: the train/validation split of a split build, None for one cache.
      supervised: a supervised build's records (pipelines/chunking/supervised.py), None for text.
    """

    def __init__(self, output: str, encoder, config: Mapping[str, Any], eos_id: int | None,
                 counters: Counters | None = None,
                 recorded: Mapping[str | None, Mapping[tuple[int, int], str]] | None = None,
                 split: SplitSpec | None = None, supervised: Supervised | None = None):
        self.output = output
        self.encoder = encoder
        self.config = config
        self.max_line = config.get("max_doc_bytes")  # longer records are streamed past, never held
        self.eos_id = eos_id
        self.counters = counters or Counters()
        self.split = split
        self.supervised = supervised
        self.masked = fmt.is_masked(config)
        self.shape = RecordShape.of(config)
        self.names = cache_names(split)
        self.roots = cache_roots(output, split)
        # per cache, in ``names`` order: the recorded sidecar checksums if it was finished, else None
        self.recorded = tuple((recorded or {}).get(name) for name in self.names)
        self.finished = [root for root, r in zip(self.roots, self.recorded) if r is not None]

    def build(self, unit: WorkUnit) -> tuple[UnitResult, ...]:
        """The unit's chunks written or verified: one result per cache of the build."""
        if unit.columnar is not None:
            per_chunk, done = [self.publish(self._build_columnar(unit))], None
        elif unit.streamed:
            per_chunk, done = self._build_stream(unit)
        else:
            per_chunk, done = [self.publish(self._build_range(unit))], None
        return tuple(UnitResult(shard=unit.shard, entries=tuple(e[i] for e in per_chunk), done=done, split=name)
                     for i, name in enumerate(self.names))

    def publish(self, sidecars: Sidecars) -> tuple[dict[str, Any], ...]:
        """A chunk's entries, written beside its sidecars (after them: a written chunk's or a kept one's, whose
        entry a finished build removed), one per cache; what followers and the finalize read."""
        out = []
        for root, sidecar in zip(self.roots, sidecars):
            data = chunk_table.entry_bytes(sidecar)
            path = fmt.join(root, chunk_table.entry_path(sidecar["shard"], sidecar["index_in_shard"]))
            if filesystem.read_or_none(path) != data:
                filesystem.write_atomic(path, data)
            out.append(ledger_entry(sidecar))
        return tuple(out)

    # -- chunk outcomes (shared by every kind of unit) ---------------------------------------------
    def chunk_builder(self, unit: WorkUnit, index: int, lo: int) -> ChunkBuilder:
        expect = None
        if self.finished:
            def expect(sidecars: Sidecars) -> None:
                for want, sidecar in zip(self.recorded, sidecars):
                    if want is not None and fmt.checksum(sidecar_bytes(sidecar)) != want.get((unit.shard, index)):
                        raise self._finished_input_changed(unit, index)

        return ChunkBuilder(root=self.output, input_path=unit.path, shard=unit.shard, index=index, lo=lo,
                            encoder=self.encoder, config=self.config, eos_id=self.eos_id, counters=self.counters,
                            expect=expect, split=self.split, supervised=self.supervised)

    def skipped(self, unit: WorkUnit, index: int, check: Found) -> Sidecars:
        """A complete chunk whose input is unchanged: kept (in a finished cache: if it is the recorded one)."""
        for root, want, c in zip(self.roots, self.recorded, check.checks):
            if want is not None and c.sidecar_checksum != want.get((unit.shard, index)):
                raise BuildError(
                    f"{fmt.join(root, fmt.sidecar_path(unit.shard, index))} is complete but is not the chunk "
                    f"the finished ledger in {root} records (another build wrote into this --output?). "
                    "Delete that chunk's .parquet and .json files and rerun the same command to restore it.")
        self.counters.inc("chunks_skipped", 1)
        return check.sidecars

    def input_changed(self, unit: WorkUnit, index: int) -> None:
        """A complete chunk whose input changed since it was built: rebuild it (never in a finished cache)."""
        if self.finished:
            raise self._finished_input_changed(unit, index)
        LOG.warning("input file %s changed since chunk %d of shard %d was built: rebuilding that chunk",
                    unit.path, index, unit.shard)
        self.counters.inc("chunks_rebuilt", 1)
        self.counters.inc("chunks_input_changed", 1)

    def _existing(self, unit: WorkUnit, index: int, lo: int, check: Found) -> Existing:
        def rebuild() -> ChunkBuilder:
            self.input_changed(unit, index)
            return self.chunk_builder(unit, index, lo)

        return Existing(found=check, keep=lambda: self.skipped(unit, index, check), rebuild=rebuild)

    def _finished_input_changed(self, unit: WorkUnit, index: int) -> BuildError:
        return BuildError(
            f"input file {unit.path} changed since the cache in {self.finished[0]} was finished (the records of "
            f"chunk {index} of shard {unit.shard} are not the input it was built from). A finished cache is never "
            "rebuilt from other inputs (readers may be using it): build into another --output, or restore "
            "the file.")

    def _found(self, shard: int, index: int, byte_range: Sequence[int] | None = None,
               row_range: Sequence[int] | None = None) -> Found:
        return Found(tuple(verify_chunk(root, shard, index, byte_range, row_range, self.masked) for root in self.roots))

    def _check(self, unit: WorkUnit, index: int, byte_range: Sequence[int] | None = None,
               row_range: Sequence[int] | None = None) -> Found:
        check = self._found(unit.shard, index, byte_range, row_range)
        if not check.absent:
            self.counters.inc("chunks_checked", 1)
        if not check.complete and not check.absent:
            LOG.warning("%s; rebuilding it", check.problem(self.roots, unit.shard, index))
            self.counters.inc("chunks_rebuilt", 1)
        return check

    @staticmethod
    def _check_unchanged(unit: WorkUnit) -> None:
        size = next((e.size for e in filesystem.BEAM.match(unit.path)), None)
        if size != unit.size:
            raise BuildError(f"input file {unit.path} changed during the build (planned size {unit.size}, "
                             f"now {size}); inputs must not change while a cache is built into the same --output")

    # -- an uncompressed JSON Lines shard's chunk: a byte range ------------------------------------
    def _build_range(self, unit: WorkUnit) -> Sidecars:
        k = unit.index
        check = self._check(unit, k, (unit.lo, unit.hi))
        self._check_unchanged(unit)
        if check.complete:
            if unit.trusted:
                return self.skipped(unit, k, check)
            lines = RangeLines(unit.path, unit.lo, unit.hi, max_line=self.max_line)
            hasher = SpanHasher()
            for off, raw in lines:
                hasher.add(off, raw)
            if check.input_matches(*hasher.finish(lines.end)):
                return self.skipped(unit, k, check)
            self.input_changed(unit, k)
        builder = self.chunk_builder(unit, k, unit.lo)
        lines = RangeLines(unit.path, unit.lo, unit.hi, max_line=self.max_line)
        for off, raw in lines:
            builder.add(off, raw)
        return builder.finish(unit.hi, lines.end)

    # -- a columnar chunk: whole row groups or record batches --------------------------------------
    def _build_columnar(self, unit: WorkUnit) -> Sidecars:
        chunk = unit.columnar
        k = chunk.index
        check = self._check(unit, k, row_range=chunk.row_range)
        self._check_unchanged(unit)
        reader = ChunkReader(chunk, keep_fields=self.config.get("keep_fields") or (), shape=self.shape)
        if check.complete:
            if unit.trusted or check.input_matches(reader.span, reader.input_checksum()):  # stored bytes, not decoded
                return self.skipped(unit, k, check)
            self.input_changed(unit, k)
        builder = self.chunk_builder(unit, k, 0)
        for record in reader:
            builder.take(record.row, record)
        builder.input_bytes = sum(chunk.group_bytes)
        return builder.write(byte_range=None, row_range=reader.row_range, input_span=reader.span,
                             input_checksum=reader.checksum)

    # -- a shard read in one pass: compressed JSON Lines, a JSON array -----------------------------
    def _build_stream(self, unit: WorkUnit) -> tuple[list[tuple[dict[str, Any], ...]], dict[str, int] | None]:
        """Every chunk of the shard (its entries); its ``_DONE.json`` content (None for a plain JSON array, whose chunks are
        known from its size)."""
        shard, cb = unit.shard, self.config["chunk_bytes"]
        plain = unit.compression == "none"
        done_paths = [] if plain else [fmt.join(root, fmt.shard_done_path(shard)) for root in self.roots]
        raw_dones = [filesystem.read_or_none(p) for p in done_paths]
        self._check_unchanged(unit)
        if plain:
            known = fmt.num_chunks(unit.size, cb)
        else:
            done = _done_record(raw_dones[0], cb)
            known = done["chunks"] if done is not None and len(set(raw_dones)) == 1 else None  # one in each cache
        if known is not None and unit.trusted:
            checks = [self._found(shard, k) for k in range(known)]
            if all(c.complete for c in checks):
                self.counters.inc("chunks_checked", len(checks))
                return [self.publish(self.skipped(unit, k, c)) for k, c in enumerate(checks)], None if plain else done
        try:
            sidecars, total = self._stream(unit)
        except DamagedInput:
            if not self.finished:
                self._forget_shard(shard)  # nothing built from a damaged stream is kept as complete
            raise
        if plain:
            return sidecars, None
        done = {"chunks": len(sidecars), "uncompressed_bytes": total}
        self._remove_stale_chunks(shard, len(sidecars))
        done_bytes = fmt.dumps(done).encode()
        for path, raw_done in zip(done_paths, raw_dones):
            if raw_done != done_bytes:
                filesystem.write_atomic(path, done_bytes)
        return sidecars, done

    def _stream(self, unit: WorkUnit) -> tuple[list[Sidecars], int]:
        cb = self.config["chunk_bytes"]
        sidecars: list[Sidecars] = []
        cur = None

        def start(k: int):
            check = self._check(unit, k)
            if not check.complete:
                return self.chunk_builder(unit, k, k * cb)
            existing = self._existing(unit, k, k * cb, check)
            return Trusted(existing) if unit.trusted else Verifying(existing)

        def finish(sink, hi: int, end: int) -> None:
            k = len(sidecars)
            span, checksum = source.result(k, end)
            sidecars.append(self.publish(sink.write(byte_range=[k * cb, hi], input_span=span,
                                                    input_checksum=checksum)))

        with open_input(unit.path, unit.compression) as f:
            source = (ArrayStream(f, unit.path, cb, self.max_line) if unit.format == JSON_ARRAY
                      else LineStream(f, cb, self.max_line))
            for off, raw in source:
                k = off // cb
                if cur is None or k != len(sidecars):
                    if cur is not None:
                        finish(cur, len(sidecars) * cb + cb, off)
                    while len(sidecars) < k:  # chunks holding no record start
                        finish(start(len(sidecars)), len(sidecars) * cb + cb, off)
                    cur = start(k)
                cur.take(off, raw)
            total = source.end
        n = fmt.num_chunks(total, cb)
        if cur is not None:
            finish(cur, min(len(sidecars) * cb + cb, total), total)
        while len(sidecars) < n:
            finish(start(len(sidecars)), min(len(sidecars) * cb + cb, total), total)
        # byte ranges come from the sidecar: a chunk of another length (the input changed) is not complete
        for k, scs in enumerate(sidecars):
            want = [k * cb, min(k * cb + cb, total)]
            for sc in scs:
                if list(sc["byte_range"]) != want:
                    raise BuildError(f"internal: chunk {k} of {unit.path} has byte range {sc['byte_range']}, "
                                     f"expected {want}")
        return sidecars, total

    def _shard_files(self, shard: int) -> list[tuple[str, int]]:
        """``(path, chunk index)`` of every chunk, sidecar and dead-letter file of ``shard`` in the caches."""
        out = []
        patterns = [fmt.join(root, rel) for root in self.roots
                    for rel in (f"{fmt.shard_dir(shard)}/chunk-*", f"{fmt.BAD_DIR}/shard-{shard:05d}/chunk-*")]
        for pattern in patterns:
            for path in filesystem.list_sizes(pattern):
                m = _CHUNK_FILE.search(path)
                if m:
                    out.append((path, int(m.group(1))))
        return out

    def _remove_stale_chunks(self, shard: int, n: int) -> None:
        """Chunks numbered ``n`` and up belong to an earlier, longer content of the shard: remove them."""
        stale = sorted((p for p, k in self._shard_files(shard) if k >= n), key=_removal_order)
        for path in stale:  # entries and sidecars first: a crash in between leaves incomplete chunks, never complete ones
            filesystem.BEAM.remove(path)

    def _forget_shard(self, shard: int) -> None:
        """Remove ``_DONE.json`` and every chunk of a shard (sidecars first), in every cache."""
        for root in self.roots:
            filesystem.BEAM.remove(fmt.join(root, fmt.shard_done_path(shard)))
        files = sorted(self._shard_files(shard), key=lambda pk: _removal_order(pk[0]))
        for path, _ in files:
            filesystem.BEAM.remove(path)


def _removal_order(path: str) -> tuple[bool, bool]:
    """Entries, then sidecars, then the rest: what says a chunk is complete goes first."""
    return not path.endswith(chunk_table.ENTRY_SUFFIX), not path.endswith(".json")


def _done_record(raw: bytes | None, chunk_bytes: int) -> dict[str, int] | None:
    """A shard's ``_DONE.json`` if it is one this configuration writes, else None (the shard is streamed
    again and the file rewritten): its numbers are checked before any is used as a count."""
    if raw is None:
        return None
    try:
        done = checks.load_json(raw, checks.STATUS_JSON_DEPTH)
    except ValueError:
        return None
    if not isinstance(done, dict) or set(done) != {"chunks", "uncompressed_bytes"}:
        return None
    total, chunks = done["uncompressed_bytes"], done["chunks"]
    if type(total) is not int or type(chunks) is not int or not 0 <= total <= MAX_SHARD_BYTES:
        return None
    return done if chunks == fmt.num_chunks(total, chunk_bytes) else None
