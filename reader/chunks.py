"""Chunk data: fetch, verify, decode only the needed row groups, and keep it in a bounded LRU.

A chunk file is fetched whole with fsspec (one request), its length and sha256 checksum are compared
with the ledger (a truncated or corrupted file raises :class:`ChunkError` naming it), and its bytes stay
in the LRU so that row groups can be decoded one at a time, using the ``ROW_GROUP_TOKENS_KEY``
metadata to know which row groups a token range needs. Decoded row groups are flat ``int32`` token
arrays plus document start offsets. Everything cached counts against ``memory_budget_bytes``;
concurrent requests for the same item (the prefetch thread and the caller) share one load.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import json
import threading
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import format as fmt
from .cache import Cache


class ChunkError(fmt.FormatError):
    """A chunk file is missing, truncated, corrupted, or does not match its ledger entry."""


@dataclasses.dataclass(frozen=True)
class ChunkMeta:
    """A verified chunk file: its bytes, row-group layout and document lengths (one chunk, not the cache)."""

    index: int  # global chunk index
    path: str  # relative path
    data: bytes
    rg_token_starts: np.ndarray  # int64 [G+1]: token offset of each row group inside the chunk
    rg_doc_starts: np.ndarray  # int64 [G+1]: document offset of each row group
    doc_lengths: np.ndarray  # int64 [docs]
    doc_starts: np.ndarray  # int64 [docs+1]: token offset of each document inside the chunk

    @property
    def nbytes(self) -> int:
        return len(self.data) + 8 * (self.rg_token_starts.size * 2 + self.doc_lengths.size * 2 + 1)


@dataclasses.dataclass(frozen=True)
class RowGroup:
    tokens: np.ndarray  # int32, the row group's documents concatenated
    doc_starts: np.ndarray  # int64 [docs+1], token offsets relative to the row group start

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.doc_starts.nbytes


def _error(cache: Cache, rel: str, what: str) -> ChunkError:
    return ChunkError(
        f"{cache.display(rel)}: {what}. The file does not match the ledger; no tokens were returned from "
        "it. Rerun the build command that made this cache (it rewrites missing chunks; delete a damaged "
        "chunk and its .json sidecar first), or run `python -m reader validate` to list every problem."
    )


def parse_chunk(cache: Cache, index: int, data: bytes, entry: dict[str, Any] | None = None) -> ChunkMeta:
    """Verify ``data`` (the bytes of global chunk ``index``) against the ledger and read its layout."""
    t = cache.table
    rel = t.paths[index]
    want_bytes = int(t.nbytes[index])
    if len(data) != want_bytes:
        kind = "truncated" if len(data) < want_bytes else "longer than recorded"
        raise _error(cache, rel, f"{kind}: {len(data)} bytes, the ledger says {want_bytes}")
    got = fmt.checksum(data)
    if got != t.checksums[index]:
        raise _error(cache, rel, f"checksum mismatch: file has {got}, the ledger says {t.checksums[index]}")
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        kv = pf.metadata.metadata or {}
        rg_tokens = json.loads(kv[fmt.ROW_GROUP_TOKENS_KEY])
        lengths = pf.read(columns=[fmt.LENGTH_COLUMN]).column(0).to_numpy().astype(np.int64)
        rg_rows = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
    except KeyError:
        raise _error(cache, rel, f"no {fmt.ROW_GROUP_TOKENS_KEY.decode()} key in the Parquet metadata") from None
    except Exception as e:  # pyarrow raises several types for damaged files
        raise _error(cache, rel, f"not a readable Parquet chunk ({e})") from e
    if len(rg_tokens) != len(rg_rows):
        raise _error(cache, rel, f"{len(rg_rows)} row groups but {len(rg_tokens)} row-group token counts")
    if lengths.size != int(t.docs[index]) or int(lengths.sum()) != int(t.tokens[index]):
        raise _error(cache, rel, f"{lengths.size} documents / {int(lengths.sum())} tokens, the ledger says "
                                 f"{int(t.docs[index])} / {int(t.tokens[index])}")
    rg_doc_starts = np.concatenate([[0], np.cumsum(rg_rows, dtype=np.int64)])
    doc_starts = np.concatenate([[0], np.cumsum(lengths)])
    rg_token_starts = np.concatenate([[0], np.cumsum(np.asarray(rg_tokens, dtype=np.int64))])
    if not np.array_equal(doc_starts[rg_doc_starts], rg_token_starts):
        raise _error(cache, rel, "row-group token counts disagree with the num_tokens column")
    return ChunkMeta(index, rel, data, rg_token_starts, rg_doc_starts, lengths, doc_starts)


class ChunkStore:
    """Verified chunk bytes and decoded row groups, in an LRU bounded by ``memory_budget_bytes``."""

    def __init__(self, cache: Cache, *, memory_budget_bytes: int = 1 << 30, threads: int = 2):
        self.cache = cache
        self.budget = int(memory_budget_bytes)
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[Any, tuple[Any, int]] = collections.OrderedDict()
        self._inflight: dict[Any, cf.Future] = {}
        self._used = 0
        self.opened: set[int] = set()  # global indices of chunks whose bytes were fetched
        self.fetches = 0  # chunk files fetched (a refetch after eviction counts again)
        self.bytes_fetched = 0
        self.decodes = 0  # row groups decoded
        self._pool = cf.ThreadPoolExecutor(max(1, threads), thread_name_prefix="chunkledger-prefetch")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- LRU ------------------------------------------------------------------------------------------
    def _get(self, key: Any, load: Callable[[], tuple[Any, int]]) -> Any:
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                return hit[0]
            fut = self._inflight.get(key)
            owner = fut is None
            if owner:
                fut = cf.Future()
                self._inflight[key] = fut
        if not owner:
            return fut.result()
        try:
            value, nbytes = load()
        except BaseException as e:
            with self._lock:
                del self._inflight[key]
            fut.set_exception(e)
            raise
        with self._lock:
            del self._inflight[key]
            self._lru[key] = (value, nbytes)
            self._used += nbytes
            while self._used > self.budget and len(self._lru) > 1:
                _, (_, n) = self._lru.popitem(last=False)
                self._used -= n
        fut.set_result(value)
        return value

    @property
    def used_bytes(self) -> int:
        return self._used

    # -- loading ----------------------------------------------------------------------------------------
    def meta(self, index: int) -> ChunkMeta:
        """The verified chunk ``index`` (fetched whole on first use)."""
        return self._get(("chunk", index), lambda: self._load_meta(index))

    def _load_meta(self, index: int):
        rel = self.cache.table.paths[index]
        try:
            data = self.cache.fs.cat_file(self.cache.path(rel))
        except FileNotFoundError:
            raise _error(self.cache, rel, "missing") from None
        with self._lock:
            self.opened.add(index)
            self.fetches += 1
            self.bytes_fetched += len(data)
        m = parse_chunk(self.cache, index, data)
        return m, m.nbytes

    def row_group(self, index: int, group: int) -> RowGroup:
        return self._get(("rg", index, group), lambda: self._load_row_group(index, group))

    def _load_row_group(self, index: int, group: int):
        m = self.meta(index)
        try:
            pf = pq.ParquetFile(pa.BufferReader(m.data))
            col = pf.read_row_group(group, columns=[fmt.TOKEN_COLUMN]).column(0)
            tokens = col.combine_chunks().flatten().to_numpy()
        except Exception as e:
            raise _error(self.cache, m.path, f"row group {group} cannot be decoded ({e})") from e
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        lo, hi = m.rg_doc_starts[group], m.rg_doc_starts[group + 1]
        starts = m.doc_starts[lo:hi + 1] - m.doc_starts[lo]
        if tokens.size != int(starts[-1]):
            raise _error(self.cache, m.path, f"row group {group} holds {tokens.size} tokens, num_tokens says "
                                             f"{int(starts[-1])}")
        with self._lock:
            self.decodes += 1
        rg = RowGroup(tokens, starts)
        return rg, rg.nbytes

    def prefetch(self, fn: Callable[[], Any]) -> cf.Future:
        """Run ``fn`` (which touches the store) on the background pool."""
        return self._pool.submit(fn)

    def submit(self, fn: Callable[..., Any], *args) -> cf.Future:
        return self._pool.submit(fn, *args)

    # -- token ranges -------------------------------------------------------------------------------------
    def tokens(self, index: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[lo, hi)`` of chunk ``index`` and each token's position within its document."""
        m = self.meta(index)
        g0 = int(np.searchsorted(m.rg_token_starts, lo, side="right")) - 1
        g1 = int(np.searchsorted(m.rg_token_starts, hi - 1, side="right")) - 1 if hi > lo else g0
        toks, poss = [], []
        for g in range(g0, g1 + 1):
            base = int(m.rg_token_starts[g])
            a, b = max(lo, base) - base, min(hi, int(m.rg_token_starts[g + 1])) - base
            if b <= a:
                continue
            rg = self.row_group(index, g)
            toks.append(rg.tokens[a:b])
            poss.append(_positions(rg.doc_starts, a, b))
        if len(toks) == 1:
            return toks[0], poss[0]
        if not toks:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        return np.concatenate(toks), np.concatenate(poss)


