"""The chunk table of a finished version 4 cache: per-chunk columns in verified blocks (docs/FORMAT.md,
"Chunk table").

A version 4 ledger has no ``chunks`` list. Its ``table`` object describes ``ROOT/table-H.bin``: for each
block of :data:`BLOCK_ROWS` rows of the global chunk order, each column's values (little-endian int64, or
32-byte sha256 digests), each piece compressed on its own and checksummed in the ledger. What can be derived
is not stored: a row's shard and index come from ``round_robin_order(inputs[].chunks)``, its path from
those, its offsets from the sums of the rows before it.

:class:`TableWriter` writes a table from blocks of rows (the builder's finalize streams entries into it);
:func:`open_table` turns a finished ledger into a :class:`reader.format.spec.ChunkTable` whose count
columns are fetched (every block, verified) and whose checksum columns are fetched a block at a time
when first asked for (:class:`Digests`). Standard library, numpy and pyarrow only.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from reader.format import spec as fmt
from reader.format.checks import MAX_COUNT, MAX_INDEX, MAX_TOTAL, is_int, short
from reader.order.streams import round_robin_order

TABLE_VERSION = 4  # ledgers of this format version and later keep their chunks in a table
BLOCK_ROWS = 16384
CODECS = ("zstd", "none")
ZSTD_LEVEL = 3
INT64, SHA256 = "int64", "sha256"
WIDTH = {INT64: 8, SHA256: 32}
# every column in file order; loss_tokens only in a cache with loss masks
COLUMNS = (("docs", INT64), ("tokens", INT64), ("bytes", INT64), ("bad_records", INT64), ("loss_tokens", INT64),
           ("checksum", SHA256), ("sidecar_checksum", SHA256))
# what a reader fetches to open a cache (every block); the rest when asked for
OPEN_COLUMNS = ("docs", "tokens", "bytes", "loss_tokens")
TABLE_PREFIX, TABLE_SUFFIX = "table-", ".bin"
ENTRY_SUFFIX = ".entry"
DIGEST_PREFIX = "sha256:"


def uses_table(raw: Mapping[str, Any]) -> bool:
    """Whether a ledger (parsed JSON) keeps its chunks in a table: a finished ledger of version 4 or later."""
    return bool(raw.get("finished")) and isinstance(raw.get("format_version"), int) \
        and raw["format_version"] >= TABLE_VERSION


def columns(masked: bool) -> list[tuple[str, str]]:
    """The ``[name, type]`` columns of a cache's table (``masked``: it has loss masks)."""
    return [c for c in COLUMNS if masked or c[0] != "loss_tokens"]


_columns = columns


def table_name(file_checksum: str) -> str:
    """``table-H.bin`` for the file whose checksum is ``file_checksum`` (``"sha256:<hex>"``)."""
    return f"{TABLE_PREFIX}{file_checksum.removeprefix(DIGEST_PREFIX)[:16]}{TABLE_SUFFIX}"


def is_table_name(name: str) -> bool:
    h = name[len(TABLE_PREFIX):-len(TABLE_SUFFIX)]
    return name.startswith(TABLE_PREFIX) and name.endswith(TABLE_SUFFIX) and len(h) == 16 and \
        all(ch in "0123456789abcdef" for ch in h)


def entry_path(shard: int, index_in_shard: int) -> str:
    """Relative path of a chunk's entry (written by the worker after its sidecar, while the build runs)."""
    return f"{fmt.shard_dir(shard)}/chunk-{index_in_shard:06d}{ENTRY_SUFFIX}"


def entry_bytes(sidecar: Mapping[str, Any]) -> bytes:
    """A chunk's entry file: its version 3 ledger entry without offsets (:func:`reader.format.spec.ledger_entry`),
    one line of JSON with sorted keys."""
    return (json.dumps(fmt.ledger_entry(sidecar), sort_keys=True, separators=(",", ":"), allow_nan=False,
                       ensure_ascii=False) + "\n").encode()


def order_position(counts: np.ndarray, shard: int, index: int) -> int:
    """The global position of chunk ``index`` of ``shard`` (``counts``: chunks per shard), without the whole
    order: the chunks of rounds before ``index``, then the shards before ``shard`` that reach round ``index``."""
    return int(np.minimum(counts, index).sum()) + int((counts[:shard] > index).sum())


# --------------------------------------------------------------------------------------------------
# Encoding


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


def block_values(entries: Sequence[Mapping[str, Any]], masked: bool) -> dict[str, Any]:
    """A block's column values from its chunks' entries (ledger entries or sidecars with ``sidecar_checksum``),
    in global order."""
    def ints(key: str) -> np.ndarray:
        return np.fromiter((e[key] for e in entries), np.int64, len(entries))

    out = {name: ints(name) for name, kind in columns(masked) if kind == INT64}
    out["checksum"] = digests_of([e["checksum"] for e in entries])
    out["sidecar_checksum"] = digests_of([e.get("sidecar_checksum") for e in entries])
    return out


