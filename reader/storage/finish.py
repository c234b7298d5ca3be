"""A finished ledger made from its chunks' entries in global order: the one way the builder's finalize and the
importers finish a cache (docs/FORMAT.md, "Chunk table" and "Versions").

A cache of format version 4 keeps its chunks in a table (:mod:`reader.format.table`): the entries stream into it
a block at a time (:class:`Finisher`), so a process holds one block whatever the cache's size; the table is
written under a temporary name (:func:`draft`), then under its own (:func:`publish`) before the ledger that
names it. A rerun of a cache of an older version keeps that version (:func:`reader.format.spec.written_version`),
whose ledger lists every chunk with its offsets: those entries are held in memory, as the builders of those
versions held them (such caches were small), and no table is written.

Each entry is checked before it is used; a wrong one raises :class:`EntryError` naming its position in the
global order (the caller names the file).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, BinaryIO, Iterable, Mapping, Sequence

import numpy as np

from reader.format import spec as fmt
from reader.format import checks
from reader.format import table as chunk_table
from reader.order.streams import round_robin_order
from reader.storage import files


class EntryError(ValueError):
    """An entry that is not its chunk's, or not valid: ``row`` is its position in the global order."""

    def __init__(self, row: int, message: str):
        super().__init__(message)
        self.row = row


@dataclasses.dataclass
class Sums:
    """What a cache's entries add up to (the ledger's totals, and per input what the builder's verdicts need)."""

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


