"""Lines of an input: iterated over a stream or a byte range of a file with exact offsets, an over-long line
streamed rather than held, and the span of input bytes a chunk was built from, hashed (local paths and
``gs://`` alike, through the builder's file system).
"""

from __future__ import annotations

import hashlib
from typing import BinaryIO, Callable, Iterator

from pipelines.filesystem import BEAM

READ_BLOCK = 1 << 20
LONG_LINE_HEAD = 4 << 10  # bytes of an over-long line kept (for its dead letter)


class LongLine:
    """A line longer than a :class:`LineReader`'s ``max_line``, streamed rather than held.

    :meth:`pieces` yields every byte of the line once, in order, keeping only its first
    :data:`LONG_LINE_HEAD` bytes in ``head`` (for its dead letter); once it is exhausted (or after
    :meth:`drain`) ``head`` is complete and ``len()`` is the line's size. The reader drains a line its
    consumer did not, so offsets stay exact either way; a consumer that needs the bytes (a hash) must take
    them before it asks for the next line.
    """

    def __init__(self, parts: list[bytes], rest: Callable[["LongLine"], Iterator[bytes]] | None = None):
        self._parts = parts
        self._rest = rest(self) if rest is not None else iter(())
        self.head = b""
        self.size = 0
        self.newline = False  # ended by a newline (False: by the end of the stream)
        self.leftover = b""  # bytes read past its newline (the next lines)

    def pieces(self) -> Iterator[bytes]:
        parts, self._parts = self._parts, []
        parts.reverse()
        while parts:  # released one by one: what was read before the line was found long is not held
            yield self._count(parts.pop())
        for b in self._rest:
            yield self._count(b)

    def _count(self, b: bytes) -> bytes:
        if len(self.head) < LONG_LINE_HEAD:  # the same bytes however the stream was cut into reads
            self.head += b[:LONG_LINE_HEAD - len(self.head)]
        self.size += len(b)
        return b

    def drain(self) -> None:
        for _ in self.pieces():
            pass

    def __len__(self) -> int:
        return self.size


class LineReader:
    """Iterates ``(offset, line)`` over a binary stream, ``line`` without its ``\\n``.

    ``offset`` is the byte position of the line's first byte, counted from ``base`` (the stream's
    position when the reader starts). After exhaustion ``end`` is the position just past the last byte.
    A line longer than ``max_line`` bytes comes as a :class:`LongLine` (streamed), so memory is bounded
    by the read block plus ``max_line``, whatever the longest line (None: no limit, the longest line).
    """

    def __init__(self, stream: BinaryIO, base: int = 0, block: int = READ_BLOCK, max_line: int | None = None):
        self.stream = stream
        self.pos = base
        self.end = base
        self.block = block
        self.max_line = max_line

    def _read(self) -> bytes:
        block = self.stream.read(self.block)
        self.end += len(block)
        return block

    def _rest_of_line(self, line: LongLine) -> Iterator[bytes]:
        """The blocks of a long line after its first parts, up to its newline; the bytes after it are
        ``line.leftover``."""
        while True:
            block = self._read()
            if not block:
                return
            i = block.find(b"\n")
            if i < 0:
                yield block
                continue
            line.leftover, line.newline = block[i + 1:], True
            yield block[:i]
            return

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        pending: list[bytes] = []
        held = 0  # bytes in pending
        pos = self.pos
        max_line = self.max_line
        carry = b""  # bytes read past a long line: split before reading more
        while True:
            block, carry = (carry, b"") if carry else (self._read(), b"")
            if not block:
                break
            parts = block.split(b"\n")
            del block
            last = parts.pop()
            if parts and pending:
                pending.append(parts[0])
                parts[0] = b"".join(pending)
                pending, held = [], 0
            for line in parts:
                if max_line is not None and len(line) > max_line:
                    line = LongLine([line])
                    yield pos, line
                    line.drain()
                    pos += line.size + 1
                    continue
                yield pos, line
                pos += len(line) + 1
            if not last:
                continue
            pending.append(last)
            held += len(last)
            if max_line is not None and held > max_line:  # no newline yet: stream the rest of this line
                line = LongLine(pending, self._rest_of_line)
                pending, held = [], 0
                yield pos, line
                line.drain()
                pos += line.size + line.newline
                carry, line.leftover = line.leftover, b""  # a consumer may keep the (drained) line
        if pending:
            line = b"".join(pending)
            yield pos, line
            pos += len(line)
        self.pos = pos


class RangeLines:
    """The lines of an uncompressed file whose first byte lies in ``[lo, hi)`` (TextIO-style splitting).

    Iterating yields ``(offset, line)``; afterwards :attr:`end` is the offset of the first line starting
    at or after ``hi`` (or the file's end): the chunk's lines span exactly ``[first offset, end)``.
    """

    def __init__(self, path: str, lo: int, hi: int, block: int = READ_BLOCK, max_line: int | None = None):
        self.path, self.lo, self.hi, self.block, self.max_line = path, lo, hi, block, max_line
        self.end: int | None = None

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        lo, hi, block = self.lo, self.hi, self.block
        f = BEAM.open(self.path)
        try:
            start = max(lo - 1, 0)
            if start:
                f.seek(start)
            reader = LineReader(f, base=start, block=min(block, max(hi - start + 1, 1 << 16)), max_line=self.max_line)
            first = lo > 0
            for off, line in reader:
                if first:
                    first = False  # the tail of the line that started before lo (or the '\n' at lo-1)
                    if off < lo:
                        continue
                if off >= hi:
                    self.end = off
                    return
                if off >= lo:
                    yield off, line
                reader.block = block
            self.end = max(reader.pos, lo)
        finally:
            f.close()


class SpanHasher:
    """sha256 of the input bytes a chunk was built from: its lines, each with its ``\n``.

    Feed every line of the chunk with :meth:`add` (in file order), then :meth:`finish` with the span's
    end (the offset of the next line, or the file's end). The hashed bytes are exactly the input's
    ``[start, end)``, where ``start`` is the first line's offset (``end`` if the chunk holds no line).
    """

    def __init__(self):
        self._h = hashlib.sha256()
        self._start: int | None = None
        self._line_end: int | None = None  # just past the last line's content (before its '\n')

    def add(self, offset: int, line: bytes | LongLine) -> None:
        """Hash ``line`` (a :class:`LongLine` is streamed through, and so consumed)."""
        if self._line_end is None:
            self._start = offset
        else:
            self._h.update(b"\n")
        if type(line) is LongLine:
            for piece in line.pieces():
                self._h.update(piece)
        else:
            self._h.update(line)
        self._line_end = offset + len(line)

    def finish(self, end: int) -> tuple[list[int], str]:
        """``([start, end], "sha256:<hex>")`` of the chunk's input span (the hasher is left as it was)."""
        h = self._h.copy()
        if self._line_end is not None and self._line_end < end:
            h.update(b"\n")  # the last line's terminator (a file may end without one)
        start = end if self._start is None else self._start
        return [start, end], "sha256:" + h.hexdigest()
