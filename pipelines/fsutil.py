"""File helpers on Beam's FileSystems (local paths and gs:// alike): atomic writes, reads, line iteration.

Paths are joined with :func:`reader.format.join`, the one definition shared with the reader.
"""

from __future__ import annotations

import gzip
import io
import posixpath
import uuid
from typing import BinaryIO, Iterator

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from reader import format as fmt

TMP_PREFIX = ".tmp-"
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


def temp_name(path: str) -> str:
    """A unique temporary name next to ``path`` (same directory, so the rename stays cheap)."""
    d, base = posixpath.split(path)
    return f"{d}/{TMP_PREFIX}{uuid.uuid4().hex}-{base}"


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` under a temporary name in the same directory, then rename over ``path``.

    A reader sees either no file or the complete file. Writing the same bytes twice (a retried bundle)
    is harmless.
    """
    _write_atomic(path, lambda f: f.write(data))


def write_atomic_stream(path: str, source: BinaryIO, block: int = 1 << 20) -> None:
    """:func:`write_atomic` with the content copied from a readable binary file, block by block."""

    def copy(f):
        while True:
            b = source.read(block)
            if not b:
                return
            f.write(b)

    _write_atomic(path, copy)


def _write_atomic(path: str, fill) -> None:
    tmp = temp_name(path)
    f = FileSystems.create(tmp, mime_type="application/octet-stream",
                           compression_type=CompressionTypes.UNCOMPRESSED)
    try:
        fill(f)
    finally:
        f.close()
    FileSystems.rename([tmp], [path])


def delete_if_exists(path: str) -> None:
    """Remove ``path`` if it is there (a missing file is not an error)."""
    if FileSystems.exists(path):
        FileSystems.delete([path])


def remove_temp_files(root: str) -> int:
    """Delete the temporary files a crashed build left in a cache (where atomic writes put them)."""
    patterns = [fmt.join(root, f"{TMP_PREFIX}*"),
                fmt.join(root, f"{fmt.CHUNKS_DIR}/*/{TMP_PREFIX}*"),
                fmt.join(root, f"{fmt.BAD_DIR}/*/{TMP_PREFIX}*")]
    paths = []
    for res in FileSystems.match(patterns):
        paths.extend(m.path for m in res.metadata_list)
    if paths:
        FileSystems.delete(paths)
    return len(paths)


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


def iter_range_lines(path: str, lo: int, hi: int, block: int = READ_BLOCK) -> Iterator[tuple[int, bytes]]:
    """Lines of an uncompressed file whose first byte lies in ``[lo, hi)`` (TextIO-style splitting)."""
    f = FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)
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
                break
            if off >= lo:
                yield off, line
            reader.block = block
    finally:
        f.close()


class _Decompressed(io.RawIOBase):
    """A bounded-memory decompressing reader that closes its source too."""

    def __init__(self, reader, source):
        self._reader, self._source = reader, source

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        return self._reader.read(n)

    def readinto(self, b) -> int:
        data = self._reader.read(len(b))
        b[:len(data)] = data
        return len(data)

    def close(self) -> None:
        try:
            self._reader.close()
        finally:
            self._source.close()
            super().close()


def open_decompressed(path: str, compression: str) -> BinaryIO:
    """Open ``path`` (any Beam filesystem) for reading its uncompressed bytes.

    Decompression streams with bounded memory: each ``read(n)`` inflates at most ``n`` bytes (Beam's own
    CompressedFile inflates 16 MiB of compressed input at once, unbounded for highly compressible data).
    Concatenated gzip members and zstd frames are read through.
    """
    raw = FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)
    if compression == "none":
        return raw
    try:
        if compression == "gzip":
            return _Decompressed(gzip.GzipFile(fileobj=raw, mode="rb"), raw)
        if compression == "zstd":
            import zstandard

            reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False)
            return _Decompressed(reader, raw)
    except Exception:
        raw.close()
        raise
    raw.close()
    raise ValueError(f"unknown compression {compression!r} for {path}")
