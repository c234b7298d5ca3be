"""The ordering math of chunkledger: pure functions, no I/O.

Everything that decides *which tokens* a reader returns for a given index lives here, so that the
pipeline, the reader, the JAX loader and the benchmarks agree by construction.

Terms (seed 000, "Reproducible Sharded Reading for Training"):

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
    shard = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    k = np.arange(shard.size, dtype=np.int64) - np.repeat(starts, counts)
    perm = np.lexsort((shard, k))  # by round k, then shard
    return np.stack([shard[perm], k[perm]], axis=1)


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
      num_streams: ``R*``, the number of ideal readers.
      loop: True for training streams (``loop(all_chunks)[s::R*]``, infinite); False for a single pass
        (epoch 0 only; positions past the end raise :class:`EndOfStream`).
      complete: False while the build is running: ``counts`` then covers only the known prefix of the
        order, only epoch 0 can be answered, and anything past the known part raises
        :class:`NotYetAvailable` (the caller waits and retries with a longer prefix).
    """

    def __init__(self, counts: Sequence[int] | np.ndarray, num_streams: int, *, loop: bool = True,
                 complete: bool = True):
        if num_streams < 1:
            raise ValueError(f"num_streams (ideal_readers) must be >= 1, got {num_streams}")
        self.counts = np.asarray(counts, dtype=np.int64)
        if (self.counts < 0).any():
            raise ValueError("unit counts must be non-negative")
        self.n = int(self.counts.size)
        self.r = int(num_streams)
        self.loop = loop
        self.complete = complete
        c = np.arange(self.n, dtype=np.int64)
        self._perm = np.lexsort((c, c % self.r))  # class-major order of chunks
        self._starts = np.concatenate([[0], np.cumsum(self.counts[self._perm])])  # N+1
        # First class-major slot of each class rho (classes with no chunk get an empty run).
        class_sizes = np.bincount(c % self.r, minlength=self.r) if self.n else np.zeros(self.r, np.int64)
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

    def epoch_units(self, s: int, epoch: int) -> int:
        """Units stream ``s`` yields in ``epoch``."""
        return int(self._class_totals[self._rho(s, epoch)])

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
        key = self._starts[self._class_first[rho]] + rem
        slot = np.searchsorted(self._starts, key, side="right") - 1
        return epochs, self._perm[slot], key - self._starts[slot]

    def locate(self, s: int, position: int) -> Location:
        e, c, o = self.locate_many(s, [position])
        return Location(int(e[0]), int(c[0]), int(o[0]))

    def locate_streams(self, streams, positions):
        """:meth:`locate_many` vectorized over streams too: unit ``positions[k]`` of stream ``streams[k]``.

        Same answers (and errors) as calling ``locate_many`` once per stream, with one set of numpy calls
        for a whole batch. Added for the reader (issue 3).
        """
        s = np.asarray(streams, dtype=np.int64)
        j = np.asarray(positions, dtype=np.int64)
        if s.size == 0:
            z = np.zeros(0, np.int64)
            return z, z, z
        if (j < 0).any():
            raise ValueError("stream positions must be non-negative")
        if (s < 0).any() or (s >= self.r).any():
            raise ValueError(f"stream out of range [0, {self.r})")
        if self.loop and self.complete:
            if self.r * (self._period + 1) > (1 << 22):  # huge R* x period: one call per stream
                e, c, o = (np.empty(s.size, np.int64) for _ in range(3))
                for x in np.unique(s):
                    m = s == x
                    e[m], c[m], o[m] = self.locate_many(int(x), j[m])
                return e, c, o
            table = self.__dict__.get("_epoch_table")
            if table is None:
                table = np.stack([self._epochs(x) for x in range(self.r)])  # [R*, period + 1]
                self._epoch_table = table
            per = table[s, -1]
            if (per == 0).any():
                self.locate_many(int(s[per == 0][0]), [0])  # raises EmptyStream
            full, rem = np.divmod(j, per)
            e_in = (table[s] <= rem[:, None]).sum(axis=1) - 1
            epochs = full * self._period + e_in
            rem = rem - table[s, e_in]
            rho = (s - epochs * self.n) % self.r
        else:
            epochs = np.zeros_like(j)
            rho = s
            total = self._class_totals[s]
            if (j >= total).any():
                k = int(np.flatnonzero(j >= total)[0])
                self.locate_many(int(s[k]), [int(j[k])])  # raises NotYetAvailable / EndOfStream
            rem = j
        key = self._starts[self._class_first[rho]] + rem
        slot = np.searchsorted(self._starts, key, side="right") - 1
        return epochs, self._perm[slot], key - self._starts[slot]

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


