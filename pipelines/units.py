"""Building one work unit on a worker: read its lines, feed the chunk writer, skip chunks already complete.

A byte-range unit (uncompressed shard) reads the lines starting in its range with a seek; a streamed
unit (compressed shard) decompresses the shard once and cuts it into chunks by uncompressed offset,
then writes the shard's ``_DONE.json``. A chunk whose files already verify against its sidecar is not
rebuilt, which is what makes a rerun after a crash cheap and byte-identical.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from reader import format as fmt

from . import fsutil
from .chunk_writer import ChunkBuilder, Counters, verify_chunk
from .errors import BuildError
from .plan import UnitResult, WorkUnit


class SkipChunk:
    """Stands in for a ChunkBuilder when the chunk is already complete (resume)."""

    def __init__(self, sidecar: dict[str, Any]):
        self.sidecar = sidecar

    def add(self, offset: int, raw: bytes) -> None:
        pass

    def finish(self, hi: int) -> dict[str, Any]:
        return self.sidecar


class UnitBuilder:
    """Builds work units into the cache at ``output``, one after the other, in one worker.

    Args:
      output: the cache root.
      encoder: the loaded tokenizer (``TokenizerSpec.load()``).
      config: the ledger's chunking configuration (``ChunkConfig.to_json()``).
      eos_id: the tokenizer's end-of-sequence id (appended only if ``config["append_eos"]``).
      counters: where chunk writers add their counts (Beam metrics on a worker).
    """

    def __init__(self, output: str, encoder, config: Mapping[str, Any], eos_id: int | None,
                 counters: Counters | None = None):
        self.output = output
        self.encoder = encoder
        self.config = config
        self.eos_id = eos_id
        self.counters = counters or Counters()

    def build(self, unit: WorkUnit) -> UnitResult:
        if unit.streamed:
            sidecars, done = self._build_stream(unit)
            return UnitResult(shard=unit.shard, sidecars=tuple(sidecars), done=done)
        return UnitResult(shard=unit.shard, sidecars=(self._build_range(unit),), done=None)

    def _builder(self, unit: WorkUnit, index: int, lo: int):
        sidecar = verify_chunk(self.output, unit.shard, index)
        if sidecar is not None:
            self.counters.inc("chunks_skipped", 1)
            return SkipChunk(sidecar)
        return ChunkBuilder(root=self.output, input_path=unit.path, shard=unit.shard, index=index, lo=lo,
                            encoder=self.encoder, config=self.config, eos_id=self.eos_id, counters=self.counters)

    @staticmethod
    def _check_unchanged(unit: WorkUnit) -> None:
        size = fsutil.file_size(unit.path)
        if size != unit.size:
            raise BuildError(f"input file {unit.path} changed during the build (planned size {unit.size}, "
                             f"now {size}); inputs must not change while a cache is built into the same --output")

    def _build_range(self, unit: WorkUnit) -> dict[str, Any]:
        b = self._builder(unit, unit.index, unit.lo)
        if isinstance(b, SkipChunk):
            return b.sidecar
        self._check_unchanged(unit)
        for off, raw in fsutil.iter_range_lines(unit.path, unit.lo, unit.hi):
            b.add(off, raw)
        return b.finish(unit.hi)

    def _build_stream(self, unit: WorkUnit) -> tuple[list[dict[str, Any]], dict[str, int]]:
        shard, cb = unit.shard, self.config["chunk_bytes"]
        done_path = fmt.join(self.output, fmt.shard_done_path(shard))
        raw_done = fsutil.read_bytes_or_none(done_path)
        if raw_done is not None:
            done = json.loads(raw_done)
            sidecars = [verify_chunk(self.output, shard, k) for k in range(done["chunks"])]
            if all(s is not None for s in sidecars):
                self.counters.inc("chunks_skipped", len(sidecars))
                return sidecars, done
        self._check_unchanged(unit)
        sidecars: list[dict[str, Any]] = []
        cur = None
        with fsutil.open_decompressed(unit.path, unit.compression) as f:
            reader = fsutil.LineReader(f)
            for off, raw in reader:
                k = off // cb
                if cur is None or k != len(sidecars):
                    if cur is not None:
                        sidecars.append(cur.finish(len(sidecars) * cb + cb))
                    while len(sidecars) < k:  # chunks holding no line start
                        sidecars.append(self._builder(unit, len(sidecars), len(sidecars) * cb)
                                        .finish(len(sidecars) * cb + cb))
                    cur = self._builder(unit, k, k * cb)
                cur.add(off, raw)
            total = reader.pos
        n = fmt.num_chunks(total, cb)
        if cur is not None:
            k = len(sidecars)
            sidecars.append(cur.finish(min(k * cb + cb, total)))
        while len(sidecars) < n:
            k = len(sidecars)
            sidecars.append(self._builder(unit, k, k * cb).finish(min(k * cb + cb, total)))
        done = {"chunks": n, "uncompressed_bytes": total}
        fsutil.write_atomic(done_path, fmt.dumps(done).encode())
        return sidecars, done
