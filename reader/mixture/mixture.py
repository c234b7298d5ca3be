"""Weighted mixtures of caches: the components opened, and the mixture's example order.

A mixture file (:mod:`reader.mixture.mixture_file`) names component caches and weights. :class:`Mixture`
opens every distinct cache once (each may still be building; components naming the same cache share it)
and checks that they share one tokenizer.
:class:`MixtureOrder` is the mixture's example order: global example ``i`` -> ``(component c,
component example k)`` (:mod:`reader.mixture.quotas` in training; the components one after the other in eval
mode), and ``k`` -> tokens through ``c``'s own :class:`reader.batch.examples.ExampleOrder` (its streams, shuffle
and epochs, exactly as when ``c`` is read alone with the same options; components of one cache share that
cache's order, so memory grows with distinct caches, not components). It answers ``locate`` with one
:class:`reader.batch.examples.Placement` for the rows of all components, with ``components`` set and chunk
numbers in the mixture's chunk space (:mod:`reader.mixture.io`), so the assembler, layouts and workers
are the single cache's.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from reader.storage.cache import Cache, wait_for
from reader.mixture.quotas import QuotaIndex
from reader.mixture.mixture_file import MixtureError, MixtureSpec, load_mixture
from reader.options import ReadOptions
from reader.batch.examples import ExampleOrder, Placement, group_by_key
from reader.storage.store import ChunkStore
from reader.storage.view_syntax import ViewError
from reader.storage.views import open_view
from reader.order.streams import NotYetAvailable, StackedStreams, stream_position
from reader.order.placement import RowPieces

T = TypeVar("T")
_SOURCES_AHEAD = 32  # batches of a shuffled component's cipher answers computed at once


class MaxPassesReached(RuntimeError):
    """A step would draw more passes over a mixture component than its ``max_passes`` allows."""


def tokenizer_identity(tok: Mapping[str, Any]) -> tuple:
    """What must match for two caches' token ids to mean the same: the tokenizer's kind and hash (its
    spec when a ledger has no hash)."""
    return tok.get("kind"), tok.get("hash") or tok.get("spec")


def _describe(tok: Mapping[str, Any]) -> str:
    return f"{tok.get('spec')} (kind={tok.get('kind')}, hash={str(tok.get('hash'))[:23]})"


class Mixture:
    """The components of a mixture file, opened.

    Args:
      source: the mixture file (local path or fsspec URL), or a parsed :class:`MixtureSpec`.
      storage_options: fsspec options for the file and every component cache.

    Attributes: ``spec``, ``url`` (the file), ``caches`` (one :class:`reader.Cache` per component, in
    file order), ``distinct`` (each cache once), ``which`` (component -> its index in ``distinct``).
    Components naming the same cache (the same resolved path; a symlink is another path) share one
    opened :class:`reader.Cache`: opening costs time and memory per distinct cache, not per component.
    It waits like a :class:`reader.Cache`: ``complete`` when every component's build has finished;
    ``refresh()`` polls the running ones.
    """

    def __init__(self, source: str | os.PathLike | MixtureSpec, *, storage_options: Mapping[str, Any] | None = None):
        self.storage_options = dict(storage_options or {})
        self.spec = source if isinstance(source, MixtureSpec) else load_mixture(source, storage_options=storage_options)
        self.url = self.spec.source
        comps = self.spec.components
        first: dict[str, int] = {}  # cache URL -> the first component naming it
        for i, c in enumerate(comps):
            first.setdefault(c.url, i)
        urls = list(first)
        # a component reads (cache, view): two views of one cache are two orders and stores over one Cache
        reads: dict[tuple[str, str | None], int] = {}
        for c in comps:
            reads.setdefault((c.url, c.view), len(reads))

        def open_one(url: str) -> Cache:
            i = first[url]
            try:
                return Cache(url, storage_options=storage_options)
            except (FileNotFoundError, ValueError) as e:
                raise MixtureError(f"{self.url}: components[{i}].path ({comps[i].name!r}): cannot open the cache at "
                                   f"{url}: {e}") from e

        if all("://" not in u or u.startswith("file://") for u in urls):
            opened = [open_one(u) for u in urls]
        else:  # remote ledgers: fetched in parallel
            with cf.ThreadPoolExecutor(min(8, len(urls))) as pool:
                opened = list(pool.map(open_one, urls))
        by_url = dict(zip(urls, opened))
        self.distinct: list[Cache] = [by_url[u] for u, _ in reads]  # one per (cache, view) read
        self.views: list[str | None] = [v for _, v in reads]  # each one's view (None: the reader's)
        self.which = [reads[(c.url, c.view)] for c in comps]  # component -> its read in ``distinct``
        self.caches: list[Cache] = [self.distinct[d] for d in self.which]
        ids = [tokenizer_identity(c.ledger.tokenizer) for c in opened]
        for d in range(1, len(ids)):
            if ids[d] != ids[0]:
                i, i0 = first[urls[d]], first[urls[0]]
                a, b = opened[0].ledger.tokenizer, opened[d].ledger.tokenizer
                raise MixtureError(
                    f"{self.url}: components[{i}].path: component {comps[i].name!r} ({comps[i].url}) was tokenized "
                    f"with {_describe(b)}, component {comps[i0].name!r} ({comps[i0].url}) with {_describe(a)}. "
                    "Token ids of different tokenizers mean different things: rebuild the component with the "
                    "same tokenizer, or mix only caches made with one tokenizer")

    def open_views(self, options: ReadOptions) -> list:
        """``(view, the cache as it sees it)`` per read of ``distinct`` (:func:`reader.storage.views.open_view`):
        its component's view, else ``options.view``; an error names the component."""
        out = []
        for d, (cache, view) in enumerate(zip(self.distinct, self.views)):
            try:
                out.append(open_view(cache, options.view if view is None else view, index_cache=options.index_cache))
            except ViewError as e:
                c = self.which.index(d)
                raise MixtureError(f"{self.url}: components[{c}] ({self.names[c]!r}): {e}") from None
        return out

    @property
    def names(self) -> tuple[str, ...]:
        return self.spec.names

    @property
    def is_local(self) -> bool:
        return all(c.is_local for c in self.distinct)

    @property
    def complete(self) -> bool:
        return all(c.complete for c in self.distinct)

    @property
    def generation(self) -> int:
        return sum(c.generation for c in self.distinct)

    def refresh(self) -> bool:
        """Poll every cache that is still building; True if any has more chunks now."""
        changed = False
        for c in self.distinct:
            if not c.complete:
                changed = c.refresh() or changed
        return changed

    def progress(self) -> str:
        return "; ".join(f"{c.url}: {'finished' if c.complete else c.progress()}" for c in self.distinct)

    def wait(self, attempt: Callable[[], T], *, timeout_s: float, poll_s: float = 1.0, what: str = "data") -> T:
        """:meth:`reader.Cache.wait` over every component."""
        return wait_for(self, attempt, timeout_s=timeout_s, poll_s=poll_s, what=what)

    def wait_complete(self, *, timeout_s: float, poll_s: float = 1.0, what: str = "this") -> None:
        def attempt():
            if not self.complete:
                raise NotYetAvailable("the total size is known only when every component's build finishes")

        self.wait(attempt, timeout_s=timeout_s, poll_s=poll_s, what=what)


