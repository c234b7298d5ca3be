"""File helpers on Beam's FileSystems (local paths and gs:// alike): atomic writes (the shared sequence of
:mod:`reader.storage.atomic` over Beam's FileSystems), reads, line iteration.

Paths are joined with :func:`reader.format.spec.join`, the one definition shared with the reader.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
from typing import Any, BinaryIO, Callable, Iterator

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from reader.format import spec as fmt
from reader.storage import atomic

TMP_PREFIX = atomic.TMP_PREFIX
# A JSON string, or an unterminated one up to the end: always matches, so the text is scanned once.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
STATUS_JSON_DEPTH = 32  # our own small JSON files (sidecars, _DONE.json, splits.json) nest a few levels
READ_BLOCK = 1 << 20
LONG_LINE_HEAD = 4 << 10  # bytes of an over-long line kept (for its dead letter)


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
    rels = [f"{TMP_PREFIX}*", f"{fmt.CHUNKS_DIR}/*/{TMP_PREFIX}*", f"{fmt.BAD_DIR}/*/{TMP_PREFIX}*"]
    patterns = [fmt.join(root, rel) for rel in rels]
    if "://" not in root:  # (Beam's local match compiles a pattern per directory: tens of thousands of shards)
        paths = [p for rel in rels for p in glob.glob(fmt.join(glob.escape(root), rel), include_hidden=True)
                 if older_than is None or _mtime(p) < older_than]
        for p in paths:
            delete_if_exists(p)
        return len(paths)
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


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


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
        f = FileSystems.open(self.path, compression_type=CompressionTypes.UNCOMPRESSED)
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


def iter_range_lines(path: str, lo: int, hi: int, block: int = READ_BLOCK,
                     max_line: int | None = None) -> Iterator[tuple[int, bytes]]:
    """Lines of an uncompressed file whose first byte lies in ``[lo, hi)`` (see :class:`RangeLines`)."""
    return iter(RangeLines(path, lo, hi, block, max_line))


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


def json_nesting(text: str, limit: int) -> int | None:
    """A bound (at most ``limit``) on how deep ``text`` nests JSON arrays and objects, or None if deeper.

    Counted on the text, valid JSON or not, without recursion: brackets outside strings, exact on every
    prefix that is valid JSON (all a parser recurses into), so the verdict never depends on the stack.
    """
    bound = text.count("[") + text.count("{")
    if bound <= limit:
        return bound
    depth = top = 0
    for c in _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)):
        if c == "[" or c == "{":
            depth += 1
            if depth > top:
                if depth > limit:
                    return None
                top = depth
        else:
            depth -= 1
    return top


def json_headroom(depth: int) -> None:
    """Let ``json.loads`` parse ``depth`` levels from here: it recurses once per level, and the interpreter's
    recursion limit counts the caller's frames too (a deep Beam stack). Only ever raised, process-wide."""
    frames, f = 0, sys._getframe()
    while f is not None:
        frames += 1
        f = f.f_back
    need = frames + depth + 50
    if sys.getrecursionlimit() < need:
        sys.setrecursionlimit(need)


def load_json(raw: bytes | str, limit: int = STATUS_JSON_DEPTH) -> Any:
    """``json.loads`` of a file a user may have edited: a ValueError (never a RecursionError) if it is not
    JSON or nests deeper than ``limit``."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    bound = json_nesting(text, limit)
    if bound is None:
        raise ValueError(f"JSON nested more than {limit} deep")
    json_headroom(bound)
    return json.loads(text)
