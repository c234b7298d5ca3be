"""Releasing the row groups a read has passed, so their memory is freed.

A decoded row group that the read will not need again leaves the store's cache at once instead of
waiting for the LRU to evict it, so the reader holds little more than the row groups ahead of it (a
read's peak RSS about halves: docs/DESIGN.md "Ablations"). Only a cache decision: a read that jumps back
decodes again.

* Unshuffled packed reads move forward through each chunk: once a batch's windows start in row group
  ``g`` of a chunk, its row groups before ``g`` are passed.
* Shuffled packed reads consume the growing-window shuffle mix by mix
  (:func:`reader.order.shuffle.mix_of_rows`): once the reads have passed a mix, the row groups wholly inside
  its source blocks (:func:`reader.order.shuffle.mix_sources_of_lanes`) are passed, and after the last mix
  of a window, those wholly inside the window (and the one before it: the row group over their
  boundary). Row groups at block ends may serve another mix: the LRU keeps those. Mixes, windows and their
  sources are counted in *lane rows*, which the read's pass rule maps to tokens
  (:mod:`reader.order.passes`, :meth:`reader.batch.examples.ExampleOrder.lanes`).
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from reader.options import ReadOptions
from reader.batch.examples import ExampleOrder
from reader.storage.store import ChunkStore

_TRACKED_CHUNKS = 4096
_TRACKED_MIXES = 64


class ReleasePolicy:
    """Tells the store which row groups the reads have passed (see the module docstring).

    Attributes:
      passed_row: shuffled reads: the first lane row (position of every lane) of the latest read;
        the prefetcher skips work for mixes below it.
      rewinds: how many times a shuffled read jumped back (the prefetcher then forgets what it loaded).
    """

    def __init__(self, store: ChunkStore, order: ExampleOrder, options: ReadOptions):
        self.store = store
        self.order = order
        self.L = options.seq_len
        cfg = order.shuffle
        # with lanes == R*, a lane's rows are its stream's positions: the mixes map onto stream ranges
        # (mixes are stream ranges of L-token windows: concat reads only; best-fit rows of a chunk never go
        # back before their earliest piece, so they release per chunk as windows do)
        self.by_mix = cfg is not None and options.packing == "concat" and cfg.lanes == options.effective_ideal_readers
        self.by_chunk = cfg is None and options.packed
        self._lock = threading.Lock()
        self._released: dict[int, int] = {}  # chunk -> its row groups before this one were released
        self._mixes: dict[int, list] = {}  # mixes being read: first output row -> [end row, lanes read]
        self._mix_span: tuple[int, int] = (0, 0)
        self._lane_sets: dict[bytes, frozenset] = {}
        self._wanted: dict[tuple[int, int], int] = {}  # (chunk, row group) -> a later batch that needs it
        self.pace = None  # the reads' reader.batch.prefetch.Pace (where they are), set by the prefetcher
        self.passed_row = 0
        self.rewinds = 0

    def released_before(self, c: int) -> int:
        """Row groups of chunk ``c`` before this one were released (unshuffled reads; 0: none)."""
        return self._released.get(c, 0)

    def want(self, c: int, groups: list[int], batch: int) -> None:
        """The prefetch planned row groups ``groups`` of chunk ``c`` for reads until batch ``batch``: the reads
        keep them when they pass them before that batch (a stream's next pass, planned while the current one
        still reads the chunk; the next mix, loaded while this one is read, which shares row groups with it
        at its blocks' ends; the latest batch wanted counts), and release them when they pass them after it."""
        with self._lock:
            for g in groups:
                if self._wanted.get((c, g), -1) < batch:
                    self._wanted[(c, g)] = batch
            while len(self._wanted) > _TRACKED_CHUNKS:
                self._wanted.pop(next(iter(self._wanted)))

    # -- unshuffled: per chunk --------------------------------------------------------------------------
    def concat_windows_read(self, recs, cross) -> None:
        """The assembler's hook: what a packed read copied (runs of windows, and windows over two row
        groups; best-fit: the row groups its pieces lie in: tuples starting ``(chunk, row group)``)."""
        if not self.by_chunk or not (recs or cross):
            return
        first: dict[int, int] = {}
        for rec in itertools.chain(recs, cross):
            c, g = rec[0], rec[1]
            if g < first.get(c, g + 1):
                first[c] = g
        todo = []
        with self._lock:
            for c, g in first.items():
                done = self._released.get(c, 0)
                if g < done:  # a new pass over this chunk (or a jump back): start again from here
                    self._released[c] = g
                elif g > done:
                    todo.extend((c, x) for x in range(done, g))
                    self._released[c] = g
            while len(self._released) > _TRACKED_CHUNKS:
                self._released.pop(next(iter(self._released)))
            if self._wanted:  # kept for a later batch (see want)
                now = self.pace.first if self.pace is not None else -1
                todo = [k for k in todo if self._wanted.get(k, -1) <= now]
                for k in todo:
                    self._wanted.pop(k, None)
        for c, g in todo:
            self.store.release(c, g)

    # -- shuffled: per mix ------------------------------------------------------------------------------
    def examples_read(self, ex: np.ndarray) -> None:
        """After a read of examples ``ex``: release the mixes every lane it reads has passed."""
        if not self.by_mix or not ex.size:
            return
        lanes = self.order.lanes()
        rows, by_lane = lanes.lane_rows(ex)
        t_min, t_max = int(rows.min()), int(rows.max())
        key = by_lane.tobytes()
        lane_set = self._lane_sets.get(key)
        if lane_set is None:  # (a reader's batches have one or a few lane patterns)
            lane_set = frozenset(np.unique(by_lane).tolist())
            if len(self._lane_sets) < 64:
                self._lane_sets[key] = lane_set
        with self._lock:
            lo, hi = self._mix_span
            fast = lo <= t_min and t_max < hi and lo in self._mixes
        if fast:
            spans = [(lo, hi)]
        else:
            _, mlo, mhi = lanes.mixes(np.unique(rows))
            spans = sorted(set(zip(mlo.tolist(), mhi.tolist())))
        finished = []
        with self._lock:
            for m_lo, m_hi in spans:
                entry = self._mixes.get(m_lo)
                if entry is None:
                    entry = self._mixes[m_lo] = [m_hi, set()]
                if not lane_set <= entry[1]:
                    entry[1] |= lane_set
            self._mix_span = spans[-1]
            if t_min < self.passed_row:  # a jump back: mixes prefetched before may have been released
                self.rewinds += 1
            self.passed_row = t_min
            for m_lo in [m for m, (m_hi, _) in self._mixes.items() if m_hi <= t_min]:
                finished.append((m_lo, *self._mixes.pop(m_lo)))
            while len(self._mixes) > _TRACKED_MIXES:  # reads far apart (random access): forget the oldest
                self._mixes.pop(next(iter(self._mixes)))
        if finished:
            for m_lo, m_hi, m_lanes in finished:
                try:
                    self._release_mix(lanes, m_lo, m_hi, sorted(m_lanes))
                except Exception:  # noqa: BLE001 - a cache decision never fails a read
                    pass

    def _release_mix(self, lanes, m_lo: int, m_hi: int, which: list[int]) -> None:
        w_lo, w_hi = lanes.shuffle_window(m_lo)
        ranges = {lane: rr.tolist() for lane, rr in zip(which, lanes.mix_sources(m_lo, which))}
        if m_hi >= w_hi:  # the window's last mix: the whole window, and the previous one (of the same pass)
            prev = lanes.shuffle_window_before(w_lo)
            for lane in which:
                ranges[lane].append([prev, w_hi])
        for lane, rr in ranges.items():
            for r0, r1 in rr:
                self._release_lane_range(lane, r0, r1)

    def _release_lane_range(self, lane: int, lo: int, hi: int) -> None:
        """Release the cached row groups that lie wholly inside the tokens of lane rows ``[lo, hi)``."""
        for _, c, a, b in self.order.lane_pieces(lane, lo, hi):
            meta = self.store.cached_meta(c)
            if meta is None:  # not in the cache: neither are its row groups, most likely
                continue
            starts = meta.rg_token_starts
            g0 = int(np.searchsorted(starts, a, side="left"))  # first row group starting at or after a
            g1 = int(np.searchsorted(starts, b, side="right")) - 1  # row groups ending at or before b
            if g1 > g0:
                keep = self._kept(c, g0, g1)
                if not keep:
                    self.store.release_range(c, g0, g1)
                for g in range(g0, g1) if keep else ():
                    if g not in keep:
                        self.store.release(c, g)

    def _kept(self, c: int, g0: int, g1: int) -> set[int]:
        """Of row groups ``g0 .. g1-1`` of chunk ``c``, those a later batch wants (see :meth:`want`)."""
        if not self._wanted:
            return set()
        now = self.pace.first if self.pace is not None else -1
        with self._lock:
            keep = {g for g in range(g0, g1) if self._wanted.get((c, g), -1) > now}
            for g in range(g0, g1):
                if g not in keep:
                    self._wanted.pop((c, g), None)
        return keep
