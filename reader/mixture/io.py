"""A mixture's reading machinery: one store, release policy and prefetcher per distinct cache, behind the
interfaces the reader, the assembler and reader workers use for a single cache.

**Distinct caches.** Components naming the same cache share its opened cache, example order, store,
release policy and prefetcher (they read the same examples, each at its own pace), so a mixture of
many components over a few caches costs memory per cache, not per component. Below, "cache ``d``" is
``mixture.distinct[d]``; with one component per cache, ``d`` is the component's index.

**Chunk space.** The assembler and the release policy name chunks by one integer. A mixture of ``D``
distinct caches numbers chunk ``j`` of cache ``d`` as ``j * D + d`` (chunk counts grow while caches
build, so no offsets); :class:`MixtureStore` routes every call to that cache's own
:class:`reader.storage.store.ChunkStore`.

**Memory.** ``memory_budget_bytes`` is split equally between the caches: each keeps its own working set
(a row group per stream it reads, or one shuffle mix when shuffled) whatever its weight, because a
component of small weight still has a current position in every stream. The stores share one pool of
``prefetch_threads`` threads.

**Release and prefetch** work per cache: the rows of a read are mapped to each cache's own examples,
and each cache's :class:`reader.batch.release.ReleasePolicy` and :class:`reader.batch.prefetch.Prefetcher`
see its examples as if it were read alone (a cache shared by components sees each component's reads;
a release is only a cache decision, so a component behind another one at most decodes again).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from typing import Any

import numpy as np

from reader.mixture.mixture import Mixture, MixtureOrder
from reader.options import ReadOptions
from reader.batch.prefetch import Pace, Prefetcher
from reader.batch.release import ReleasePolicy
from reader.storage.store import ChunkStore


class MixtureStore:
    """The caches' chunk stores as one store over the mixture's chunk space (chunk ``j * D + d``).

    Attributes: ``stores`` (one :class:`reader.storage.store.ChunkStore` per distinct cache); the I/O
    counters (``bytes_fetched``, ``fetches``, ``meta_fetches``, ``decodes``, ...) summed over them, and
    ``opened`` in the mixture's chunk space.
    """

    def __init__(self, stores: list[ChunkStore], executor: cf.ThreadPoolExecutor, planner: cf.ThreadPoolExecutor):
        self.stores = stores
        self.D = len(stores)
        self._pool, self._planner = executor, planner

    def close(self) -> None:
        for s in self.stores:
            s.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._planner.shutdown(wait=False, cancel_futures=True)

    def _where(self, chunk: int) -> tuple[ChunkStore, int]:
        q, d = divmod(int(chunk), self.D)
        return self.stores[d], q

    # -- what the assembler, release and prefetch call ------------------------------------------------
    def meta(self, chunk: int):
        s, q = self._where(chunk)
        return s.meta(q)

    def cached_meta(self, chunk: int):
        s, q = self._where(chunk)
        return s.cached_meta(q)

    def doc_index(self, chunk: int):
        s, q = self._where(chunk)
        return s.doc_index(q)

    def row_group(self, chunk: int, group: int):
        s, q = self._where(chunk)
        return s.row_group(q, group)

    def row_groups(self, keys) -> dict[tuple[int, int], Any]:
        """``{(chunk, group): row group}`` for ``keys``, in their order (the assembler's are sorted and it
        relies on that), duplicates once; each cache's through its store's ``row_groups`` (its cached
        ones under one lock)."""
        D = self.D
        out: dict[tuple[int, int], Any] = dict.fromkeys(keys)
        by: list[list[tuple[int, int]]] = [[] for _ in range(D)]
        for key in out:
            by[key[0] % D].append(key)
        for d, ks in enumerate(by):
            if ks:
                part = self.stores[d].row_groups([(chunk // D, g) for chunk, g in ks])
                out.update(zip(ks, part.values()))  # (ks are distinct: one value each, in order)
        return out

    def tokens(self, chunk: int, lo: int, hi: int):
        s, q = self._where(chunk)
        return s.tokens(q, lo, hi)

    def loss_flags(self, chunk: int, lo: int, hi: int):
        s, q = self._where(chunk)
        return s.loss_flags(q, lo, hi)

    def release(self, chunk: int, group: int) -> None:
        s, q = self._where(chunk)
        s.release(q, group)

    def release_range(self, chunk: int, lo: int, hi: int) -> int:
        s, q = self._where(chunk)
        return s.release_range(q, lo, hi)

    def touch_row_groups(self, chunk: int, groups) -> list[int]:
        s, q = self._where(chunk)
        return s.touch_row_groups(q, groups)

    def warm_row_groups(self, chunk: int, groups) -> None:
        s, q = self._where(chunk)
        s.warm_row_groups(q, groups)

    def submit(self, fn, *args) -> cf.Future:
        return self._pool.submit(fn, *args)

    def plan(self, fn, *args) -> cf.Future:
        """:meth:`reader.storage.store.ChunkStore.plan` (one planning thread for every remote cache)."""
        return (self._planner if any(s.asynchronous for s in self.stores) else self._pool).submit(fn, *args)

    # -- counters -------------------------------------------------------------------------------------
    @property
    def opened(self) -> set[int]:
        return {j * self.D + d for d, s in enumerate(self.stores) for j in s.opened}

    def _sum(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.stores)

    budget = property(lambda self: self._sum("budget"))
    used_bytes = property(lambda self: self._sum("used_bytes"))
    fetches = property(lambda self: self._sum("fetches"))
    meta_fetches = property(lambda self: self._sum("meta_fetches"))
    bytes_fetched = property(lambda self: self._sum("bytes_fetched"))
    decodes = property(lambda self: self._sum("decodes"))


class MixtureRelease:
    """Each cache's :class:`reader.batch.release.ReleasePolicy`, fed with the reads of its components."""

    def __init__(self, order: MixtureOrder, policies: list[ReleasePolicy]):
        self.order = order
        self.policies = policies
        self.D = len(policies)
        self.by_chunk = any(p.by_chunk for p in policies)
        self.by_mix = any(p.by_mix for p in policies)
        self._routed: dict[int, int] = {}  # chunk -> the first row group routed for it last time

    def concat_windows_read(self, recs, cross) -> None:
        """The assembler's hook: runs of windows ``(chunk, row group, ...)`` in the mixture's chunk space,
        ``recs`` sorted (the assembler sorts them). A policy only looks at the first row group read in
        each chunk, so only that is routed, and only when it changed (a policy does nothing for the same
        row group again)."""
        if not self.by_chunk or not (recs or cross):
            return
        # sorted: a chunk's first record has its smallest row group; dict() keeps the last value given
        first = dict(zip([r[0] for r in reversed(recs)], [r[1] for r in reversed(recs)]))
        for rec in cross:
            c, g = rec[0], rec[1]
            if g < first.get(c, g + 1):
                first[c] = g
        parts: dict[int, list[tuple[int, int]]] = {}
        routed = self._routed
        if len(routed) > 4096:
            routed.clear()
        for chunk, g in first.items():
            if routed.get(chunk) != g:
                routed[chunk] = g
                q, d = divmod(chunk, self.D)
                parts.setdefault(d, []).append((q, g))
        for d, part in parts.items():
            self.policies[d].concat_windows_read(part, [])

    def examples_read(self, ex: np.ndarray) -> None:
        """After a read of global examples ``ex``: each shuffled cache releases the mixes it passed."""
        if not self.by_mix or not ex.size:
            return
        comp, k = self.order.assign(ex)
        dist = np.where(comp >= 0, self.order.which[np.maximum(comp, 0)], -1)
        for d in np.flatnonzero(np.bincount(dist[dist >= 0], minlength=self.D)).tolist():
            if self.policies[d].by_mix:
                self.policies[d].examples_read(k[dist == d])


