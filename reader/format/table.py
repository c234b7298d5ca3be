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
when first asked for (:class:`reader.format.blocks.Digests`). The block format: :mod:`reader.format.blocks`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Sequence

import numpy as np

from reader.format import spec as fmt
from reader.format.blocks import (CODECS, DIGEST_PREFIX, INT64, SHA256, BlockFile, BlockWriter, Digests, Fetch,
                                  digests_of, rows_of)
from reader.format.sidecar import ledger_entry
from reader.format.checks import MAX_COUNT, MAX_INDEX, MAX_TOTAL, is_int, short
from reader.order.streams import round_robin_order

BLOCK_ROWS = 16384
# every column in file order; loss_tokens only in a cache with loss masks
COLUMNS = (("docs", INT64), ("tokens", INT64), ("bytes", INT64), ("bad_records", INT64), ("loss_tokens", INT64),
           ("checksum", SHA256), ("sidecar_checksum", SHA256))
# what a reader fetches to open a cache (every block); the rest when asked for
OPEN_COLUMNS = ("docs", "tokens", "bytes", "loss_tokens")
TABLE_PREFIX, TABLE_SUFFIX = "table-", ".bin"
ENTRY_SUFFIX = ".entry"


def uses_table(raw: Mapping[str, Any]) -> bool:
    """Whether a ledger (parsed JSON) keeps its chunks in a table: a finished ledger of version 4 or later."""
    return bool(raw.get("finished")) and isinstance(raw.get("format_version"), int) \
        and raw["format_version"] >= fmt.TABLE_VERSION


def writes_entries(raw: Mapping[str, Any]) -> bool:
    """Whether the build of a ledger (a plan or finished) has its workers' chunk entries to follow: version 4 and
    later (a rerun of an older cache may write some, but its chunks written before have only sidecars)."""
    return isinstance(raw.get("format_version"), int) and raw["format_version"] >= fmt.TABLE_VERSION


def columns(masked: bool) -> list[tuple[str, str]]:
    """The ``[name, type]`` columns of a cache's table (``masked``: it has loss masks)."""
    return [c for c in COLUMNS if masked or c[0] != "loss_tokens"]


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
    """A chunk's entry file: its version 3 ledger entry without offsets (:func:`reader.format.sidecar.ledger_entry`),
    one line of JSON with sorted keys."""
    return (json.dumps(ledger_entry(sidecar), sort_keys=True, separators=(",", ":"), allow_nan=False,
                       ensure_ascii=False) + "\n").encode()


def order_position(counts: np.ndarray, shard: int, index: int) -> int:
    """The global position of chunk ``index`` of ``shard`` (``counts``: chunks per shard), without the whole
    order: the chunks of rounds before ``index``, then the shards before ``shard`` that reach round ``index``."""
    return int(np.minimum(counts, index).sum()) + int((counts[:shard] > index).sum())


def block_values(entries: Sequence[Mapping[str, Any]], masked: bool) -> dict[str, Any]:
    """A block's column values from its chunks' entries (ledger entries or sidecars with ``sidecar_checksum``),
    in global order."""
    def ints(key: str) -> np.ndarray:
        return np.fromiter((e[key] for e in entries), np.int64, len(entries))

    out = {name: ints(name) for name, kind in columns(masked) if kind == INT64}
    out["checksum"] = digests_of([e["checksum"] for e in entries])
    out["sidecar_checksum"] = digests_of([e.get("sidecar_checksum") for e in entries])
    return out


# --------------------------------------------------------------------------------------------------
# Reading

class TableWriter(BlockWriter):
    """Writes a chunk table into ``out`` (:class:`reader.format.blocks.BlockWriter` with the columns of a cache
    with or without loss masks, ``masked``); :meth:`finish` gives the ledger's ``table`` object."""

    def __init__(self, out: BinaryIO, rows: int, masked: bool, *, block_rows: int = BLOCK_ROWS):
        super().__init__(out, rows, columns(masked), block_rows=block_rows)


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
    table = BlockFile(desc, fetch, where(desc["path"]))
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


def recorded_rows(t: fmt.ChunkTable, raw: Mapping[str, Any], indices) -> dict[int, dict[str, Any]]:
    """What a finished ledger ``raw`` records of chunks ``indices`` of its table ``t``: their entries (version 1 to
    3), or their table rows with the derived path, shard and index (version 4: the blocks holding them fetched
    once)."""
    table = table_of(t)
    if table is None:
        return {i: dict(raw["chunks"][i]) for i in indices}
    rows = rows_of(table, list(indices))
    for i, row in rows.items():
        row.update(path=t.paths[i], shard=int(t.shard[i]), index_in_shard=int(t.index_in_shard[i]))
    return rows


def fingerprint(t: fmt.ChunkTable) -> str:
    """What a cache's derived files (index files, attribute sets, views' counts) were computed from: a version
    4 table's checksum (every chunk's checksum is in the table, so nothing is fetched), else the sha256 of the
    chunk checksums joined by newlines."""
    table = table_of(t)
    return table.fingerprint() if table is not None else hashlib.sha256("\n".join(t.checksums).encode()).hexdigest()


def table_of(t: fmt.ChunkTable) -> BlockFile | None:
    """The table file behind a :class:`reader.format.spec.ChunkTable` (None for one from a chunk list)."""
    return t.checksums.table if isinstance(t.checksums, Digests) else None