# --------------------------------------------------------------------------------------------------
# Examples, batches and readers


def split_example_index(i, num_streams: int):
    """Global example ``i`` -> ``(stream, position in stream)`` (works on numpy arrays too)."""
    return i % num_streams, i // num_streams


def batch_example_indices(batch: int, batch_size: int) -> np.ndarray:
    """Global example indices of global batch ``batch``."""
    return batch * batch_size + np.arange(batch_size, dtype=np.int64)


def reader_rows(batch_size: int, num_readers: int, reader_index: int) -> np.ndarray:
    """Rows of each global batch served by reader ``reader_index`` of ``num_readers``: ``k ≡ r (mod R)``."""
    if num_readers < 1 or not 0 <= reader_index < num_readers:
        raise ValueError(f"reader_index {reader_index} out of range for num_readers {num_readers}")
    if batch_size % num_readers:
        raise ValueError(f"batch_size {batch_size} must be a multiple of num_readers {num_readers}")
    return np.arange(reader_index, batch_size, num_readers, dtype=np.int64)


def streams_of_reader(num_streams: int, num_readers: int, reader_index: int) -> list[int] | None:
    """The streams a reader touches when ``R`` divides ``R*`` or ``R*`` divides ``R``; None otherwise."""
    if num_streams % num_readers == 0:
        return list(range(reader_index, num_streams, num_readers))
    if num_readers % num_streams == 0:
        return [reader_index % num_streams]
    return None


# --------------------------------------------------------------------------------------------------
# Unpacked examples: one document per example, long documents split into seq_len pieces


