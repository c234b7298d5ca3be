"""Parquet and Arrow IPC inputs: chunks planned from the footer or the message headers, read by byte ranges.

A *group* is a Parquet row group or an Arrow record batch. :func:`plan` reads only a Parquet file's footer
(or an Arrow file's message headers, :mod:`pipelines.inputs.arrow_ipc`) and cuts the groups into chunks:
runs of whole groups holding about ``chunk_bytes`` (:func:`plan_chunks`). A group's size is what a worker
decodes of it: the uncompressed bytes of the columns read (the text and the kept fields) of a Parquet row
group, the whole message of an Arrow record batch, and at least 4 bytes per row and column (a count of rows
a footer claims is a size too). A group above ``max_group_bytes`` is refused there, before the build, with
the fix (smaller row groups).

:class:`ChunkReader` reads one chunk, one group at a time (memory: one group's stored bytes, never the file):
a Parquet row group as :mod:`pipelines.inputs.parquet` reads it (the footer parsed once per worker, only the
column chunks read, decoding bounded by what is decoded), an Arrow record batch as its one message. It
yields a :class:`Record` per row (provenance: the row number in the file) and computes the chunk's
``input_checksum`` from the bytes it read (docs/FORMAT.md defines it): a sha256 of the stored
bytes, so it is the same with every pyarrow version and costs one pass over compressed bytes.
:func:`chunk_checksum` computes it without decoding (a rerun checks a kept chunk's input with it).

Damage (a truncated file, a bad footer, a page that does not decode) is a
:class:`~pipelines.errors.DamagedFile` naming the file and the group; a file changed since it was planned
is a BuildError. Neither ever yields fewer rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
from typing import Any, Iterator, Sequence

import pyarrow as pa

from pipelines.errors import BuildError, DamagedFile
from pipelines.inputs import arrow_ipc, keys
from pipelines.inputs.keys import RecordShape, resolve_columns
from pipelines.inputs.parquet import MAX_GROUP_BYTES, ParquetInput, groups_digest, leaf, size_text
from pipelines.inputs.ranges import ByteSource
from pipelines.inputs.rows import Record, binary_view, records, supervised_records

MIN_ROW_BYTES = 4  # every row of every column read decodes to at least its 4-byte offset (or value)
CHECKSUM_TAG = b"chunkledger-columnar-1\n"
PARQUET, ARROW = "parquet", "arrow"


@dataclasses.dataclass(frozen=True)
class ColumnarLayout:
    """A columnar input as planned: its groups and chunks (pure data: it travels with the work units)."""

    path: str
    format: str  # PARQUET or ARROW
    size: int
    group_rows: tuple[int, ...]
    group_bytes: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]  # chunk k = groups [g0, g1)
    group_offsets: tuple[int, ...] = ()  # Arrow: each record batch message's byte offset
    schema_range: tuple[int, int] | None = None  # Arrow: the schema message's (offset, length)
    footer_bytes: int = 0  # Parquet: the footer, its length and the closing magic

    @property
    def rows(self) -> int:
        return self._row_starts[-1]

    @functools.cached_property
    def _row_starts(self) -> tuple[int, ...]:
        """The first row of each group, and the file's rows (so a chunk's rows cost no sum over the file)."""
        return (0, *itertools.accumulate(self.group_rows))

    def row_range(self, k: int) -> tuple[int, int]:
        g0, g1 = self.chunks[k]
        return self._row_starts[g0], self._row_starts[g1]

    @functools.cached_property
    def groups_digest(self) -> str:
        return groups_digest(self.group_rows, self.group_bytes)

    def chunk(self, k: int) -> "ColumnarChunk":
        """What a worker needs to read chunk ``k``: its groups alone (a work unit carries it)."""
        g0, g1 = self.chunks[k]
        return ColumnarChunk(path=self.path, format=self.format, size=self.size, index=k, first_group=g0,
                             first_row=self.row_range(k)[0], group_rows=self.group_rows[g0:g1],
                             group_bytes=self.group_bytes[g0:g1], group_offsets=self.group_offsets[g0:g1],
                             schema_range=self.schema_range, footer_bytes=self.footer_bytes,
                             groups_digest=self.groups_digest, file_rows=self.rows)


@dataclasses.dataclass(frozen=True)
class ColumnarChunk:
    """Chunk ``index`` of a planned columnar input, as a work unit carries it: its groups only (so units stay
    small however many groups the file has), and a digest of the file's groups, which a Parquet read checks
    against the footer (a file changed since it was planned is an error)."""

    path: str
    format: str
    size: int
    index: int
    first_group: int
    first_row: int
    group_rows: tuple[int, ...]
    group_bytes: tuple[int, ...]
    group_offsets: tuple[int, ...] = ()
    schema_range: tuple[int, int] | None = None
    footer_bytes: int = 0
    groups_digest: str = ""
    file_rows: int = 0  # the whole file's rows (its chunks' share of the file, for progress)

    @property
    def span(self) -> list[int]:
        """``[g0, g1)``, its groups: the sidecar's ``input_span``."""
        return [self.first_group, self.first_group + len(self.group_rows)]

    @property
    def row_range(self) -> list[int]:
        """``[r0, r1)``, the rows of its groups: the sidecar's ``row_range``."""
        return [self.first_row, self.first_row + sum(self.group_rows)]


