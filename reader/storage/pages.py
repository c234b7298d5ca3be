"""Decoding a verified row group's bytes: the Parquet page fast path, and pyarrow for anything else.

The pipeline writes the token column as PLAIN int32 data pages (zstd). Those pages are decompressed
with pyarrow's codec and their values taken as they are; documents are delimited by the num_tokens
column, so the list structure (repetition/definition levels) is skipped instead of being reassembled.
Anything else (dictionary pages, other encodings or codecs) makes :func:`fast_plain_values` return
None, and :func:`decode_row_group` falls back to pyarrow's reader. The caller verifies the bytes
against their sha256 before calling, and checks the decoded counts after.

A masked cache's ``loss_spans`` column (:func:`decode_loss_spans`) is a list column without a count
column beside it: its pages' repetition and definition levels (bit width 1) say where each document's
spans begin (:func:`fast_list_values`); :func:`loss_flags` turns the spans into a flag per token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reader.format import spec as fmt
from reader.format.parquet_pages import Thrift, page_headers
from reader.storage.files import RangeFile


def int_values(column, dtype=np.int32) -> np.ndarray:
    """A non-null integer Arrow (chunked) array as numpy, without ``to_numpy`` (which imports pandas)."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if arr.null_count:
        raise ValueError("unexpected nulls")
    width = np.dtype(dtype).itemsize
    if arr.type.bit_width != 8 * width:
        raise ValueError(f"expected {dtype}, got {arr.type}")
    if len(arr) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * width)


def decode_row_group(buf: bytes, *, base: int, group: int, file_meta: Any, file_size: int,
                     footer: tuple[int, bytes], docs: int, tokens: int, fast: bool = True):
    """Decode row group ``group`` from its bytes ``buf`` (file offset ``base``).

    Args:
      file_meta: the chunk's pyarrow ``FileMetaData``; file_size, footer: the file's size and its
        ``(offset, bytes)`` footer (pyarrow's fallback reader needs them).
      docs, tokens: what the sidecar says the row group holds (the fast path's expected counts).
      fast: False forces pyarrow's reader.

    Returns ``(padded, lengths)``: ``padded[0] == 0`` then the tokens, and the documents' lengths. Raises
    on undecodable bytes.
    """
    rgm = file_meta.row_group(group)
    if fast:
        lengths = fast_plain_values(buf, rgm.column(1), docs, base=base, column=fmt.LENGTH_COLUMN, levels=0)
        if lengths is not None:
            padded = fast_plain_values(buf, rgm.column(0), tokens, lead=1, base=base)
            if padded is not None:
                return padded, lengths
    f = RangeFile(file_size, [(base, buf), footer])
    pf = pq.ParquetFile(pa.PythonFile(f, mode="r"), metadata=file_meta)
    tab = pf.read_row_group(group, columns=[fmt.TOKEN_COLUMN, fmt.LENGTH_COLUMN], use_threads=False)
    values = int_values(tab.column(0).combine_chunks().flatten())
    lengths = int_values(tab.column(1))
    padded = np.empty(values.size + 1, np.int32)
    padded[0] = 0
    padded[1:] = values
    return padded, lengths


_LOSS_INDEX = fmt.MASKED_CHUNK_SCHEMA.get_field_index(fmt.LOSS_COLUMN)


