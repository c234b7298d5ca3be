"""Exporting a cache to other training-data formats: ``python -m reader export CACHE --format F --out PATH``.

Formats:

* ``megatron``: Megatron-Core's indexed dataset, ``PATH.bin`` + ``PATH.idx`` (``reader/interop/megatron.py``).
* ``flat-tokens``: seqax's zarr flat-tokens dataset, groups ``train`` and ``validation``
  (``reader/interop/flat_tokens.py``).

Both stream the cache in global order (ledger chunk order, documents in chunk order), one Parquet row
group at a time, with every chunk file checked against the ledger's size and sha256 before it is
decoded; memory stays bounded by a few chunk files whatever the cache's size. Outputs are written under
temporary names and renamed into place at the end, so a file (or zarr directory) with the final name is
complete. The reference is ``docs/INTEROP.md``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reader.format import spec as fmt
from reader.format.splits import SPLIT_NAMES
from reader.storage import files, remote
from reader.storage.cache import Cache
from reader.storage.remote import protocol_of
from reader.format.sidecar import file_mismatch
from reader.storage.validate import chunk_error
from reader.storage.whatis import not_a_cache

SPLITS = SPLIT_NAMES


class ExportError(fmt.FormatError):
    """An export cannot run or its input is damaged; the message names the file and the fix."""


# --------------------------------------------------------------------------------------------------
# Reading a finished cache in global order


def open_finished(url: str) -> Cache:
    """The cache at ``url``; raises :class:`ExportError` unless its build has finished, or if it has loss
    masks (neither output format has a standard place for them: the export would drop them)."""
    cache = Cache(url)
    if not cache.complete:
        raise ExportError(f"{cache.display(fmt.LEDGER_NAME)}: the build has not finished (finished: false). "
                          "Export needs a finished cache: wait for the build, or rerun the build command.")
    if cache.ledger.masked:
        raise ExportError(f"{cache.display(fmt.LEDGER_NAME)}: a cache with loss masks (config.record_format = "
                          f"{cache.ledger.config.get('record_format')!r}); neither Megatron's .bin/.idx nor "
                          "flat-tokens has a standard place for a loss mask, so an export would train on every "
                          "token. Read it with the reader (reader.Reader, JaxLoader, TokenBatches), which carries "
                          "the mask as loss_mask.")
    return cache


def split_caches(url: str) -> dict[str, str]:
    """The caches of a dataset: ``{"train": url}`` for a plain cache, or ``train``/``validation`` for a
    directory holding those sub-caches (each with its own ledger)."""
    fs, root, anonymous = remote.filesystem(url)
    root = root.rstrip("/")
    if protocol_of(url) != "file":
        remote.check_open(fs, url, f"{root}/{fmt.LEDGER_NAME}", f"{url.rstrip('/')}/{fmt.LEDGER_NAME}",
                          anonymous=anonymous)
    if fs.exists(root + "/" + fmt.LEDGER_NAME):
        return {"train": url}
    found = {s: url.rstrip("/") + "/" + s for s in SPLITS if fs.exists(f"{root}/{s}/{fmt.LEDGER_NAME}")}
    if "train" not in found:
        raise not_a_cache(fs, root, url)
    return found


@dataclasses.dataclass(frozen=True)
class Block:
    """The documents of one row group: ``lengths[i]`` tokens each, concatenated in ``values``."""

    chunk: int  # global chunk index
    lengths: np.ndarray  # int32 [docs]
    values: np.ndarray  # int32 [tokens]


def _column_numpy(column, dtype) -> np.ndarray:
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=dtype)


def _read_verified(cache: Cache, c: int) -> bytes:
    rel = cache.table.paths[c]
    try:
        data = cache.cat(rel)
    except FileNotFoundError:
        raise chunk_error(cache, rel, "missing (listed in the ledger)") from None
    wrong = file_mismatch(data, int(cache.table.nbytes[c]), cache.table.checksums[c])
    if wrong:
        raise chunk_error(cache, rel, wrong)
    return data


def _blocks_of(cache: Cache, c: int, data: bytes) -> list[Block]:
    rel = cache.table.paths[c]
    pf = pq.ParquetFile(pa.BufferReader(data))
    out, docs, tokens = [], 0, 0
    for g in range(pf.metadata.num_row_groups):
        t = pf.read_row_group(g, columns=[fmt.TOKEN_COLUMN, fmt.LENGTH_COLUMN])
        lists = t.column(0).combine_chunks()
        values = _column_numpy(lists.flatten(), np.int32)
        lengths = _column_numpy(t.column(1), np.int32)
        offsets = _column_numpy(lists.offsets, np.int64)
        if len(values) != int(lengths.sum(dtype=np.int64)) or not np.array_equal(np.diff(offsets), lengths):
            raise ExportError(f"{cache.display(rel)}: row group {g}: {fmt.LENGTH_COLUMN} disagrees with the token "
                              "lists (damaged chunk; rebuild it)")
        docs += len(lengths)
        tokens += len(values)
        out.append(Block(c, lengths, values))
    if docs != int(cache.table.docs[c]) or tokens != int(cache.table.tokens[c]):
        raise ExportError(f"{cache.display(rel)}: holds {docs} documents / {tokens} tokens, the ledger says "
                          f"{int(cache.table.docs[c])} / {int(cache.table.tokens[c])}")
    return out


def iter_blocks(cache: Cache, *, prefetch: int = 2, chunks: Sequence[int] | None = None) -> Iterator[Block]:
    """Every document of a finished cache in global order, a row group at a time (verified reads).

    The next ``prefetch`` chunk files are fetched and decoded in the background while the caller
    consumes the current one, so memory holds at most ``prefetch + 1`` chunks.

    Args:
      cache: a finished cache.
      prefetch: chunk files fetched and decoded ahead.
      chunks: global chunk indices to read, in this order (default: all); empty chunks are not read.
    """
    todo = [c for c in (range(len(cache.table)) if chunks is None else chunks) if int(cache.table.docs[c]) > 0]

    def load(c: int) -> list[Block]:
        return _blocks_of(cache, c, _read_verified(cache, c))

    with cf.ThreadPoolExecutor(max(1, prefetch)) as pool:
        pending = [pool.submit(load, c) for c in todo[:prefetch + 1]]
        nxt = len(pending)
        while pending:
            blocks = pending.pop(0).result()
            if nxt < len(todo):
                pending.append(pool.submit(load, todo[nxt]))
                nxt += 1
            yield from blocks


def check_token_range(block: Block, vocab_size: int, cache: Cache) -> None:
    """Token ids must lie in ``[0, vocab_size)``; else an error naming the chunk file."""
    if block.values.size and (int(block.values.min()) < 0 or int(block.values.max()) >= vocab_size):
        bad = int(block.values.max()) if int(block.values.max()) >= vocab_size else int(block.values.min())
        raise ExportError(f"{cache.display(cache.table.paths[block.chunk])}: token id {bad} is outside the "
                          f"tokenizer's vocabulary [0, {vocab_size}) recorded in the ledger")


def vocab_size_of(cache: Cache) -> int:
    v = cache.ledger.tokenizer.get("vocab_size")
    if not isinstance(v, int) or v <= 0:
        raise ExportError(f"{cache.display(fmt.LEDGER_NAME)}: tokenizer.vocab_size is missing or not a positive "
                          "integer; the output dtype is chosen from it")
    return v


# --------------------------------------------------------------------------------------------------
# Atomic outputs


def output_location(path: str):
    """``(fs, path)`` of an output location; an unreachable remote location fails in seconds with a
    :class:`reader.storage.remote.StorageError` naming it."""
    fs, p, anonymous = remote.filesystem(path)
    if protocol_of(path) != "file":  # bounded first contact, as for a cache (reader.storage.remote)
        remote.check_open(fs, path, p, path, anonymous=anonymous)
    return fs, p


def output_fs(path: str):
    """:func:`output_location`, with the local directories leading to it created."""
    fs, p = output_location(path)
    parent = p.rstrip("/").rsplit("/", 1)[0] if "/" in p.rstrip("/") else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    return fs, p


def rename(fs, src: str, dst: str) -> None:
    """Move ``src`` onto ``dst`` (atomic on a local filesystem; on Cloud Storage ``dst`` appears whole)."""
    files.storage(fs).rename(src, dst)


def write_file(path: str, write: Callable[[Any], None]) -> None:
    """Write the file ``path`` (exactly that name, local or fsspec URL) through ``write(f)``: under a
    temporary name beside it, renamed onto ``path`` once complete (nothing half-written is left)."""
    fs, p = output_fs(path)
    if fs.isdir(p):
        raise IsADirectoryError(f"{path}: is a directory; give a file name, e.g. {path.rstrip('/')}/batches.npz")
    files.write(fs, p, write)


# --------------------------------------------------------------------------------------------------
# Command line
