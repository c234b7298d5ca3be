"""Parquet and Arrow IPC inputs: chunks planned from the footer or the message headers, read by byte ranges.

A *group* is a Parquet row group or an Arrow record batch. :func:`plan` reads only a Parquet file's footer
(or an Arrow file's message headers, :mod:`pipelines.inputs.arrow_ipc`) and cuts the groups into chunks:
runs of whole groups holding about ``chunk_bytes`` (:func:`plan_chunks`). A group's size is what a worker
decodes of it: the uncompressed bytes of the columns read (the text and the kept fields) of a Parquet row
group, the whole message of an Arrow record batch. A group above ``max_group_bytes`` is refused there,
before the build, with the fix (smaller row groups).

:class:`ChunkReader` reads one chunk, one group at a time (memory: one group's stored bytes, never the file):
of a Parquet row group only the column chunks of the columns read, each one range read through fsspec (local
paths and ``gs://`` alike) and handed to pyarrow, which reads nothing else; an Arrow record batch as its one
message. A Parquet file's footer is parsed once per worker process (a cache bounded in memory), not per chunk.

Decoding is bounded by what is decoded, never by what a footer or a page header claims. Before a row group
is decoded, its pages' headers are read from the stored bytes: a flat column's pages must hold exactly the
footer's rows (a nested one's at least one value per row), and the largest page bounds any one value. The
group is then decoded a batch of rows at a time (as many as that bound fits in :data:`BATCH_BYTES`), the
decoded bytes counted as they come out against the group limit (a dictionary-encoded value repeated over
many rows decodes far larger than it is stored), and afterwards every nested column's values against its
pages'.
It yields a :class:`Record` per row (provenance: the row number in the file) and computes the chunk's
``input_checksum`` from the bytes it read (docs/FORMAT.md defines it): a sha256 of the stored
bytes, so it is the same with every pyarrow version and costs one pass over compressed bytes.
:func:`chunk_checksum` computes it without decoding (a rerun checks a kept chunk's input with it).

Damage (a truncated file, a bad footer, a page that does not decode) is a
:class:`~pipelines.errors.DamagedFile` naming the file and the group; a file changed since it was planned
is a BuildError. Neither ever yields fewer rows.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import struct
import threading
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reader.storage.files import RangeFile
from reader.storage.pages import page_headers

from pipelines.errors import BuildError, DamagedFile
from pipelines.inputs import arrow_ipc, keys
from pipelines.inputs.ranges import ByteSource
from pipelines.inputs.keys import RecordShape
from pipelines.inputs.rows import Record, binary_view, dead_letter, records, supervised_records  # noqa: F401

# A worker decodes one group at a time, at a peak of 3.5 to 5 times its size (benchmarks/columnar_memory.py:
# 220 to 340 MB above the imports for 64 MB row groups); larger groups are refused (see plan).
MAX_GROUP_BYTES = 256 << 20
BATCH_BYTES = 64 << 20  # a row group is decoded in batches of rows whose values can hold at most this
MAX_BATCH_ROWS = 1 << 16
MIN_ROW_BYTES = 4  # every row of every column read decodes to at least its 4-byte offset (or value)
FOOTER_CACHE_BYTES = 256 << 20  # parsed footers kept per worker process (about 5 times their stored size)
FOOTER_READ = 64 << 10  # the first read of a Parquet tail (the footer usually fits)
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


def groups_digest(rows: Sequence[int], sizes: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([list(rows), list(sizes)]).encode()).hexdigest()[:32]


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


def _resolve(path: str, schema: pa.Schema, shape: RecordShape, keep_fields: Sequence[str]) -> list[list[str]]:
    """The name paths of the record's columns (the text, or a supervised record's) and the kept fields, each
    checked (BuildError naming the fix)."""
    out = []
    for key, option, kind in list(shape.keys) + [(f, "--keep_fields", None) for f in keep_fields]:
        found = keys.schema_lookup(schema, key)
        if found is None:
            raise BuildError(keys.missing_column_message(path, key, schema, option))
        names, typ = found
        if kind is str and not keys.is_text_type(typ):
            raise BuildError(f"input file {path}: column {key!r} is {typ}, not text; {option} must name a string "
                             "column")
        if kind is list and not keys.is_messages_type(typ):
            raise BuildError(f"input file {path}: column {key!r} is {typ}; {option} must name a list of messages, "
                             "list<struct<role: string, content: string, ...>>")
        if option == "--keep_fields" and not keys.is_keepable_type(typ):
            raise BuildError(f"input file {path}: column {key!r} is {typ}; --keep_fields keeps string and integer "
                             "columns only")
        out.append(names)
    return out


def _column_span(col) -> tuple[int, int]:
    """``(first byte, length)`` of a column chunk as stored (its dictionary page, if any, comes first)."""
    start = col.data_page_offset
    if col.has_dictionary_page and col.dictionary_page_offset is not None and 0 < col.dictionary_page_offset < start:
        start = col.dictionary_page_offset
    return start, col.total_compressed_size


@dataclasses.dataclass
class _Footer:
    """A Parquet file's footer, parsed, and what a build reads of it (kept per worker: :func:`_footer`)."""

    meta: Any  # pyarrow FileMetaData
    schema: pa.Schema
    names: list[list[str]]
    leaves: list[int]  # the leaf columns read, in file order
    nested: list[bool]  # per leaf read: repeated (a list's values), so its pages hold a value per list item
    columns: list[str]
    group_rows: tuple[int, ...]
    group_bytes: tuple[int, ...]
    digest: str
    footer_bytes: int
    cost: int  # bytes of memory it is reckoned to take


