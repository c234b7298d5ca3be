"""Where a chunk's records go: the writer, or a stand-in for a chunk an earlier run left.

A work unit reads each chunk's records from its source (:mod:`pipelines.chunking.units`) and hands them to a
*sink*: ``take(pos, record)`` for each, then ``write(byte_range=, input_span=, input_checksum=,
row_range=)`` with what the source read, which returns the chunk's sidecars (one per cache of the build).
:class:`~pipelines.chunking.chunk_writer.ChunkBuilder` is the sink that writes. The two here stand in for a
complete chunk (:class:`Existing`) while its input is read once more in a single pass (a compressed
shard, a JSON array: a chunk whose input changed cannot be read again cheaply):

- :class:`Verifying` keeps the records (in a spooled file) and compares the input span and checksum
  with the chunk's sidecar: the same, the chunk is kept; else the kept records are replayed into a writer.
- :class:`Trusted` takes nothing: the input is known unchanged (the same Cloud Storage CRC32C).

Sources that can read a chunk again (a byte range, a columnar chunk) check the checksum first and use a
writer only when it differs.
"""

from __future__ import annotations

import dataclasses
import struct
import tempfile
from typing import Any, Callable, Iterator, Sequence

from reader.format import spec as fmt

from pipelines.chunking.chunk_writer import ChunkBuilder, ChunkCheck

REPLAY_MEMORY = 8 << 20  # a verified chunk's records are kept in memory up to this, then in a local temp file
_REPLAY_HEADER = struct.Struct("<qq")  # a kept record's position and size (-1: an over-long one, kept aside)

Sidecars = tuple[dict[str, Any], ...]  # one chunk's sidecars, one per cache of the build


@dataclasses.dataclass(frozen=True)
class Found:
    """What a rerun finds of one chunk in every cache of the build (one :class:`ChunkCheck` each)."""

    checks: tuple[ChunkCheck, ...]

    @property
    def complete(self) -> bool:
        first = self.checks[0].sidecar
        return all(c.complete and c.sidecar["input_span"] == first["input_span"]
                   and c.sidecar["input_checksum"] == first["input_checksum"] for c in self.checks)

    @property
    def absent(self) -> bool:
        return all(c.absent for c in self.checks)

    @property
    def sidecars(self) -> Sidecars:
        return tuple(c.sidecar for c in self.checks)

    def input_matches(self, span: Sequence[int], checksum: str) -> bool:
        """The input the chunk was built from is ``span`` with checksum ``checksum``."""
        first = self.checks[0].sidecar
        return list(span) == first["input_span"] and checksum == first["input_checksum"]

    def problem(self, roots: tuple[str, ...], shard: int, index: int) -> str:
        """Why the chunk is not complete, naming the file."""
        for root, c in zip(roots, self.checks):
            if not c.complete:
                return f"{fmt.join(root, fmt.chunk_path(shard, index))}: {c.problem}"
        return (f"{fmt.join(roots[-1], fmt.chunk_path(shard, index))}: records other input bytes than "
                f"{fmt.join(roots[0], fmt.chunk_path(shard, index))}")


@dataclasses.dataclass(frozen=True)
class Existing:
    """A complete chunk an earlier run left, and the two ways on: ``keep()`` it (its sidecars; checked
    against a finished ledger), or ``rebuild()`` it because its input changed (a fresh writer; logged and
    counted, refused in a finished cache)."""

    found: Found
    keep: Callable[[], Sidecars]
    rebuild: Callable[[], ChunkBuilder]


class Verifying:
    """Stands in for a writer while a complete chunk's input is read: keeps its records until
    :meth:`write` knows whether the input changed. An over-long record is kept as its head and size (all
    its dead letter needs)."""

    def __init__(self, existing: Existing):
        self.existing = existing
        self.kept = tempfile.SpooledTemporaryFile(max_size=REPLAY_MEMORY)  # (position, size, bytes) records
        self.long: dict[int, Any] = {}  # position -> an over-long record (its head and size)

    def take(self, pos: int, record: Any) -> None:
        if type(record) is bytes:
            self.kept.write(_REPLAY_HEADER.pack(pos, len(record)))
            self.kept.write(record)
        else:
            self.long[pos] = record
            self.kept.write(_REPLAY_HEADER.pack(pos, -1))

    def _replay(self) -> Iterator[tuple[int, Any]]:
        self.kept.seek(0)
        while header := self.kept.read(_REPLAY_HEADER.size):
            pos, n = _REPLAY_HEADER.unpack(header)
            yield pos, (self.long[pos] if n < 0 else self.kept.read(n))

    def write(self, *, byte_range: Sequence[int] | None, input_span: Sequence[int], input_checksum: str,
              row_range: Sequence[int] | None = None) -> Sidecars:
        try:
            if self.existing.found.input_matches(input_span, input_checksum):
                return self.existing.keep()
            builder = self.existing.rebuild()
            for pos, record in self._replay():
                builder.take(pos, record)
            return builder.write(byte_range=byte_range, input_span=input_span, input_checksum=input_checksum,
                                 row_range=row_range)
        finally:
            self.kept.close()


class Trusted:
    """Stands in for a writer when a complete chunk's input is known unchanged (the same CRC32C)."""

    def __init__(self, existing: Existing):
        self.existing = existing

    def take(self, pos: int, record: Any) -> None:
        pass

    def write(self, **_: Any) -> Sidecars:
        return self.existing.keep()
