"""The record batches of an Arrow IPC file (stream or file format), found from their message headers alone.

An Arrow IPC *stream* (what Hugging Face ``datasets`` writes into its ``.arrow`` files) has no footer: it
is a sequence of messages, each an 8-byte prefix (``0xFFFFFFFF`` and the metadata length), a flatbuffer
``Message`` (its kind, the record batch's row count, ``bodyLength``) and the body. The *file* format is
the magic ``ARROW1\\0\\0``, the same stream, a footer and ``ARROW1``. :func:`scan` hops from header to header:
it reads each message's prefix and metadata (a few hundred bytes) and seeks over its body, so planning a
file's chunks reads a small fraction of it, never the data twice. The few flatbuffer fields needed are
read by hand (:class:`_Table`): pyarrow reads a message only together with its body.

A message that runs past the end of the file, a stream that ends without its end-of-stream marker (every
writer writes it; a file cut at a message boundary would otherwise read as a shorter one), metadata that
is not a flatbuffer ``Message``, or a file whose closing magic is missing is damage
(:class:`~pipelines.errors.DamagedFile`); dictionary batches are refused (:class:`~pipelines.errors.BuildError`):
a chunk's batches would need every dictionary before them, which no writer of text corpora produces.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Callable

import pyarrow as pa
import pyarrow.ipc as ipc

from pipelines.errors import BuildError, DamagedFile

FILE_MAGIC = b"ARROW1"
FILE_HEAD = FILE_MAGIC + b"\0\0"  # the file format's first 8 bytes (magic padded to 8)
CONTINUATION = b"\xff\xff\xff\xff"
HEAD_READ = 4096  # bytes read at each message: its prefix and, nearly always, its whole metadata
MAX_METADATA = 64 << 20  # a longer message header is not an Arrow header
# Message.header_type values (Message.fbs)
SCHEMA, DICTIONARY_BATCH, RECORD_BATCH = 1, 2, 3

Read = Callable[[int, int], bytes]  # (offset, length) -> the bytes there (fewer only at the end of the file)


class _Table:
    """A flatbuffer table: its scalar and table fields by index (only what a Message header needs)."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        (soff,) = struct.unpack_from("<i", buf, pos)
        self.vt = pos - soff
        self.vt_size = struct.unpack_from("<H", buf, self.vt)[0]

    def _field(self, i: int) -> int:
        slot = 4 + 2 * i
        if slot >= self.vt_size:
            return 0
        return struct.unpack_from("<H", self.buf, self.vt + slot)[0]

    def scalar(self, i: int, fmt: str, default: int = 0) -> int:
        off = self._field(i)
        return struct.unpack_from("<" + fmt, self.buf, self.pos + off)[0] if off else default

    def table(self, i: int) -> "_Table | None":
        off = self._field(i)
        if not off:
            return None
        at = self.pos + off
        return _Table(self.buf, at + struct.unpack_from("<I", self.buf, at)[0])


def parse_message(meta: bytes) -> tuple[int, int, int]:
    """``(header_type, body_length, rows)`` of a flatbuffer ``Message`` (rows: a record batch's, else 0).

    Raises ValueError (or struct.error) on bytes that are not one.
    """
    if len(meta) < 8:
        raise ValueError("message metadata shorter than a flatbuffer")
    root = _Table(meta, struct.unpack_from("<I", meta, 0)[0])
    kind = root.scalar(1, "B")
    body = root.scalar(3, "q")
    if kind not in (SCHEMA, DICTIONARY_BATCH, RECORD_BATCH, 4, 5) or body < 0:
        raise ValueError(f"not an Arrow message header (type {kind}, body length {body})")
    rows = 0
    if kind == RECORD_BATCH:
        header = root.table(2)
        rows = header.scalar(0, "q") if header is not None else 0
        if rows < 0:
            raise ValueError(f"a record batch of {rows} rows")
    return kind, body, rows


@dataclasses.dataclass(frozen=True)
class Batch:
    """One record batch message: ``[offset, offset + length)`` holds its prefix, metadata and body."""

    offset: int
    length: int
    rows: int


@dataclasses.dataclass(frozen=True)
class IpcLayout:
    """What :func:`scan` found: the schema message's byte range and every record batch, in file order."""

    file_format: bool  # the file format (ARROW1 magic and footer), else the stream format
    schema_range: tuple[int, int]  # (offset, length) of the schema message
    batches: tuple[Batch, ...]