def digest_text(row: np.ndarray) -> str:
    return DIGEST_PREFIX + row.tobytes().hex()


class TableWriter:
    """Writes a table into the binary file ``out``, a block at a time (:meth:`add`), and describes it
    (:meth:`finish`: the ledger's ``table`` object).

    Args:
      out: where the bytes go (written in order; nothing is read back).
      rows: the chunks the table will hold (every block but the last has ``block_rows``).
      masked: the cache has loss masks (the ``loss_tokens`` column).
    """

    def __init__(self, out: BinaryIO, rows: int, masked: bool, *, block_rows: int = BLOCK_ROWS, codec: str = "zstd",
                 columns: Sequence[tuple[str, str]] | None = None, offset: int = 0):
        """``columns``: other ``(name, type)`` columns than a chunk table's (a reader's index file, in the same
        format); ``offset``: where in ``out`` the first piece goes (other parts of a file before it)."""
        self.out, self.rows, self.block_rows, self.codec = out, int(rows), int(block_rows), codec
        self.columns = list(columns) if columns is not None else _columns(masked)
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
        return {"path": table_name(checksum), "bytes": self.offset, "checksum": checksum, "rows": self.rows,
                "block_rows": self.block_rows, "codec": self.codec, "columns": [list(c) for c in self.columns],
                "blocks": self.blocks}


# --------------------------------------------------------------------------------------------------
# Reading

# fetch(rel, [(start, end), ...]) -> the bytes of each range (fewer at the end of a short file)
Fetch = Callable[[str, Sequence[tuple[int, int]]], list[bytes]]