class MixturePrefetcher:
    """Prefetch for a mixture: each cache's :class:`reader.batch.prefetch.Prefetcher` loads what its
    components' items of the upcoming batches need."""

    def __init__(self, order: MixtureOrder, prefetchers: list[Prefetcher], options: ReadOptions, rows: np.ndarray):
        self.order, self.prefetchers, self.options, self.rows = order, prefetchers, options, rows
        # the mixture's reads advance every component's batches alike
        self.pace = Pace(lambda: sum(p.store.waited_s for p in prefetchers))
        for p in prefetchers:
            p.pace = p.release.pace = self.pace

    def lookahead(self) -> int:
        """Batches ahead to load: the smallest of the caches' (each sized by its share of the budget and the
        most of a batch it serves: a cache at weight 0.1 holds a tenth of a batch's rows ahead per batch)."""
        return min(p.lookahead(w) for p, w in zip(self.prefetchers, self.order.shares))

    def ask(self, ex: np.ndarray) -> None:
        """Start loading what a read of global examples ``ex`` needs, all at once (remote caches)."""
        try:
            comp, k = self.order.assign(ex)
        except Exception:  # noqa: BLE001 - the read itself reports
            return
        dist = np.where(comp >= 0, self.order.which[np.maximum(comp, 0)], -1)
        for d in np.flatnonzero(np.bincount(dist[dist >= 0], minlength=len(self.prefetchers))).tolist():
            if self.prefetchers[d].store.asynchronous:
                self.prefetchers[d].ask(k[dist == d])

    def prefetch(self, b: int, rows=None, count: int = 1) -> list[cf.Future]:
        """Start loading what rows ``rows`` (default: this reader's) of batches ``b .. b+count-1`` need."""
        B = self.options.batch_size
        mine = rows is None
        rows = self.rows if mine else np.asarray(rows, dtype=np.int64).reshape(-1)
        try:
            comp, k = self.order.assign(np.concatenate([(b + i) * B + rows for i in range(count)]))
            plans = self.order.touched_by_component(comp, k)
        except Exception:  # noqa: BLE001 - e.g. NotYetAvailable (eval during a build): the read waits
            return []
        futs: list[cf.Future] = []
        if plans is not None:  # every cache planned in one call
            for d, plan in enumerate(plans):
                futs += self.prefetchers[d].prefetch_chunks(plan, batch=b)
            return futs
        dist = np.where(comp >= 0, self.order.which[np.maximum(comp, 0)], -1)
        for d in np.flatnonzero(np.bincount(dist[dist >= 0], minlength=len(self.prefetchers))).tolist():
            futs += self.prefetchers[d].prefetch_examples([k[dist == d]], whole=mine, batch=b)
        return futs


