"""The build's last step: each cache's chunk table streamed from its chunks' entries, the verdict, the finished
ledgers (docs/FORMAT.md, "Chunk table").

No process ever holds more than one block of rows. Every worker writes a chunk's *entry* (its version 3 ledger
entry without offsets, ``chunk-KKKKKK.entry``) right after its sidecar; the finalize reads them back in global
order, a block of :data:`reader.format.table.BLOCK_ROWS` at a time (many reads in flight), and writes each
block of the table as it goes, summing what the ledger's totals and the verdicts need (per shard: documents
and bad records, for the empty-input check). Then, in this order: the verdict (``_FAILED.json`` and no table
if the build must stop), each table under its name (``table-H.bin``), each finished ledger naming it (the
commit, train then validation), and last any table no ledger names. The entries stay (a rerun of the finished
cache keeps them; removing a million files would cost more than the finalize: each unlink is a metadata
write, and on a disk mounted with ``discard`` a synchronous trim).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import glob
import hashlib
import os
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from reader.format import spec as fmt
from reader.format import blocks
from reader.format import table as chunk_table
from reader.order.streams import round_robin_order
from reader.storage import atomic

from pipelines.errors import BuildError
from pipelines.inputs import fsutil
from pipelines.options import is_remote

ENTRY_THREADS = 32  # entries read at once (remote storage: each is a round trip)


def final_inputs(plan: Mapping[str, Any], root: str) -> list[dict[str, Any]]:
    """The finished ledger's ``inputs``: each input of the plan with ``uncompressed_bytes``, and a compressed
    shard's chunk count and size from its ``_DONE.json``."""
    out = []
    for inp in plan["inputs"]:
        inp = dict(inp)
        if inp.get("compression", "none") == "none":
            inp["uncompressed_bytes"] = inp["size"]
        else:
            done = _done(fmt.join(root, fmt.shard_done_path(inp["shard"])))
            if done is None:
                raise BuildError(f"internal: compressed shard {inp['path']} was not completed")
            inp["chunks"], inp["uncompressed_bytes"] = done["chunks"], done["uncompressed_bytes"]
        out.append(inp)
    return out


def _done(path: str) -> dict[str, int] | None:
    raw = fsutil.read_bytes_or_none(path)
    if raw is None:
        return None
    try:
        done = fsutil.load_json(raw)
    except ValueError:
        return None
    ok = isinstance(done, dict) and all(fmt.is_int(done.get(k), 0, fmt.MAX_COUNT) for k in ("chunks", "uncompressed_bytes"))
    return {"chunks": done["chunks"], "uncompressed_bytes": done["uncompressed_bytes"]} if ok else None


def entry_blocks(root: str, order: np.ndarray, block_rows: int = chunk_table.BLOCK_ROWS,
                 threads: int = ENTRY_THREADS) -> Iterator[list[dict[str, Any]]]:
    """The entries of the chunks ``order`` (``(shard, index)`` rows, global order) in ``root``, a block of
    ``block_rows`` at a time; the next block's reads are in flight while one is used."""
    def read(row) -> bytes | None:
        return _read(fmt.join(root, chunk_table.entry_path(int(row[0]), int(row[1]))))

    def fetch(lo: int) -> list:
        return list(pool.map(read, order[lo:lo + block_rows]))

    with cf.ThreadPoolExecutor(threads) as pool, cf.ThreadPoolExecutor(1) as ahead:
        nxt = ahead.submit(fetch, 0) if len(order) else None
        for lo in range(0, len(order), block_rows):
            got = nxt.result()
            nxt = ahead.submit(fetch, lo + block_rows) if lo + block_rows < len(order) else None
            block = []
            for (s, k), raw in zip(order[lo:lo + block_rows].tolist(), got):
                rel = chunk_table.entry_path(s, k)
                if raw is None:
                    raise BuildError(f"internal: chunk {fmt.join(root, fmt.chunk_path(s, k))} is missing after the "
                                     f"build (no {rel})")
                try:
                    block.append(fmt.load_json(raw))
                except ValueError as e:
                    raise BuildError(f"{fmt.join(root, rel)}: not valid JSON ({e}); delete it and the chunk's "
                                     ".json sidecar, and rerun the same command") from None
            yield block


@dataclasses.dataclass
class Sums:
    """What a cache's entries add up to (the ledger's totals and the verdicts)."""

    shards: int
    docs: int = 0
    tokens: int = 0
    bytes: int = 0
    bad: int = 0
    loss: int = 0
    reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    shard_docs: np.ndarray = None  # per input
    shard_bad: np.ndarray = None

    def __post_init__(self):
        self.shard_docs = np.zeros(self.shards, np.int64)
        self.shard_bad = np.zeros(self.shards, np.int64)


