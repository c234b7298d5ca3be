"""Parquet files that lie, made by rewriting real ones: a Thrift compact-protocol codec for footers and page
headers (a field is ``{id: (type, value)}``; a list ``(element type, [values])``), and the hostile files
the builder's tests read. Only tests write these; the project reads page headers with
``reader.storage.pages.page_headers``."""

from __future__ import annotations

import io
import struct

import pyarrow as pa
import pyarrow.parquet as pq

TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7


def _unzigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _read(buf: bytes, pos: int, t: int):
    if t in (TRUE, FALSE):
        return t == TRUE, pos
    if t == BYTE:
        return struct.unpack_from("b", buf, pos)[0], pos + 1
    if t in (I16, I32, I64):
        v, pos = _varint(buf, pos)
        return _unzigzag(v), pos
    if t == DOUBLE:
        return struct.unpack_from("<d", buf, pos)[0], pos + 8
    if t == BINARY:
        n, pos = _varint(buf, pos)
        return bytes(buf[pos:pos + n]), pos + n
    if t in (LIST, SET):
        head = buf[pos]
        pos += 1
        n, et = head >> 4, head & 15
        if n == 15:
            n, pos = _varint(buf, pos)
        items = []
        for _ in range(n):
            if et in (TRUE, FALSE):
                v, pos = buf[pos] == 1, pos + 1
            else:
                v, pos = _read(buf, pos, et)
            items.append(v)
        return (et, items), pos
    if t == STRUCT:
        return read_struct(buf, pos)
    if t == MAP:
        n, pos = _varint(buf, pos)
        if not n:
            return (0, 0, []), pos
        kv = buf[pos]
        pos += 1
        items = []
        for _ in range(n):
            k, pos = _read(buf, pos, kv >> 4)
            v, pos = _read(buf, pos, kv & 15)
            items.append((k, v))
        return (kv >> 4, kv & 15, items), pos
    raise ValueError(f"thrift type {t}")


def read_struct(buf: bytes, pos: int) -> tuple[dict, int]:
    fields, last = {}, 0
    while True:
        head = buf[pos]
        pos += 1
        if head == 0:
            return fields, pos
        t, delta = head & 15, head >> 4
        if delta:
            fid = last + delta
        else:
            v, pos = _varint(buf, pos)
            fid = _unzigzag(v)
        fields[fid], pos = _read(buf, pos, t)
        fields[fid] = (t, fields[fid])
        last = fid


def _wvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def _write(t: int, v) -> bytes:
    if t in (TRUE, FALSE):
        return b""
    if t == BYTE:
        return struct.pack("b", v)
    if t in (I16, I32, I64):
        return _wvarint((v << 1) ^ (v >> 63))
    if t == DOUBLE:
        return struct.pack("<d", v)
    if t == BINARY:
        return _wvarint(len(v)) + v
    if t in (LIST, SET):
        et, items = v
        head = bytes([(len(items) << 4) | et]) if len(items) < 15 else bytes([0xF0 | et]) + _wvarint(len(items))
        return head + b"".join((b"\x01" if x else b"\x02") if et in (TRUE, FALSE) else _write(et, x) for x in items)
    if t == STRUCT:
        return write_struct(v)
    if t == MAP:
        kt, vt, items = v
        if not items:
            return b"\x00"
        return _wvarint(len(items)) + bytes([(kt << 4) | vt]) + b"".join(_write(kt, k) + _write(vt, x) for k, x in items)
    raise ValueError(f"thrift type {t}")


def write_struct(fields: dict) -> bytes:
    out, last = bytearray(), 0
    for fid in sorted(fields):
        t, v = fields[fid]
        tt = (TRUE if v else FALSE) if t in (TRUE, FALSE) else t
        if 0 < fid - last <= 15:
            out.append(((fid - last) << 4) | tt)
        else:
            out.append(tt)
            out += _wvarint((fid << 1) ^ (fid >> 63))
        out += _write(t, v)
        last = fid
    out.append(0)
    return bytes(out)


def footer(data: bytes) -> tuple[dict, int]:
    """The FileMetaData of a Parquet file's bytes, and where it starts."""
    n = struct.unpack_from("<I", data, len(data) - 8)[0]
    return read_struct(data, len(data) - 8 - n)[0], len(data) - 8 - n


def with_footer(body: bytes, meta: dict) -> bytes:
    f = write_struct(meta)
    return body + f + struct.pack("<I", len(f)) + b"PAR1"


def table_bytes(table: pa.Table, **kw) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, **kw)
    return buf.getvalue()


def column_meta(meta: dict, group: int = 0, column: int = 0) -> dict:
    """The ColumnMetaData of a column chunk (FileMetaData 4: row groups; RowGroup 1: columns; ColumnChunk 3)."""
    return meta[4][1][1][group][1][1][1][column][3][1]


def claim_rows(data: bytes, rows: int, group: int = 0) -> bytes:
    """``data`` with its footer saying ``rows`` rows in row group ``group`` (and in the file), its pages
    unchanged."""
    meta, start = footer(data)
    meta[4][1][1][group][3] = (I64, rows)
    meta[3] = (I64, sum(rg[3][1] for rg in meta[4][1][1]))
    return with_footer(data[:start], meta)


def nulls_file(values: int, rows: int) -> bytes:
    """A text column of one data page whose definition levels are one RLE run of ``values`` nulls (a few bytes
    holding, truly, any number of rows), the footer saying ``rows``."""
    data = table_bytes(pa.table({"text": pa.array([None, None, None], pa.string())}), compression="none",
                       use_dictionary=False, write_statistics=False)
    meta, start = footer(data)
    cm = column_meta(meta)
    header, _ = read_struct(data, cm[9][1])
    run = _wvarint(values << 1) + b"\x00"  # RLE run: count << 1, then the value (level 0: null) in one byte
    body = struct.pack("<I", len(run)) + run
    header[2] = header[3] = (I32, len(body))
    header[5][1][1] = (I32, values)
    header[5][1].pop(5, None)  # the page's statistics
    page = write_struct(header) + body
    cm[5], cm[6], cm[7] = (I64, rows), (I64, len(page)), (I64, len(page))
    rg = meta[4][1][1][0]
    rg[3], rg[2] = (I64, rows), (I64, len(page))
    for k in (6,):
        if k in rg:
            rg[k] = (I64, len(page))
    meta[3] = (I64, rows)
    return with_footer(data[:cm[9][1]] + page, meta)


def with_data_page_offset(data: bytes, offset: int) -> bytes:
    meta, start = footer(data)
    column_meta(meta)[9] = (I64, offset)
    return with_footer(data[:start], meta)