def plan_chunks(group_bytes: Sequence[int], chunk_bytes: int) -> tuple[tuple[int, int], ...]:
    """Groups ``[g0, g1)`` of each chunk: whole groups are added until the chunk holds at least
    ``chunk_bytes`` (the last chunk may hold less). No groups, no chunks."""
    chunks, start, held = [], 0, 0
    for g, n in enumerate(group_bytes):
        held += n
        if held >= chunk_bytes:
            chunks.append((start, g + 1))
            start, held = g + 1, 0
    if start < len(group_bytes):
        chunks.append((start, len(group_bytes)))
    return tuple(chunks)


def _shape(text_key: str, shape: RecordShape | None) -> RecordShape:
    return shape if shape is not None else RecordShape(keys.TEXT, ((text_key, "--text_key", str),))


class _Arrow:
    """An Arrow IPC file's schema and record batch messages (located by :func:`arrow_ipc.scan` when planned)."""

    def __init__(self, src: ByteSource, shape: RecordShape, keep_fields: Sequence[str],
                 chunk: ColumnarChunk | None = None):
        self.src, self.path = src, src.path
        if chunk is None:  # planning: every batch, from the message headers
            ipc = arrow_ipc.scan(self.path, src.read, src.size)
            self.schema_range, self.base = ipc.schema_range, 0
            self.offsets = tuple(b.offset for b in ipc.batches)
            self.group_rows = tuple(b.rows for b in ipc.batches)
            self.group_bytes = tuple(b.length for b in ipc.batches)
        else:  # reading: the chunk's batches, as planned (a stream is never scanned twice)
            self.schema_range, self.offsets, self.base = chunk.schema_range, chunk.group_offsets, chunk.first_group
            self.group_rows, self.group_bytes = chunk.group_rows, chunk.group_bytes
        self.schema_message = src.read(*self.schema_range)
        try:
            self.schema = arrow_ipc.read_schema(self.schema_message)
        except (OSError, pa.ArrowException) as e:
            raise DamagedFile(self.path, f"at byte {self.schema_range[0]}", f"an unreadable Arrow schema ({e})") from e
        self.names = resolve_columns(self.path, self.schema, shape, keep_fields)

    def descriptor(self) -> bytes:
        return self.schema_message

    def raw(self, g: int, hasher) -> bytes:
        """Record batch ``g``'s message as stored, fed to ``hasher``."""
        i = g - self.base
        data = self.src.read(self.offsets[i], self.group_bytes[i])
        if len(data) != self.group_bytes[i]:
            raise DamagedFile(self.path, f"record batch {g} at byte {self.offsets[i]}", "it lies past the end of "
                                                                                       "the file")
        hasher.update(data)
        return data

    def arrays(self, g: int, hasher) -> Iterator[list[pa.Array]]:
        """Record batch ``g``'s columns read (one list: a record batch is decoded whole, as stored)."""
        yield self._arrays(g, hasher)

    def _arrays(self, g: int, hasher) -> list[pa.Array]:
        i = g - self.base
        where = f"record batch {g} at byte {self.offsets[i]}"
        data = self.raw(g, hasher)
        try:
            batch = arrow_ipc.read_batch(data, self.schema)
            if batch.num_rows != self.group_rows[i]:
                raise DamagedFile(self.path, where, f"{batch.num_rows} rows, its header says {self.group_rows[i]}")
            out = [leaf(batch.column(self.schema.get_field_index(n[0])), n[1:]) for n in self.names]
            for a in out:  # offsets in bounds (Arrow data carries no checksum); UTF-8 is checked per value
                binary_view(a).validate(full=True)
        except (OSError, pa.ArrowException) as e:
            raise DamagedFile(self.path, where, f"it does not decode ({e})") from e
        return out


def _open(src: ByteSource, fmt: str, shape: RecordShape, keep_fields: Sequence[str], chunk=None,
          max_group_bytes: int = MAX_GROUP_BYTES):
    if fmt == PARQUET:
        return ParquetInput(src, shape, keep_fields, chunk, max_group_bytes)
    if fmt == ARROW:
        return _Arrow(src, shape, keep_fields, chunk)
    raise ValueError(f"not a columnar format: {fmt!r}")