@dataclasses.dataclass
class Draft:
    """A cache's table, written under a temporary name, and its sums."""

    root: str
    tmp: str
    desc: dict[str, Any]
    sums: Sums


def draft_table(root: str, plan: Mapping[str, Any], inputs: Sequence[Mapping[str, Any]],
                blocks: Iterable[list[Mapping[str, Any]]] | None = None,
                block_rows: int = chunk_table.BLOCK_ROWS) -> Draft:
    """The table of the cache in ``root`` written from its entries (``blocks``, in global order, a block of
    ``block_rows`` each; default: its entry files), under a temporary name in ``root``.

    Each entry is checked (its chunk, its numbers) before it is used. Raises BuildError naming the first
    entry that is missing or wrong.
    """
    counts = [int(inp["chunks"]) for inp in inputs]
    order = round_robin_order(counts)
    rows, masked = len(order), fmt.is_masked(plan["config"])
    if blocks is None:
        blocks = entry_blocks(root, order, block_rows)
    sums = Sums(shards=len(inputs))
    tmp = atomic.temp_name(fmt.join(root, "table.bin"))
    out = fsutil.BEAM.create(tmp)
    try:
        writer = chunk_table.TableWriter(out, rows, masked, block_rows=block_rows)
        lo = 0
        for block in blocks:
            writer.add(_block_columns(root, block, order[lo:lo + len(block)], len(inputs), masked, sums))
            lo += len(block)
        desc = writer.finish()
        out.close()
    except BaseException:
        out.close()
        fsutil.delete_if_exists(tmp)
        raise
    sums.reasons = dict(sorted(sums.reasons.items()))
    return Draft(root=root, tmp=tmp, desc=desc, sums=sums)


def _block_columns(root: str, block: Sequence[Mapping[str, Any]], rows: np.ndarray, num_inputs: int, masked: bool,
                   sums: Sums) -> dict[str, Any]:
    """One block's columns from its entries, checked, added to ``sums``."""
    try:
        t = fmt.ChunkTable.from_entries(block, num_inputs=num_inputs)  # keys, integer ranges, paths
        if len(t) != len(rows) or not (np.array_equal(t.shard, rows[:, 0]) and np.array_equal(t.index_in_shard,
                                                                                                rows[:, 1])):
            i = next((i for i in range(min(len(t), len(rows))) if (t.shard[i], t.index_in_shard[i]) != tuple(rows[i])),
                     min(len(t), len(rows)))
            raise ValueError(f"chunk entry {i}: names chunk {t.paths[i] if i < len(t) else None}, expected "
                             f"{fmt.chunk_path(*map(int, rows[i]))}")
        if masked and t.loss_tokens is None:
            raise ValueError("an entry of a cache with loss masks without loss_tokens")
        values = chunk_table.block_values(block, masked)
        bad = values["bad_records"]
        if (bad < 0).any() or (bad > fmt.MAX_COUNT).any():
            raise ValueError(f"bad_records outside [0, {fmt.MAX_COUNT}]")
    except (ValueError, KeyError, TypeError) as e:
        where = str(e).split(":", 1)
        i = int(where[0].removeprefix("chunk entry ")) if where[0].startswith("chunk entry ") else 0
        s, k = map(int, rows[min(i, len(rows) - 1)])
        raise BuildError(f"{fmt.join(root, chunk_table.entry_path(s, k))}: not this chunk's entry ({e}); delete it "
                         "and the chunk's .json sidecar, and rerun the same command") from None
    sums.docs += int(t.docs.sum())
    sums.tokens += int(t.tokens.sum())
    sums.bytes += int(t.nbytes.sum())
    sums.bad += int(bad.sum())
    sums.loss += int(t.loss_tokens.sum()) if masked else 0
    np.add.at(sums.shard_docs, rows[:, 0], t.docs)
    np.add.at(sums.shard_bad, rows[:, 0], bad)
    for e in block:
        for reason, n in (e.get("bad_reasons") or {}).items():
            sums.reasons[reason] = sums.reasons.get(reason, 0) + int(n)
    return values


def finished_ledger(plan: Mapping[str, Any], inputs: Sequence[Mapping[str, Any]], draft: Draft) -> dict[str, Any]:
    """The finished ledger: the plan with the final ``inputs``, the ``table`` and the totals (no chunk list)."""
    s = draft.sums
    ledger = {k: v for k, v in plan.items() if k != "chunks"}
    ledger.update(finished=True, format_version=chunk_table.TABLE_VERSION, inputs=[dict(i) for i in inputs],
                  table=draft.desc, bad_records=s.reasons)
    ledger["totals"] = {"docs": s.docs, "tokens": s.tokens, "chunks": draft.desc["rows"], "bytes": s.bytes,
                        "input_bytes": sum(int(i["size"]) for i in inputs),
                        "uncompressed_bytes": sum(int(i["uncompressed_bytes"]) for i in inputs),
                        "bad_records": s.bad}
    if fmt.is_masked(plan["config"]):
        ledger["totals"]["loss_tokens"] = s.loss
    return ledger


