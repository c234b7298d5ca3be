"""The block format of the chunk table and of the reader's index files: columns of fixed-width values, cut into
blocks of rows, each piece (a column of a block) stored on its own, compressed and checksummed, so that a reader
fetches and verifies only the pieces it needs (docs/FORMAT.md, "Chunk table").

:class:`BlockWriter` writes pieces and describes them; :class:`BlockFile` reads them back as the description says,
verifying each; :class:`Digests` is a sha256 column read a block at a time. :func:`write_parts` /
:func:`read_parts`: a file of several such parts after a JSON header line (the index files). Standard library,
numpy and pyarrow only.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from reader.format import spec as fmt
from reader.format.checks import short

CODECS = ("zstd", "none")
ZSTD_LEVEL = 3
INT64, SHA256 = "int64", "sha256"
WIDTH = {INT64: 8, SHA256: 32}
DIGEST_PREFIX = "sha256:"
# fetch(rel, [(start, end), ...]) -> the bytes of each range (fewer at the end of a short file)
Fetch = Callable[[str, Sequence[tuple[int, int]]], list[bytes]]


_ZSTD: list = []  # (made once: a Codec costs more to make than a block to decode)


def _codec(codec: str) -> pa.Codec | None:
    if codec != "zstd":
        return None
    if not _ZSTD:
        _ZSTD.append(pa.Codec("zstd", compression_level=ZSTD_LEVEL))
    return _ZSTD[0]


def encode_piece(values: np.ndarray, kind: str, codec: str) -> bytes:
    """One column's values for one block, as stored: int64 little-endian (compressed by ``codec``), or rows of
    32 digest bytes (as they are: digests do not compress)."""
    raw = np.ascontiguousarray(values, dtype="<i8" if kind == INT64 else np.uint8).tobytes()
    c = _codec(codec) if kind == INT64 else None
    return raw if c is None else c.compress(raw, asbytes=True)


def decode_piece(data: bytes, kind: str, rows: int, codec: str) -> np.ndarray:
    """The values of a stored piece of ``rows`` rows (int64 ``[rows]`` or uint8 ``[rows, 32]``); raises
    ``ValueError`` if it does not decode to exactly that many."""
    size = rows * WIDTH[kind]
    c = _codec(codec) if kind == INT64 else None
    raw = data if c is None or not size else c.decompress(data, decompressed_size=size, asbytes=True)
    if len(raw) != size:
        raise ValueError(f"decodes to {len(raw)} bytes, {size} expected for {rows} rows")
    if kind == INT64:
        return np.frombuffer(raw, dtype="<i8").astype(np.int64)
    return np.frombuffer(raw, dtype=np.uint8).reshape(rows, 32)


def digests_of(checksums: Sequence[str]) -> np.ndarray:
    """``"sha256:<hex>"`` strings as a uint8 ``[n, 32]`` array (a table's sha256 column); raises ``ValueError``
    for anything else."""
    out = np.zeros((len(checksums), 32), np.uint8)
    for i, c in enumerate(checksums):
        if not isinstance(c, str) or not c.startswith(DIGEST_PREFIX) or len(c) != 71:
            raise ValueError(f"checksum {short(c)} is not \"sha256:\" and 64 hex digits")
        out[i] = np.frombuffer(bytes.fromhex(c[7:]), np.uint8)
    return out


def digest_text(row: np.ndarray) -> str:
    return DIGEST_PREFIX + row.tobytes().hex()


class BlockWriter:
    """Writes columns of ``rows`` rows into the binary file ``out``, a block of ``block_rows`` at a time
    (:meth:`add`), and describes them (:meth:`finish`: a ledger's ``table`` object, or a part of an index file).

    Args:
      out: where the bytes go (written in order; nothing is read back).
      rows: the rows there will be (every block but the last has ``block_rows``).
      columns: ``(name, type)`` of each column, in file order.
      offset: where in ``out`` the first piece goes (other parts of a file before it).
    """

    def __init__(self, out: BinaryIO, rows: int, columns: Sequence[tuple[str, str]], *, block_rows: int,
                 codec: str = "zstd", offset: int = 0):
        self.out, self.rows, self.block_rows, self.codec = out, int(rows), int(block_rows), codec
        self.columns = [tuple(c) for c in columns]
        self.blocks: list[list[list[Any]]] = []
        self.written = 0  # rows
        self.offset = int(offset)
        self.sha = hashlib.sha256()

    def add(self, values: Mapping[str, np.ndarray]) -> None:
        """The next block's rows: each column's values (a sha256 column as ``[n, 32]`` digests, or strings)."""
        n = min(self.block_rows, self.rows - self.written)
        pieces = []
        for name, kind in self.columns:
            v = values[name]
            if kind == SHA256 and not isinstance(v, np.ndarray):
                v = digests_of(v)
            if len(v) != n:
                raise ValueError(f"block {len(self.blocks)}: {len(v)} values of {name}, {n} expected")
            data = encode_piece(v, kind, self.codec)
            self.out.write(data)
            self.sha.update(data)
            pieces.append([self.offset, len(data), fmt.checksum(data)])
            self.offset += len(data)
        self.blocks.append(pieces)
        self.written += n

    def finish(self) -> dict[str, Any]:
        """The ledger's ``table`` object (the file must then be named ``path``)."""
        if self.written != self.rows:
            raise ValueError(f"{self.written} rows written, {self.rows} announced")
        checksum = DIGEST_PREFIX + self.sha.hexdigest()
        return {"path": f"table-{checksum[7:23]}.bin", "bytes": self.offset, "checksum": checksum, "rows": self.rows,
                "block_rows": self.block_rows, "codec": self.codec, "columns": [list(c) for c in self.columns],
                "blocks": self.blocks}


class BlockFile:
    """A file of blocks as its descriptor (:meth:`BlockWriter.finish`) says: pieces fetched on demand, each
    verified before it is decoded.

    Args:
      desc: the descriptor (a ledger's ``table`` object, checked by ``reader.format.table.descriptor_problem``).
      fetch: reads byte ranges of a file of the cache (see :data:`Fetch`).
      where: the table file as a user would name it (messages).
    """

    def __init__(self, desc: Mapping[str, Any], fetch: Fetch, where: str):
        self.desc, self.fetch, self.where = desc, fetch, where
        self.rows, self.block_rows, self.codec = int(desc["rows"]), int(desc["block_rows"]), desc["codec"]
        self.names = [c[0] for c in desc["columns"]]
        self.kinds = dict((c[0], c[1]) for c in desc["columns"])

    @property
    def num_blocks(self) -> int:
        return len(self.desc["blocks"])

    def block_size(self, b: int) -> int:
        return min(self.block_rows, self.rows - b * self.block_rows)

    def fingerprint(self) -> str:
        """A digest that changes with any value of the table: the sha256 of its whole file, as recorded."""
        return self.desc["checksum"]

    def pieces(self, names: Sequence[str], blocks: Sequence[int]) -> dict[tuple[str, int], np.ndarray]:
        """The decoded values of each column of ``names`` in each block of ``blocks``: one request for all
        (adjacent pieces merged into one range), every piece verified before it is decoded."""
        want = [(name, b) for b in blocks for name in names]
        spans = [self.desc["blocks"][b][self.names.index(name)] for name, b in want]
        ranges: list[list[int]] = []  # merged [start, end)
        for off, length, _ in spans:
            if ranges and ranges[-1][1] == off:
                ranges[-1][1] = off + length
            else:
                ranges.append([off, off + length])
        try:
            got = self.fetch(self.desc["path"], [tuple(r) for r in ranges])
        except FileNotFoundError:
            raise fmt.DamagedCache(f"{self.where}: missing (the ledger names it); restore it, or rerun the build "
                                   "command that made this cache") from None
        out, r = {}, 0
        for (name, b), (off, length, checksum) in zip(want, spans):
            while not ranges[r][0] <= off < ranges[r][1] and not (length == 0 and off == ranges[r][0]):
                r += 1
            start = off - ranges[r][0]
            data = got[r][start:start + length]
            if len(data) != length or fmt.checksum(data) != checksum:
                what = "cut short" if len(data) != length else "its checksum does not match the ledger's"
                raise fmt.DamagedCache(f"{self.where}: block {b} of column {name} (bytes [{off}, {off + length})) is "
                                       f"{what}; the table was damaged or edited: restore it, or rerun the build "
                                       "command that made this cache")
            try:
                out[(name, b)] = decode_piece(data, self.kinds[name], self.block_size(b), self.codec)
            except (ValueError, OSError, pa.ArrowException) as e:
                raise fmt.DamagedCache(f"{self.where}: block {b} of column {name} does not decode ({e}); rerun the "
                                       "build command that made this cache") from None
        return out

    def problems(self) -> list[str]:
        """Every block fetched and checked: what is wrong with each damaged one (``validate``)."""
        out = []
        for b in range(self.num_blocks):
            try:
                self.pieces(self.names, [b])
            except fmt.DamagedCache as e:
                out.append(str(e))
        return out

    def columns(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Whole columns (every block), fetched together."""
        got = self.pieces(names, range(self.num_blocks))
        return {n: (np.concatenate([got[(n, b)] for b in range(self.num_blocks)]) if self.num_blocks
                    else np.zeros((0, 32) if self.kinds[n] == SHA256 else 0, np.uint8 if self.kinds[n] == SHA256
                                  else np.int64)) for n in names}


class Digests(Sequence[str]):
    """A table's sha256 column as ``"sha256:<hex>"`` strings, its blocks fetched when first needed (a host
    opening chunk c fetches the block holding row c, 512 KiB)."""

    def __init__(self, table: BlockFile, name: str):
        self.table, self.name = table, name
        self._blocks: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.table.rows

    def _load(self, blocks) -> None:
        with self._lock:
            todo = sorted({b for b in blocks if b not in self._blocks})
            if todo:
                got = self.table.pieces([self.name], todo)
                for b in todo:
                    self._blocks[b] = got[(self.name, b)]

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` as a uint8 ``[n, 32]`` array."""
        br = self.table.block_rows
        if hi <= lo:
            return np.zeros((0, 32), np.uint8)
        blocks = range(lo // br, (hi - 1) // br + 1)
        self._load(blocks)
        return np.concatenate([self._blocks[b] for b in blocks])[lo - blocks[0] * br:hi - blocks[0] * br]

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            return [digest_text(r) for r in self.rows(lo, hi)[::step]] if hi > lo else []
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return digest_text(self.rows(i, i + 1)[0])

    def __iter__(self) -> Iterator[str]:
        self._load(range(self.table.num_blocks))
        for b in range(self.table.num_blocks):
            for r in self._blocks[b]:
                yield digest_text(r)

    def fingerprint(self) -> str:
        return self.table.fingerprint()


def rows_of(table: BlockFile, rows: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Every column of the given rows (the blocks holding them fetched once): ``row -> {name: value}``, the
    digests as ``"sha256:<hex>"``."""
    blocks = sorted({r // table.block_rows for r in rows})
    got = table.pieces(table.names, blocks)
    out = {}
    for r in rows:
        b, i = divmod(r, table.block_rows)
        out[r] = {n: (digest_text(got[(n, b)][i]) if table.kinds[n] == SHA256 else int(got[(n, b)][i]))
                  for n in table.names}
    return out


def write_parts(head: Mapping[str, Any], parts: Mapping[str, Sequence[tuple[str, str, np.ndarray]]],
                block_rows: int) -> bytes:
    """A file of several parts (each ``(name, type, values)`` columns of equal length) after a header line: the JSON
    of ``head`` with ``"parts"``, each part's descriptor (its offsets count from the byte after the header)."""
    out, descs = io.BytesIO(), {}
    for name, cols in parts.items():
        n = len(cols[0][2])
        w = BlockWriter(out, n, [(c, k) for c, k, _ in cols], block_rows=block_rows, offset=out.tell())
        for lo in range(0, n, block_rows):
            w.add({c: v[lo:lo + block_rows] for c, _, v in cols})
        descs[name] = w.finish()
    return (json.dumps(dict(head, parts=descs), sort_keys=True, separators=(",", ":")) + "\n").encode() + out.getvalue()


def read_parts(raw: bytes, where: str) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    """``(header, {part: {column: values}})`` of a file of :func:`write_parts`, every piece verified
    (``DamagedCache`` naming ``where`` and the block; ``ValueError``, ``KeyError``... for a malformed header)."""
    line, _, data = raw.partition(b"\n")
    head = fmt.load_json(line)
    out = {}
    for name, desc in head["parts"].items():
        f = BlockFile(desc, lambda _rel, ranges: [data[a:b] for a, b in ranges], where)
        out[name] = f.columns(f.names)
    return head, out
