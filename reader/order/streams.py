"""The stream index: global chunk order, streams and examples. Pure functions, no I/O.

Which chunk and offset holds unit ``j`` of stream ``s``: the pipeline (chunk order), the reader, the
JAX loader and the benchmarks all ask this module, so they agree by construction. The shuffle is
:mod:`reader.order.shuffle`; :mod:`reader.batch.examples` combines both into "which tokens is example ``i``".

Terms (Levanter's design for a sharded, resumable token cache, "Reproducible Sharded Reading for Training"):

* **Global chunk order.** Chunks are ordered round-robin across input shards, in shard order; a shard
  that has run out of chunks drops out of later rounds (:func:`round_robin_order`).
* **Streams.** With ``R*`` ideal readers, stream ``s`` is ``loop(all_chunks)[s::R*]``. Each stream turns
  its chunks into a sequence of *units*: tokens (packed examples), documents, or unpacked examples.
* **Examples.** ``example[i] = stream_examples[i % R*][i // R*]``; global batch ``b`` is
  ``example[b*B : (b+1)*B]``; with ``R`` readers, reader ``r`` serves rows ``k ≡ r (mod R)`` of it.

The key fact used for O(log N) seeking: position ``p`` of the looped chunk list is chunk ``p mod N`` of
epoch ``p // N``. Stream ``s`` holds the positions ``p ≡ s (mod R*)``, so within epoch ``e`` it visits
exactly the chunks ``c ≡ (s - e*N) (mod R*)``, in increasing order. Sorting chunks by
``(c mod R*, c)`` ("class-major order") makes every stream-epoch a contiguous run, so one prefix-sum
array of length ``N + 1`` answers every seek with a binary search, and the per-stream sequence of
epochs is periodic with period ``R* / gcd(N, R*)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Sequence

import numpy as np


_TABLE_LIMIT = 1 << 22  # entries of a stream-by-epoch table held at once (larger: one call per stream)


def _in_period(rows: np.ndarray, per: np.ndarray, j: np.ndarray):
    """``(full periods, epoch in the period, units into that epoch)`` of unit positions ``j``, each of a
    stream whose epoch starts in one period are ``rows[k]`` (:meth:`StreamIndex.epoch_table` rows; any
    padding past the period above every position in it) and whose period holds ``per[k]`` units."""
    full, rem = np.divmod(j, per)
    e_in = (rows <= rem[:, None]).sum(axis=1) - 1
    return full, e_in, rem - rows[np.arange(rows.shape[0]), e_in]


def _slot(starts: np.ndarray, key: np.ndarray):
    """``(slot, offset)``: the slot of the class-major prefix sums ``starts`` holding unit ``key``, and the
    unit's offset in it."""
    slot = np.searchsorted(starts, key, side="right") - 1
    return slot, key - starts[slot]


class NotYetAvailable(LookupError):
    """The answer depends on chunks the (still running) build has not written yet."""


class EndOfStream(IndexError):
    """A single-pass (non-looping) stream has no unit at that position."""


class EmptyStream(ValueError):
    """A looping stream that never yields anything (every chunk it visits is empty)."""


# --------------------------------------------------------------------------------------------------
# Global chunk order


def round_robin_order(chunks_per_shard: Sequence[int]) -> np.ndarray:
    """Global chunk order as an ``(N, 2)`` int64 array of ``(shard, index_in_shard)``.

    Round ``j`` lists chunk ``j`` of every shard that has more than ``j`` chunks, in shard order.
    """
    counts = np.asarray(chunks_per_shard, dtype=np.int64)
    if counts.size == 0 or counts.sum() == 0:
        return np.zeros((0, 2), dtype=np.int64)
    n = int(counts.sum())
    k = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    # by round k; the chunks are in shard order already, so a stable sort keeps it within a round (a radix sort
    # when the rounds fit 16 bits: 10^7 chunks in well under a second)
    perm = np.argsort(k.astype(np.uint16) if counts.max() <= 1 << 16 else k, kind="stable")
    out = np.empty((n, 2), dtype=np.int64)
    out[:, 0] = np.repeat(np.arange(counts.size, dtype=np.int64), counts)[perm]
    out[:, 1] = k[perm]
    return out