def file_checksum(path: str) -> str | None:
    """``"sha256:"`` of a file's bytes, read block by block; None if it does not exist."""
    if not FileSystems.exists(path):
        return None
    h = hashlib.sha256()
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        while b := f.read(1 << 20):
            h.update(b)
    return "sha256:" + h.hexdigest()


def publish(draft: Draft) -> None:
    """The table under its name (an identical one already there is kept, and the draft removed)."""
    path = fmt.join(draft.root, draft.desc["path"])
    if file_checksum(path) == draft.desc["checksum"]:
        fsutil.delete_if_exists(draft.tmp)
        return
    atomic.publish(fsutil.BEAM, draft.tmp, path)


def discard(draft: Draft) -> None:
    fsutil.delete_if_exists(draft.tmp)


def _read(path: str) -> bytes | None:
    """A small file's bytes, None if it does not exist (a local file read directly: Beam's local filesystem
    costs a glob per call, and the finalize reads a million of them)."""
    if is_remote(path):
        return fsutil.read_bytes_or_none(path)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def remove_other_tables(root: str, keep: str | None) -> None:
    """Delete the tables in ``root`` that the ledger does not name (an earlier, interrupted finalize's)."""
    pattern = f"{chunk_table.TABLE_PREFIX}*{chunk_table.TABLE_SUFFIX}"
    if is_remote(root):
        paths = [m.path for res in FileSystems.match([fmt.join(root, pattern)]) for m in res.metadata_list]
    else:  # (Beam's local match walks the whole tree)
        paths = glob.glob(fmt.join(glob.escape(root), pattern))
    for path in paths:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if chunk_table.is_table_name(name) and name != keep:
            fsutil.delete_if_exists(path)


def read_ranges(path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """The bytes of each ``(start, end)`` range of a file (Beam's FileSystems: local or gs://)."""
    out = []
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        for start, end in ranges:
            f.seek(start)
            out.append(f.read(end - start))
    return out


class Recorded:
    """What the finished ledger in ``root`` records of each chunk, for a rerun that verifies the cache:
    ``get((shard, index))`` -> the sidecar checksum its chunk must reproduce.

    A worker reads what its own units need: a version 4 ledger's table a block of ``sidecar_checksum`` at a
    time (each verified; the last few kept), an older ledger's chunk list once (such ledgers were small).
    Nothing is read before the first question.
    """

    KEEP_BLOCKS = 8

    def __init__(self, root: str):
        self.root = root
        self._raw: dict[str, Any] | None = None
        self._old: dict[tuple[int, int], str] | None = None
        self._blocks: dict[int, np.ndarray] = {}

    def _load(self) -> dict[str, Any]:
        if self._raw is None:
            path = fmt.join(self.root, fmt.LEDGER_NAME)
            raw = fsutil.read_bytes_or_none(path)
            if raw is None:
                raise BuildError(f"{path}: the finished ledger is gone; rerun the same command")
            self._raw = fmt.Ledger.parse(raw, where=path).raw
            if not chunk_table.uses_table(self._raw):
                self._old = {(c["shard"], c["index_in_shard"]): c.get("sidecar_checksum")
                             for c in self._raw.get("chunks", [])}
            else:
                counts = chunk_table.chunk_counts(self._raw)
                wrong = None if counts is None else chunk_table.descriptor_problem(
                    self._raw.get("table"), int(counts.sum()), fmt.is_masked(self._raw["config"]))
                if wrong or counts is None:
                    raise BuildError(f"{path}: {wrong or 'an input chunk count is null'}; the ledger is damaged: "
                                     "restore it, or build into another --output")
                self._counts = counts
                desc = self._raw["table"]
                self._table = blocks.BlockFile(desc, lambda rel, r: read_ranges(fmt.join(self.root, rel), r),
                                                fmt.join(self.root, desc["path"]))
        return self._raw

    def get(self, key: tuple[int, int], default: Any = None) -> str | None:
        self._load()
        if self._old is not None:
            return self._old.get(key, default)
        shard, index = key
        if not (0 <= shard < len(self._counts) and 0 <= index < self._counts[shard]):
            return default
        row = chunk_table.order_position(self._counts, shard, index)
        b, i = divmod(row, self._table.block_rows)
        block = self._blocks.get(b)
        if block is None:
            try:
                block = self._table.pieces(["sidecar_checksum"], [b])[("sidecar_checksum", b)]
            except fmt.DamagedCache as e:
                raise BuildError(f"{e}") from None
            if len(self._blocks) >= self.KEEP_BLOCKS:
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[b] = block
        return blocks.digest_text(block[i])