_FOOTERS: collections.OrderedDict[tuple, _Footer] = collections.OrderedDict()
_FOOTERS_LOCK = threading.Lock()
footer_parses = 0  # footers parsed by this process (tests count them)


def _footer(src: ByteSource, shape: RecordShape, keep_fields: Sequence[str], footer_bytes: int | None) -> _Footer:
    """The footer of ``src``, parsed once per process while the file is unchanged (its metadata fingerprint is
    in the key) and kept in a cache of at most :data:`FOOTER_CACHE_BYTES` (the last one always).
    ``footer_bytes``: its planned length (read in one request; another length is a changed file)."""
    key = (src.path, src.stamp, shape, tuple(keep_fields))
    with _FOOTERS_LOCK:
        got = _FOOTERS.get(key)
        if got is not None:
            _FOOTERS.move_to_end(key)
    if got is None:
        got = _parse_footer(src, shape, keep_fields, footer_bytes)
        with _FOOTERS_LOCK:
            _FOOTERS[key] = got
            while len(_FOOTERS) > 1 and sum(f.cost for f in _FOOTERS.values()) > FOOTER_CACHE_BYTES:
                _FOOTERS.popitem(last=False)
    if footer_bytes and got.footer_bytes != footer_bytes:
        raise BuildError(f"input file {src.path} changed during the build (its footer differs from the plan); "
                         "inputs must not change while a cache is built")
    return got


def _parse_footer(src: ByteSource, shape: RecordShape, keep_fields: Sequence[str],
                  footer_bytes: int | None) -> _Footer:
    global footer_parses
    path = src.path
    if src.size < 12:
        raise DamagedFile(path, f"{src.size} bytes", "too short for a Parquet file")
    # planned: the footer is read in one request of its known length
    want = min(src.size, footer_bytes or FOOTER_READ)
    tail = src.read(src.size - want, want)
    if tail[-4:] != b"PAR1":
        raise DamagedFile(path, "at its last 4 bytes", "no closing PAR1 magic: truncated, or not Parquet")
    (n,) = struct.unpack_from("<I", tail, len(tail) - 8)
    if n + 12 > src.size:
        raise DamagedFile(path, "at its footer", f"a footer length of {n} bytes in a {src.size}-byte file")
    if n + 8 > len(tail):  # a large footer: read the rest of it
        tail = src.read(src.size - n - 8, n + 8 - len(tail)) + tail
    try:
        meta = pq.read_metadata(pa.BufferReader(tail[len(tail) - n - 8:]))
        schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        raise DamagedFile(path, "at its footer", f"an unreadable Parquet footer ({e})") from e
    footer_parses += 1
    names = _resolve(path, schema, shape, keep_fields)
    dotted = [".".join(x) for x in names]
    paths = [meta.schema.column(i).path for i in range(meta.num_columns)]
    # distinct leaf columns read, in file order (a list of messages has several: role, content, ...)
    leaves = [i for i, p in enumerate(paths) if any(p == d or p.startswith(d + ".") for d in dotted)]
    end = src.size - n - 8  # where the footer starts: every column chunk lies before it
    rows, sizes = [], []
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        rows.append(rg.num_rows)
        total = 0
        for i in leaves:
            col = rg.column(i)
            start, length = _column_span(col)
            if start < 4 or length < 0 or start + length > end:
                raise DamagedFile(path, f"row group {g}, column {paths[i]!r}",
                                  f"its column chunk [{start}, {start + length}) lies outside the file's data "
                                  f"[4, {end})")
            total += col.total_uncompressed_size
        sizes.append(total)
    group_rows, group_bytes = tuple(rows), tuple(sizes)
    return _Footer(meta=meta, schema=schema, names=names, leaves=leaves,
                   nested=[meta.schema.column(i).max_repetition_level > 0 for i in leaves],
                   columns=sorted(set(dotted), key=dotted.index), group_rows=group_rows, group_bytes=group_bytes,
                   digest=groups_digest(group_rows, group_bytes), footer_bytes=n + 8,
                   cost=5 * (n + 8) + 100 * len(group_rows))