def _positions(doc_starts: np.ndarray, a: int, b: int) -> np.ndarray:
    """Position within its document of each token ``a..b-1`` (doc_starts: token offsets, length docs+1)."""
    d0 = int(np.searchsorted(doc_starts, a, side="right")) - 1
    d1 = int(np.searchsorted(doc_starts, b - 1, side="right")) - 1
    starts = doc_starts[d0:d1 + 1]
    bounds = np.concatenate([[a], doc_starts[d0 + 1:d1 + 1], [b]])
    base = np.repeat(starts, np.diff(bounds))
    return (np.arange(a, b, dtype=np.int64) - base).astype(np.int32)


def validate_chunk(cache: Cache, index: int, *, decode: bool = True) -> list[str]:
    """Problems with global chunk ``index`` (empty list if it is sound): file, checksum, layout, sidecar."""
    t = cache.table
    rel = t.paths[index]
    problems = []
    try:
        try:
            data = cache.fs.cat_file(cache.path(rel))
        except FileNotFoundError:
            raise _error(cache, rel, "missing") from None
        m = parse_chunk(cache, index, data)
        if decode:
            pf = pq.ParquetFile(pa.BufferReader(m.data))
            for g in range(pf.metadata.num_row_groups):
                col = pf.read_row_group(g, columns=[fmt.TOKEN_COLUMN]).column(0)
                n = len(col.combine_chunks().flatten())
                want = int(m.rg_token_starts[g + 1] - m.rg_token_starts[g])
                if n != want:
                    raise _error(cache, rel, f"row group {g} decodes to {n} tokens, metadata says {want}")
    except fmt.FormatError as e:
        problems.append(str(e).split(". The file does not match")[0])
    except Exception as e:  # noqa: BLE001 - report, never crash the validator
        problems.append(f"{cache.display(rel)}: {e!r}")
    shard, k = int(t.shard[index]), int(t.index_in_shard[index])
    side = fmt.sidecar_path(shard, k)
    try:
        entry = json.loads(cache.fs.cat_file(cache.path(side)))
        if cache.complete:
            want = {key: v for key, v in cache.ledger.raw["chunks"][index].items()
                    if key not in ("doc_offset", "token_offset")}
            if entry != want:
                diff = sorted(key for key in set(entry) | set(want) if entry.get(key) != want.get(key))
                problems.append(f"{cache.display(side)}: sidecar differs from the ledger entry in {diff}")
    except FileNotFoundError:
        problems.append(f"{cache.display(side)}: sidecar missing")
    except ValueError as e:
        problems.append(f"{cache.display(side)}: not valid JSON ({e})")
    return problems
