"""A mixture's reading machinery: one store, release policy and prefetcher per component, behind the
interfaces the reader, the assembler and reader workers use for a single cache.

**Chunk space.** The assembler and the release policy name chunks by one integer. A mixture of ``C``
components numbers chunk ``j`` of component ``c`` as ``j * C + c`` (components' chunk counts grow while
they build, so no offsets); :class:`MixtureStore` routes every call to the component's own
:class:`reader.storage.store.ChunkStore`.

**Memory.** ``memory_budget_bytes`` is split equally between the components: each keeps its own
working set (a row group per stream it reads, or one shuffle mix when shuffled) whatever its weight,
because a component of small weight still has a current position in every stream. The stores share
one pool of ``prefetch_threads`` threads.

**Release and prefetch** work per component: the rows of a read are mapped to each component's own
examples, and each component's :class:`reader.batch.release.ReleasePolicy` and
:class:`reader.batch.prefetch.Prefetcher` see its examples as if it were read alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
from typing import Any, Mapping

import numpy as np

from reader.mixture.mixture import Mixture, MixtureOrder
from reader.options import ReadOptions
from reader.batch.prefetch import Prefetcher
from reader.batch.release import ReleasePolicy
from reader.storage.store import ChunkStore


class MixtureStore:
    """The components' chunk stores as one store over the mixture's chunk space (chunk ``j * C + c``).

    Attributes: ``stores`` (one :class:`reader.storage.store.ChunkStore` per component); the I/O counters
    (``bytes_fetched``, ``fetches``, ``meta_fetches``, ``decodes``, ...) summed over them, and
    ``opened`` in the mixture's chunk space.
    """

    def __init__(self, stores: list[ChunkStore], executor: cf.ThreadPoolExecutor):
        self.stores = stores
        self.C = len(stores)
        self._pool = executor

    def close(self) -> None:
        for s in self.stores:
            s.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _where(self, chunk: int) -> tuple[ChunkStore, int]:
        q, c = divmod(int(chunk), self.C)
        return self.stores[c], q

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
        relies on that), duplicates once; each component's through its store's ``row_groups`` (its
        cached ones under one lock)."""
        C = self.C
        out: dict[tuple[int, int], Any] = dict.fromkeys(keys)
        by: list[list[tuple[int, int]]] = [[] for _ in range(C)]
        for key in out:
            by[key[0] % C].append(key)
        for c, ks in enumerate(by):
            if ks:
                part = self.stores[c].row_groups([(chunk // C, g) for chunk, g in ks])
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

    # -- counters -------------------------------------------------------------------------------------
    @property
    def opened(self) -> set[int]:
        return {j * self.C + c for c, s in enumerate(self.stores) for j in s.opened}

    def _sum(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.stores)

    budget = property(lambda self: self._sum("budget"))
    used_bytes = property(lambda self: self._sum("used_bytes"))
    fetches = property(lambda self: self._sum("fetches"))
    meta_fetches = property(lambda self: self._sum("meta_fetches"))
    bytes_fetched = property(lambda self: self._sum("bytes_fetched"))
    decodes = property(lambda self: self._sum("decodes"))
    fresh_buffers = property(lambda self: self._sum("fresh_buffers"))
    retired_buffers = property(lambda self: self._sum("retired_buffers"))


class MixtureRelease:
    """Each component's :class:`reader.batch.release.ReleasePolicy`, fed with that component's reads."""

    def __init__(self, order: MixtureOrder, policies: list[ReleasePolicy]):
        self.order = order
        self.policies = policies
        self.C = len(policies)
        self.by_chunk = any(p.by_chunk for p in policies)
        self.by_mix = any(p.by_mix for p in policies)
        self._routed: dict[int, int] = {}  # chunk -> the first row group routed for it last time

    def windows_read(self, recs, cross) -> None:
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
                q, c = divmod(chunk, self.C)
                parts.setdefault(c, []).append((q, g))
        for c, part in parts.items():
            self.policies[c].windows_read(part, [])

    def examples_read(self, ex: np.ndarray) -> None:
        """After a read of global examples ``ex``: each shuffled component releases the mixes it passed."""
        if not self.by_mix or not ex.size:
            return
        comp, k = self.order.assign(ex)
        for c in np.flatnonzero(np.bincount(comp[comp >= 0], minlength=self.C)).tolist():
            if self.policies[c].by_mix:
                self.policies[c].examples_read(k[comp == c])


class MixturePrefetcher:
    """Prefetch for a mixture: each component's :class:`reader.batch.prefetch.Prefetcher` loads what its items
    of the upcoming batches need."""

    def __init__(self, order: MixtureOrder, prefetchers: list[Prefetcher], options: ReadOptions, rows: np.ndarray):
        self.order, self.prefetchers, self.options, self.rows = order, prefetchers, options, rows

    def lookahead(self) -> int:
        """Batches ahead to load: the smallest of the components' (each sized by its share of the budget)."""
        return min(p.lookahead() for p in self.prefetchers)

    def prefetch(self, b: int, rows=None, count: int = 1) -> list[cf.Future]:
        """Start loading what rows ``rows`` (default: this reader's) of batches ``b .. b+count-1`` need."""
        B = self.options.batch_size
        mine = rows is None
        rows = self.rows if mine else np.asarray(rows, dtype=np.int64).reshape(-1)
        try:
            comp, k = self.order.assign(np.concatenate([(b + i) * B + rows for i in range(count)]))
            plans = self.order.plan_components(comp, k)
        except Exception:  # noqa: BLE001 - e.g. NotYetAvailable (eval during a build): the read waits
            return []
        futs: list[cf.Future] = []
        if plans is not None:  # every component planned in one call
            for c, plan in enumerate(plans):
                futs += self.prefetchers[c].prefetch_plan(plan)
            return futs
        for c in np.flatnonzero(np.bincount(comp[comp >= 0], minlength=len(self.prefetchers))).tolist():
            futs += self.prefetchers[c].prefetch_examples([k[comp == c]], whole=mine)
        return futs


def open_mixture(source: str, options: ReadOptions, rows: np.ndarray, num_readers: int, reader_index: int, *,
                 storage_options: Mapping[str, Any] | None = None):
    """Open mixture file ``source`` for a reader: ``(mixture, store, order, release, prefetcher)``, the
    parts a :class:`reader.Reader` wires together (see the module docstring)."""
    mixture = Mixture(os.fspath(source), storage_options=storage_options)
    C = len(mixture.caches)
    copts = dataclasses.replace(options, memory_budget_bytes=max(1, options.memory_budget_bytes // C))
    pool = cf.ThreadPoolExecutor(max(1, options.prefetch_threads), thread_name_prefix="chunkledger-prefetch")
    stores = [ChunkStore(cache, memory_budget_bytes=copts.memory_budget_bytes, executor=pool)
              for cache in mixture.caches]
    store = MixtureStore(stores, pool)
    order = MixtureOrder(mixture, copts, stores, rows)
    policies = [ReleasePolicy(s, o, copts) for s, o in zip(stores, order.components)]
    prefetchers = [Prefetcher(cache, s, o, copts, p, rows, num_readers, reader_index)
                   for cache, s, o, p in zip(mixture.caches, stores, order.components, policies)]
    return (mixture, store, order, MixtureRelease(order, policies),
            MixturePrefetcher(order, prefetchers, options, rows))