def decode_loss_spans(buf: bytes, *, base: int, group: int, file_meta: Any, file_size: int,
                      footer: tuple[int, bytes], docs: int, fast: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Row group ``group``'s ``loss_spans`` (arguments as :func:`decode_row_group`): every document's span
    bounds concatenated (int32) and how many each document has. Raises on a chunk without the column."""
    rgm = file_meta.row_group(group)
    c = _LOSS_INDEX  # every other column has one leaf
    if rgm.num_columns <= c or rgm.column(c).path_in_schema != f"{fmt.LOSS_COLUMN}.list.element":
        raise ValueError(f"no {fmt.LOSS_COLUMN} column (the ledger's config.record_format says the cache has loss "
                         "masks)")
    sc = file_meta.schema.column(c)
    if fast and sc.max_repetition_level == 1 and sc.max_definition_level == 1:
        got = fast_list_values(buf, rgm.column(c), docs, base=base)
        if got is not None:
            return got
    f = RangeFile(file_size, [(base, buf), footer])
    pf = pq.ParquetFile(pa.PythonFile(f, mode="r"), metadata=file_meta)
    col = pf.read_row_group(group, columns=[fmt.LOSS_COLUMN], use_threads=False).column(0).combine_chunks()
    if col.null_count:
        raise ValueError(f"null {fmt.LOSS_COLUMN} lists")
    return int_values(col.flatten()), np.diff(int_values(col.offsets)).astype(np.int64)


_ALTERNATING = [np.zeros(0, bool)]


def _alternating(n: int) -> np.ndarray:
    """``[False, True, False, True, ...]`` of ``n`` entries (read-only, cached)."""
    a = _ALTERNATING[0]
    if a.size < n:
        a = np.zeros(max(n, 2 * a.size), bool)
        a[1::2] = True
        a.setflags(write=False)
        _ALTERNATING[0] = a
    return a[:n]


def loss_flags(values: np.ndarray, counts: np.ndarray, lengths: np.ndarray, *, strict: bool = False) -> np.ndarray:
    """A row group's loss flags from its documents' spans, laid out like ``RowGroup.padded``: bool
    ``[tokens + 1]``, ``flags[0] == False``, ``flags[1 + t]``: token ``t`` is a loss token.

    ``values``: the documents' span bounds concatenated, ``counts[k]`` of them for document ``k`` of
    ``lengths[k]`` tokens. Raises ValueError naming what is wrong when the spans do not make flags (an odd
    list, bounds out of order, a bound outside its document); ``strict`` (``validate``): also unless every
    document's spans are sorted, disjoint, non-empty ranges (docs/FORMAT.md). The reader reads
    bytes whose sha256 it checked, which the builder wrote so; it keeps to the checks that cost a few
    array operations (a few per cent of decoding a row group)."""
    docs = lengths.size
    if counts.size != docs or (counts & 1).any():
        raise ValueError(f"{fmt.LOSS_COLUMN}: a list of an odd length, or {counts.size} lists for {docs} documents")
    starts = np.empty(docs + 1, np.int64)
    starts[0] = 0
    np.cumsum(lengths, out=starts[1:])
    # the bounds as token offsets in the row group, after the flag of padded[0]
    edges = np.empty(values.size + 2, np.int64)
    edges[0], edges[-1] = -1, starts[-1]
    np.add(values, np.repeat(starts[:-1], counts), out=edges[1:-1])
    doc = np.repeat(np.arange(docs), counts)
    bad = (values < 0) | (edges[1:-1] > starts[doc + 1])  # a span past its document: always refused
    if strict:
        bad[1:] |= (edges[2:-1] <= edges[1:-2]) & (doc[1:] == doc[:-1])
    if bad.any():
        k = int(doc[np.argmax(bad)])
        if strict:
            raise ValueError(f"{fmt.LOSS_COLUMN} of document {k} of the row group are not sorted, disjoint, non-empty "
                             f"ranges within its {int(lengths[k])} tokens")
        raise ValueError(f"{fmt.LOSS_COLUMN} of document {k} of the row group reach past its {int(lengths[k])} tokens")
    try:  # runs between the bounds: off before s_0, on from s_k to e_k, off after
        flags = np.repeat(_alternating(values.size + 1), np.diff(edges))
    except ValueError:
        flags = None  # a bound before the one ahead of it
    if flags is None or flags.size != edges[-1] + 1:
        raise ValueError(f"{fmt.LOSS_COLUMN} out of order or past the end of their documents (python -m reader "
                         "validate names the document)")
    return flags


_CODECS = {"ZSTD": "zstd", "SNAPPY": "snappy", "GZIP": "gzip", "BROTLI": "brotli", "UNCOMPRESSED": None}


class _NotPlain(Exception):
    """A column chunk the fast path does not read (the caller falls back to pyarrow)."""


def _data_pages(data, col_meta, *, base: int, column: str, levels: int):
    """``(values, level blocks, entries)`` of every data page of a PLAIN int32 column chunk of ``column``:
    the page's values (bytes), its repetition and definition level blocks (``levels`` of them, RLE bytes
    without their length) and its level entries. Raises :class:`_NotPlain` for anything else."""
    path = str(col_meta.path_in_schema)
    if not (path == column or path.startswith(column + ".")):
        raise _NotPlain
    if col_meta.has_dictionary_page or col_meta.physical_type != "INT32":
        raise _NotPlain
    codec_name = str(col_meta.compression).upper()
    if codec_name not in _CODECS:
        raise _NotPlain
    codec = _CODECS[codec_name]
    start = col_meta.data_page_offset - base
    end = start + col_meta.total_compressed_size
    if start < 0 or end > len(data):
        raise _NotPlain
    view = memoryview(data)
    for h, pos in page_headers(data, start, end):
        ptype, usize, csize = h.get(1), h.get(2), h.get(3)
        body = view[pos:pos + csize]
        blocks = []
        if ptype == 0:  # DATA_PAGE (v1): levels and values compressed together
            dph = h.get(5) or {}
            if dph.get(2, 0) != 0 or (levels and (dph.get(3) != 3 or dph.get(4) != 3)):  # PLAIN values, RLE levels
                raise _NotPlain
            raw = pa.decompress(body, decompressed_size=usize, codec=codec) if codec else pa.py_buffer(body)
            raw = memoryview(raw)
            p = 0
            for _ in range(levels):  # repetition levels, then definition levels: <int32 length><bytes>
                n = int.from_bytes(raw[p:p + 4], "little")
                blocks.append(raw[p + 4:p + 4 + n])
                p += 4 + n
            values = raw[p:]
        elif ptype == 3:  # DATA_PAGE_V2: levels uncompressed in front of the (maybe compressed) values
            dph = h.get(8) or {}
            if dph.get(4, 0) != 0:
                raise _NotPlain
            rl, dl = dph.get(6, 0), dph.get(5, 0)
            if levels:
                blocks = [body[:rl], body[rl:rl + dl]]
            rest = body[rl + dl:]
            if codec and dph.get(7, True):
                values = memoryview(pa.decompress(rest, decompressed_size=usize - rl - dl, codec=codec))
            else:
                values = rest
        elif ptype == 2:
            raise _NotPlain  # dictionary page: not PLAIN
        else:
            continue  # index pages carry no values
        if len(values) % 4:
            raise _NotPlain
        yield values, blocks, int(dph.get(1, 0))


_ERRORS = (_NotPlain, ValueError, IndexError, KeyError, TypeError, OSError, pa.ArrowException)


def fast_plain_values(data, col_meta, expect: int, *, lead: int = 0, base: int = 0,
                      column: str = fmt.TOKEN_COLUMN, levels: int = 2) -> np.ndarray | None:
    """The int32 values of one PLAIN column chunk of ``column`` (after ``lead`` zeros), or None.

    ``data`` holds the file's bytes from offset ``base`` on (a row group's verified byte range, or the
    whole file with ``base=0``). ``levels``: level blocks in front of v1 page values (2 for the
    ``list<int32>`` token column: repetition and definition; 0 for a required top-level column).
    """
    try:
        out = np.empty(expect + lead, np.int32)
        out[:lead] = 0
        got = 0
        for values, _, _ in _data_pages(data, col_meta, base=base, column=column, levels=levels):
            n = len(values) // 4
            if got + n > expect:
                return None
            out[lead + got:lead + got + n] = np.frombuffer(values, dtype="<i4")
            got += n
        return out if got == expect else None
    except _ERRORS:
        return None


def _level_bits(buf, n: int) -> np.ndarray:
    """``n`` levels of bit width 1 from Parquet's RLE / bit-packed hybrid encoding."""
    out = np.empty(n, np.uint8)
    i = pos = 0
    while i < n:
        t = Thrift(buf, pos)
        head = t.varint()
        pos = t.pos
        if head & 1:  # bit-packed: (head >> 1) groups of 8 values, one byte each at width 1
            nb = head >> 1
            bits = np.unpackbits(np.frombuffer(buf, np.uint8, nb, pos), bitorder="little")
            pos += nb
        else:  # a run: (head >> 1) times the value in the next byte
            bits = buf[pos]
            pos += 1
            if bits > 1:
                raise _NotPlain
            bits = np.full(head >> 1, bits, np.uint8)
        take = min(bits.size, n - i)
        if not take:
            raise _NotPlain
        out[i:i + take] = bits[:take]
        i += take
    return out