def pieces_per_doc(doc_lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Examples each document yields unpacked: ``ceil(len / seq_len)`` (a zero-length doc yields none)."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    return -(-lengths // seq_len)


def unpacked_examples_per_chunk(doc_lengths: np.ndarray, seq_len: int) -> int:
    return int(pieces_per_doc(doc_lengths, seq_len).sum())


def unpacked_locate_in_chunk(doc_lengths: np.ndarray, seq_len: int, example_offsets: np.ndarray):
    """Within one chunk: example offsets -> ``(doc index in chunk, token start in doc, token stop)``."""
    per = pieces_per_doc(doc_lengths, seq_len)
    cum = np.concatenate([[0], np.cumsum(per)])
    ex = np.asarray(example_offsets, dtype=np.int64)
    doc = np.searchsorted(cum, ex, side="right") - 1
    piece = ex - cum[doc]
    start = piece * seq_len
    stop = np.minimum(start + seq_len, np.asarray(doc_lengths, dtype=np.int64)[doc])
    return doc, start, stop


# ---- Permutations (shuffle)
#
# The growing-window shuffle (issue 4): ``shuffled_example[i] = example[pi(i)]``. ``pi`` is a bijection
# of example indices that maps every window onto itself, computed per index by keyed ciphers (Feistel
# networks with cycle-walking, and a stratified Owen-style bit scramble; uint64 arithmetic throughout).
# No permutation array, no state beyond the index. docs/FORMAT.md ("Shuffle") is the prose definition.
#
# Units. ``pi`` preserves ``i mod lanes``. With ``lanes = R*`` (ideal_readers; the reader sets this),
# example ``i`` and ``pi(i)`` live in the same stream, so a host that serves streams ``s ≡ r (mod R)``
# still reads only those streams. Inside a lane the shuffle acts on *rows*: row ``t`` is examples
# ``[t*lanes, (t+1)*lanes)``, i.e. position ``t`` of every stream. Windows, blocks and groups are given
# in examples and converted to rows by ``// lanes``.
#
# Inside a window of ``n`` rows (``b`` rows per block, ``G`` blocks per group; a window smaller than
# one group is cut into ``G`` blocks of ``n // G`` rows instead, and one of fewer than ``2G`` rows is a
# single Feistel permutation):
#   1. output slots are cut into groups of ``G*b`` consecutive slots. Inside a full group, slot ``o``
#      takes rank ``c = o // G`` of block slot ``a = o % G`` (rank-major interleave: consecutive rows
#      come from different blocks), and that rank goes through a per-block *stratified* permutation
#      of ``[0, b)`` (:func:`_spread`: ranks a block serves close together in time land in different
#      parts of it, so a document rarely shows up again in nearby batches). A partial last group is
#      one Feistel permutation;
#   2. block slots go through a Feistel permutation of the window's full blocks (a partial tail block
#      stays in place).
# So a reader consumes the window group by group; a group needs ``G`` blocks of ``b`` contiguous rows
# (= ``b`` contiguous positions of every stream) decoded at once, and each block is read once.

import functools  # noqa: E402  (this section is appended to the module)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_FEISTEL_ROUNDS = 6
_TAG_FULL, _TAG_GROUP, _TAG_LASTGROUP, _TAG_BLOCKS = 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class ShuffleConfig:
    """Growing-window shuffle of example indices; every size is counted in examples.

    Attributes:
      seed: the shuffle seed (any Python int; reduced mod 2**64).
      first_window: examples in window 0. Small, so training starts at once, also while the cache is
        being built (window 0 only needs the first chunk or so of every stream).
      growth: each window is ``ceil(previous * growth)`` examples, up to ``max_window``. ``1.0`` gives
        fixed windows of ``first_window`` ("eras").
      max_window: the largest window. Windows never cost memory (only groups do); larger windows give
        better mixing but, while a build is running, reading window k needs its whole range built.
      block_size: examples per block: a block is ``block_size // lanes`` contiguous rows, i.e. that many
        contiguous positions of every stream, read as one unit.
      group_size: examples mixed together (``group_size // block_size`` blocks). This is what the
        reader holds decoded at once: about ``group_size * seq_len * 8`` bytes as ``reader.chunks``
        decodes packed tokens (int32 tokens + int32 positions), plus the partial row groups at block
        ends; split over the hosts by stream. Give the reader a ``memory_budget_bytes`` of about twice
        that (plus the chunk bytes it keeps): an LRU smaller than the group's working set thrashes.
      The defaults are what :meth:`for_reader` gives for the pipeline's default cache (1 Mi-token row
      groups) at seq_len 2048, R* = 16, batch 64: 2 blocks of one row group per stream, 256 MiB + row
      group ends decoded. Prefer :meth:`for_reader` with the cache's ``row_group_tokens``.
      lanes: ``pi(i) ≡ i (mod lanes)``. Set it to ``R*`` (ideal_readers) so every example stays in its
        stream and each host keeps reading only its own streams; 1 mixes across streams.
    """

    seed: int
    first_window: int = 1024
    growth: float = 2.0
    max_window: int = 1 << 22
    block_size: int = 8192
    group_size: int = 16384
    lanes: int = 1

    def __post_init__(self):
        if not isinstance(self.seed, (int, np.integer)):
            raise TypeError(f"ShuffleConfig.seed must be an int, got {self.seed!r}")
        for name in ("first_window", "max_window", "block_size", "group_size", "lanes"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ShuffleConfig.{name} must be a positive int, got {v!r}")
        if not (isinstance(self.growth, (int, float)) and math.isfinite(self.growth) and self.growth >= 1.0):
            raise ValueError(f"ShuffleConfig.growth must be a finite number >= 1, got {self.growth!r}")
        if self.first_window > self.max_window:
            raise ValueError(f"ShuffleConfig.first_window ({self.first_window}) must be <= max_window "
                             f"({self.max_window})")

    @classmethod
    def for_reader(cls, seed: int, *, seq_len: int, ideal_readers: int, batch_size: int,
                   row_group_tokens: int | None = None, examples_per_row_group: int | None = None,
                   max_group_bytes: int = 1 << 29, **overrides) -> "ShuffleConfig":
        """Sizes derived from how the reader reads (a pure function of its arguments, so every host and
        every resume derives the same config; never pass a per-host, changing memory budget here).

        * ``lanes = ideal_readers``: examples stay in their stream (each host reads only its streams);
        * blocks of ``4`` row groups of every stream (at least 64 rows): a block is read in whole row
          groups, and the partial row groups at its two ends add about 1/4 of extra reading;
        * ``max(8, 2 * rows_per_batch)`` blocks per group, ``rows_per_batch = ceil(batch_size / lanes)``
          (the examples of one stream a batch takes): with the rank-major interleave two consecutive
          batches then draw from disjoint blocks;
        * memory: a group decodes about ``G * lanes * (block rows + one row group) * seq_len * 8`` bytes
          (``reader.chunks`` keeps int32 tokens + positions; a block's ends decode whole row groups).
          ``max_group_bytes`` bounds that for a host reading all ``lanes`` streams (a host serving a
          fraction of the streams holds that fraction; with a fixed pod of R hosts pass R times the
          per-host allowance). Over the bound, blocks shrink to one row group, then groups to 2 blocks,
          then blocks below a row group (row groups then get decoded more than once per window).
          The reader's ``memory_budget_bytes`` should be about twice the group's bytes: an LRU smaller
          than a group's working set thrashes.

        ``examples_per_row_group`` overrides ``row_group_tokens / seq_len`` (unpacked examples are
        shorter than ``seq_len``). ``overrides`` set any field directly.
        """
        lanes = max(1, int(ideal_readers))
        rows_per_batch = -(-int(batch_size) // lanes)
        if examples_per_row_group is None:
            examples_per_row_group = -(-int(row_group_tokens) // int(seq_len)) if row_group_tokens else 64
        rg = max(1, int(examples_per_row_group))
        per_row = int(seq_len) * DECODED_BYTES_PER_TOKEN * lanes

        def mem(g: int, b: int) -> int:
            return g * (b + min(b, rg)) * per_row

        g, b = max(8, 2 * rows_per_batch), max(64, 4 * rg)
        while mem(g, b) > max_group_bytes and b > rg:
            b = max(rg, b // 2)
        while mem(g, b) > max_group_bytes and g > 2:
            g -= 1
        while mem(g, b) > max_group_bytes and b > 1:
            b = max(1, b // 2)
        kw = dict(first_window=max(1024, 2 * int(batch_size)), growth=2.0, block_size=b * lanes,
                  group_size=g * b * lanes, lanes=lanes)
        kw["max_window"] = max(1 << 22, 4 * kw["group_size"], kw["first_window"])
        kw.update(overrides)
        if "first_window" not in overrides:
            kw["first_window"] = min(kw["first_window"], kw["max_window"])
        return cls(seed=seed, **kw)

    # -- sizes in rows (one row = `lanes` examples) --------------------------------------------------
    @property
    def block_rows(self) -> int:
        return max(1, self.block_size // self.lanes)

    @property
    def group_blocks(self) -> int:
        return max(1, self.group_size // self.block_size)

    @property
    def window_table(self) -> tuple[np.ndarray, int]:
        """``(starts, max_rows)``: row starts of the growing windows (the last entry is where windows of
        ``max_rows`` begin), a pure function of the config."""
        return _window_table(self.first_window, float(self.growth), self.max_window, self.lanes)


_MAX_GROWING_WINDOWS = 100_000
DECODED_BYTES_PER_TOKEN = 8  # reader.chunks keeps int32 tokens + int32 positions per decoded token


@functools.lru_cache(maxsize=64)
def _window_table(first_window: int, growth: float, max_window: int, lanes: int):
    first = max(1, first_window // lanes)
    top = max(1, max_window // lanes)
    if growth == 1.0:
        arr = np.zeros(1, dtype=np.int64)
        arr.setflags(write=False)
        return arr, first  # fixed windows ("eras") of `first` rows
    starts, w, s = [0], first, 0
    while w < top:
        s += w
        starts.append(s)
        w = min(top, math.ceil(w * growth))  # IEEE double multiply + ceil: identical on every platform
        if len(starts) > _MAX_GROWING_WINDOWS:
            raise ValueError(f"ShuffleConfig growth {growth} is too close to 1 to reach max_window "
                             f"{max_window} from first_window {first_window}")
    # starts[k] = row start of window k; windows k >= len(starts) - 1 all have `top` rows.
    arr = np.asarray(starts, dtype=np.int64)
    arr.setflags(write=False)  # cached and shared
    return arr, top


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _u64(x) -> np.ndarray:
    """int64 / Python int -> uint64 (two's complement, mod 2**64)."""
    if isinstance(x, (int, np.integer)):
        return np.array([int(x) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    return np.asarray(x, dtype=np.int64).astype(np.uint64)


def _key(*parts) -> np.ndarray:
    """Hash a tuple of ints / int arrays into uint64 keys (broadcasting)."""
    with np.errstate(over="ignore"):
        h = np.zeros(1, dtype=np.uint64)
        for p in parts:
            h = _mix64(h * _GOLDEN + _u64(p) + np.uint64(0x632BE59BD9B4E019))
    return h


def _ceil_log2(n: np.ndarray) -> np.ndarray:
    """Smallest ``k`` with ``2**k >= n`` for uint64 arrays of n >= 1."""
    v = n - np.uint64(1)
    k = np.zeros(v.shape, dtype=np.uint64)
    for s in (32, 16, 8, 4, 2, 1):
        big = v >= (np.uint64(1) << np.uint64(s))
        k = k + np.where(big, np.uint64(s), np.uint64(0))
        v = np.where(big, v >> np.uint64(s), v)
    return k + (v > 0).astype(np.uint64)


def _flat_domain(x, n, key, what: str):
    """Broadcast ``x`` (int64), ``n`` (int64) and ``key`` (uint64) and flatten them; check ``0 <= x < n``."""
    x, n, key = np.broadcast_arrays(np.asarray(x, np.int64), np.asarray(n, np.int64),
                                    np.asarray(key, np.uint64))
    shape = x.shape
    x, n, key = x.reshape(-1), n.reshape(-1), key.reshape(-1)
    if x.size and ((x < 0).any() or (x >= n).any()):
        raise ValueError(f"{what}: input outside [0, n)")
    return shape, x, n, key


def _feistel(x, n, key, *, inverse: bool = False) -> np.ndarray:
    """A keyed bijection of ``[0, n)`` per element (``x``, ``n``, ``key`` broadcast; int64 out).

    Balanced Feistel network on ``2h`` bits (``4**h >= n``, so the domain is less than ``4n``) with
    cycle-walking back into ``[0, n)``. ``inverse=True`` gives the inverse permutation.
    """
    shape, x, n, key = _flat_domain(x, n, key, "feistel")
    if x.size == 0:
        return np.zeros(shape, dtype=np.int64)
    n_u = n.astype(np.uint64)
    h = np.maximum((_ceil_log2(n_u) + np.uint64(1)) >> np.uint64(1), np.uint64(1))
    mask = (np.uint64(1) << h) - np.uint64(1)
    with np.errstate(over="ignore"):
        rkeys = np.stack([_mix64(key ^ (_GOLDEN * np.uint64(r + 1))) for r in range(_FEISTEL_ROUNDS)])
        y = x.astype(np.uint64)
        idx = np.arange(y.size)
        while idx.size:
            yy, hh, mm, rk = y[idx], h[idx], mask[idx], rkeys[:, idx]
            left, right = yy >> hh, yy & mm
            if inverse:  # undo (L, R) -> (R, L ^ F(R)) round by round
                for r in range(_FEISTEL_ROUNDS - 1, -1, -1):
                    left, right = right ^ (_mix64(left + rk[r]) & mm), left
            else:
                for r in range(_FEISTEL_ROUNDS):
                    left, right = right, left ^ (_mix64(right + rk[r]) & mm)
            y[idx] = (left << hh) | right
            idx = idx[y[idx] >= n_u[idx]]  # cycle-walk the ones that left [0, n)
    return y.astype(np.int64).reshape(shape)


def _spread(x, n, key, *, inverse: bool = False) -> np.ndarray:
    """A keyed *stratified* bijection of ``[0, n)`` per element: ranks ``x`` in any aligned run of
    ``2**j`` consecutive values land in distinct strata of ``2**(m-j)`` positions (``2**m >= n``), so
    consecutive ranks are spread far apart, at random.

    It is a nested-uniform (Owen) scramble of the ``m``-bit reversal of ``x``: bit ``i`` of the output
    is bit ``i`` of ``reverse(x)`` XOR a keyed hash of the bits above ``i``; values ``>= n`` are
    cycle-walked back into ``[0, n)``. Vectorized; ``inverse=True`` gives the inverse permutation.
    """
    shape, x, n, key = _flat_domain(x, n, key, "spread")
    if x.size == 0:
        return np.zeros(shape, dtype=np.int64)
    n_u = n.astype(np.uint64)
    m = _ceil_log2(n_u)
    top = int(m.max())
    one = np.uint64(1)

    def flips(prefix_src, i, kk):  # keyed bit from the bits of prefix_src above i
        prefix = _mix64((prefix_src >> np.uint64(i + 1)) + np.uint64(i))
        return _mix64(kk ^ (_GOLDEN * np.uint64(i + 1)) ^ prefix) & one

    def rev(v, mm):
        r = np.zeros_like(v)
        for i in range(top):
            act = np.uint64(i) < mm
            bit = (v >> np.uint64(i)) & one
            r = np.where(act, r | (bit << np.where(act, mm - np.uint64(i + 1), np.uint64(0))), r)
        return r

    def fwd(v, mm, kk):
        r = rev(v, mm)
        out = r.copy()
        for i in range(top):
            act = np.uint64(i) < mm
            out = np.where(act, out ^ (flips(r, i, kk) << np.uint64(i)), out)
        return out

    def inv(y, mm, kk):
        r = np.zeros_like(y)
        for i in range(top - 1, -1, -1):
            act = np.uint64(i) < mm
            bit = ((y >> np.uint64(i)) & one) ^ flips(r, i, kk)
            r = np.where(act, r | (bit << np.uint64(i)), r)
        return rev(r, mm)

    with np.errstate(over="ignore"):
        y = x.astype(np.uint64)
        idx = np.arange(y.size)
        while idx.size:
            step = inv if inverse else fwd
            y[idx] = step(y[idx], m[idx], key[idx])
            idx = idx[y[idx] >= n_u[idx]]  # cycle-walk the ones that left [0, n)
    return y.astype(np.int64).reshape(shape)


def shuffle_window_of(indices: np.ndarray, cfg: ShuffleConfig, *, epoch_length: int | None = None):
    """Window of each example index: arrays ``(window, start, stop)`` in examples.

    The window is the set of examples ``j`` with ``start <= j < stop`` whose row ``j // lanes`` lies in
    the window's row range (so ``pi`` maps ``[start, stop)`` onto itself). With ``epoch_length`` the
    windows are clipped to ``[0, epoch_length)``.
    """
    i = np.asarray(indices, dtype=np.int64)
    rows = i // cfg.lanes
    w, rs, re = _row_windows(rows, cfg)
    lo, hi = rs * cfg.lanes, re * cfg.lanes
    if epoch_length is not None:
        hi = np.minimum(hi, epoch_length)
    return w, lo, hi


def _row_windows(rows: np.ndarray, cfg: ShuffleConfig):
    """Row -> (window index, first row, end row) in O(log) per row, vectorized."""
    starts, top = cfg.window_table
    g = starts.size - 1  # windows 0..g-1 grow; window g onwards have `top` rows, starting at starts[g]
    base = starts[-1]
    k = np.searchsorted(starts, rows, side="right") - 1
    tail = rows >= base
    kt = (rows - base) // top
    win = np.where(tail, g + kt, k)
    lo = np.where(tail, base + kt * top, starts[np.minimum(k, g)])
    hi = np.where(tail, lo + top, starts[np.minimum(k + 1, g)])
    return win, lo, hi


def _permute_rows(rows: np.ndarray, lane: np.ndarray, cfg: ShuffleConfig, row_limit: np.ndarray | None, *,
                  inverse: bool = False) -> np.ndarray:
    """The within-window permutation of the rows of one lane (``row_limit``: rows in that lane, or None
    = infinite). Every lane has its own keys, so streams do not move in lockstep."""
    win, lo, hi = _row_windows(rows, cfg)
    win = _key(win, lane).astype(np.int64) if cfg.lanes > 1 else win  # window key: (window, lane)
    if row_limit is not None:
        hi = np.minimum(hi, row_limit)
    n = hi - lo
    j = rows - lo
    g_blocks = cfg.group_blocks
    # Block size of each window: cfg.block_rows, or for a window smaller than one group, the window cut
    # into `g_blocks` blocks (so small early windows get the same rank-major interleave).
    b_all = np.where(n >= cfg.block_rows * g_blocks, cfg.block_rows, n // g_blocks)
    seed = cfg.seed
    out = np.empty_like(j)

    small = b_all < 2  # tiny windows (fewer than 2 rows per block): one Feistel permutation
    if small.any():
        out[small] = _feistel(j[small], n[small], _key(seed, _TAG_FULL, win[small]), inverse=inverse)
    big = ~small
    if big.any():
        jb, nb, wb, b = j[big], n[big], win[big], b_all[big]
        gsize = b * g_blocks
        nfull = nb // b  # full blocks (a partial tail block stays in place)

        def group_step(p):
            grp, o = p // gsize, p % gsize
            m = np.minimum(gsize, nb - grp * gsize)
            full = m == gsize
            q = np.empty_like(o)
            if full.any():
                of, gf, bf = o[full], grp[full], b[full]
                if not inverse:
                    a, c = of % g_blocks, of // g_blocks
                    slot = gf * g_blocks + a
                    q[full] = a * bf + _spread(c, bf, _key(seed, _TAG_GROUP, wb[full], slot))
                else:
                    a, pos = of // bf, of % bf
                    slot = gf * g_blocks + a
                    c = _spread(pos, bf, _key(seed, _TAG_GROUP, wb[full], slot), inverse=True)
                    q[full] = c * g_blocks + a
            part = ~full
            if part.any():
                q[part] = _feistel(o[part], m[part], _key(seed, _TAG_LASTGROUP, wb[part], grp[part]),
                                   inverse=inverse)
            return grp * gsize + q

        def block_step(p):
            inb = p < nfull * b
            r = p.copy()
            if inb.any():
                bi = b[inb]
                blk, off = p[inb] // bi, p[inb] % bi
                key = _key(seed, _TAG_BLOCKS, wb[inb])
                r[inb] = _feistel(blk, nfull[inb], key, inverse=inverse) * bi + off
            return r

        out[big] = block_step(group_step(jb)) if not inverse else group_step(block_step(jb))
    return lo + out


def _apply(indices, cfg: ShuffleConfig, epoch_length: int | None, inverse: bool) -> np.ndarray:
    i = np.asarray(indices, dtype=np.int64)
    if i.size and int(i.min()) < 0:
        raise ValueError("example indices must be non-negative")
    if epoch_length is not None:
        if epoch_length < 0:
            raise ValueError(f"epoch_length must be >= 0, got {epoch_length}")
        if i.size and int(i.max()) >= epoch_length:
            raise ValueError(f"example index {int(i.max())} is outside [0, epoch_length={epoch_length})")
    flat = i.reshape(-1)
    lane, rows = flat % cfg.lanes, flat // cfg.lanes
    limit = None
    if epoch_length is not None:  # lane l holds ceil((epoch_length - l) / lanes) rows
        limit = (epoch_length - lane + cfg.lanes - 1) // cfg.lanes
    out = _permute_rows(rows, lane, cfg, limit, inverse=inverse) * cfg.lanes + lane
    return out.reshape(i.shape)


def shuffle_example_indices(indices: np.ndarray, cfg: ShuffleConfig, *,
                            epoch_length: int | None = None) -> np.ndarray:
    """``pi(i)`` for every ``i`` in ``indices`` (int64 array of any shape): ``shuffled[i] = example[pi(i)]``.

    ``pi`` is a bijection of ``[0, inf)`` (or of ``[0, epoch_length)`` when given: the last window is
    then partial) that maps every window onto itself and preserves ``i mod cfg.lanes``. Pure function
    of ``(indices, cfg, epoch_length)``: identical in every process, on every host, at every resume.
    Windows tile the whole (looping) index range and every window is keyed by its own index, so every
    pass over the data is ordered differently.
    """
    return _apply(indices, cfg, epoch_length, inverse=False)


def unshuffle_example_indices(indices: np.ndarray, cfg: ShuffleConfig, *,
                              epoch_length: int | None = None) -> np.ndarray:
    """``pi^{-1}``: the shuffled position at which each original example index is served."""
    return _apply(indices, cfg, epoch_length, inverse=True)


def shuffle_group_of_rows(rows: np.ndarray, cfg: ShuffleConfig):
    """The mixing group of each output row (a row ``t`` is examples ``[t*lanes, (t+1)*lanes)``), without an
    epoch length: arrays ``(window, lo, hi)``, the group's output rows being ``[lo, hi)`` (the same rows in
    every lane). A window smaller than one group of full blocks, or of fewer than ``2`` rows per block,
    is one group. ``pi`` maps a group's rows onto source rows that no other group uses (see
    :func:`shuffle_group_sources`), so once a read has passed row ``hi - 1`` of every lane it reads,
    that group's sources are not needed again. Added for the reader's cache (releasing row groups).
    """
    rows = np.asarray(rows, dtype=np.int64)
    win, lo, hi = _row_windows(rows, cfg)
    n = hi - lo
    g_blocks = cfg.group_blocks
    b = np.where(n >= cfg.block_rows * g_blocks, cfg.block_rows, n // g_blocks)
    gsize = np.maximum(b, 1) * g_blocks
    whole = b < 2
    grp = np.where(whole, 0, (rows - lo) // gsize)
    glo = np.where(whole, lo, lo + grp * gsize)
    ghi = np.where(whole, hi, np.minimum(glo + gsize, hi))
    return win, glo, ghi


def shuffle_group_sources(row: int, lane: int, cfg: ShuffleConfig) -> np.ndarray:
    """Source rows of lane ``lane`` that the mixing group holding output row ``row`` reads (no epoch
    length): int64 ``[k, 2]`` row ranges ``[start, stop)``, sorted and merged. Equal to the set
    ``{pi(t) // lanes : t in the group's rows of that lane}`` (brute-force tested); groups of one window
    read disjoint sources whose union is the window. Added for the reader's cache.
    """
    return shuffle_group_sources_of_lanes(row, [lane], cfg)[0]


def shuffle_group_sources_of_lanes(row: int, lanes, cfg: ShuffleConfig) -> list[np.ndarray]:
    """:func:`shuffle_group_sources` for each lane of ``lanes`` (one vectorized cipher call)."""
    lanes = [int(x) for x in lanes]
    r = np.asarray([int(row)], dtype=np.int64)
    win, lo, hi = (int(x[0]) for x in _row_windows(r, cfg))
    _, glo, ghi = (int(x[0]) for x in shuffle_group_of_rows(r, cfg))
    n = hi - lo
    g_blocks = cfg.group_blocks
    b = cfg.block_rows if n >= cfg.block_rows * g_blocks else n // g_blocks
    if b < 2:  # one Feistel permutation of the whole window
        return [np.asarray([[lo, hi]], dtype=np.int64) for _ in lanes]
    nfull = n // b
    slots = np.arange((glo - lo) // b, -(-(ghi - lo) // b), dtype=np.int64)
    full = slots[slots < nfull]
    tail = [(lo + nfull * b, hi)] if slots.size > full.size else []  # a partial tail block stays in place
    if full.size and lanes:
        lane_arr = np.asarray(lanes, dtype=np.int64)[:, None]
        wkey = _key(win, lane_arr).astype(np.int64) if cfg.lanes > 1 else np.full_like(lane_arr, win)
        blocks = _feistel(np.broadcast_to(full, (len(lanes), full.size)), np.int64(nfull),
                          _key(cfg.seed, _TAG_BLOCKS, wkey))
        blocks.sort(axis=1)
    else:
        blocks = np.zeros((len(lanes), 0), dtype=np.int64)
    out = []
    for row_blocks in blocks.tolist():
        ranges = sorted([(lo + x * b, lo + (x + 1) * b) for x in row_blocks] + tail)
        merged: list[list[int]] = []
        for a, z in ranges:
            if merged and merged[-1][1] == a:
                merged[-1][1] = z
            else:
                merged.append([a, z])
        out.append(np.asarray(merged, dtype=np.int64).reshape(-1, 2))
    return out