def scan(path: str, read: Read, size: int) -> IpcLayout:
    """The messages of the Arrow IPC file at ``path`` (``size`` bytes), read through ``read``.

    Raises DamagedFile for a truncated or garbled file, BuildError for what is valid but unsupported
    (dictionary batches, tensors, the pre-1.0 message prefix).
    """
    head = read(0, min(size, HEAD_READ))
    file_format = head.startswith(FILE_HEAD)
    end = size
    if file_format:  # the stream ends where the footer starts: [footer][int32 footer length]["ARROW1"]
        tail = read(size - 10, 10) if size >= 18 else b""
        if tail[4:] != FILE_MAGIC:
            raise DamagedFile(path, f"at byte {size}", "an Arrow file without its closing ARROW1 magic (truncated?)")
        end = size - 10 - struct.unpack_from("<i", tail)[0]
        if not len(FILE_HEAD) <= end <= size - 10:
            raise DamagedFile(path, f"at byte {size - 10}", "an Arrow file footer length out of range")
    pos = len(FILE_HEAD) if file_format else 0
    schema_range = None
    batches = []
    while True:
        if pos + 8 > end:  # every writer ends a stream with the marker: without it, the end may be lost
            what = "without its end-of-stream marker" if pos == end else "inside a message header"
            raise DamagedFile(path, f"at byte {pos}", f"the Arrow stream ends {what} (truncated?)")
        block = head[pos:pos + HEAD_READ] if pos + 8 <= len(head) else read(pos, HEAD_READ)
        if block[:4] != CONTINUATION:
            if schema_range is None and block[:4] != b"\0\0\0\0":
                raise BuildError(f"input file {path}: an Arrow stream written by pre-1.0 Arrow (no continuation "
                                 "marker); rewrite it with a current pyarrow (pyarrow.ipc.new_stream)")
            raise DamagedFile(path, f"at byte {pos}", "bytes that are not an Arrow message")
        (meta_len,) = struct.unpack_from("<i", block, 4)
        if meta_len == 0:  # end-of-stream marker
            break
        if not 8 <= meta_len <= MAX_METADATA or pos + 8 + meta_len > end:
            raise DamagedFile(path, f"at byte {pos}",
                              f"an Arrow message header of {meta_len} bytes runs past the end of the file (truncated?)"
                              if meta_len > 0 else "a negative Arrow message length")
        meta = block[8:8 + meta_len]
        if len(meta) < meta_len:
            meta = read(pos + 8, meta_len)
        try:
            kind, body, rows = parse_message(meta)
        except (ValueError, struct.error) as e:
            raise DamagedFile(path, f"at byte {pos}", f"a damaged Arrow message header ({e})") from e
        length = 8 + meta_len + body
        if pos + length > end:
            raise DamagedFile(path, f"at byte {pos}", f"an Arrow message of {length} bytes runs past the end of "
                                                     f"the file ({size} bytes; truncated?)")
        if schema_range is None:
            if kind != SCHEMA:
                raise DamagedFile(path, f"at byte {pos}", "an Arrow stream that does not start with its schema")
            schema_range = (pos, length)
        elif kind == RECORD_BATCH:
            batches.append(Batch(pos, length, rows))
        elif kind == DICTIONARY_BATCH:
            raise BuildError(f"input file {path} holds dictionary-encoded columns (an Arrow dictionary batch at "
                             f"byte {pos}); rewrite it with plain columns (table.cast to string types)")
        else:
            raise BuildError(f"input file {path}: an Arrow message of type {kind} (tensor) at byte {pos}; "
                             "only record batches can be read")
        pos += length
    return IpcLayout(file_format=file_format, schema_range=schema_range, batches=tuple(batches))


def read_schema(message: bytes) -> pa.Schema:
    """The schema from its message's bytes (prefix included)."""
    return ipc.read_schema(ipc.read_message(pa.py_buffer(message)))


def read_batch(message: bytes, schema: pa.Schema) -> pa.RecordBatch:
    """One record batch from its message's bytes (prefix, metadata and body)."""
    return ipc.read_record_batch(ipc.read_message(pa.py_buffer(message)), schema)