def known_order_prefix(lower_bounds: Sequence[int], final: Sequence[bool]) -> np.ndarray:
    """The prefix of the global chunk order that is already fixed while a build runs.

    ``lower_bounds[i]`` chunks of shard ``i`` are known to exist; ``final[i]`` says the count is exact
    (uncompressed shards: from their size at planning time; compressed ones: once fully read). Round
    ``j`` is fixed once every shard with a non-final count is known to have more than ``j`` chunks.
    """
    lb = np.asarray(lower_bounds, dtype=np.int64)
    fin = np.asarray(final, dtype=bool)
    open_bounds = lb[~fin]
    rounds = int(open_bounds.min()) if open_bounds.size else (int(lb.max()) if lb.size else 0)
    return round_robin_order(np.minimum(lb, rounds))


# --------------------------------------------------------------------------------------------------
# Streams


@dataclasses.dataclass(frozen=True)
class Location:
    epoch: int
    chunk: int  # global chunk index
    offset: int  # unit offset inside that chunk


class StreamIndex:
    """Maps (stream, unit position) to (epoch, chunk, offset within chunk) in O(log N).

    Args:
      counts: units per chunk in global chunk order (tokens, documents or unpacked examples).
      ideal_readers: ``R*``, the number of ideal readers.
      loop: True for training streams (``loop(all_chunks)[s::R*]``, infinite); False for a single pass
        (epoch 0 only; positions past the end raise :class:`EndOfStream`).
      complete: False while the build is running: ``counts`` then covers only the known prefix of the
        order, only epoch 0 can be answered, and anything past the known part raises
        :class:`NotYetAvailable` (the caller waits and retries with a longer prefix).
    """

    def __init__(self, counts: Sequence[int] | np.ndarray, ideal_readers: int, *, loop: bool = True,
                 complete: bool = True):
        if ideal_readers < 1:
            raise ValueError(f"ideal_readers must be >= 1, got {ideal_readers}")
        self.counts = np.asarray(counts, dtype=np.int64)
        if (self.counts < 0).any():
            raise ValueError("unit counts must be non-negative")
        self.n = int(self.counts.size)
        self.r = int(ideal_readers)
        self.loop = loop
        self.complete = complete
        # class-major order of chunks: class rho = c mod R* is chunks rho, rho + R*, ... (made, not sorted)
        self._perm = np.concatenate([np.arange(rho, self.n, self.r, dtype=np.int64)
                                     for rho in range(min(self.r, self.n))] or [np.zeros(0, np.int64)])
        self._starts = np.concatenate([[0], np.cumsum(self.counts[self._perm])])  # N+1
        # First class-major slot of each class rho (classes with no chunk get an empty run).
        class_sizes = np.maximum(0, (self.n - np.arange(self.r, dtype=np.int64) + self.r - 1) // self.r)
        self._class_first = np.concatenate([[0], np.cumsum(class_sizes)])  # R+1
        self._class_totals = self._starts[self._class_first[1:]] - self._starts[self._class_first[:-1]]
        self._period = self.r // math.gcd(self.n, self.r) if self.n else 1
        self._epoch_cum: dict[int, np.ndarray] = {}

    # -- per-stream epoch bookkeeping ------------------------------------------------------------
    def _rho(self, s: int, epoch: int | np.ndarray):
        return (s - epoch * self.n) % self.r

    def _epochs(self, s: int) -> np.ndarray:
        """Cumulative units of stream ``s`` over one period of epochs (length period + 1)."""
        got = self._epoch_cum.get(s)
        if got is None:
            rhos = self._rho(s, np.arange(self._period, dtype=np.int64))
            got = np.concatenate([[0], np.cumsum(self._class_totals[rhos])])
            self._epoch_cum[s] = got
        return got

    def pass_units(self, streams) -> np.ndarray:
        """Units of each stream of ``streams`` in epoch 0 (all of a single-pass stream; vectorized)."""
        return self._class_totals[np.asarray(streams, dtype=np.int64)]

    def stream_length(self, s: int) -> float:
        """Units in stream ``s``: infinite (``math.inf``) for a looping stream that is not empty."""
        self._check_stream(s)
        if self.loop and self.complete:
            return math.inf if self._epochs(s)[-1] > 0 else 0
        return int(self._class_totals[s]) if s < self.r else 0

    def _check_stream(self, s: int) -> None:
        if not 0 <= s < self.r:
            raise ValueError(f"stream {s} out of range [0, {self.r})")

    # -- locating units ---------------------------------------------------------------------------
    def locate_many(self, s: int, positions: np.ndarray | Sequence[int]):
        """Vectorized :meth:`locate`: returns arrays ``(epochs, chunks, offsets)``."""
        self._check_stream(s)
        j = np.asarray(positions, dtype=np.int64)
        if (j < 0).any():
            raise ValueError("stream positions must be non-negative")
        if self.loop and self.complete:
            ecum = self._epochs(s)
            per = int(ecum[-1])
            if per == 0:
                raise EmptyStream(
                    f"stream {s} of {self.r} never yields anything: every chunk it visits is empty. "
                    f"Use fewer ideal_readers (now {self.r}) than non-empty chunks ({int((self.counts > 0).sum())})."
                )
            full, rem = np.divmod(j, per)
            e_in = np.searchsorted(ecum, rem, side="right") - 1
            epochs = full * self._period + e_in
            rem = rem - ecum[e_in]
            rho = self._rho(s, epochs)
        else:
            epochs = np.zeros_like(j)
            rho = np.full_like(j, s)
            total = int(self._class_totals[s]) if s < self.r else 0
            if j.size and int(j.max()) >= total:
                bad = int(j.max())
                if not self.complete:
                    raise NotYetAvailable(f"stream {s} position {bad}: needs chunks not yet written")
                raise EndOfStream(f"stream {s} has {total} units; position {bad} is past its end")
            rem = j
        slot, off = _slot(self._starts, self._starts[self._class_first[rho]] + rem)
        return epochs, self._perm[slot], off

    def locate(self, s: int, position: int) -> Location:
        e, c, o = self.locate_many(s, [position])
        return Location(int(e[0]), int(c[0]), int(o[0]))

    def locate_streams(self, streams, positions):
        """:meth:`locate_many` vectorized over streams too: unit ``positions[k]`` of stream ``streams[k]``.

        Same answers (and errors) as calling ``locate_many`` once per stream, with one set of numpy calls
        for a whole batch.
        """
        s = np.asarray(streams, dtype=np.int64)
        j = np.asarray(positions, dtype=np.int64)
        if s.size == 0:
            z = np.zeros(0, np.int64)
            return z, z, z
        # (min/max: one reduction each; a batch's arrays are small and these run for every batch)
        if j.min() < 0:
            raise ValueError("stream positions must be non-negative")
        if s.min() < 0 or s.max() >= self.r:
            raise ValueError(f"stream out of range [0, {self.r})")
        if self.loop and self.complete:
            table = self.epoch_table()
            if table is None:  # huge R* x period: one call per stream
                e, c, o = (np.empty(s.size, np.int64) for _ in range(3))
                for x in np.unique(s):
                    m = s == x
                    e[m], c[m], o[m] = self.locate_many(int(x), j[m])
                return e, c, o
            rows = table[s]
            per = rows[:, -1]
            if (per == 0).any():
                self.locate_many(int(s[per == 0][0]), [0])  # raises EmptyStream
            full, e_in, rem = _in_period(rows, per, j)
            epochs = full * self._period + e_in
            rho = (s - epochs * self.n) % self.r
        else:
            epochs = np.zeros_like(j)
            rho = s
            total = self._class_totals[s]
            if (j >= total).any():
                k = int(np.flatnonzero(j >= total)[0])
                self.locate_many(int(s[k]), [int(j[k])])  # raises NotYetAvailable / EndOfStream
            rem = j
        slot, off = _slot(self._starts, self._starts[self._class_first[rho]] + rem)
        return epochs, self._perm[slot], off

    def epoch_table(self) -> np.ndarray | None:
        """Every stream's :meth:`_epochs` as one ``[R*, period + 1]`` array (kept), or None when that is
        too large to hold (a huge ``R* x period``)."""
        table = self.__dict__.get("_epoch_table")
        if table is None:
            if self.r * (self._period + 1) > _TABLE_LIMIT:
                return None
            table = self._epoch_table = np.stack([self._epochs(x) for x in range(self.r)])
        return table

    def pieces(self, s: int, start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
        """The pieces ``(epoch, chunk, lo, hi)`` that hold units ``[start, stop)`` of stream ``s``, in order.

        For a single-pass stream the pieces stop at the stream's end (the caller pads).
        """
        pos = start
        if not (self.loop and self.complete):
            stop = min(stop, self.stream_length(s)) if self.complete else stop
        while pos < stop:
            loc = self.locate(s, pos)
            take = min(int(self.counts[loc.chunk]) - loc.offset, stop - pos)
            yield loc.epoch, loc.chunk, loc.offset, loc.offset + take
            pos += take


class StackedStreams:
    """Several looping, complete stream indexes with one ``R*`` (a mixture's components) side by side:
    :meth:`locate` answers :meth:`StreamIndex.locate_streams` of index ``comps[k]`` for every ``k`` in
    one set of numpy calls instead of one set per index. Build it with :meth:`of`."""

    def __init__(self, indexes: Sequence[StreamIndex], tables: list[np.ndarray]):
        self.indexes = tuple(indexes)
        r = self.r = indexes[0].r
        C = len(indexes)
        self._table = np.full((C * r, max(t.shape[1] for t in tables)), np.iinfo(np.int64).max, np.int64)
        for c, t in enumerate(tables):  # padded past each period: never <= a position inside it
            self._table[c * r:(c + 1) * r, :t.shape[1]] = t
        self._per = np.concatenate([t[:, -1] for t in tables])
        self._period = np.asarray([i._period for i in indexes], np.int64)
        self._n = np.asarray([i.n for i in indexes], np.int64)
        # class-major slots of every index one after the other, units offset so the prefix sums keep rising
        units = np.concatenate([[0], np.cumsum([int(i._starts[-1]) for i in indexes])])
        slots = np.concatenate([[0], np.cumsum([i.n for i in indexes])])
        self._starts = np.concatenate([i._starts[:-1] + units[c] for c, i in enumerate(indexes)] + [units[-1:]])
        self._class_first = np.concatenate([i._class_first[:-1] + slots[c] for c, i in enumerate(indexes)])
        self._perm = np.concatenate([i._perm for i in indexes])

    @classmethod
    def of(cls, indexes: Sequence[StreamIndex]) -> StackedStreams | None:
        """The stacked ``indexes``, or None where :meth:`StreamIndex.locate_streams` must answer one index
        at a time: one still building or single-pass, different ``R*``, an empty stream (its error), or
        tables too large to hold."""
        if not indexes or any(not (i.loop and i.complete) or i.r != indexes[0].r for i in indexes):
            return None
        tables = [i.epoch_table() for i in indexes]
        if any(t is None or not t[:, -1].all() for t in tables):
            return None
        if len(indexes) * indexes[0].r * max(t.shape[1] for t in tables) > _TABLE_LIMIT:
            return None
        return cls(indexes, tables)

    def locate(self, comps: np.ndarray, streams: np.ndarray, positions: np.ndarray):
        """``(epochs, chunks, offsets, available)``: unit ``positions[k]`` (>= 0) of stream ``streams[k]``
        (in ``[0, R*)``) of index ``comps[k]``, as ``locate_streams`` answers it (``chunks``: that index's
        own), and the units of that chunk from the offset on."""
        r = self.r
        row = comps * r + streams
        full, e_in, rem = _in_period(self._table[row], self._per[row], positions)
        epochs = full * self._period[comps] + e_in
        rho = (streams - epochs * self._n[comps]) % r
        key = self._starts[self._class_first[comps * r + rho]] + rem
        slot, off = _slot(self._starts, key)
        return epochs, self._perm[slot], off, self._starts[slot + 1] - key


# --------------------------------------------------------------------------------------------------
# Examples, batches and readers


def stream_position(i, ideal_readers: int):
    """Global example ``i`` -> ``(stream, position in stream)`` (works on numpy arrays too)."""
    return i % ideal_readers, i // ideal_readers


def reader_rows(batch_size: int, num_readers: int, reader_index: int) -> np.ndarray:
    """Rows of each global batch served by reader ``reader_index`` of ``num_readers``: ``k ≡ r (mod R)``."""
    if num_readers < 1 or not 0 <= reader_index < num_readers:
        raise ValueError(f"reader_index {reader_index} out of range for num_readers {num_readers}")
    if batch_size % num_readers:
        raise ValueError(f"batch_size {batch_size} must be a multiple of num_readers {num_readers}")
    return np.arange(reader_index, batch_size, num_readers, dtype=np.int64)


def streams_of_reader(ideal_readers: int, num_readers: int, reader_index: int) -> list[int] | None:
    """The streams a reader touches when ``R`` divides ``R*`` or ``R*`` divides ``R``; None otherwise."""
    if ideal_readers % num_readers == 0:
        return list(range(reader_index, ideal_readers, num_readers))
    if num_readers % ideal_readers == 0:
        return [reader_index % ideal_readers]
    return None
