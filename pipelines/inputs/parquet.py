"""A Parquet input's row groups, read as a build's worker reads them (:mod:`pipelines.inputs.columnar` plans
and reads the chunks; this module is the Parquet side of it).

The footer is parsed once per worker process (:func:`footer`: a cache bounded in memory, keyed by the file's
metadata fingerprint), not per chunk. Of a row group only the column chunks of the columns read are read,
each one byte range, and handed to pyarrow, which reads nothing else.

Decoding is bounded by what is decoded, never by what a footer or a page header claims. Before a row group
is decoded, its pages' headers are read from the stored bytes: a flat column's pages must hold exactly the
footer's rows (a nested one's at least one value per row), and the largest page bounds any one value. The
group is then decoded a batch of rows at a time (as many as that bound fits in :data:`BATCH_BYTES`), the
decoded bytes counted as they come out against the group limit (a dictionary-encoded value repeated over
many rows decodes far larger than it is stored), and afterwards every nested column's values against its
pages'. Damage is a :class:`~pipelines.errors.DamagedFile` naming the file and where, never fewer rows.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import struct
import threading
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reader.format.parquet_pages import page_headers
from reader.storage.files import RangeFile

from pipelines.errors import BuildError, DamagedFile
from pipelines.inputs.keys import RecordShape, resolve_columns
from pipelines.inputs.ranges import ByteSource

# A worker decodes one group at a time, at a peak of 3.5 to 5 times its size (benchmarks/columnar_memory.py:
# 220 to 340 MB above the imports for 64 MB row groups); larger groups are refused (see columnar.plan).
MAX_GROUP_BYTES = 256 << 20
BATCH_BYTES = 64 << 20  # a row group is decoded in batches of rows whose values can hold at most this
MAX_BATCH_ROWS = 1 << 16
FOOTER_CACHE_BYTES = 256 << 20  # parsed footers kept per worker process (about 5 times their stored size)
FOOTER_READ = 64 << 10  # the first read of a Parquet tail (the footer usually fits)


def groups_digest(rows: Sequence[int], sizes: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([list(rows), list(sizes)]).encode()).hexdigest()[:32]



def size_text(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"



def leaf(arr: pa.Array, names: Sequence[str]) -> pa.Array:
    """The child ``names`` of a struct array, a null parent making the child null."""
    for name in names:
        arr = arr.flatten()[arr.type.get_field_index(name)]
    return arr



def column_span(col) -> tuple[int, int]:
    """``(first byte, length)`` of a column chunk as stored (its dictionary page, if any, comes first)."""
    start = col.data_page_offset
    if col.has_dictionary_page and col.dictionary_page_offset is not None and 0 < col.dictionary_page_offset < start:
        start = col.dictionary_page_offset
    return start, col.total_compressed_size


@dataclasses.dataclass
class Footer:
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


_FOOTERS: collections.OrderedDict[tuple, Footer] = collections.OrderedDict()
_FOOTERS_LOCK = threading.Lock()
footer_parses = 0  # footers parsed by this process (tests count them)


def footer(src: ByteSource, shape: RecordShape, keep_fields: Sequence[str], footer_bytes: int | None) -> Footer:
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
                  footer_bytes: int | None) -> Footer:
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
    names = resolve_columns(path, schema, shape, keep_fields)
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
            start, length = column_span(col)
            if start < 4 or length < 0 or start + length > end:
                raise DamagedFile(path, f"row group {g}, column {paths[i]!r}",
                                  f"its column chunk [{start}, {start + length}) lies outside the file's data "
                                  f"[4, {end})")
            total += col.total_uncompressed_size
        sizes.append(total)
    group_rows, group_bytes = tuple(rows), tuple(sizes)
    return Footer(meta=meta, schema=schema, names=names, leaves=leaves,
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


class ParquetInput:
    """A Parquet file's footer (parsed once per process) and the column chunks of the columns read."""

    def __init__(self, src: ByteSource, shape: RecordShape, keep_fields: Sequence[str], layout=None,
                 max_group_bytes: int = MAX_GROUP_BYTES):
        self.src, self.path, self.max_group_bytes = src, src.path, max_group_bytes
        f = footer(src, shape, keep_fields, layout.footer_bytes if layout is not None else None)
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
            start, length = column_span(rg.column(i))
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
                        f"input file {self.path}: row group {g} decodes to more than {size_text(self.max_group_bytes)} "
                        f"(its first {got} of {rows} rows already; its pages hold {size_text(self.group_bytes[g])}: "
                        "values repeated through a dictionary decode far larger), above what a worker decodes at "
                        "once. Rewrite the file with smaller row groups (pyarrow.parquet.write_table(table, path, "
                        "row_group_size=ROWS))")
                if any(self.nested):
                    found = [c for col in batch.columns for c in _levels(col)]
                    levels = [a + int(c.sum()) for a, c in zip(levels, found)]
                yield [leaf(batch.column(n[0]), n[1:]) for n in self.names]
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
