"""The build's last step: each cache's chunk table streamed from its chunks' entries, the verdict, the finished
ledgers (docs/FORMAT.md, "Chunk table").

No process ever holds more than one block of rows. Every worker writes a chunk's *entry* (its version 3 ledger
entry without offsets, ``chunk-KKKKKK.entry``) right after its sidecar; the finalize reads them back in global
order, a block of :data:`reader.format.table.BLOCK_ROWS` at a time (many reads in flight), and writes each
block of the table as it goes (:mod:`reader.storage.finish`), summing what the ledger's totals and the verdicts
need (per shard: documents and bad records, for the empty-input check). A rerun of an unfinished cache of an
older version finishes it in that version: its ledger's chunk list is built from the same entries, in memory
(such caches were small), and it has no table. Then, in this order: the verdict (``_FAILED.json`` and no table
if the build must stop), each table under its name (``table-H.bin``), each finished ledger naming it (the
commit, train then validation), and last any table no ledger names. The entries stay (a rerun of the finished
cache keeps them; removing a million files would cost more than the finalize: each unlink is a metadata
write, and on a disk mounted with ``discard`` a synchronous trim).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from reader.format import spec as fmt
from reader.format import checks
from reader.format import blocks
from reader.format import table as chunk_table
from reader.order.streams import round_robin_order
from reader.storage import finish

from pipelines.errors import BuildError
from pipelines.filesystem import BEAM, read_or_none

ENTRY_THREADS = 32  # entries read at once (remote storage: each is a round trip)


def final_inputs(plan: Mapping[str, Any], root: str) -> list[dict[str, Any]]:
    """The finished ledger's ``inputs``: each input of the plan with ``uncompressed_bytes``, and a compressed
    shard's chunk count and size from its ``_DONE.json``."""
    out = []
    for inp in plan["inputs"]:
        inp = {k: v for k, v in inp.items() if k != "fingerprint"}  # the build's own check, not the content's
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
    raw = read_or_none(path)
    if raw is None:
        return None
    try:
        done = fmt.load_json(raw)
    except ValueError:
        return None
    ok = isinstance(done, dict) and all(checks.is_int(done.get(k), 0, checks.MAX_COUNT) for k in ("chunks", "uncompressed_bytes"))
    return {"chunks": done["chunks"], "uncompressed_bytes": done["uncompressed_bytes"]} if ok else None


def entry_blocks(root: str, order: np.ndarray, block_rows: int = chunk_table.BLOCK_ROWS,
                 threads: int = ENTRY_THREADS) -> Iterator[list[dict[str, Any]]]:
    """The entries of the chunks ``order`` (``(shard, index)`` rows, global order) in ``root``, a block of
    ``block_rows`` at a time; the next block's reads are in flight while one is used."""
    def read(row) -> bytes | None:
        try:
            return BEAM.read(fmt.join(root, chunk_table.entry_path(int(row[0]), int(row[1]))))
        except FileNotFoundError:
            return None

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


def draft_table(root: str, plan: Mapping[str, Any], inputs: Sequence[Mapping[str, Any]],
                blocks: Iterable[list[Mapping[str, Any]]] | None = None,
                block_rows: int = chunk_table.BLOCK_ROWS) -> finish.Draft:
    """The finished ledger of the cache in ``root`` from its entries (``blocks``, in global order, a block of
    ``block_rows`` each; default: its entry files), its table under a temporary name in ``root``
    (:func:`reader.storage.finish.draft`; a rerun of an older version's cache: its chunk list, no table).

    Each entry is checked before it is used. Raises BuildError naming the first entry that is missing or wrong.
    """
    order = round_robin_order([int(inp["chunks"]) for inp in inputs])
    if blocks is None:
        blocks = entry_blocks(root, order, block_rows)
    try:
        return finish.draft(BEAM, root, plan, inputs, blocks, block_rows)
    except finish.EntryError as e:
        s, k = map(int, order[min(e.row, len(order) - 1)])
        if str(e) == "missing":
            raise BuildError(f"internal: chunk {fmt.join(root, fmt.chunk_path(s, k))} is missing after the "
                             f"build (no {chunk_table.entry_path(s, k)})") from None
        raise BuildError(f"{fmt.join(root, chunk_table.entry_path(s, k))}: not this chunk's entry ({e}); delete it "
                         "and the chunk's .json sidecar, and rerun the same command") from None


def remove_other_tables(root: str, keep: str | None) -> None:
    """Delete the tables in ``root`` that the ledger does not name (an earlier, interrupted finalize's)."""
    finish.remove_other_tables(BEAM, root, keep)


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
            raw = read_or_none(path)
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
                self._table = blocks.BlockFile(desc, lambda rel, r: BEAM.read_ranges(fmt.join(self.root, rel), r),
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
