"""File helpers on Beam's FileSystems (local paths and gs:// alike): atomic writes (the shared sequence of
:mod:`reader.storage.atomic` over Beam's FileSystems), reads, line iteration.

Paths are joined with :func:`reader.format.spec.join`, the one definition shared with the reader.
"""

from __future__ import annotations

import hashlib
from typing import BinaryIO, Iterator

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from reader.format import spec as fmt
from reader.storage import atomic

TMP_PREFIX = atomic.TMP_PREFIX
READ_BLOCK = 1 << 20


def exists(path: str) -> bool:
    return FileSystems.exists(path)


def read_bytes(path: str) -> bytes:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


def read_bytes_or_none(path: str) -> bytes | None:
    try:
        if not FileSystems.exists(path):
            return None
        return read_bytes(path)
    except (OSError, IOError, FileNotFoundError):
        return None
    except Exception as e:  # BeamIOError and friends
        if "not found" in str(e).lower() or "no such" in str(e).lower():
            return None
        raise


class BeamStorage(atomic.Storage):
    """The atomic writes' operations over Beam's FileSystems: the builder's writes use the client and the
    credentials its reads use, on every runner (gcsfs is not needed on Flink or Spark workers)."""

    def create(self, path: str) -> BinaryIO:
        return FileSystems.create(path, mime_type="application/octet-stream",
                                  compression_type=CompressionTypes.UNCOMPRESSED)

    def rename(self, src: str, dst: str) -> None:
        FileSystems.rename([src], [dst])

    def remove(self, path: str) -> None:
        delete_if_exists(path)


BEAM = BeamStorage()


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` under a temporary name in the same directory, then rename over ``path``
    (:mod:`reader.storage.atomic`). A reader sees either no file or the complete file."""
    atomic.write(BEAM, path, data)


def write_atomic_stream(path: str, source: BinaryIO, block: int = 1 << 20) -> None:
    """:func:`write_atomic` with the content copied from a readable binary file, block by block."""
    atomic.write_stream(BEAM, path, source, block)


def delete_if_exists(path: str) -> None:
    """Remove ``path`` if it is there (a missing file is not an error)."""
    if FileSystems.exists(path):
        FileSystems.delete([path])


def remove_temp_files(root: str, older_than: float | None = None) -> int:
    """Delete the temporary files a crashed build left in a cache (where atomic writes put them).

    Args:
      root: the cache root.
      older_than: a Unix time; only files last modified before it are deleted, so a build running
        concurrently into the same root keeps the temporary files it is writing.
    """
    patterns = [fmt.join(root, f"{TMP_PREFIX}*"),
                fmt.join(root, f"{fmt.CHUNKS_DIR}/*/{TMP_PREFIX}*"),
                fmt.join(root, f"{fmt.BAD_DIR}/*/{TMP_PREFIX}*")]
    paths = []
    for res in FileSystems.match(patterns):
        paths.extend(m.path for m in res.metadata_list
                     if older_than is None or not m.last_updated_in_seconds
                     or m.last_updated_in_seconds < older_than)
    if paths:
        try:
            FileSystems.delete(paths)
        except Exception:  # noqa: BLE001 - another run removed some of them first: that is the goal anyway
            pass
    return len(paths)


def list_sizes(pattern: str) -> dict[str, int]:
    """``path -> size`` of every file matching ``pattern`` (empty if none)."""
    try:
        return {m.path: m.size_in_bytes for m in FileSystems.match([pattern])[0].metadata_list}
    except Exception:  # noqa: BLE001 - Beam raises when nothing matches on some filesystems
        return {}


def file_size(path: str) -> int | None:
    try:
        res = FileSystems.match([path])[0].metadata_list
    except Exception:
        return None
    return res[0].size_in_bytes if res else None


class LineReader:
    """Iterates ``(offset, line)`` over a binary stream, ``line`` without its ``\\n``.

    ``offset`` is the byte position of the line's first byte, counted from ``base`` (the stream's
    position when the reader starts). After exhaustion ``end`` is the position just past the last byte.
    Memory is bounded by the read block plus the longest line.
    """

    def __init__(self, stream: BinaryIO, base: int = 0, block: int = READ_BLOCK):
        self.stream = stream
        self.pos = base
        self.end = base
        self.block = block

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        pending: list[bytes] = []
        pos = self.pos
        read = self.stream.read
        while True:
            block = read(self.block)
            if not block:
                break
            self.end += len(block)
            parts = block.split(b"\n")
            del block
            last = parts.pop()
            if not parts:  # no newline in this block: part of a long line
                pending.append(last)
                continue
            if pending:
                pending.append(parts[0])
                parts[0] = b"".join(pending)
                pending = []
            for line in parts:
                yield pos, line
                pos += len(line) + 1
            if last:
                pending.append(last)
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

    def __init__(self, path: str, lo: int, hi: int, block: int = READ_BLOCK):
        self.path, self.lo, self.hi, self.block = path, lo, hi, block
        self.end: int | None = None

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        lo, hi, block = self.lo, self.hi, self.block
        f = FileSystems.open(self.path, compression_type=CompressionTypes.UNCOMPRESSED)
        try:
            start = max(lo - 1, 0)
            if start:
                f.seek(start)
            reader = LineReader(f, base=start, block=min(block, max(hi - start + 1, 1 << 16)))
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


def iter_range_lines(path: str, lo: int, hi: int, block: int = READ_BLOCK) -> Iterator[tuple[int, bytes]]:
    """Lines of an uncompressed file whose first byte lies in ``[lo, hi)`` (see :class:`RangeLines`)."""
    return iter(RangeLines(path, lo, hi, block))


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

    def add(self, offset: int, line: bytes) -> None:
        if self._line_end is None:
            self._start = offset
        else:
            self._h.update(b"\n")
        self._h.update(line)
        self._line_end = offset + len(line)

    def finish(self, end: int) -> tuple[list[int], str]:
        """``([start, end], "sha256:<hex>")`` of the chunk's input span."""
        if self._line_end is not None and self._line_end < end:
            self._h.update(b"\n")  # the last line's terminator (a file may end without one)
        start = end if self._start is None else self._start
        return [start, end], "sha256:" + self._h.hexdigest()

