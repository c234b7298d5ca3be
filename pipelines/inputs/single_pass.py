"""The records of a shard read in one pass (a compressed JSON Lines file, a JSON array), with each chunk's
input span and checksum.

Chunk ``k`` of such a shard holds the records whose first byte lies in ``[k*chunk_bytes, (k+1)*chunk_bytes)``
of the uncompressed stream. Iterating yields ``(offset, record)`` in file order; afterwards :attr:`end` is
the stream's length, and :meth:`result` gives a chunk's ``input_span`` and ``input_checksum`` (the sha256
of its records' bytes, which are hashed as they pass: an over-long record is never held). A chunk's result
is complete once a record of a later chunk has been yielded, or the stream has ended.
"""

from __future__ import annotations

from typing import BinaryIO, Iterator

from pipelines.inputs.lines import LineReader, LongLine, SpanHasher
from pipelines.inputs.json_array import ArrayRecords, LongElement, Spans


class LineStream:
    """The lines of a JSON Lines stream (a :class:`~pipelines.inputs.LongLine` for one over
    ``max_line``), each chunk's span hashed by :class:`~pipelines.inputs.SpanHasher`."""

    def __init__(self, stream: BinaryIO, chunk_bytes: int, max_line: int | None = None):
        self.reader = LineReader(stream, max_line=max_line)
        self.chunk_bytes = chunk_bytes
        self.hashers: dict[int, SpanHasher] = {}

    def __iter__(self) -> Iterator[tuple[int, bytes | LongLine]]:
        cb, hashers = self.chunk_bytes, self.hashers
        for off, raw in self.reader:
            h = hashers.get(off // cb)
            if h is None:
                h = hashers[off // cb] = SpanHasher()
            h.add(off, raw)  # first: a long line's bytes stream into the hash, then its head and size are known
            yield off, raw

    @property
    def end(self) -> int:
        return self.reader.pos

    def result(self, k: int, end: int) -> tuple[list[int], str]:
        return (self.hashers.pop(k, None) or SpanHasher()).finish(end)


class ArrayStream:
    """The elements of a JSON array (a :class:`~pipelines.inputs.json_array.LongElement` for one over
    ``max_element``); a chunk's span runs from its first element to the next chunk's (the last one's to the
    end of the file)."""

    def __init__(self, stream: BinaryIO, path: str, chunk_bytes: int, max_element: int | None = None):
        self.spans = Spans(chunk_bytes)
        self.records = ArrayRecords(stream, path, max_element=max_element, feed=self.spans, keep_tails=False)

    def __iter__(self) -> Iterator[tuple[int, bytes | LongElement]]:
        for off, element, _ in self.records:
            yield off, element

    @property
    def end(self) -> int:
        return self.records.end

    def result(self, k: int, end: int) -> tuple[list[int], str]:
        return self.spans.result(k, end)