def _page_values(path: str, g: int, column: str, data: bytes) -> tuple[int, int]:
    """``(values, largest page)`` of one stored column chunk, from its pages' headers: the values its data
    pages hold, and the largest uncompressed page (data or dictionary: no value decodes larger)."""
    values = largest = 0
    try:
        for h, _ in page_headers(data):
            largest = max(largest, h[2])
            kind = h.get(1)
            if kind in (0, 3):  # a data page (v1, v2): its header's first field is its number of values
                header = h.get(5 if kind == 0 else 8)
                n = header.get(1) if isinstance(header, dict) else None
                if not isinstance(n, int) or n < 0:
                    raise ValueError("a data page without its number of values")
                values += n
    except ValueError as e:
        raise DamagedFile(path, f"row group {g}, column {column!r}", str(e)) from None
    return values, largest


def _levels(arr: pa.Array) -> list[np.ndarray]:
    """Per leaf of ``arr``'s type (depth first, the order of its Parquet columns), how many values each element
    of ``arr`` has in that column's pages: one per list item, and one for a null or an empty list."""
    t = arr.type
    if pa.types.is_struct(t):
        valid = np.asarray(arr.is_valid()) if arr.null_count else None
        out = []
        for i in range(t.num_fields):
            for counts in _levels(arr.field(i)):
                if valid is not None:
                    counts = np.where(valid, counts, 1)
                out.append(counts)
        return out
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        offsets = np.asarray(arr.offsets, dtype=np.int64)
        lengths = np.diff(offsets)
        empty = lengths == 0
        if arr.null_count:
            empty |= ~np.asarray(arr.is_valid())
        out = []
        for counts in _levels(arr.values):
            cum = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
            out.append(np.where(empty, 1, cum[offsets[1:]] - cum[offsets[:-1]]))
        return out
    return [np.ones(len(arr), np.int64)]


