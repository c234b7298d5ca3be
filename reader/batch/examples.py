"""The example order: which tokens example ``i`` is, apart from fetching them.

:class:`ExampleOrder` combines the pass rule (:mod:`reader.order.passes`: spans over the eval pass's rows,
or the streams of :mod:`reader.order.streams`), the shuffle (:mod:`reader.order.shuffle`), the end of an
eval pass and, for unpacked examples and best-fit rows, the
per-chunk example counts (:mod:`reader.storage.index`) and where each lies in its chunk (:class:`ChunkPlacer`:
:mod:`reader.order.placement` on the documents the store decodes). Given global example indices it answers with a
:class:`Placement`: for every row, the chunk and token range (best fit: token ranges) it holds. The
assembler (:mod:`reader.batch.assemble`) only gathers those tokens; the prefetcher asks :meth:`ExampleOrder.plan` what upcoming batches touch.

This is the seam for mixtures of several caches: a mixture order maps global example ``i`` to
``(component, component-local example)``, each component with its own ``ExampleOrder``, and answers
with the same kind of placement plus a ``components`` array.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import threading
from typing import Any

import numpy as np

from reader.storage.cache import Cache
from reader.options import ReadOptions
from reader.order import placement
from reader.order.placement import RowPieces
from reader.order.passes import Spans, StreamLanes, stream_repeats
from reader.order.shuffle import shuffle_example_indices
from reader.storage.store import ChunkStore
from reader.order.streams import EmptyStream, NotYetAvailable, StreamIndex, stream_position
from reader.storage.index import ExampleIndex

LOG = logging.getLogger("chunkledger.reader")
_WAIT = ("pass_rule='spans' serves each pass as a permutation of every row of the cache, so a training read "
         "waits for the build to finish")

# cipher answers computed at once for the batches after a regular one (the cipher's cost is mostly
# per call: a few hundred small numpy operations whatever the size)
_SOURCE_BATCHES_AHEAD = 32
_SOURCE_CACHE = 4096  # arrays of source indices kept
_SOURCE_RUNS = 4  # runs of source indices kept (``ahead``: mixture components)
_CUM_CACHE = 256  # chunks whose cumulative piece counts (or window bounds) are kept
_ROWS_CACHE_BYTES = 64 << 20  # best-fit packings of recent windows kept (about 30 bytes per piece)


def group_by_key(keys: np.ndarray, values: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(key, values with that key)`` in key order, each key's values in their order (a plan's chunks
    and token offsets)."""
    by = np.argsort(keys, kind="stable")
    keys, values = keys[by], values[by]
    if not keys.size:
        return []
    # (slices at the key boundaries: np.split and np.r_ cost more than the work on a few rows per key)
    bounds = [0] + (np.flatnonzero(keys[1:] != keys[:-1]) + 1).tolist() + [keys.size]
    return [(x, values[a:b]) for x, a, b in zip(keys[bounds[:-1]].tolist(), bounds[:-1], bounds[1:])]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the tokens of each row of a read come from.

    Attributes:
      examples: int64 [n]: each row's global example index, -1 for padding rows.
      valid: bool [n]: rows that hold an example (False: past the end of an eval pass).
      rows: int64 [k]: the valid rows, ascending. The arrays below have one entry per valid row.
      streams, positions: int64 [k]: its stream and position in the stream index ("spans": 0, the eval row).
      epochs: int64 [k]: the epoch of the row's first token.
      chunks, starts: int64 [k]: the chunk holding the row's first token and that token's offset in it.
      lengths: int64 [k]: tokens of the row that lie in that chunk from ``starts`` (at most L). Packed
        rows shorter than L continue in other chunks, or end the eval pass: see ``spill``. Best-fit
        rows: the row's tokens, in the pieces of ``pieces``.
      first_positions: int64 [k] (unpacked, best-fit) or None (concat: derived from the documents' starts).
      spill: packed rows whose tokens do not lie in one chunk: ``{k: [(epoch, chunk, lo, hi), ...]}``,
        the row's pieces in order (fewer than L tokens at the end of an eval pass).
      components: int32 [n]: each row's mixture component (-1 for padding rows), or None: a single
        cache (component 0). In a mixture, ``chunks`` are the mixture's chunk ids (see
        :mod:`reader.mixture.io`) and ``streams``/``positions``/``epochs`` the components' own.
      pieces: best-fit rows: their pieces (:class:`RowPieces`); None for the other packings.
    """

    examples: np.ndarray
    valid: np.ndarray
    rows: np.ndarray
    streams: np.ndarray
    positions: np.ndarray
    epochs: np.ndarray
    chunks: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    first_positions: np.ndarray | None
    spill: dict[int, list[tuple[int, int, int, int]]]
    components: np.ndarray | None = None
    pieces: RowPieces | None = None


class ChunkPlacer:
    """Where unpacked examples and best-fit rows lie in their chunks: the documents from the store, the counts
    from the index, the arithmetic of :mod:`reader.order.placement`. Recent chunks' pieces and windows, and
    recent windows' rows, are kept; a window is packed once: a thread that asks while another packs it (a read
    and the prefetch) waits for that one."""

    def __init__(self, index: ExampleIndex, store: ChunkStore):
        self.index = index
        self.store = store
        self._lock = threading.Lock()
        self._cum: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._rows: collections.OrderedDict[tuple[int, int], placement.WindowRows] = collections.OrderedDict()
        self._rows_bytes = 0
        self._packing: dict[tuple[int, int], cf.Future] = {}  # windows being packed

    def _kept(self, c: int, make):
        """Chunk ``c``'s cumulative pieces or windows: kept, or ``make()`` (a few recent chunks are kept)."""
        with self._lock:
            got = self._cum.get(c)
            if got is not None:
                self._cum.move_to_end(c)
                return got
        try:
            got = make()
        except placement.Disagrees as e:
            raise self.index.mismatch(c, str(e)) from None
        with self._lock:
            self._cum[c] = got
            while len(self._cum) > _CUM_CACHE:
                self._cum.popitem(last=False)
        return got

    def locate(self, c: int, offsets: np.ndarray):
        """Unpacked examples ``offsets`` of chunk ``c``: :func:`reader.order.placement.locate` (decodes the
        chunk)."""
        docs, idx = self.store.doc_index(c), self.index
        cum = self._kept(c, lambda: placement.pieces_cum(idx.lengths(docs.doc_lengths), idx.seq_len,
                                                         idx.examples_of(c)))
        return placement.locate(cum, docs.doc_lengths, docs.doc_starts, offsets, idx.seq_len)

    def windows(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``c``'s windows (:func:`reader.order.placement.windows`), from its row groups' token counts
        (``store.meta``: no decoding) and the counted rows per window."""
        return self._kept(c, lambda: placement.windows(np.diff(self.store.meta(c).rg_token_starts),
                                                       self.index.window_tokens, self.index.window_counts(c)))

    def window_rows(self, c: int, w: int) -> placement.WindowRows:
        """Window ``w`` of chunk ``c``: its best-fit rows, from the documents of its row groups
        (``store.window_docs`` decodes them)."""
        key = (c, w)
        with self._lock:
            got = self._rows.get(key)
            if got is not None:
                self._rows.move_to_end(key)
                return got
            fut = self._packing.get(key)
            owner = fut is None
            if owner:
                fut = self._packing[key] = cf.Future()
        if not owner:
            return fut.result()
        idx = self.index
        try:
            bounds, first = self.windows(c)
            docs = self.store.window_docs(c, int(bounds[w]), int(bounds[w + 1]))
            try:
                got = placement.window_rows(idx.lengths(docs.doc_lengths), docs.doc_starts, idx.seq_len, first, w,
                                            **idx.caps)
            except placement.Disagrees as e:
                raise idx.mismatch(c, str(e)) from None
        except BaseException as e:
            with self._lock:
                del self._packing[key]
            fut.set_exception(e)
            raise
        with self._lock:
            del self._packing[key]
            self._rows[key] = got
            self._rows_bytes += got.nbytes
            while self._rows_bytes > _ROWS_CACHE_BYTES and len(self._rows) > 1:
                self._rows_bytes -= self._rows.popitem(last=False)[1].nbytes
        fut.set_result(got)
        return got

    def rows(self, c: int, offsets: np.ndarray) -> RowPieces:
        """Best-fit rows ``offsets`` of chunk ``c`` (:func:`reader.order.placement.rows`). Decodes only the
        windows the rows lie in."""
        _, first = self.windows(c)
        offsets = np.asarray(offsets, dtype=np.int64)
        return placement.rows(first, offsets, lambda w: self.window_rows(c, w))


class ExampleOrder:
    """Example index -> tokens, for one cache read with one set of options.

    Args:
      cache: the open cache (its known chunks grow while a build runs).
      options: the :class:`reader.ReadOptions`.
      store: the chunk store; unpacked examples and best-fit rows need their chunks' document lengths
        from it.
      rows: the rows of each global batch this reader serves (a hint: the cipher runs ahead for them).
      ahead: for a component of a mixture (whose examples are not whole batches): the cipher answers
        are computed for runs of this many examples ahead of those asked for, on the arithmetic
        progression this reader's examples lie on (see :meth:`sources`).
    """

    def __init__(self, cache: Cache, options: ReadOptions, store: ChunkStore, rows: np.ndarray,
                 ahead: int | None = None):
        self.cache = cache
        self.options = options
        self.store = store
        self.rows = rows
        self.ahead = ahead
        # rows i = rho (mod n) of every batch: examples of stream s = i mod R* = rho (mod g), g = gcd(n, R*),
        # and a shuffle with lanes = R* keeps that (a mixture component's examples k = s (mod R*) too)
        n = int(np.gcd.reduce(np.append(np.diff(rows), options.batch_size))) if rows.size else 1
        self._step = int(np.gcd(n, options.effective_ideal_readers))
        self._residue = int(rows[0]) % self._step if rows.size else 0
        self._source_runs: list[tuple[int, np.ndarray]] = []
        self.shuffle = options.shuffle_config()
        self.packing = options.packing
        # the pass rule (docs/FORMAT.md, "Passes"): eval reads are one stream under either
        self.pass_rule = options.pass_rule_for(cache.ledger.format_version)
        self.spans_rule = self.pass_rule == "spans" and not options.eval_mode
        self._spans: Spans | None = None
        self._said_wait = False
        # best fit: the continuation pieces per row, resolved by the cache's format version
        self.continuations = options.continuations(int(cache.ledger.raw["format_version"]))
        # per-chunk example counts (None: a concat stream's units are its tokens)
        self.chunk_index = None if self.packing == "concat" else ExampleIndex(
            cache, options.seq_len, self.packing, index_cache=options.index_cache,
            window_tokens=options.best_fit_window_tokens, drop_long=options.drop_long,
            continuations=self.continuations, max_segments=options.max_segments,
            view=getattr(cache, "view", None))
        self.placer = None if self.chunk_index is None else ChunkPlacer(self.chunk_index, store)
        self._lock = threading.Lock()
        self._index: StreamIndex | None = None
        self._index_key: tuple[int, bool] | None = None
        self._sources: collections.OrderedDict[Any, np.ndarray] = collections.OrderedDict()

    # -- the stream index ---------------------------------------------------------------------------
    def stream_index(self) -> StreamIndex:
        """The :class:`StreamIndex` over the chunks known now (all once the build is done): the streams of
        ``"streams"``, or the eval pass (one stream, no loop), whose rows the spans of ``"spans"`` cut."""
        with self._lock:
            table = self.cache.table
            key = (len(table), self.cache.complete)
            if self._index is None or self._index_key != key:
                counts = table.tokens if self.chunk_index is None else self.chunk_index.counts(table)
                loop = not (self.options.eval_mode or self.spans_rule)
                self._index = StreamIndex(counts, self.options.effective_ideal_readers if loop else 1, loop=loop,
                                          complete=self.cache.complete)
                self._index_key = key
            return self._index

    def pass_examples(self) -> int:
        """``E``, the examples of one pass: the rows of an eval pass at these options (concat: its whole
        rows, ``floor(T / L)``) in the chunks known now (all once the build is done)."""
        units = int(self.stream_index().counts.sum())
        return units // self.options.seq_len if self.packing == "concat" else units

    def repeated_rows(self) -> int:
        """:func:`reader.order.passes.stream_repeats` of this read: 0 under ``"spans"``, in eval mode and while
        the build runs."""
        if self.spans_rule or self.options.eval_mode or not self.cache.complete:
            return 0
        idx = self.stream_index()
        per_row = self.options.seq_len if self.packing == "concat" else 1
        return stream_repeats(self.pass_examples(), idx.pass_units(np.arange(idx.r)) // per_row)

    def spans(self) -> Spans:
        """The spans rule of the finished cache (:class:`reader.order.passes.Spans`). While the build runs:
        :class:`NotYetAvailable` (a pass needs every row), said once in the log; no row: :class:`EmptyStream`."""
        if self._spans is None:
            if not self.cache.complete:
                if not self._said_wait:
                    self._said_wait = True
                    LOG.warning("%s: the build is still running: %s (up to the reader's wait_timeout_s); "
                                "ReadOptions(pass_rule='streams') reads while it builds", self.cache.url, _WAIT)
                raise NotYetAvailable(_WAIT)
            rows = self.pass_examples()
            if rows == 0:
                what = (f"its {int(self.stream_index().counts.sum())} tokens make no whole row of seq_len "
                        f"{self.options.seq_len}" if self.packing == "concat" else "no document gives an example")
                raise EmptyStream(f"{self.cache.url}: nothing to read: {what}")
            self._spans = Spans(rows, self.options.effective_ideal_readers, self.shuffle)
        return self._spans

    def lanes(self) -> Spans | StreamLanes | None:
        """A shuffled read's lanes (:mod:`reader.order.passes`), which the release policy and the prefetcher
        follow; None unshuffled."""
        if self.shuffle is None:
            return None
        return self.spans() if self.spans_rule else StreamLanes(self.shuffle)

    def lane_pieces(self, lane: int, lo: int, hi: int):
        """The pieces ``(epoch, chunk, lo, hi)`` of the tokens of lane rows ``[lo, hi)`` of lane ``lane``
        (concat reads: a row is ``seq_len`` tokens)."""
        s, a, b = self.lanes().stream_rows(lane, lo, hi)
        return self.stream_index().pieces(s, a * self.options.seq_len, b * self.options.seq_len)

    def dropped_long(self) -> tuple[int, int]:
        """``drop_long``: ``(documents, tokens)`` longer than ``seq_len`` in the chunks known now, which
        yield no example; ``(0, 0)`` without it."""
        if not self.options.drop_long:
            return 0, 0
        self.stream_index()  # (counts every known chunk)
        return self.chunk_index.dropped(self.cache.table)

    # -- the end of an eval pass ---------------------------------------------------------------------
    def num_examples(self) -> int | None:
        """Eval mode: examples in the single pass (needs the finished cache). Training: None."""
        if not self.options.eval_mode:
            return None
        units = int(self.stream_index().stream_length(0))
        return -(-units // self.options.seq_len) if self.packing == "concat" else units

    def eval_limit(self, idx: StreamIndex, j: np.ndarray) -> int:
        """Eval: number of examples, or raise NotYetAvailable if ``j`` reaches past the known part."""
        units = int(idx.stream_length(0))
        L = self.options.seq_len
        concat = self.packing == "concat"
        if idx.complete:
            return -(-units // L) if concat else units
        known = units // L if concat else units
        if j.size and int(j.max()) >= known:
            raise NotYetAvailable(f"eval example {int(j.max())} is past the {known} examples written so far")
        return known

    def has_example(self, ex: int) -> bool:
        """False past the end of an eval pass (raises NotYetAvailable while the build has not decided)."""
        if not self.options.eval_mode:
            return True
        return ex < self.eval_limit(self.stream_index(), np.asarray([ex], dtype=np.int64))

    # -- the shuffle ----------------------------------------------------------------------------------
    def sources(self, exs: list[np.ndarray]) -> list[np.ndarray]:
        """The source index ``pi(ex)`` of every array of ``exs`` (``ex`` itself without a shuffle).

        The prefetch planner and the assembler ask for the same batches, so answers are kept (a few
        KB). A miss computes every missing array in one cipher call, and when the last one is a batch
        ``b`` of :attr:`rows`, batches ``b+1 ..`` too.
        """
        if self.shuffle is None:
            return exs
        if self.ahead is not None:
            return [self._sources_ahead(ex) for ex in exs]
        keys = [(int(ex[0]), ex.size, ex.tobytes()) if ex.size else None for ex in exs]
        with self._lock:
            got = [self._sources.get(k) for k in keys]
        todo = [i for i, g in enumerate(got) if g is None]
        if not todo:
            return got
        arrs = [exs[i] for i in todo]
        akeys = [keys[i] for i in todo]
        last = self._regular_batch(exs[todo[-1]])
        if last is not None:
            B = self.options.batch_size
            with self._lock:
                for b in range(last + 1, last + _SOURCE_BATCHES_AHEAD):
                    ex = b * B + self.rows
                    k = (int(ex[0]), ex.size, ex.tobytes())
                    if k not in self._sources:
                        arrs.append(ex)
                        akeys.append(k)
        allsrc = self._permute(np.concatenate(arrs))
        parts = np.split(allsrc, np.cumsum([a.size for a in arrs])[:-1])
        with self._lock:
            for k, src in zip(akeys, parts):
                src.setflags(write=False)
                self._sources[k] = src
            while len(self._sources) > _SOURCE_CACHE:
                self._sources.popitem(last=False)
        for i, src in zip(todo, parts):
            got[i] = src
        return got

    def _sources_ahead(self, ex: np.ndarray) -> np.ndarray:
        """``pi(ex)`` from a run of answers computed ahead: ``pi`` of ``k0, k0 + g, ..., k0 + g m`` for
        ``m`` reaching ``ahead`` examples past ``ex``; a few runs are kept (reads and prefetch plans
        ask for different places)."""
        if not ex.size:
            return ex
        g = self._step
        with self._lock:
            wins = list(self._source_runs)
        for k0, arr in wins:
            d = ex - k0
            if int(d.min()) >= 0 and int(d.max()) // g < arr.size and not (d % g).any():
                return arr[d // g]
        if ((ex - self._residue) % g).any():  # not this reader's progression (rows a loader names)
            return self._permute(ex)
        k0 = int(ex.min())
        m = (int(ex.max()) - k0 + self.ahead) // g + 1
        arr = self._permute(k0 + g * np.arange(m, dtype=np.int64))
        arr.setflags(write=False)
        with self._lock:
            self._source_runs = ([(k0, arr)] + self._source_runs)[:_SOURCE_RUNS]
        return arr[(ex - k0) // g]

    def _permute(self, ex: np.ndarray) -> np.ndarray:
        """The shuffle's source index of each example (under the spans rule: ``p * E`` plus its place in
        pass ``p``)."""
        if self.spans_rule:
            return self.spans().sources(ex)
        return np.asarray(shuffle_example_indices(ex, self.shuffle), dtype=np.int64)

    def _regular_batch(self, ex: np.ndarray) -> int | None:
        """``b`` if ``ex`` is ``b * B + rows``, else None."""
        rows = self.rows
        if ex.size != rows.size or not ex.size:
            return None
        d = ex - rows
        B = self.options.batch_size
        b0 = int(d[0])
        if b0 < 0 or b0 % B or not (d == b0).all():
            return None
        return b0 // B

    # -- placing examples -----------------------------------------------------------------------------
    def locate(self, ex: np.ndarray, src: np.ndarray | None = None) -> Placement:
        """Where the tokens of examples ``ex`` (one per row) are. ``src``: ``sources([ex])`` if known.

        Raises NotYetAvailable when they depend on chunks a running build has not written yet.
        """
        opts = self.options
        L = opts.seq_len
        idx = self.stream_index()
        if src is None:
            src = self.sources([ex])[0]
        examples = ex.astype(np.int64, copy=True)
        s, j, passes = self._positions(src)
        if opts.eval_mode:
            valid = j < self.eval_limit(idx, j)
            examples[~valid] = -1
            rows = np.flatnonzero(valid)
            s, j = s[rows], j[rows]
        else:
            valid = np.ones(ex.size, bool)
            rows = np.arange(ex.size)
        spill: dict[int, list[tuple[int, int, int, int]]] = {}
        pieces = None
        if self.packing == "concat":
            epochs, chunks, starts = idx.locate_streams(s, j * L)
            lengths = np.minimum(idx.counts[chunks] - starts, L)
            first = None
            for k in np.flatnonzero(lengths < L).tolist():
                jk = int(j[k])
                spill[k] = list(idx.pieces(int(s[k]), jk * L, (jk + 1) * L))
        elif self.packing == "unpacked":
            epochs, chunks, offsets = idx.locate_streams(s, j)
            starts, first, lengths = (np.empty(rows.size, np.int64) for _ in range(3))
            for c in np.unique(chunks).tolist():
                m = chunks == c
                starts[m], first[m], lengths[m] = self.placer.locate(c, offsets[m])
        else:
            epochs, chunks, offsets = idx.locate_streams(s, j)
            starts, first, lengths, pieces = self._best_fit_rows(chunks, offsets)
        if passes is not None:  # a row's epoch is its pass
            epochs = passes
            spill = {k: [(int(passes[k]), c, a, b) for _, c, a, b in got] for k, got in spill.items()}
        return Placement(examples, valid, rows, s, j, epochs, chunks, starts, lengths, first, spill, pieces=pieces)

    def _positions(self, src: np.ndarray):
        """``(streams, positions, passes)`` of sources ``src`` in :meth:`stream_index`: under ``"spans"`` stream
        0 (the eval pass) at the example's eval row, and its pass; else its stream and position, None."""
        if self.spans_rule:
            p, _, _, row = self.spans().place(src)
            return np.zeros_like(row), row, p
        return (*stream_position(src, self.options.effective_ideal_readers), None)

    def _best_fit_rows(self, chunks: np.ndarray, offsets: np.ndarray):
        """``(starts, first_positions, lengths, pieces)`` of best-fit rows ``offsets`` of ``chunks``."""
        parts = []
        for c, dst in group_by_key(chunks, np.arange(chunks.size)):
            parts.append((dst, self.placer.rows(c, offsets[dst])))
        pieces = RowPieces.scatter(chunks.size, parts) if len(parts) > 1 else (
            parts[0][1] if parts else RowPieces.empty())
        head = pieces.ptr[:-1]
        lengths = np.add.reduceat(pieces.lengths, head) if head.size else np.zeros(0, np.int64)
        return pieces.starts[head], pieces.first_positions[head], lengths.astype(np.int64), pieces

    # -- what upcoming reads touch --------------------------------------------------------------------
    def touched(self, exs: list[np.ndarray]) -> list[tuple[int, np.ndarray]]:
        """``(chunk, unit offsets)`` that examples ``exs`` touch, in chunk order (concat: token offsets of
        each window's first and last token; unpacked and best-fit: example offsets, see
        :meth:`token_offsets`)."""
        opts = self.options
        L = opts.seq_len
        idx = self.stream_index()
        s, j, _ = self._positions(np.concatenate(self.sources(exs)))
        if self.packing == "concat":
            pos = np.concatenate([j * L, j * L + L - 1])
            s = np.concatenate([s, s])
        else:
            pos = j
        if not (idx.loop and idx.complete):
            keep = pos < idx.pass_units(s)
            s, pos = s[keep], pos[keep]
        _, chunks, offs = idx.locate_streams(s, pos)
        return group_by_key(chunks, offs)

    def token_offsets(self, c: int, offsets: np.ndarray) -> np.ndarray:
        """Token offsets in chunk ``c`` of unit offsets from :meth:`plan` (unpacked: decodes the chunk;
        best-fit: every piece of the rows, decoding the windows they lie in)."""
        if self.chunk_index is None:
            return offsets
        if self.packing == "best_fit":
            return self.placer.rows(c, offsets).starts
        return self.placer.locate(c, offsets)[0]

