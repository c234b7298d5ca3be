"""The chunk store: fetch only the needed row groups by byte range, verify each, decode it, keep it in an LRU.

A chunk is opened (:func:`reader.storage.chunk.open_chunk`) from its sidecar and Parquet footer. A row group
is then one range read of its bytes, whose sha256 is compared with the sidecar BEFORE anything is
decoded (:mod:`reader.storage.pages`): a truncated or corrupted chunk raises :class:`reader.ChunkError`
naming the file and the row group, and no wrong token is ever returned. Decoded row groups are flat
``int32`` token arrays plus document starts (4 bytes per token; 5 with a masked cache's loss flags); they, and the small per-chunk
metadata, count against ``memory_budget_bytes`` (fetched bytes are not kept). Concurrent requests
for the same item (the prefetch threads and the caller) share one load.

A remote cache on an asynchronous filesystem (gcsfs for ``gs://``) is read ahead with many requests in
flight and no thread waiting on them (:mod:`reader.storage.requests`); a local one with ``os.pread`` on
the threads.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import io
import os
import threading
import weakref
from typing import Any, Callable

import numpy as np

from reader.format import spec as fmt
from reader.storage import files
from reader.storage.cache import Cache
from reader.storage.chunk import ChunkMeta, DocIndex, RowGroup, open_chunk
from reader.storage.pages import decode_loss_spans, decode_row_group, loss_flags
from reader.format.sidecar import arrow_message
from reader.storage.requests import TIMEOUT_S, ReadAhead, Requests
from reader.storage.validate import chunk_error
from reader.storage.views import View, keep_documents, viewed_meta


_MAX_OPEN_FILES = 64


def _nothing() -> None:
    pass


def _shutdown(pools: list[cf.ThreadPoolExecutor], files: dict, lock: threading.Lock,
              requests: Requests | None) -> None:
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)
    with lock:
        for f in files.values():
            f.close()
        files.clear()
    if requests is not None:
        requests.close()


class ChunkStore:
    """Verified, decoded row groups (and per-chunk layouts) in an LRU bounded by ``memory_budget_bytes``.

    Args:
      cache: the open cache.
      memory_budget_bytes: bound on decoded row groups and chunk layouts kept.
      threads: background threads for :meth:`submit` (prefetch work).
      executor: a thread pool to use instead of starting ``threads`` (the stores of a mixture's
        components share one); the store does not shut it down.
      planner: the one-thread pool of :meth:`plan` to use instead of starting one (a mixture's stores
        share one); the store does not shut it down.
      view: a :class:`reader.storage.views.View`: chunks hold its kept documents only (their layouts count
        those, their row groups are decoded whole and the others left out).
      timeout_s: a remote request not answered in this long raises :class:`reader.ReaderStalled`
        (:mod:`reader.storage.requests`; a reader gives ``ReadOptions.worker_timeout_s``).
    """

    def __init__(self, cache: Cache, *, memory_budget_bytes: int = 1 << 30, threads: int = 2,
                 executor: cf.ThreadPoolExecutor | None = None, view: View | None = None,
                 planner: cf.ThreadPoolExecutor | None = None, timeout_s: float = TIMEOUT_S):
        self.cache = cache
        self.timeout_s = timeout_s
        self.view = view
        self.budget = int(memory_budget_bytes)
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[Any, tuple[Any, int]] = collections.OrderedDict()
        self._inflight: dict[Any, cf.Future] = {}
        self._used = 0
        self.opened: set[int] = set()  # global indices of chunks whose metadata or data were fetched
        self.fetches = 0  # row-group byte ranges (or whole legacy files) fetched; again after eviction
        self.meta_fetches = 0  # chunks opened (sidecar + footer); again after eviction
        self.bytes_fetched = 0  # every byte fetched: sidecars, footers, row groups
        self.decodes = 0  # row groups decoded
        self.fast_decode = True  # PLAIN pages: decompress and take the values (reader.storage.pages)
        self.masked = cache.ledger.masked  # row groups carry loss flags (their loss_spans column)
        self.progress: Callable[[], None] = _nothing  # called at every fetch (a reader's liveness)
        own = executor is None
        self._pool = executor or cf.ThreadPoolExecutor(max(1, threads), thread_name_prefix="chunkledger-prefetch")
        # Local caches: byte ranges are os.pread() calls on descriptors kept open (fsspec opens the file
        # for every range, which costs as much as reading a row group). Other filesystems use fsspec.
        self._files: collections.OrderedDict[str, io.FileIO] = collections.OrderedDict()
        self._local = cache.is_local
        # a remote cache on an asynchronous filesystem: requests on its event loop (reader.storage.requests)
        self.asynchronous: bool = not self._local and bool(getattr(cache.fs, "async_impl", False))
        self.remote = ReadAhead(self) if self.asynchronous else None
        # read-ahead planning on a remote cache read asynchronously: a thread of its own (see plan())
        own_planner = planner is None and self.asynchronous
        self._planner = cf.ThreadPoolExecutor(1, thread_name_prefix="chunkledger-plan") if own_planner else planner
        # a store dropped without close() still stops its threads, closes its files and cancels its requests
        pools = ([self._pool] if own else []) + ([self._planner] if own_planner else [])
        self._closer = weakref.finalize(self, _shutdown, pools, self._files, self._lock,
                                        None if self.remote is None else self.remote.requests)

    def close(self) -> None:
        self._closer()

    # -- LRU ------------------------------------------------------------------------------------------
    def _get(self, key: Any, load: Callable[[], tuple[Any, int]], wait: bool = True) -> Any:
        """The cached value of ``key``, else ``load()`` it (once, whoever asks meanwhile waits for it);
        ``wait=False``: return None instead of waiting for a load another thread runs."""
        hit, fut, owner = self._begin(key)
        if fut is None:
            return hit
        if not owner:
            return fut.result() if wait else None
        try:
            value, nbytes = load()
        except BaseException as e:
            self._end(key, fut, error=e)
            raise
        self._end(key, fut, value, nbytes)
        return value

    def _begin(self, key: Any) -> tuple[Any, cf.Future | None, bool]:
        """``(value, None, False)`` if ``key`` is cached; else ``(None, future, owner)``: the load under way,
        or a new one this caller owns (it must :meth:`_end` it)."""
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                return hit[0], None, False
            fut = self._inflight.get(key)
            if fut is not None:
                return None, fut, False
            fut = self._inflight[key] = cf.Future()
            return None, fut, True

    def _end(self, key: Any, fut: cf.Future, value: Any = None, nbytes: int = 0, error: BaseException | None = None):
        """Finish the load of ``key`` that :meth:`_begin` started: cache ``value`` (or fail with ``error``);
        an opened chunk's :meth:`when_open` work runs before anyone waiting for it wakes."""
        with self._lock:
            del self._inflight[key]
            if error is None:
                self._lru[key] = (value, nbytes)
                self._used += nbytes
                while self._used > self.budget and len(self._lru) > 1:
                    _, (_, n) = self._lru.popitem(last=False)
                    self._used -= n
            then = self.remote.opened(key[1]) if key[0] == "chunk" and self.remote is not None else ()
        for fn in then if error is None else ():
            self._quietly(fn, value)
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)

    @staticmethod
    def _quietly(fn: Callable[..., Any], *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - read-ahead work never fails a read; the read itself reports
            pass

    @property
    def used_bytes(self) -> int:
        return self._used

    def release(self, index: int, group: int) -> None:
        """Drop row group ``group`` of chunk ``index`` from the cache now (the read is past it), so its memory
        is freed once nothing else refers to it. Only a cache decision: a later read decodes it again."""
        self.release_range(index, group, group + 1)

    def release_range(self, index: int, lo: int, hi: int) -> int:
        """:meth:`release` row groups ``lo .. hi-1`` of chunk ``index`` (those in the cache); returns how
        many were there."""
        got = 0
        with self._lock:
            for group in range(lo, hi):
                hit = self._lru.pop(("rg", index, group), None)
                if hit is not None:
                    self._used -= hit[1]
                    got += 1
        return got

    def cached_meta(self, index: int) -> ChunkMeta | None:
        """Chunk ``index``'s layout if it is in the cache now (never fetches)."""
        with self._lock:
            hit = self._lru.get(("view" if self.remote is not None and self.view is not None else "chunk", index))
        return None if hit is None else hit[0]

    def _count(self, index: int, nbytes: int, *, data: bool | None) -> None:
        """Tally a fetch: ``data`` True for chunk data, False for opening a chunk, None for its footer."""
        self.progress()
        with self._lock:
            self.opened.add(index)
            self.bytes_fetched += nbytes
            if data:
                self.fetches += 1
            elif data is not None:
                self.meta_fetches += 1

    def _cat(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            if start is not None and self._local:
                return self._pread(rel, start, end)
            if self.remote is not None:  # (a read waits for it: ahead of the read-ahead's requests waiting their turn)
                requests = self.remote.requests
                return requests.wait(requests.request(rel, start, end, urgent=True))
            return self.cache.cat(rel, start, end)
        except FileNotFoundError:
            raise chunk_error(self.cache, rel, "missing") from None
        except files.UnsafeFile as e:
            raise self.cache.unsafe(rel, e) from None

    @property
    def latency_s(self) -> float | None:
        """Seconds a range request of this store takes, averaged over the latest (None: not a remote cache
        read asynchronously, or no request yet)."""
        return None if self.remote is None else self.remote.requests.latency_s

    @property
    def waited_s(self) -> float:
        """Seconds reads have spent waiting for this store's requests (0: not a remote cache read
        asynchronously)."""
        return 0.0 if self.remote is None else self.remote.requests.waited_s

    def when_open(self, index: int, fn: Callable[[ChunkMeta], None]) -> None:
        """Run ``fn(meta)`` once chunk ``index`` is open: now if it is; on a remote cache read
        asynchronously, when its sidecar and footer have come back (opening it without waiting, if nobody
        is), before anyone waiting for it wakes; otherwise after opening it in this thread. Read-ahead
        work: an error (of ``fn`` or of the opening) is dropped, the read itself reports it."""
        if self.remote is not None:
            if self.view is not None:  # (the view's mask is read off the event loop, then fn runs)
                self.remote.when_open(index, lambda _m: self.submit(lambda: self._quietly(fn, self.meta(index))))
                return
            self.remote.when_open(index, fn)
            return
        try:
            m = self.meta(index)
        except Exception:  # noqa: BLE001 - see above
            return
        self._quietly(fn, m)

    def _pread(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a local file (fewer at its end), through a kept-open file. An evicted
        file is only dropped from the table; it closes when the last thread reading it lets go, so a
        descriptor is never closed (and its number reused) under a concurrent read."""
        with self._lock:
            f = self._files.get(rel)
            if f is not None:
                self._files.move_to_end(rel)
        if f is None:
            f = self.cache.storage.open(self.cache.path(rel))  # through the door: a FIFO is refused
            with self._lock:
                f = self._files.setdefault(rel, f)
                while len(self._files) > _MAX_OPEN_FILES:
                    self._files.popitem(last=False)
        return os.pread(f.fileno(), max(0, end - start), start)

    # -- loading ----------------------------------------------------------------------------------------
    def meta(self, index: int) -> ChunkMeta:
        """Chunk ``index``'s verified layout (sidecar + footer, fetched on first use)."""
        if self.remote is not None:  # (every request of a remote store is one of its Requests)
            m = self.remote.meta(index)
            return m if self.view is None else self._get(("view", index), lambda: viewed_meta(self.view, m))
        if self.view is not None:
            return self._get(("chunk", index), lambda: viewed_meta(
                self.view, open_chunk(self.cache, index, self._cat, self._count)[0]))
        return self._get(("chunk", index), lambda: open_chunk(self.cache, index, self._cat, self._count))

    def doc_index(self, index: int) -> DocIndex:
        """Every document length of chunk ``index`` (decodes each of its row groups; unpacked reads)."""
        return self._get(("docs", index), lambda: self._load_docs(("docs", index), index, 0, None))

    def window_docs(self, index: int, lo: int, hi: int) -> DocIndex:
        """The documents of row groups ``lo .. hi-1`` of chunk ``index`` (decodes them; a best-fit packing
        window), ``doc_starts`` as token offsets in the chunk."""
        key = ("docs", index, lo, hi)
        return self._get(key, lambda: self._load_docs(key, index, lo, hi))

    def _load_docs(self, key, index: int, lo: int, hi: int | None):
        m = self.meta(index)
        hi = m.num_row_groups if hi is None else hi
        if hi - lo > 2 and not self.asynchronous:  # the background threads decode the second half meanwhile
            self.submit(self._warm_for_docs, key, index, list(range((lo + hi) // 2, hi)))
        if self.asynchronous:  # every row group requested at once (decoded as they come)
            self.warm_row_groups(index, range(lo, hi))
        parts = [np.diff(self.row_group(index, g).doc_starts) for g in range(lo, hi)]
        lengths = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        d = DocIndex(lengths, int(m.rg_token_starts[lo]) + np.concatenate([[0], np.cumsum(lengths)]))
        return d, d.nbytes

    def _warm_for_docs(self, key, index: int, groups: list[int]) -> None:
        with self._lock:
            done = key in self._lru or key not in self._inflight
        if not done:  # (a task that starts after the documents are listed has nothing left to do)
            try:
                self.warm_row_groups(index, groups)
            except Exception:  # noqa: BLE001 - the listing's own load reports it
                pass

    def row_group(self, index: int, group: int) -> RowGroup:
        return self._get(("rg", index, group), lambda: self._load_row_group(index, group))

    def touch_row_groups(self, index: int, groups) -> list[int]:
        """Of row groups ``groups`` of chunk ``index``: mark the cached ones used (LRU) and return the others
        that no thread is loading, i.e. what a prefetch still has to load."""
        todo = []
        with self._lock:
            lru, inflight = self._lru, self._inflight
            for group in groups:
                key = ("rg", index, group)
                if key in lru:
                    lru.move_to_end(key)
                elif key not in inflight:
                    todo.append(group)
        return todo

    def warm_row_groups(self, index: int, groups) -> None:
        """Prefetch: load row groups ``groups`` of chunk ``index``, skipping those cached (they count as
        used) and those another thread is loading (so the prefetch threads decode different row groups).
        On a remote cache read asynchronously this only starts their requests (:meth:`when_open`)."""
        if self.remote is not None:
            self.remote.warm(index, groups)
            return
        for group in self.touch_row_groups(index, groups):
            self._get(("rg", index, group), lambda: self._load_row_group(index, group), wait=False)

    def row_groups(self, keys) -> dict[tuple[int, int], RowGroup]:
        """``{(chunk, group): row_group(chunk, group)}`` for ``keys`` (in their order, duplicates once):
        the cached ones under one lock, the rest through :meth:`row_group`."""
        out: dict[tuple[int, int], Any] = dict.fromkeys(keys)
        miss = []
        with self._lock:
            lru = self._lru
            for key in out:
                k = ("rg", *key)
                hit = lru.get(k)
                if hit is None:
                    miss.append(key)
                else:
                    lru.move_to_end(k)
                    out[key] = hit[0]
        if self.asynchronous and len(miss) > 1:  # (a read whose rows the read-ahead did not reach: one round trip)
            by_chunk: dict[int, list[int]] = {}
            for c, g in miss:
                by_chunk.setdefault(c, []).append(g)
            for c, gs in by_chunk.items():
                self.warm_row_groups(c, gs)
        for c, g in miss:
            out[(c, g)] = self.row_group(c, g)
        return out

    def _fetch_row_group(self, m: ChunkMeta, group: int) -> bytes:
        off, length = (int(x) for x in m.rg_ranges[group])
        ahead = None if self.remote is None or m.data is not None else self.remote.bytes_of(m, group)
        if m.data is not None:
            buf = m.data[off:off + length]  # verified with the whole file
        elif ahead is not None:  # requested ahead (waited for if it was on its way)
            buf = ahead
        else:
            buf = self._cat(m.path, off, off + length)
            self._count(m.index, len(buf), data=True)
        if len(buf) != length:
            raise chunk_error(self.cache, m.path, f"truncated: row group {group} at bytes [{off}, {off + length}) read "
                              f"{len(buf)} bytes")
        if fmt.checksum(buf) != m.rg_checksums[group]:
            raise chunk_error(self.cache, m.path, f"checksum mismatch in row group {group} (bytes [{off}, "
                              f"{off + length}))")
        return buf

    def _load_row_group(self, index: int, group: int):
        m = self.meta(index)
        buf = self._fetch_row_group(m, group)  # verified before any decoding
        base = int(m.rg_ranges[group, 0])
        token_starts, doc_starts = m.stored if m.stored is not None else (m.rg_token_starts, m.rg_doc_starts)
        docs = int(doc_starts[group + 1] - doc_starts[group])
        expect = int(token_starts[group + 1] - token_starts[group])
        try:
            padded, lengths = decode_row_group(
                buf, base=base, group=group, file_meta=m.file_meta, file_size=m.nbytes_file, footer=m.footer,
                docs=docs, tokens=expect, fast=self.fast_decode)
        except Exception as e:
            raise chunk_error(self.cache, m.path, f"row group {group} cannot be decoded ({arrow_message(e)})") from e
        if padded.size - 1 != expect or lengths.size != docs or int(lengths.sum(dtype=np.int64)) != expect:
            raise chunk_error(self.cache, m.path, f"row group {group} holds {padded.size - 1} tokens in {lengths.size} "
                              f"documents, the sidecar says {expect} in {docs}")
        loss = None
        if self.masked:  # (the row group's sha256 covers every column: this one was verified with the tokens)
            try:
                values, counts = decode_loss_spans(buf, base=base, group=group, file_meta=m.file_meta,
                                                   file_size=m.nbytes_file, footer=m.footer, docs=docs,
                                                   fast=self.fast_decode)
                loss = loss_flags(values, counts, lengths)
            except Exception as e:
                raise chunk_error(self.cache, m.path, f"row group {group}: its loss spans cannot be read "
                                  f"({arrow_message(e)})") from e
        if m.keep is not None:
            padded, lengths, loss = keep_documents(m.keep[int(doc_starts[group]):int(doc_starts[group + 1])],
                                                   padded, lengths, loss)
        starts = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        with self._lock:
            self.decodes += 1
        rg = RowGroup(padded, starts, loss)
        return rg, rg.nbytes

    def submit(self, fn: Callable[..., Any], *args) -> cf.Future:
        """Run ``fn(*args)`` on the store's background threads (``prefetch_threads``; prefetch work)."""
        return self._pool.submit(fn, *args)

    def plan(self, fn: Callable[..., Any], *args) -> cf.Future:
        """Run read-ahead planning ``fn(*args)`` (what later batches need): on a remote cache read
        asynchronously, on a thread of its own, where planning only starts requests and must not wait
        behind the row groups decoded on the store's threads (that wait delays every request by as much
        as a round trip); otherwise as :meth:`submit`."""
        return (self._planner or self._pool).submit(fn, *args)

    def loss_flags(self, index: int, lo: int, hi: int) -> np.ndarray | None:
        """Loss flags of tokens ``[lo, hi)`` of chunk ``index`` (None: a cache without loss masks)."""
        if not self.masked:
            return None
        m = self.meta(index)
        g0 = int(np.searchsorted(m.rg_token_starts, lo, side="right")) - 1
        parts = []
        for g in range(g0, m.num_row_groups):
            base = int(m.rg_token_starts[g])
            if base >= hi:
                break
            a, b = max(lo, base) - base, min(hi, int(m.rg_token_starts[g + 1])) - base
            parts.append(self.row_group(index, g).loss[1 + a:1 + b])
        return parts[0] if len(parts) == 1 else np.concatenate(parts + [np.zeros(0, bool)])

    # -- token ranges -------------------------------------------------------------------------------------
    def tokens(self, index: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[lo, hi)`` of chunk ``index`` and each token's position within its document."""
        m = self.meta(index)
        g0 = int(np.searchsorted(m.rg_token_starts, lo, side="right")) - 1
        g1 = int(np.searchsorted(m.rg_token_starts, hi - 1, side="right")) - 1 if hi > lo else g0
        if self.asynchronous and g1 > g0:
            self.warm_row_groups(index, range(g0, g1 + 1))
        toks, poss = [], []
        for g in range(g0, g1 + 1):
            base = int(m.rg_token_starts[g])
            a, b = max(lo, base) - base, min(hi, int(m.rg_token_starts[g + 1])) - base
            if b <= a:
                continue
            rg = self.row_group(index, g)
            toks.append(rg.padded[a + 1:b + 1])
            poss.append(rg.positions_range(a, b))
        if len(toks) == 1:
            return toks[0], poss[0]
        if not toks:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        return np.concatenate(toks), np.concatenate(poss)