def fast_list_values(data, col_meta, rows: int, *, base: int = 0, column: str = fmt.LOSS_COLUMN
                     ) -> tuple[np.ndarray, np.ndarray] | None:
    """The int32 values of one PLAIN ``list<int32>`` column chunk whose list and values are required
    (levels of bit width 1), and how many of them each of its ``rows`` rows holds; or None.

    The list structure comes from the levels: repetition level 0 starts a row, definition level 1 is a
    value (0: an empty list)."""
    try:
        vals, reps, defs = [], [], []
        for values, (rep, dfn), n in _data_pages(data, col_meta, base=base, column=column, levels=2):
            vals.append(np.frombuffer(values, dtype="<i4"))
            reps.append(_level_bits(rep, n))
            defs.append((dfn, n))
        if not vals:
            return (np.zeros(0, np.int32), np.zeros(rows, np.int64)) if rows == 0 else None
        values, rep = (x[0] if len(x) == 1 else np.concatenate(x) for x in (vals, reps))
        first = np.flatnonzero(rep == 0)  # each row's first entry
        if first.size != rows or not rows or first[0] != 0:
            return None
        counts = np.diff(first, append=rep.size)
        if values.size != rep.size:  # empty lists: one entry of definition level 0 each, no value
            dfn = np.concatenate([_level_bits(d, n) for d, n in defs])
            counts *= dfn[first]
            if int(counts.sum()) != values.size or int(dfn.sum()) != values.size:
                return None
        return values, counts
    except _ERRORS:
        return None
