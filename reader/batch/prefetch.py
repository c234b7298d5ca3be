"""Prefetch: loading, on the store's background threads, the row groups upcoming batches need.

``iter_batches`` (and loaders, through ``Reader.prefetch``) ask for batches :meth:`Prefetcher.lookahead`
ahead of the one being served: about one row group of every stream (best fit: one packing window, which
a stream's next rows need whole), capped by an eighth of the memory budget (on a remote cache half of it),
so decoding overlaps serving.
A plan (:meth:`reader.batch.examples.ExampleOrder.plan`) lists the chunk offsets those batches touch; one
background task per chunk fetches, verifies and decodes the row groups that hold them, so the chunks of a
batch load in parallel.

Shuffled packed reads of whole lanes load whole mixes instead, as each comes into view: a batch of a
mix touches rows all over the mix's blocks, and the mix needs all of them within its first batches
anyway. On a remote cache the chunks of the mix after it are opened then too (sidecars and footers
only), so its row groups are one round trip away when it comes into view. Errors are left for the real read to report: a prefetch never fails a run.

**Remote caches.** A range request to a bucket takes tens of milliseconds, during which the read goes
on: the batches planned ahead must cover what is read while the requests of the next ones are out (a
chunk's sidecar, then its footer, then its row groups: up to three round trips). There the lookahead is
``LATENCIES_AHEAD`` times the store's observed request latency times the observed read rate (batches per
second of the reads when they are not waiting for requests, :class:`Pace`), never less than the local
rule above and never more than it allows in memory; the store keeps that many requests in flight without
a thread per request (:mod:`reader.storage.store`). Planning runs on the store's planning thread
(:meth:`reader.storage.store.ChunkStore.plan`), and a concat plan starts its chunks' requests at once:
neither waits behind the row groups being decoded on the store's threads.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures as cf
import dataclasses
import math
import threading
import time
from typing import Callable, Iterator

import numpy as np

from reader.format import spec as fmt
from reader.storage.cache import Cache
from reader.options import ReadOptions
from reader.batch.examples import ExampleOrder
from reader.batch.release import ReleasePolicy
from reader.storage.store import ChunkStore
from reader.order.streams import NotYetAvailable, streams_of_reader

_TRACKED_MIXES = 64
_PLANNED_WINDOWS = 1024  # read_ahead: windows remembered as planned (a read's streams enter a few at a time)
LATENCIES_AHEAD = 8  # remote caches: batches planned ahead cover this many request latencies of reading
# the lookahead's share of the memory budget: an eighth; on a remote cache half, since a read there gets at
# most its lookahead per request latency (docs/DESIGN.md, remote reads)
LOCAL_AHEAD_SHARE, REMOTE_AHEAD_SHARE = 1 / 8, 1 / 2
_PACE_S = 0.5  # the read rate is measured over about this many seconds
_PACE_REWIND = 256  # a read this many batches before the latest one starts the rate again
_FEW_TOKENS = 32  # _missing: up to this many tokens, bisect in Python; more, one numpy search (the two cost the same at 40-50)


def _opened(meta) -> None:
    """Nothing to do once a chunk is open (opening it ahead was the point)."""


class Pace:
    """Where a reader's reads are and how fast they advance, in global batches per second over the last
    ``_PACE_S`` seconds (:meth:`note` is told the batches of every read as it starts), leaving out the
    seconds the reads waited for requests (``waited()``: a running total): the rate the reads go at when
    the read-ahead covers the latency. (With the waits counted, a read-ahead too short for the latency
    slows the reads, which shortens it further.)"""

    def __init__(self, waited: Callable[[], float] = lambda: 0.0):
        self._lock = threading.Lock()
        self._marks: collections.deque[tuple[float, int]] = collections.deque()
        self.first = self.last = -1  # the first and last batch of the latest read
        self._waited = waited

    def note(self, first: int, last: int) -> None:
        now = time.monotonic() - self._waited()
        self.first, self.last = first, last
        with self._lock:
            marks = self._marks
            if marks:  # (waits of reads in several threads at once may exceed the time)
                now = max(now, marks[-1][0])
            if marks and last < marks[-1][1]:
                if last > marks[-1][1] - _PACE_REWIND:  # reads out of order (a loader's threads): the rate stands
                    return
                marks.clear()  # a jump back (a new read): start again
            marks.append((now, last))
            while len(marks) > 2 and now - marks[1][0] > _PACE_S:
                marks.popleft()

    def rate(self) -> float:
        """Batches per second (0 until the reads span a tenth of ``_PACE_S``: a rate from two reads close
        together would be noise)."""
        with self._lock:
            if len(self._marks) < 2:
                return 0.0
            (t0, b0), (t1, b1) = self._marks[0], self._marks[-1]
        return (b1 - b0) / (t1 - t0) if t1 - t0 >= _PACE_S / 10 else 0.0


@dataclasses.dataclass
class _Planned:
    """What :meth:`Prefetcher.read_ahead` planned: the next batch to plan (-1: none yet), the row groups
    ``(chunk, group)`` still to decode, soonest first, and the windows ``(chunk, window)`` planned."""

    batch: int = -1
    todo: collections.deque = dataclasses.field(default_factory=collections.deque)
    seen: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)


class Prefetcher:
    """Prefetch for one reader.

    Args:
      cache, store, order, options: the reader's.
      release: the reader's release policy (a plan the reads have overtaken is skipped).
      rows: the rows of each global batch this reader serves.
      num_readers, reader_index: the reader's place (R, r): which streams and lanes are its own.
    """

    def __init__(self, cache: Cache, store: ChunkStore, order: ExampleOrder, options: ReadOptions,
                 release: ReleasePolicy, rows: np.ndarray, num_readers: int, reader_index: int):
        self.cache, self.store, self.order, self.options, self.release = cache, store, order, options, release
        self.rows, self.num_readers, self.reader_index = rows, num_readers, reader_index
        self._lock = threading.Lock()
        self._mixes: collections.OrderedDict[int, bool] = collections.OrderedDict()  # first rows, loaded
        self._mix_span: tuple[int, int] = (0, 0)
        self._rewinds = 0
        self.whole_mixes = self._whole_mixes()
        # told of every read (Reader._read); a mixture's components share one
        self.pace = release.pace = Pace(lambda: store.waited_s)
        # a remote cache read asynchronously, concat windows: loading a chunk's part only starts requests
        self._now = store.asynchronous and order.chunk_index is None
        self._ahead = _Planned()

    def _row_group_tokens(self) -> int:
        return int(self.cache.ledger.config.get("row_group_tokens") or (1 << 20))

    def lookahead(self, share: float = 1.0) -> int:
        """How many batches ahead to load: about one row group per stream (best fit: one window, which a
        stream's next rows need whole), within the budget; on a remote cache at least what is read during
        ``LATENCIES_AHEAD`` request latencies (see the module docstring). ``share``: the most of a batch's
        rows this cache serves (a mixture's component: its largest weight), which sets how far its streams
        advance per batch."""
        opts = self.options
        streams = streams_of_reader(opts.effective_ideal_readers, self.num_readers, self.reader_index)
        local = len(streams) if streams is not None else opts.effective_ideal_readers
        # tokens each stream advances per global batch, whatever R (unpacked pieces are at most seq_len)
        per_batch = max(1.0, min(1.0, share) * opts.batch_size * opts.seq_len / opts.effective_ideal_readers)
        stream_tokens = opts.memory_budget_bytes // (4 * max(1, local))  # a stream's share, decoded (4 bytes a token)
        unit = opts.best_fit_window_tokens if opts.packing == "best_fit" else self._row_group_tokens()
        ahead = math.ceil(min(unit, stream_tokens * LOCAL_AHEAD_SHARE) / per_batch)
        latency = self.store.latency_s
        if latency is not None:
            remote = math.ceil(LATENCIES_AHEAD * latency * self.pace.rate())
            ahead = max(ahead, min(remote, stream_tokens * REMOTE_AHEAD_SHARE // per_batch))
        return int(max(1, min(4096, ahead)))

    def read_ahead(self, b: int, stop: int | None = None) -> Iterator[None]:
        """Best fit, on the caller's thread: decode the row groups of the packing windows that this reader's
        rows of batches ``b .. b + lookahead`` (before ``stop``, the end of the read; None: no end) enter,
        soonest first, one row group per step (a generator; it ends when none is missing). For a reader
        worker waiting for its next slab: a stream decodes a whole window when it enters it, several times
        the CPU of a slab, so without this one worker's window stalls the other's slabs (docs/DESIGN.md).
        What was planned carries over to the next call, so each batch is planned once; row groups the reads
        have passed are left alone. A chunk not built yet, damaged or unreadable ends it quietly (the real read
        waits or reports it); any other error is a bug and propagates."""
        placer = self.order.placer
        if self.options.packing != "best_fit" or placer is None:
            return
        B = self.options.batch_size
        ahead = self.lookahead()
        step = max(1, ahead // 32)  # (a window shorter than this many batches is decoded when it is read)
        state = self._ahead
        if not b <= state.batch <= b + ahead + step:  # a first call, or a jump: plan afresh
            state = self._ahead = _Planned(b)
        todo, seen = state.todo, state.seen
        try:
            while True:
                while todo:
                    c, g = todo.popleft()
                    if g >= self.release.released_before(c) and self.store.touch_row_groups(c, [g]):
                        self.store.row_group(c, g)
                        yield
                at = state.batch
                if at > b + ahead or (stop is not None and at >= stop):
                    return
                state.batch = at + step
                for c, offs in self.order.touched([at * B + self.rows]):
                    bounds, first = placer.windows(c)
                    for w in np.unique(np.searchsorted(first, offs, side="right") - 1).tolist():
                        if (c, w) not in seen:
                            seen[(c, w)] = None
                            todo.extend((c, g) for g in range(int(bounds[w]), int(bounds[w + 1])))
                while len(seen) > _PLANNED_WINDOWS:
                    seen.popitem(last=False)
        except (NotYetAvailable, fmt.FormatError, OSError):  # not built yet: the real read waits; a damaged
            self._ahead = _Planned()  # or unreadable chunk: the real read reports it

    def _whole_mixes(self) -> bool:
        """Whether to load whole mixes: shuffled concat reads where this reader reads whole lanes (``R``
        divides ``R* == lanes``) and a mix's row groups fit in half the memory budget."""
        cfg, opts = self.order.shuffle, self.options
        if not (cfg is not None and opts.packing == "concat" and cfg.lanes == opts.effective_ideal_readers
                and cfg.lanes % self.num_readers == 0
                and self.rows.size * self.num_readers == opts.batch_size):  # (not a worker's share of them)
            return False
        rows = cfg.block_rows * cfg.mix_blocks
        lanes = cfg.lanes // self.num_readers
        # decoded bytes: the mix's windows, plus a row group at each end of each block
        need = lanes * 4 * (rows * opts.seq_len + 2 * cfg.mix_blocks * self._row_group_tokens())
        return need <= opts.memory_budget_bytes // 2

    def prefetch(self, b: int, rows=None, count: int = 1) -> list[cf.Future]:
        """Start loading what rows ``rows`` (default: this reader's) of batches ``b .. b+count-1`` need;
        return the background tasks' futures at once."""
        B = self.options.batch_size
        mine = rows is None
        rows = self.rows if mine else np.asarray(rows, dtype=np.int64).reshape(-1)
        return self.prefetch_examples([(b + i) * B + rows for i in range(count)], whole=mine, batch=b)

    def ask(self, ex: np.ndarray) -> None:
        """Start loading what a read of examples ``ex`` needs, all at once (a remote cache: before the read
        waits for any of it)."""
        self.prefetch_examples([ex], whole=False)

    def prefetch_examples(self, exs: list[np.ndarray], whole: bool = True, batch: int = -1) -> list[cf.Future]:
        """Start loading what examples ``exs`` (arrays, in reading order) need; ``whole``: they are this
        reader's rows of some batches (or a mixture's items of one component in them), so whole mixes
        may be loaded; ``batch``: the first global batch they are in (-1: unknown). Returns the background
        tasks' futures at once."""
        exs = [e for e in exs if e.size]
        if not exs:
            return []
        try:
            if whole and self.whole_mixes:
                return self._prefetch_mixes(exs)
            plan = self.order.touched(exs)
        except Exception:  # noqa: BLE001 - e.g. NotYetAvailable during a build: the real read waits
            return []
        last_row = -1
        if self.release.by_mix:
            last_row = int(self.order.lanes().lane_rows(np.concatenate(exs))[0].max())
        return self.prefetch_chunks(plan, last_row, batch)

    def prefetch_chunks(self, plan: list[tuple[int, np.ndarray]], last_row: int = -1, batch: int = -1
                        ) -> list[cf.Future]:
        """Start loading the row groups a plan (:meth:`reader.batch.examples.ExampleOrder.plan`) names that are
        neither cached nor loading; ``last_row``: the last shuffle row it serves (-1: unshuffled); ``batch``:
        the first global batch it serves (-1: unknown)."""
        futs = []
        ahead = batch if batch > self.pace.last else 0  # a plan ahead of the reads: a chunk they released is read again
        for c, offs in plan:
            if self.order.chunk_index is None:  # concat: skip a chunk whose row groups are all there (or loading)
                meta = self.store.cached_meta(c)
                if meta is not None and not self._missing(c, meta, offs, ahead):
                    continue
            futs.append(self._start(self._load_chunk_part, c, offs, last_row, ahead))
        return futs

    def _start(self, fn, *args) -> cf.Future:
        """Run read-ahead work ``fn(*args)``: now where it only starts requests (a remote cache read
        asynchronously, concat windows: on the store's threads it would wait behind the row groups being
        decoded, delaying its requests), else on the store's threads."""
        if not self._now:
            return self.store.submit(fn, *args)
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - read-ahead work never fails a read; the read itself reports
            fut.set_exception(e)
        return fut

    def _missing(self, c: int, meta, tokens: np.ndarray, ahead: int = 0) -> list[int]:
        """Row groups holding ``tokens`` of chunk ``c`` (``meta``: its :class:`reader.storage.chunk.ChunkMeta`)
        that are neither cached nor loading (the cached ones are marked used), past those the reads have
        released unless the plan is ahead of the reads (a stream's next pass reads the chunk again;
        ``ahead``: the plan's first batch, 0: not ahead), which the reads then keep until that batch
        (:meth:`reader.batch.release.ReleasePolicy.want`).
        (A plan names a few tokens per chunk, except a best-fit plan's pieces: bisect over the row-group
        starts costs less than numpy's per-call overhead for a few, more for hundreds.)"""
        done = 0 if ahead else self.release.released_before(c)  # a plan the reads have overtaken: already used
        if tokens.size > _FEW_TOKENS:
            at = np.unique(np.searchsorted(meta.rg_token_starts, tokens, side="right") - 1)
            groups = at[at >= done].tolist()
        else:
            starts, toks = meta.rg_token_starts_list, tokens.tolist()
            lo, hi = bisect.bisect_right(starts, min(toks)) - 1, bisect.bisect_right(starts, max(toks)) - 1
            if hi - lo <= 1:  # the usual case (a stream's next windows): every group from lo to hi is touched
                groups = [g for g in range(lo, hi + 1) if g >= done]
            else:
                groups = sorted({g for g in (bisect.bisect_right(starts, t) - 1 for t in toks) if g >= done})
        if ahead:  # cached or on their way now: the reads may be about to release them
            self.release.want(c, groups, ahead)
        return self.store.touch_row_groups(c, groups)

    def _prefetch_mixes(self, exs: list[np.ndarray]) -> list[cf.Future]:
        """Load the row groups of every mix that examples ``exs`` reach and that is not loaded yet: one
        background task per chunk."""
        lanes = self.order.lanes()
        rows = [lanes.lane_rows(e)[0] for e in exs]
        t = min(int(r.min()) for r in rows)
        t_end = max(int(r.max()) for r in rows)
        futs: list[cf.Future] = []
        while t <= t_end:
            with self._lock:
                if self._rewinds != self.release.rewinds:  # the reads jumped back: mixes were released
                    self._rewinds = self.release.rewinds
                    self._mixes.clear()
                    self._mix_span = (0, 0)
                lo, hi = self._mix_span
            if not lo <= t < hi:
                _, mlo, mhi = lanes.mixes(np.asarray([t]))
                lo, hi = int(mlo[0]), int(mhi[0])
                with self._lock:
                    new = lo not in self._mixes
                    if new:  # (two planning threads never both load a mix)
                        self._mixes[lo] = True
                        while len(self._mixes) > _TRACKED_MIXES:
                            self._mixes.popitem(last=False)
                if new:
                    try:
                        # first what the planned examples in the mix need (the pool runs tasks in
                        # order), then the rest of the mix
                        inside = [e for e, r in zip(exs, rows) if int(r.min()) < hi and int(r.max()) >= lo]
                        if inside:
                            futs.extend(self._start(self._load_chunk_part, c, offs, hi - 1)
                                        for c, offs in self.order.touched(inside))
                        futs.extend(self._prefetch_mix(lo, hi))
                    except BaseException:  # e.g. NotYetAvailable during a build: try again next time
                        with self._lock:
                            self._mixes.pop(lo, None)
                        raise
                with self._lock:
                    self._mix_span = (lo, hi)
            t = hi
        return futs

    def _prefetch_mix(self, lo: int, hi: int) -> list[cf.Future]:
        per_chunk = self._mix_chunks(lo)
        lanes = self.order.lanes()
        batch = lanes.last_example(hi - 1) // self.options.batch_size  # the mix's last batch
        futs = [self._start(self._load_chunk_ranges, c, ranges, hi - 1, batch) for c, ranges in per_chunk.items()]
        if self.store.asynchronous:
            # a remote cache: open the next mix's chunks now (their sidecars and footers, a few KiB each),
            # so that when it comes into view its row groups are one round trip away, not three
            try:
                for c in self._mix_chunks(hi):
                    self.store.when_open(c, _opened)
            except Exception:  # noqa: BLE001 - e.g. past the data, or not built yet: its own turn will say
                pass
        return futs

    def _mix_chunks(self, lo: int) -> dict[int, list[tuple[int, int]]]:
        """``{chunk: [(a, z), ...]}``: the token ranges of each chunk that this reader's lanes read in the mix
        starting at lane row ``lo``."""
        lanes = self.order.lanes()
        mine = lanes.reader_lanes(lo, self.num_readers, self.reader_index)
        per_chunk: dict[int, list[tuple[int, int]]] = {}
        for lane, ranges in zip(mine, lanes.mix_sources(lo, mine)):
            for r0, r1 in ranges.tolist():
                for _, c, a, z in self.order.lane_pieces(lane, r0, r1):
                    per_chunk.setdefault(c, []).append((a, z))
        return per_chunk

    def _load_chunk_ranges(self, c: int, ranges: list[tuple[int, int]], last_row: int, batch: int = -1) -> None:
        """Load the row groups of chunk ``c`` that hold tokens ``[a, z)`` for each range (for a mix read until
        batch ``batch``: the reads keep them until then, :meth:`reader.batch.release.ReleasePolicy.want`)."""
        if last_row < self.release.passed_row:  # the reads have passed the mix: already served
            return

        def load(meta) -> None:
            starts = meta.rg_token_starts
            groups: set[int] = set()
            for a, z in ranges:
                g0 = int(np.searchsorted(starts, a, side="right")) - 1
                g1 = int(np.searchsorted(starts, z - 1, side="right")) - 1
                groups.update(range(g0, g1 + 1))
            groups = sorted(groups)
            if batch > self.pace.last:  # (the mix before may hold some of them: its release keeps them)
                self.release.want(c, groups, batch)
            self.store.warm_row_groups(c, groups)

        self.store.when_open(c, load)  # (a prefetch never fails the run; the real read reports an error)

    def _load_chunk_part(self, c: int, offs: np.ndarray, last_row: int = -1, ahead: int = 0) -> None:
        if 0 <= last_row < self.release.passed_row:  # a shuffled plan the reads have overtaken
            return
        if ahead and ahead <= self.pace.last:  # planned ahead, run late (queued behind decodes): the reads
            ahead = 0  # have overtaken it, so what they released they have passed (not decoded again)
        try:
            tokens = self.order.token_offsets(c, offs)
        except Exception:  # noqa: BLE001 - a prefetch never fails the run; the real read reports it
            return
        self.store.when_open(c, lambda meta: self.store.warm_row_groups(
            c, self._missing(c, meta, tokens, ahead)))