def descriptor_problem(desc: Any, rows: int, masked: bool) -> str | None:
    """What is wrong with a ledger's ``table`` object (for a cache of ``rows`` chunks), or None."""
    if not isinstance(desc, dict):
        return "table must be an object"
    path, size, br = desc.get("path"), desc.get("bytes"), desc.get("block_rows")
    if not isinstance(path, str) or not is_table_name(path):
        return f"table.path {short(path)} is not table-<16 hex digits>.bin"
    if desc.get("checksum") is None or not isinstance(desc["checksum"], str) \
            or table_name(desc["checksum"]) != path:
        return f"table.checksum {short(desc.get('checksum'))} does not name {path}"
    if desc.get("rows") != rows:
        return f"table.rows {short(desc.get('rows'))}, the inputs have {rows} chunks"
    if not is_int(size, 0, MAX_TOTAL) or not is_int(br, 1, MAX_INDEX):
        return "table.bytes and table.block_rows must be integers in range"
    if desc.get("codec") not in CODECS:
        return f"table.codec {short(desc.get('codec'))} is not one of {', '.join(CODECS)}"
    if desc.get("columns") != [list(c) for c in columns(masked)]:
        return f"table.columns {short(desc.get('columns'), 120)}, this cache's are {columns(masked)}"
    blocks = desc.get("blocks")
    want = -(-rows // br)
    if not isinstance(blocks, list) or len(blocks) != want:
        return f"table.blocks must list {want} blocks of {br} rows"
    pos, ncol = 0, len(desc["columns"])
    for b, pieces in enumerate(blocks):
        if not isinstance(pieces, list) or len(pieces) != ncol:
            return f"table.blocks[{b}] must list {ncol} pieces"
        for p in pieces:
            if not (isinstance(p, list) and len(p) == 3 and is_int(p[0], 0, MAX_TOTAL) and is_int(p[1], 0, MAX_TOTAL)
                    and isinstance(p[2], str)) or p[0] != pos:
                return f"table.blocks[{b}]: pieces must be [offset, length, checksum], contiguous from byte 0"
            pos += p[1]
    if pos != size:
        return f"table.blocks cover {pos} bytes, table.bytes is {size}"
    return None


class Table:
    """A table file as a finished ledger describes it: pieces fetched on demand, each verified.

    Args:
      desc: the ledger's ``table`` object (checked by :func:`descriptor_problem`).
      fetch: reads byte ranges of a file of the cache (see :data:`Fetch`).
      where: the table file as a user would name it (messages).
    """

    def __init__(self, desc: Mapping[str, Any], fetch: Fetch, where: str):
        self.desc, self.fetch, self.where = desc, fetch, where
        self.rows, self.block_rows, self.codec = int(desc["rows"]), int(desc["block_rows"]), desc["codec"]
        self.names = [c[0] for c in desc["columns"]]
        self.kinds = dict((c[0], c[1]) for c in desc["columns"])
        self.fetched = 0  # bytes fetched so far

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
        self.fetched += sum(len(g) for g in got)
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

    def columns(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Whole columns (every block), fetched together."""
        got = self.pieces(names, range(self.num_blocks))
        return {n: (np.concatenate([got[(n, b)] for b in range(self.num_blocks)]) if self.num_blocks
                    else np.zeros((0, 32) if self.kinds[n] == SHA256 else 0, np.uint8 if self.kinds[n] == SHA256
                                  else np.int64)) for n in names}


class Digests(Sequence[str]):
    """A table's sha256 column as ``"sha256:<hex>"`` strings, its blocks fetched when first needed (a host
    opening chunk c fetches the block holding row c, 512 KiB)."""

    def __init__(self, table: Table, name: str):
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


class Paths(Sequence[str]):
    """Chunk paths derived from their shards and indices (never stored)."""

    def __init__(self, shard: np.ndarray, index: np.ndarray):
        self.shard, self.index = shard, index

    def __len__(self) -> int:
        return int(self.shard.size)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [fmt.chunk_path(int(s), int(k)) for s, k in zip(self.shard[i].tolist(), self.index[i].tolist())]
        return fmt.chunk_path(int(self.shard[i]), int(self.index[i]))

    def __iter__(self) -> Iterator[str]:
        return iter(self[:])


def chunk_counts(raw: Mapping[str, Any]) -> np.ndarray | None:
    """Chunks per input of a ledger, or None if one is unknown (a compressed shard of a plan)."""
    counts = [inp.get("chunks") for inp in raw["inputs"]]
    return None if any(c is None for c in counts) else np.asarray(counts, dtype=np.int64)


def open_table(raw: Mapping[str, Any], fetch: Fetch, where: Callable[[str], str]) -> fmt.ChunkTable:
    """The :class:`reader.format.spec.ChunkTable` of a finished version 4 ledger ``raw``: the order from its
    inputs, the count columns fetched and checked (every block), the checksum columns on demand.

    ``where(rel)``: a path of the cache as a user would name it. Raises ``DamagedCache`` naming the ledger or
    the table (and its block).
    """
    ledger = where(fmt.LEDGER_NAME)
    fix = "the ledger is damaged or was edited: restore it, or rebuild the cache"
    counts = chunk_counts(raw)
    null = next((i for i, inp in enumerate(raw["inputs"]) if inp.get("chunks") is None), None)
    if raw.get("table") is None:
        what = "no chunk table" if null is None else f"no chunk count for input shard {null} and no chunk table"
        raise fmt.DamagedCache(f"{ledger}: says finished, but records {what} (a build's plan marked finished, or a "
                               "damaged ledger). Rerun the build command that made this cache (it finishes the build "
                               "and writes the real ledger)")
    if counts is None:
        raise fmt.DamagedCache(f"{ledger}: input shard {null} has a null chunk count in a finished ledger; {fix}")
    rows = int(counts.sum())
    masked = fmt.is_masked(raw["config"])
    wrong = descriptor_problem(raw.get("table"), rows, masked)
    if wrong:
        raise fmt.DamagedCache(f"{ledger}: {wrong}; {fix}")
    desc = raw["table"]
    table = Table(desc, fetch, where(desc["path"]))
    cols = table.columns([n for n in OPEN_COLUMNS if n in table.names])
    for name, values in cols.items():
        bad = np.flatnonzero((values < 0) | (values > MAX_COUNT))
        if bad.size:
            raise fmt.DamagedCache(f"{table.where}: row {int(bad[0])} of column {name} holds {int(values[bad[0]])}, "
                                   f"outside [0, {MAX_COUNT}]; rerun the build command that made this cache")
        if float(values.sum(dtype=np.float64)) > MAX_TOTAL:
            raise fmt.DamagedCache(f"{table.where}: column {name} adds up to more than {MAX_TOTAL}")
    order = round_robin_order(counts)
    shard = order[:, 0].astype(np.int32)
    index = order[:, 1].astype(np.int32)
    del order
    return fmt.ChunkTable(paths=Paths(shard, index), checksums=Digests(table, "checksum"), shard=shard,
                          index_in_shard=index, docs=cols["docs"], tokens=cols["tokens"], nbytes=cols["bytes"],
                          sidecar_checksums=Digests(table, "sidecar_checksum"), loss_tokens=cols.get("loss_tokens"))


def table_of(t: fmt.ChunkTable) -> Table | None:
    """The table file behind a :class:`reader.format.spec.ChunkTable` (None for one from a chunk list)."""
    return t.checksums.table if isinstance(t.checksums, Digests) else None


def rows_of(table: Table, rows: Sequence[int]) -> dict[int, dict[str, Any]]:
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