def open_mixture(mixture: Mixture, options: ReadOptions, rows: np.ndarray, num_readers: int, reader_index: int):
    """The parts a :class:`reader.Reader` wires together for an opened mixture file: ``(mixture, store, order,
    release, prefetcher)`` (see the module docstring)."""
    D = len(mixture.distinct)
    copts = dataclasses.replace(options, memory_budget_bytes=max(1, options.memory_budget_bytes // D))
    views = mixture.open_views(options)
    pool = cf.ThreadPoolExecutor(max(1, options.prefetch_threads), thread_name_prefix="chunkledger-prefetch")
    planner = cf.ThreadPoolExecutor(1, thread_name_prefix="chunkledger-plan")  # (its thread starts if used)
    stores = [ChunkStore(cache, memory_budget_bytes=copts.memory_budget_bytes, executor=pool, view=v, planner=planner,
                         timeout_s=options.worker_timeout_s)
              for cache, (v, _) in zip(mixture.distinct, views)]
    store = MixtureStore(stores, pool, planner)
    order = MixtureOrder(mixture, copts, stores, rows, caches=[seen for _, seen in views])
    policies = [ReleasePolicy(s, o, copts) for s, o in zip(stores, order.orders)]
    prefetchers = [Prefetcher(cache, s, o, copts, p, rows, num_readers, reader_index)
                   for (_, cache), s, o, p in zip(views, stores, order.orders, policies)]
    return (mixture, store, order, MixtureRelease(order, policies),
            MixturePrefetcher(order, prefetchers, options, rows))