def plan(path: str, fmt: str, *, text_key: str, keep_fields: Sequence[str] = (), chunk_bytes: int,
         max_group_bytes: int = MAX_GROUP_BYTES, storage_options: dict[str, Any] | None = None,
         source: ByteSource | None = None, shape: RecordShape | None = None) -> ColumnarLayout:
    """The layout of a Parquet (``fmt`` PARQUET) or Arrow IPC (ARROW) input, from its metadata alone.

    Raises BuildError for a missing or mistyped column or a group above ``max_group_bytes``, DamagedFile for
    damaged metadata. ``source`` (tests): an open :class:`ByteSource` of the file, to count what is read.
    ``shape``: the columns of a supervised record, instead of ``text_key``.
    """
    with contextlib.nullcontext(source) if source is not None else ByteSource(path, storage_options) as src:
        f = _open(src, fmt, _shape(text_key, shape), keep_fields)
        columns = len(getattr(f, "leaves", f.names))
        for g, (n, rows) in enumerate(zip(f.group_bytes, f.group_rows)):
            # every row of every column decodes to 4 bytes at least: a count of rows is a size too
            n = max(n, rows * MIN_ROW_BYTES * columns)
            if n > max_group_bytes:
                what, whats = ("row group", "row groups") if fmt == PARQUET else ("record batch", "record batches")
                fix = ("pyarrow.parquet.write_table(table, path, row_group_size=ROWS)" if fmt == PARQUET else
                       "datasets' writer_batch_size, or RecordBatchStreamWriter.write_table(table, max_chunksize=ROWS)")
                raise BuildError(
                    f"input file {path}: {what} {g} holds {size_text(n)} to decode ({rows} rows), above the "
                    f"{size_text(max_group_bytes)} a worker decodes at once. Rewrite the file with smaller {whats} "
                    f"({fix}); a few tens of MiB each reads well")
        return ColumnarLayout(path=path, format=fmt, size=src.size, group_rows=f.group_rows,
                              group_bytes=f.group_bytes, chunks=plan_chunks(f.group_bytes, chunk_bytes),
                              group_offsets=getattr(f, "offsets", ()), schema_range=getattr(f, "schema_range", None),
                              footer_bytes=getattr(f, "footer_bytes", 0))


class ChunkReader:
    """The records of one chunk of a planned columnar input, in row order; then its checksum.

    ``chunk`` is a :class:`ColumnarChunk`, or a :class:`ColumnarLayout` with the chunk's index ``k``.
    After iterating: :attr:`checksum` (``"sha256:<hex>"``, the sidecar's ``input_checksum``), :attr:`span`
    (``[g0, g1]``, its groups: the sidecar's ``input_span``) and :attr:`row_range`. ``source`` (tests) is an
    open :class:`ByteSource` of the file, to count what is read. With a supervised ``shape`` the records are
    :class:`~pipelines.inputs.rows.SupervisedRecord` values.
    """

    def __init__(self, chunk: ColumnarChunk | ColumnarLayout, k: int | None = None, *, text_key: str = "text",
                 keep_fields: Sequence[str] = (), storage_options: dict[str, Any] | None = None,
                 source: ByteSource | None = None, shape: RecordShape | None = None,
                 max_group_bytes: int = MAX_GROUP_BYTES):
        self.chunk = chunk if isinstance(chunk, ColumnarChunk) else chunk.chunk(k)
        self.max_group_bytes = max_group_bytes
        self.shape, self.keep_fields = _shape(text_key, shape), tuple(keep_fields)
        self.storage_options, self.source = storage_options, source
        self.span = self.chunk.span
        self.row_range = self.chunk.row_range
        self.checksum: str | None = None

    def _opened(self, src: ByteSource):
        c = self.chunk
        if src.size != c.size:
            raise BuildError(f"input file {c.path} changed during the build (planned size {c.size}, now "
                             f"{src.size}); inputs must not change while a cache is built")
        f = _open(src, c.format, self.shape, self.keep_fields, c, self.max_group_bytes)
        if c.format == PARQUET and f.digest != c.groups_digest:
            raise BuildError(f"input file {c.path} changed during the build (its row groups differ from the plan); "
                             "inputs must not change while a cache is built")
        h = hashlib.sha256(CHECKSUM_TAG)
        h.update(f.descriptor())
        return f, h

    def __iter__(self) -> Iterator[Record]:
        src = self.source or ByteSource(self.chunk.path, self.storage_options)
        try:
            f, h = self._opened(src)
            row = self.row_range[0]
            rows_of = records if self.shape.format == keys.TEXT else supervised_records
            for g in range(*self.span):
                for arrays in f.arrays(g, h):
                    yield from rows_of(arrays, row, len(self.shape.keys))
                    row += len(arrays[0])
                    del arrays
            self.checksum = "sha256:" + h.hexdigest()
        finally:
            if self.source is None:
                src.close()

    def input_checksum(self) -> str:
        """:attr:`checksum` computed from the stored bytes alone (nothing decoded): a rerun checks a kept chunk."""
        with ByteSource(self.chunk.path, self.storage_options) as src:
            f, h = self._opened(src)  # the same checks as a read
            for g in range(*self.span):
                f.raw(g, h)
        return "sha256:" + h.hexdigest()


def chunk_checksum(chunk: ColumnarChunk | ColumnarLayout, k: int | None = None, *, text_key: str = "text",
                   keep_fields: Sequence[str] = (), storage_options: dict[str, Any] | None = None,
                   shape: RecordShape | None = None) -> str:
    """:attr:`ChunkReader.checksum` of a chunk computed from the stored bytes alone (nothing decoded)."""
    return ChunkReader(chunk, k, text_key=text_key, keep_fields=keep_fields, storage_options=storage_options,
                       shape=shape).input_checksum()