class _Parquet:
    """A Parquet file's footer (parsed once per process) and the column chunks of the columns read."""

    def __init__(self, src: ByteSource, shape: RecordShape, keep_fields: Sequence[str], layout=None,
                 max_group_bytes: int = MAX_GROUP_BYTES):
        self.src, self.path, self.max_group_bytes = src, src.path, max_group_bytes
        f = _footer(src, shape, keep_fields, layout.footer_bytes if layout is not None else None)
        self.meta, self.schema, self.names, self.leaves, self.nested = f.meta, f.schema, f.names, f.leaves, f.nested
        self.columns, self.footer_bytes, self.digest = f.columns, f.footer_bytes, f.digest
        self.group_rows, self.group_bytes = f.group_rows, f.group_bytes
        self._file = RangeFile(src.size, name=self.path)
        self._pf = None

    def descriptor(self) -> bytes:
        """What the checksum covers of the footer: the columns read, by their Parquet type names."""
        cols = []
        for i in self.leaves:
            c = self.meta.schema.column(i)
            cols.append([c.path, c.physical_type, c.logical_type.type, c.converted_type, c.max_definition_level,
                         c.max_repetition_level])
        return json.dumps(cols, separators=(",", ":")).encode() + b"\n"

    def raw(self, g: int, hasher) -> list[tuple[int, bytes]]:
        """The stored bytes of group ``g``'s column chunks read, each fed to ``hasher`` with its length."""
        rg = self.meta.row_group(g)
        hasher.update(b"%d\n" % rg.num_rows)
        out = []
        for i in self.leaves:
            start, length = _column_span(rg.column(i))
            data = self.src.read(start, length) if 0 <= start and start + length <= self.src.size else b""
            if len(data) != length:
                raise DamagedFile(self.path, f"row group {g}, column {self.meta.schema.column(i).path!r}",
                                  f"its column chunk [{start}, {start + length}) lies past the end of the file")
            hasher.update(b"%d\n" % length)
            hasher.update(data)
            out.append((start, data))
        return out

    def arrays(self, g: int, hasher) -> Iterator[list[pa.Array]]:
        """Group ``g``'s columns read, a batch of rows at a time (see the module doc)."""
        chunks = self.raw(g, hasher)
        rows = self.group_rows[g]
        values, largest = [], 1
        for (_, data), i, nested in zip(chunks, self.leaves, self.nested):
            column = self.meta.schema.column(i).path
            n, big = _page_values(self.path, g, column, data)
            if n != rows if not nested else n < rows:
                raise DamagedFile(self.path, f"row group {g}, column {column!r}",
                                  f"its pages hold {n} values, the footer says {rows} rows")
            values.append(n)
            largest = max(largest, big * -(-n // max(rows, 1)))  # a row's values: a page's worth per level
        batch_rows = max(1, min(MAX_BATCH_ROWS, BATCH_BYTES // largest))
        self._file.ranges = chunks
        decoded = got = 0
        levels = [0] * len(values)
        try:
            if self._pf is None:
                self._pf = pq.ParquetFile(self._file, metadata=self.meta, pre_buffer=False,
                                          page_checksum_verification=True)
            for batch in self._pf.iter_batches(batch_size=batch_rows, row_groups=[g], columns=self.columns,
                                               use_threads=False):
                got += batch.num_rows
                decoded += batch.nbytes
                if decoded > self.max_group_bytes:
                    raise BuildError(
                        f"input file {self.path}: row group {g} decodes to more than {_size(self.max_group_bytes)} "
                        f"(its first {got} of {rows} rows already; its pages hold {_size(self.group_bytes[g])}: "
                        "values repeated through a dictionary decode far larger), above what a worker decodes at "
                        "once. Rewrite the file with smaller row groups (pyarrow.parquet.write_table(table, path, "
                        "row_group_size=ROWS))")
                if any(self.nested):
                    found = [c for col in batch.columns for c in _levels(col)]
                    levels = [a + int(c.sum()) for a, c in zip(levels, found)]
                yield [_leaf(batch.column(n[0]), n[1:]) for n in self.names]
        except (OSError, pa.ArrowException) as e:
            raise DamagedFile(self.path, f"row group {g}", f"its pages do not decode ({e})") from e
        finally:
            self._file.ranges = []
        if got != rows:
            raise DamagedFile(self.path, f"row group {g}", f"{got} rows decoded, the footer says {rows}")
        for i, nested, want, have in zip(self.leaves, self.nested, values, levels):
            if nested and have != want:
                raise DamagedFile(self.path, f"row group {g}, column {self.meta.schema.column(i).path!r}",
                                  f"its pages hold {want} values, its {rows} rows decode to {have}")


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
        self.names = _resolve(self.path, self.schema, shape, keep_fields)

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
            out = [_leaf(batch.column(self.schema.get_field_index(n[0])), n[1:]) for n in self.names]
            for a in out:  # offsets in bounds (Arrow data carries no checksum); UTF-8 is checked per value
                binary_view(a).validate(full=True)
        except (OSError, pa.ArrowException) as e:
            raise DamagedFile(self.path, where, f"it does not decode ({e})") from e
        return out


def _leaf(arr: pa.Array, names: Sequence[str]) -> pa.Array:
    """The child ``names`` of a struct array, a null parent making the child null."""
    for name in names:
        arr = arr.flatten()[arr.type.get_field_index(name)]
    return arr


def _open(src: ByteSource, fmt: str, shape: RecordShape, keep_fields: Sequence[str], chunk=None,
          max_group_bytes: int = MAX_GROUP_BYTES):
    if fmt == PARQUET:
        return _Parquet(src, shape, keep_fields, chunk, max_group_bytes)
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
                    f"input file {path}: {what} {g} holds {_size(n)} to decode ({rows} rows), above the "
                    f"{_size(max_group_bytes)} a worker decodes at once. Rewrite the file with smaller {whats} "
                    f"({fix}); a few tens of MiB each reads well")
        return ColumnarLayout(path=path, format=fmt, size=src.size, group_rows=f.group_rows,
                              group_bytes=f.group_bytes, chunks=plan_chunks(f.group_bytes, chunk_bytes),
                              group_offsets=getattr(f, "offsets", ()), schema_range=getattr(f, "schema_range", None),
                              footer_bytes=getattr(f, "footer_bytes", 0))


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


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