class Finisher:
    """The finished ledger of ``plan`` (a plan ledger) with its final ``inputs`` (each with its chunk count and
    ``uncompressed_bytes``), from the entries added in global order (:meth:`add`, any block sizes): a version 4
    plan's table is written into ``out`` as they come (blocks of ``block_rows``), an older plan's chunk list is
    kept (``out`` unused)."""

    def __init__(self, plan: Mapping[str, Any], inputs: Sequence[Mapping[str, Any]], out: BinaryIO | None,
                 block_rows: int = chunk_table.BLOCK_ROWS):
        self.plan, self.inputs = plan, [dict(i) for i in inputs]
        self.order = round_robin_order([int(inp["chunks"]) for inp in inputs])
        self.masked = fmt.is_masked(plan["config"])
        self.table = chunk_table.writes_entries(plan)
        self.writer = chunk_table.TableWriter(out, len(self.order), self.masked, block_rows=block_rows) \
            if self.table else None
        self.block_rows = block_rows
        self.chunks: list[dict[str, Any]] = []  # (an older version's chunk list)
        self.sums = Sums(shards=len(inputs))
        self._pending: list[Mapping[str, Any]] = []
        self.added = 0

    def add(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """The next entries of the global order (ledger entries without offsets: a worker's ``.entry`` files, or
        :func:`reader.format.sidecar.ledger_entry` of sidecars). Raises :class:`EntryError`."""
        self._pending.extend(entries)
        while len(self._pending) >= self.block_rows:
            self._block(self._pending[:self.block_rows])
            del self._pending[:self.block_rows]

    def _block(self, block: Sequence[Mapping[str, Any]]) -> None:
        lo = self.added
        rows = self.order[lo:lo + len(block)]
        try:
            t = fmt.ChunkTable.from_entries(block, num_inputs=len(self.inputs))  # keys, integer ranges, paths
            if len(t) != len(rows) or not (np.array_equal(t.shard, rows[:, 0])
                                           and np.array_equal(t.index_in_shard, rows[:, 1])):
                i = next((i for i in range(min(len(t), len(rows)))
                          if (t.shard[i], t.index_in_shard[i]) != tuple(rows[i])), min(len(t), len(rows)))
                what = t.paths[i] if i < len(t) else None
                raise EntryError(lo + min(i, len(rows) - 1), f"names chunk {what}, expected "
                                 f"{fmt.chunk_path(*map(int, rows[min(i, len(rows) - 1)]))}")
            if self.masked and t.loss_tokens is None:
                raise ValueError("chunk entry 0: an entry of a cache with loss masks without loss_tokens")
            values = chunk_table.block_values(block, self.masked)
            bad = values["bad_records"]
            if (bad < 0).any() or (bad > checks.MAX_COUNT).any():
                raise ValueError(f"chunk entry {int(np.flatnonzero((bad < 0) | (bad > checks.MAX_COUNT))[0])}: "
                                 f"bad_records outside [0, {checks.MAX_COUNT}]")
        except EntryError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            where = str(e).split(":", 1)
            i = int(where[0].removeprefix("chunk entry ")) if where[0].startswith("chunk entry ") else 0
            raise EntryError(lo + min(i, len(block) - 1), str(e)) from None
        s = self.sums
        s.docs += int(t.docs.sum())
        s.tokens += int(t.tokens.sum())
        s.bytes += int(t.nbytes.sum())
        s.bad += int(bad.sum())
        s.loss += int(t.loss_tokens.sum()) if self.masked else 0
        np.add.at(s.shard_docs, rows[:, 0], t.docs)
        np.add.at(s.shard_bad, rows[:, 0], bad)
        for e in block:
            for reason, n in (e.get("bad_reasons") or {}).items():
                s.reasons[reason] = s.reasons.get(reason, 0) + int(n)
        if self.writer is not None:
            self.writer.add(values)
        else:
            docs, tokens = s.docs - int(t.docs.sum()), s.tokens - int(t.tokens.sum())
            for e, d, n in zip(block, t.docs.tolist(), t.tokens.tolist()):
                self.chunks.append({**e, "doc_offset": docs, "token_offset": tokens})
                docs, tokens = docs + d, tokens + n
        self.added += len(block)

    def ledger(self) -> dict[str, Any]:
        """The finished ledger, once every entry is added (raises :class:`EntryError` for the first missing one):
        the plan with the final ``inputs``, its ``table`` (version 4) or ``chunks`` (older), the bad records and
        the totals."""
        if self._pending:
            self._block(self._pending)
            self._pending = []
        if self.added != len(self.order):
            raise EntryError(self.added, "missing")
        self.sums.reasons = dict(sorted(self.sums.reasons.items()))
        if self.writer is not None:
            return finished_ledger(self.plan, self.inputs, self.sums, table=self.writer.finish())
        return finished_ledger(self.plan, self.inputs, self.sums, chunks=self.chunks)


def finished_ledger(plan: Mapping[str, Any], inputs: Sequence[Mapping[str, Any]], sums: Sums, *,
                    table: Mapping[str, Any] | None = None, chunks: list | None = None) -> dict[str, Any]:
    """The finished ledger: the plan with the final ``inputs``, its ``table`` object (version 4) or ``chunks``
    list (older), the bad records and the totals from ``sums``."""
    ledger = {k: v for k, v in plan.items() if k not in ("chunks", "table")}
    ledger.update(finished=True, inputs=[dict(i) for i in inputs], bad_records=dict(sums.reasons))
    if table is not None:
        ledger["table"] = dict(table)
    else:
        ledger["chunks"] = chunks
    ledger["totals"] = {"docs": sums.docs, "tokens": sums.tokens,
                        "chunks": table["rows"] if table is not None else len(chunks), "bytes": sums.bytes,
                        "input_bytes": sum(int(i["size"]) for i in inputs),
                        "uncompressed_bytes": sum(int(i["uncompressed_bytes"]) for i in inputs),
                        "bad_records": sums.bad}
    if fmt.is_masked(plan["config"]):
        ledger["totals"]["loss_tokens"] = sums.loss
    return ledger


@dataclasses.dataclass
class Draft:
    """A cache's finished ledger and its table under a temporary name (``tmp``; None for an older version's
    ledger, which has no table), not yet published."""

    storage: files.Storage
    root: str
    tmp: str | None
    ledger: dict[str, Any]
    sums: Sums


def draft(storage: files.Storage, root: str, plan: Mapping[str, Any], inputs: Sequence[Mapping[str, Any]],
          blocks: Iterable[Sequence[Mapping[str, Any]]], block_rows: int = chunk_table.BLOCK_ROWS) -> Draft:
    """The finished ledger of the cache in ``root`` from its entries (``blocks``, in global order), its table
    written under a temporary name in ``root`` (removed again if anything fails). Raises :class:`EntryError`."""
    if not chunk_table.writes_entries(plan):
        finisher = Finisher(plan, inputs, None, block_rows)
        for block in blocks:
            finisher.add(block)
        return Draft(storage, root, None, finisher.ledger(), finisher.sums)
    tmp = files.temp_name(fmt.join(root, "table.bin"))
    out = storage.create(tmp)
    try:
        finisher = Finisher(plan, inputs, out, block_rows)
        for block in blocks:
            finisher.add(block)
        ledger = finisher.ledger()
        out.close()
    except BaseException:
        out.close()
        storage.remove(tmp)
        raise
    return Draft(storage, root, tmp, ledger, finisher.sums)


def file_checksum(storage: files.Storage, path: str) -> str | None:
    """``"sha256:"`` of a file's bytes, read block by block; None if it does not exist."""
    if not storage.exists(path):
        return None
    h = hashlib.sha256()
    with storage.open(path) as f:
        while b := f.read(files.BLOCK):
            h.update(b)
    return "sha256:" + h.hexdigest()


def publish(d: Draft) -> None:
    """The draft's table under its name (an identical one already there is kept, and the draft removed)."""
    if d.tmp is None:
        return
    path = fmt.join(d.root, d.ledger["table"]["path"])
    if file_checksum(d.storage, path) == d.ledger["table"]["checksum"]:
        d.storage.remove(d.tmp)
        return
    files.publish(d.storage, d.tmp, path)


def discard(d: Draft) -> None:
    if d.tmp is not None:
        d.storage.remove(d.tmp)


def remove_other_tables(storage: files.Storage, root: str, keep: str | None) -> None:
    """Delete the tables in ``root`` that its ledger does not name (an earlier, interrupted finish's)."""
    for e in storage.match(fmt.join(root, f"{chunk_table.TABLE_PREFIX}*{chunk_table.TABLE_SUFFIX}")):
        name = e.path.rstrip("/").rsplit("/", 1)[-1]
        if chunk_table.is_table_name(name) and name != keep:
            storage.remove(e.path)


def finish_cache(storage: files.Storage, root: str, plan: Mapping[str, Any], inputs: Sequence[Mapping[str, Any]],
                 entries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Finish the cache in ``root`` at once (an importer's last step): its table (version 4) published, then
    its finished ledger written (the commit), then any other table removed. Returns the ledger."""
    d = draft(storage, root, plan, inputs, [list(entries)])
    publish(d)
    files.write(storage, fmt.join(root, fmt.LEDGER_NAME), fmt.dumps_ledger(d.ledger).encode())
    remove_other_tables(storage, root, (d.ledger.get("table") or {}).get("path"))
    return d.ledger