class MixtureOrder:
    """The mixture's example order (see the module docstring).

    Args:
      mixture: the opened :class:`Mixture`.
      options: the reader's :class:`reader.ReadOptions` (every component is read with them).
      stores: one :class:`reader.storage.store.ChunkStore` per distinct cache (``mixture.distinct``).
      rows: the rows of each global batch this reader serves.
      caches: ``mixture.distinct`` as each read sees it (a view's :class:`reader.storage.views.ViewedCache`);
        None: ``mixture.distinct``.

    Attributes: ``orders`` (one :class:`reader.batch.examples.ExampleOrder` per distinct cache: the
    components of one cache read the same examples, each at its own pace), ``components`` (each
    component's order, ``orders[which[c]]``), ``which``, ``index`` (the :class:`reader.mixture.quotas.QuotaIndex`
    of training; None in eval mode), ``shuffle`` (None: each cache's order shuffles its own examples).
    """

    shuffle = None

    def __init__(self, mixture: Mixture, options: ReadOptions, stores: list[ChunkStore], rows: np.ndarray,
                 caches: list | None = None):
        self.mixture = mixture
        self.options = options
        self.rows = rows
        # a shuffled component's cipher answers are computed ahead for the examples it serves next: about
        # _SOURCES_AHEAD batches at its largest weight w, plus w of a block of every lane (how far its
        # lanes drift apart inside blocks)
        # (components of one cache share its order, whose examples they all read: the sum of their weights)
        spec, B, R = mixture.spec, options.batch_size, options.effective_ideal_readers
        wmax = [max(ws) for ws in zip(*(spec.normalised(s) for s in range(len(spec.segments))))]
        wsum = np.bincount(mixture.which, weights=wmax, minlength=len(mixture.distinct)).tolist()
        self.shares = [min(w, 1.0) for w in wsum]  # the most of a batch's rows each cache serves
        self.orders = [ExampleOrder(cache, options, stores[d], rows,
                                    ahead=int(min(w, 1.0) * (_SOURCES_AHEAD * B + spec.block * R)) + R)
                       for d, (cache, w) in enumerate(zip(caches or mixture.distinct, wsum))]
        self.which = np.asarray(mixture.which, dtype=np.int64)
        self.components = [self.orders[d] for d in mixture.which]  # one per component (shared per cache)
        self.num_components = len(self.components)
        self.index = None if options.eval_mode else QuotaIndex(mixture.spec.quotas(options.effective_ideal_readers, options.batch_size))
        self._stack: tuple[tuple, StackedStreams | None] | None = None
        self._limited = [c for c, comp in enumerate(mixture.spec.components) if comp.max_passes is not None]
        self._limit: tuple[int, MaxPassesReached] | None = None  # (first step refused, its error)

    def pass_limit(self) -> tuple[int, MaxPassesReached] | None:
        """``(step, error)``: the first step that would draw an example of a component past its
        ``max_passes`` (passes of ``E`` examples, its rows of an eval pass at these options), and the error
        that step raises; None when no component has a limit, in eval mode, or while a limited component's
        build runs (its passes are not known yet; a ``"spans"`` read waits for it anyway)."""
        if self.index is None or not self._limited or self._limit is not None:
            return self._limit
        if not all(self.components[c].cache.complete for c in self._limited):
            return None
        spec, B = self.mixture.spec, self.options.batch_size
        per_pass = {c: self.components[c].pass_examples() for c in self._limited}
        limits = np.full(self.num_components, -1, np.int64)
        for c, E in per_pass.items():
            limits[c] = int(spec.components[c].max_passes * E)  # (exact: a Fraction times an int, floored)
        step = self.index.first_step_reaching(limits, B)
        if step is None:
            self._limit = None
            self._limited = []
            return None
        last = self.index.last_items((step + 1) * B)
        c = next(c for c in self._limited if last[c] >= limits[c])
        comp, E, k = spec.components[c], per_pass[c], int(last[c])
        passes = f"{float(comp.max_passes):g}"
        error = MaxPassesReached(
            f"{self.mixture.url}: component {comp.name!r} has max_passes {passes} ({int(limits[c]):,} of its examples, "
            f"{E:,} per pass at seq_len {self.options.seq_len}); step {step} would draw its example {k:,}, in pass "
            f"{k // E + 1}. Raise its max_passes, lower its weight before step {step} (a schedule entry), or end "
            f"the run before step {step}")
        self._limit = (step, error)
        return self._limit

    def stream_index(self):
        raise TypeError("a mixture has no single stream index: each component has its own "
                        "(reader.batch.examples.components[c].stream_index())")

    # -- which component each example is ------------------------------------------------------------
    def assign(self, ex) -> tuple[np.ndarray, np.ndarray]:
        """``(components, k)``: each global example's component and its example index in that component's
        own order (int64). Eval mode: component -1 past the end of the pass; raises
        :class:`reader.NotYetAvailable` where it depends on a component still being built."""
        ex = np.asarray(ex, dtype=np.int64).reshape(-1)
        if self.index is not None:
            return self.index.assign(ex)
        comp = np.full(ex.size, -1, np.int64)
        k = np.zeros(ex.size, np.int64)
        first = 0  # first example of component c in the concatenation
        for c, order in enumerate(self.components):
            rest = ex >= first
            if not rest.any():
                break
            if not order.cache.complete:  # its size is unknown: what is past `first` is c's, if written
                comp[rest], k[rest] = c, ex[rest] - first
                order.eval_limit(order.stream_index(), k[rest])  # raises NotYetAvailable past what is written
                return comp, k
            n = order.num_examples()
            mine = rest & (ex < first + n)
            comp[mine], k[mine] = c, ex[mine] - first
            first += n
        return comp, k

    def num_examples(self) -> int | None:
        """Eval mode: examples in the pass, every component once (needs every build finished). Training: None."""
        if self.index is not None:
            return None
        return sum(order.num_examples() for order in self.components)

    def has_example(self, ex: int) -> bool:
        """False past the end of an eval pass (raises NotYetAvailable while a build has not decided)."""
        return self.index is not None or int(self.assign([ex])[0][0]) >= 0

    def dropped_long(self) -> tuple[int, int]:
        """``drop_long``: ``(documents, tokens)`` skipped in every component's chunks known now."""
        got = [order.dropped_long() for order in self.components]
        return sum(d for d, _ in got), sum(t for _, t in got)

    def sources(self, exs: list[np.ndarray]) -> list[np.ndarray]:
        return exs  # (the components shuffle inside locate)

    # -- placing examples ----------------------------------------------------------------------------
    def locate(self, ex: np.ndarray, src: np.ndarray | None = None) -> Placement:
        """Where the tokens of examples ``ex`` (one per row) are, in the mixture's chunk space
        (chunk ``local * D + d`` of distinct cache ``d``). Raises NotYetAvailable while a needed chunk is
        not written."""
        ex = np.asarray(ex, dtype=np.int64).reshape(-1)
        D = len(self.orders)
        comp, k = self.assign(ex)
        concat = self.options.packing == "concat"
        stacked = self._stacked() if self.index is not None and concat else None
        if stacked is not None:
            return self._locate_stacked(stacked, ex, comp, k)
        valid = comp >= 0
        rows = np.flatnonzero(valid)
        entry = np.full(ex.size, -1, np.int64)
        entry[rows] = np.arange(rows.size)
        dist = np.where(valid, self.which[np.maximum(comp, 0)], -1)
        m = rows.size
        streams, positions, epochs, chunks, starts, lengths = (np.empty(m, np.int64) for _ in range(6))
        first = None if concat else np.empty(m, np.int64)
        spill: dict[int, list[tuple[int, int, int, int]]] = {}
        rows_pieces = [] if self.options.packing == "best_fit" else None
        for d in np.flatnonzero(np.bincount(dist[rows], minlength=D)).tolist():
            sel = np.flatnonzero(dist == d)
            sub = self.orders[d].locate(k[sel])
            if sub.rows.size != sel.size:
                raise AssertionError(f"cache {d}: rows past its end were assigned to it")
            dst = entry[sel]
            streams[dst], positions[dst], epochs[dst] = sub.streams, sub.positions, sub.epochs
            chunks[dst], starts[dst], lengths[dst] = sub.chunks * D + d, sub.starts, sub.lengths
            if first is not None:
                first[dst] = sub.first_positions
            if rows_pieces is not None:
                rows_pieces.append((dst, sub.pieces))
            for kk, pieces in sub.spill.items():
                spill[int(dst[kk])] = [(e, ch * D + d, lo, hi) for e, ch, lo, hi in pieces]
        examples = np.where(valid, ex, -1)
        return Placement(examples, valid, rows, streams, positions, epochs, chunks, starts, lengths, first, spill,
                         comp.astype(np.int32), None if rows_pieces is None else RowPieces.scatter(m, rows_pieces))

    def touched_by_component(self, comp: np.ndarray, k: np.ndarray) -> list[list[tuple[int, np.ndarray]]] | None:
        """Each distinct cache's :meth:`reader.batch.examples.ExampleOrder.plan` of the examples ``k`` of its
        components (``comp`` and ``k`` from :meth:`assign`), found in one stacked call: packed, unshuffled
        training reads of finished caches; else None (ask each cache's order)."""
        if self.index is None or self.options.packing != "concat" or self.orders[0].shuffle is not None:
            return None
        stacked = self._stacked()
        if stacked is None:
            return None
        D, L = len(self.orders), self.options.seq_len
        s, j = stream_position(k, self.options.effective_ideal_readers)
        dist = self.which[comp]
        dists = np.concatenate([dist, dist])  # each window's first and last token, as ExampleOrder.plan asks
        _, chunks, offs, _ = stacked.locate(dists, np.concatenate([s, s]), np.concatenate([j * L, j * L + L - 1]))
        plans: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(D)]
        for x, part in group_by_key(chunks * D + dists, offs):  # (mixture chunk j * D + d)
            plans[x % D].append((x // D, part))
        return plans

    def _stacked(self) -> StackedStreams | None:
        """The caches' stream indexes stacked (:class:`reader.order.streams.StackedStreams`) while all of them
        are finished, else None; made again only when an index changes."""
        idxs = tuple(order.stream_index() for order in self.orders)
        got = self._stack
        if got is None or any(a is not b for a, b in zip(got[0], idxs)):
            got = self._stack = (idxs, StackedStreams.of(idxs))
        return got[1]

    def _locate_stacked(self, stacked: StackedStreams, ex: np.ndarray, comp: np.ndarray, k: np.ndarray) -> Placement:
        """:meth:`locate` of packed training examples, every cache at once: the same placement as asking
        each cache's ``locate`` for its rows."""
        D, L = len(self.orders), self.options.seq_len
        dist = self.which[comp]
        src = k
        if self.orders[0].shuffle is not None:  # each cache's own shuffle
            src = k.copy()
            for d in np.flatnonzero(np.bincount(dist, minlength=D)).tolist():
                sel = dist == d
                src[sel] = self.orders[d].sources([k[sel]])[0]
        s, j = stream_position(src, self.options.effective_ideal_readers)
        epochs, chunks, starts, avail = stacked.locate(dist, s, j * L)
        lengths = np.minimum(avail, L)
        spill: dict[int, list[tuple[int, int, int, int]]] = {}
        for row in np.flatnonzero(lengths < L).tolist():  # windows over a chunk's end
            d, jr = int(dist[row]), int(j[row])
            spill[row] = [(e, ch * D + d, lo, hi) for e, ch, lo, hi in
                          stacked.indexes[d].pieces(int(s[row]), jr * L, (jr + 1) * L)]
        return Placement(ex.copy(), np.ones(ex.size, bool), np.arange(ex.size), s, j, epochs, chunks * D + dist,
                         starts, lengths, None, spill, comp.astype(np.int32))
