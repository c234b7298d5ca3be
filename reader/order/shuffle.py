"""The growing-window shuffle: ``shuffled_example[i] = example[pi(i)]``. Pure functions, no I/O.

``pi`` is a bijection of example indices that maps every window onto itself, computed per index by the
keyed ciphers of :mod:`reader.order.ciphers`. No permutation array, no state beyond the index.
docs/FORMAT.md ("Shuffle") is the prose definition; changing anything here changes the order.

Units. ``pi`` preserves ``i mod lanes``. With ``lanes = R*`` (ideal_readers; the reader sets this),
example ``i`` and ``pi(i)`` live in the same stream, so a host that serves streams ``s ≡ r (mod R)``
still reads only those streams. Inside a lane the shuffle acts on *rows*: row ``t`` is examples
``[t*lanes, (t+1)*lanes)``, i.e. position ``t`` of every stream. Windows, blocks and mixes are given
in examples and converted to rows by ``// lanes``.

Inside a window of ``n`` rows (``b`` rows per block, ``G`` blocks per mix; a window smaller than one
mix is cut into ``G`` blocks of ``n // G`` rows instead, and one of fewer than ``2G`` rows is a single
Feistel permutation):

1. output slots are cut into *mixes* of ``G*b`` consecutive slots. Inside a full mix, slot ``o``
   takes rank ``c = o // G`` of block slot ``a = o % G`` (rank-major interleave: consecutive rows come
   from different blocks), and that rank goes through a per-block *stratified* permutation of
   ``[0, b)`` (:func:`reader.order.ciphers.spread`: ranks a block serves close together in time land in
   different parts of it, so a document rarely shows up again in nearby batches). A partial last mix
   is one Feistel permutation;
2. block slots go through a Feistel permutation of the window's full blocks (a partial tail block
   stays in place).

So a reader consumes a window mix by mix; a mix needs ``G`` blocks of ``b`` contiguous rows (= ``b``
contiguous positions of every stream) decoded at once, and each block is read once.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from reader.order.ciphers import feistel, hash_key, spread

# cipher key tags (part of the definition of pi)
_TAG_FULL, _TAG_MIX, _TAG_LAST_MIX, _TAG_BLOCKS = 1, 2, 3, 4
_MAX_GROWING_WINDOWS = 100_000
# Bytes per decoded token that ShuffleConfig.for_reader sizes mixes with. It stays 8 (the store holds 4,
# int32 tokens only) because changing it would change the configs for_reader derives, hence pi.
DECODED_BYTES_PER_TOKEN = 8


@dataclasses.dataclass(frozen=True)
class ShuffleConfig:
    """Growing-window shuffle of example indices; every size is counted in examples.

    Attributes:
      seed: the shuffle seed (any Python int; reduced mod 2**64).
      first_window: examples in window 0. Small, so training starts at once, also while the cache is
        being built (window 0 only needs the first chunk or so of every stream).
      growth: each window is ``ceil(previous * growth)`` examples, up to ``max_window``. ``1.0`` gives
        fixed windows of ``first_window`` ("eras").
      max_window: the largest window. Windows never cost memory (only mixes do); larger windows give
        better mixing but, while a build is running, reading window k needs its whole range built.
      block_size: examples per block: a block is ``block_size // lanes`` contiguous rows, i.e. that many
        contiguous positions of every stream, read as one unit.
      mix_size: examples of one mix, whose rows are interleaved (``mix_size // block_size`` blocks).
        This is what the reader holds decoded at once: at most ``mix_size * seq_len *
        DECODED_BYTES_PER_TOKEN`` bytes, plus the partial row groups at block ends; split over the
        hosts by stream. Give the reader a ``memory_budget_bytes`` of about twice that (plus the chunk
        bytes it keeps): an LRU smaller than the mix's working set thrashes.
      The defaults are what :meth:`for_reader` gives for 1 Mi-token row groups at seq_len 2048, R* = 16,
      batch 64: 2 blocks of one row group per stream. Prefer :meth:`for_reader` with the cache's
      ``row_group_tokens``.
      lanes: ``pi(i) ≡ i (mod lanes)``. Set it to ``R*`` (ideal_readers) so every example stays in its
        stream and each host keeps reading only its own streams; 1 mixes across streams.
    """

    seed: int
    first_window: int = 1024
    growth: float = 2.0
    max_window: int = 1 << 22
    block_size: int = 8192
    mix_size: int = 16384
    lanes: int = 1

    def __post_init__(self):
        if not isinstance(self.seed, (int, np.integer)):
            raise TypeError(f"ShuffleConfig.seed must be an int, got {self.seed!r}")
        for name in ("first_window", "max_window", "block_size", "mix_size", "lanes"):
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
                   max_mix_bytes: int = 1 << 29, **overrides) -> "ShuffleConfig":
        """Sizes derived from how the reader reads (a pure function of its arguments, so every host and
        every resume derives the same config; never pass a per-host, changing memory budget here).

        * ``lanes = ideal_readers``: examples stay in their stream (each host reads only its streams);
        * blocks of ``4`` row groups of every stream (at least 64 rows): a block is read in whole row
          groups, and the partial row groups at its two ends add about 1/4 of extra reading;
        * ``max(8, 2 * rows_per_batch)`` blocks per mix, ``rows_per_batch = ceil(batch_size / lanes)``
          (the examples of one stream a batch takes): with the rank-major interleave two consecutive
          batches then draw from disjoint blocks;
        * memory: a mix decodes about ``G * lanes * (block rows + one row group) * seq_len *
          DECODED_BYTES_PER_TOKEN`` bytes (a block's ends decode whole row groups).
          ``max_mix_bytes`` bounds that for a host reading all ``lanes`` streams (a host serving a
          fraction of the streams holds that fraction; with a fixed pod of R hosts pass R times the
          per-host allowance). Over the bound, blocks shrink to one row group, then mixes to 2 blocks,
          then blocks below a row group (row groups then get decoded more than once per window).
          The reader's ``memory_budget_bytes`` should be about twice the mix's bytes: an LRU smaller
          than a mix's working set thrashes.

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
        while mem(g, b) > max_mix_bytes and b > rg:
            b = max(rg, b // 2)
        while mem(g, b) > max_mix_bytes and g > 2:
            g -= 1
        while mem(g, b) > max_mix_bytes and b > 1:
            b = max(1, b // 2)
        kw = dict(first_window=max(1024, 2 * int(batch_size)), growth=2.0, block_size=b * lanes,
                  mix_size=g * b * lanes, lanes=lanes)
        kw["max_window"] = max(1 << 22, 4 * kw["mix_size"], kw["first_window"])
        kw.update(overrides)
        if "first_window" not in overrides:
            kw["first_window"] = min(kw["first_window"], kw["max_window"])
        return cls(seed=seed, **kw)

    # -- sizes in rows (one row = `lanes` examples) --------------------------------------------------
    @property
    def block_rows(self) -> int:
        return max(1, self.block_size // self.lanes)

    @property
    def mix_blocks(self) -> int:
        return max(1, self.mix_size // self.block_size)

    @property
    def window_table(self) -> tuple[np.ndarray, int]:
        """``(starts, max_rows)``: row starts of the growing windows (the last entry is where windows of
        ``max_rows`` begin), a pure function of the config."""
        return _window_table(self.first_window, float(self.growth), self.max_window, self.lanes)




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


def _window_keys(win, lane, cfg: ShuffleConfig, passes):
    """The key of each window: its index with one lane; ``(window, lane)`` hashed with more; and with
    ``passes`` (a read whose passes are shuffled one by one), ``(window, lane, pass)`` hashed."""
    if passes is not None:
        return hash_key(win, lane, passes).astype(np.int64)
    return hash_key(win, lane).astype(np.int64) if cfg.lanes > 1 else win


def _permute_rows(rows: np.ndarray, lane: np.ndarray, cfg: ShuffleConfig, row_limit: np.ndarray | None, *,
                  inverse: bool = False, passes: np.ndarray | None = None) -> np.ndarray:
    """The within-window permutation of the rows of one lane (``row_limit``: rows in that lane, or None
    = infinite). Every lane has its own keys, so streams do not move in lockstep."""
    win, lo, hi = _row_windows(rows, cfg)
    win = _window_keys(win, lane, cfg, passes)
    if row_limit is not None:
        hi = np.minimum(hi, row_limit)
    n = hi - lo
    j = rows - lo
    m_blocks = cfg.mix_blocks
    # Block size of each window: cfg.block_rows, or for a window smaller than one mix, the window cut
    # into `m_blocks` blocks (so small early windows get the same rank-major interleave).
    b_all = np.where(n >= cfg.block_rows * m_blocks, cfg.block_rows, n // m_blocks)
    seed = cfg.seed
    out = np.empty_like(j)

    small = b_all < 2  # tiny windows (fewer than 2 rows per block): one Feistel permutation
    if small.any():
        out[small] = feistel(j[small], n[small], hash_key(seed, _TAG_FULL, win[small]), inverse=inverse)
    big = ~small
    if big.any():
        jb, nb, wb, b = j[big], n[big], win[big], b_all[big]
        msize = b * m_blocks
        nfull = nb // b  # full blocks (a partial tail block stays in place)

        def mix_step(p):
            mix, o = p // msize, p % msize
            m = np.minimum(msize, nb - mix * msize)
            full = m == msize
            q = np.empty_like(o)
            if full.any():
                of, mf, bf = o[full], mix[full], b[full]
                if not inverse:
                    a, c = of % m_blocks, of // m_blocks
                    slot = mf * m_blocks + a
                    q[full] = a * bf + spread(c, bf, hash_key(seed, _TAG_MIX, wb[full], slot))
                else:
                    a, pos = of // bf, of % bf
                    slot = mf * m_blocks + a
                    c = spread(pos, bf, hash_key(seed, _TAG_MIX, wb[full], slot), inverse=True)
                    q[full] = c * m_blocks + a
            part = ~full
            if part.any():
                q[part] = feistel(o[part], m[part], hash_key(seed, _TAG_LAST_MIX, wb[part], mix[part]),
                                  inverse=inverse)
            return mix * msize + q

        def block_step(p):
            inb = p < nfull * b
            r = p.copy()
            if inb.any():
                bi = b[inb]
                blk, off = p[inb] // bi, p[inb] % bi
                key = hash_key(seed, _TAG_BLOCKS, wb[inb])
                r[inb] = feistel(blk, nfull[inb], key, inverse=inverse) * bi + off
            return r

        out[big] = block_step(mix_step(jb)) if not inverse else mix_step(block_step(jb))
    return lo + out


def _apply(indices, cfg: ShuffleConfig, epoch_length: int | None, inverse: bool, passes=None) -> np.ndarray:
    i = np.asarray(indices, dtype=np.int64)
    if i.size and int(i.min()) < 0:
        raise ValueError("example indices must be non-negative")
    if passes is not None:
        if epoch_length is None:
            raise ValueError("passes are shuffled one by one over [0, epoch_length): give epoch_length")
        passes = np.broadcast_to(np.asarray(passes, dtype=np.int64), i.shape).reshape(-1)
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
    out = _permute_rows(rows, lane, cfg, limit, inverse=inverse, passes=passes) * cfg.lanes + lane
    return out.reshape(i.shape)


def shuffle_example_indices(indices: np.ndarray, cfg: ShuffleConfig, *, epoch_length: int | None = None,
                            passes: np.ndarray | None = None) -> np.ndarray:
    """``pi(i)`` for every ``i`` in ``indices`` (int64 array of any shape): ``shuffled[i] = example[pi(i)]``.

    ``pi`` is a bijection of ``[0, inf)`` (or of ``[0, epoch_length)`` when given: the last window is
    then partial) that maps every window onto itself and preserves ``i mod cfg.lanes``. Pure function
    of ``(indices, cfg, epoch_length, passes)``: identical in every process, on every host, at every
    resume. Windows tile the whole (looping) index range and every window is keyed by its own index, so
    every pass over the data is ordered differently. ``passes`` (with ``epoch_length``; an int or one per
    index): the pass each index is in, a bijection of ``[0, epoch_length)`` per pass, each pass keyed by
    its number (:mod:`reader.order.passes`).
    """
    return _apply(indices, cfg, epoch_length, inverse=False, passes=passes)


def unshuffle_example_indices(indices: np.ndarray, cfg: ShuffleConfig, *, epoch_length: int | None = None,
                              passes: np.ndarray | None = None) -> np.ndarray:
    """``pi^{-1}``: the shuffled position at which each original example index is served."""
    return _apply(indices, cfg, epoch_length, inverse=True, passes=passes)


def _mixes(rows: np.ndarray, cfg: ShuffleConfig, epoch_length: int | None):
    """``(window, lo, hi, b, whole, mlo, mhi)`` of each output row: its window's rows ``[lo, hi)``, cut at the
    longest lane's end with ``epoch_length``; ``b`` rows per block; ``whole``: the window is one mix
    ``[mlo, mhi)``."""
    win, lo, hi = _row_windows(rows, cfg)
    m_blocks = cfg.mix_blocks
    big = cfg.block_rows * m_blocks
    n = hi - lo
    b = np.where(n >= big, cfg.block_rows, n // m_blocks)
    whole = b < 2
    if epoch_length is not None:
        # lanes hold ceil(E / lanes) or one row fewer: the window reaching the end holds n or n - 1 rows
        # in a lane. Unless both have full blocks their mixes may differ, so it is one mix then (the union
        # of every lane's mixes; no larger than one mix of full blocks)
        end = -(-int(epoch_length) // cfg.lanes)
        reach = hi >= end
        hi = np.minimum(hi, end)
        n = hi - lo
        b = np.where(n >= big, cfg.block_rows, n // m_blocks)
        whole = (b < 2) | (reach & (n - 1 < big))
    msize = np.maximum(b, 1) * m_blocks
    mix = np.where(whole, 0, (rows - lo) // msize)
    mlo = np.where(whole, lo, lo + mix * msize)
    mhi = np.where(whole, hi, np.minimum(mlo + msize, hi))
    return win, lo, hi, b, whole, mlo, mhi


def mix_of_rows(rows: np.ndarray, cfg: ShuffleConfig, epoch_length: int | None = None):
    """The mix of each output row (a row ``t`` is examples ``[t*lanes, (t+1)*lanes)``): arrays ``(window, lo,
    hi)``, the mix's output rows being ``[lo, hi)`` (the same rows in every lane; with ``epoch_length``, the
    last mix ends at the longest lane's end). A window smaller than one mix of full blocks, or of fewer
    than ``2`` rows per block, is one mix, and so is a window cut by ``epoch_length`` unless every lane has
    a mix of full blocks in it. ``pi`` maps a mix's rows onto source rows that no other mix uses (see
    :func:`mix_sources`), so once a read has passed row ``hi - 1`` of every lane it reads, that mix's
    sources are not needed again (the reader releases their row groups then).
    """
    win, _, _, _, _, mlo, mhi = _mixes(np.asarray(rows, dtype=np.int64), cfg, epoch_length)
    return win, mlo, mhi


def mix_sources(row: int, lane: int, cfg: ShuffleConfig) -> np.ndarray:
    """Source rows of lane ``lane`` that the mix holding output row ``row`` reads (no epoch length):
    int64 ``[k, 2]`` row ranges ``[start, stop)``, sorted and merged. Equal to the set
    ``{pi(t) // lanes : t in the mix's rows of that lane}`` (brute-force tested); the mixes of one
    window read disjoint sources whose union is the window.
    """
    return mix_sources_of_lanes(row, [lane], cfg)[0]


def mix_sources_of_lanes(row: int, lanes, cfg: ShuffleConfig, *, epoch_length: int | None = None,
                         passes: int | None = None) -> list[np.ndarray]:
    """:func:`mix_sources` for each lane of ``lanes`` (one vectorized cipher call); with ``epoch_length``
    and ``passes`` (one int), of the shuffle :func:`shuffle_example_indices` computes with them."""
    lanes = [int(x) for x in lanes]
    r = np.asarray([int(row)], dtype=np.int64)
    win, lo, hi, b, whole, mlo, mhi = (int(x[0]) for x in _mixes(r, cfg, epoch_length))
    lane_arr = np.asarray(lanes, dtype=np.int64)
    ends = np.full(lane_arr.size, hi, np.int64)
    if epoch_length is not None:  # each lane's own rows: ceil((E - lane) / lanes)
        ends = np.minimum(ends, (int(epoch_length) - lane_arr + cfg.lanes - 1) // cfg.lanes)
    n = np.maximum(ends - lo, 0)
    if whole:  # one Feistel permutation of the whole window, or a cut window taken as one mix
        return [np.asarray([[lo, lo + m]] if m else [], dtype=np.int64).reshape(-1, 2) for m in n.tolist()]
    nfull = n // b
    slots = np.arange((mlo - lo) // b, -(-(mhi - lo) // b), dtype=np.int64)
    full = slots[None, :] < nfull[:, None]  # [lanes, slots]: full blocks of each lane
    if full.any():
        wkey = _window_keys(win, lane_arr[:, None], cfg, passes)
        if np.ndim(wkey) == 0 or np.size(wkey) == 1:
            wkey = np.full((lane_arr.size, 1), int(np.asarray(wkey).reshape(-1)[0]), np.int64)
        x = np.where(full, slots[None, :], 0)
        blocks = feistel(x, np.maximum(nfull, 1)[:, None], hash_key(cfg.seed, _TAG_BLOCKS, wkey))
    else:
        blocks = np.zeros((lane_arr.size, slots.size), dtype=np.int64)
    out = []
    for row_blocks, is_full, m, nf in zip(blocks.tolist(), full.tolist(), n.tolist(), nfull.tolist()):
        # a partial tail block stays in place
        tail = [(lo + nf * b, lo + m)] if not all(is_full) and m > nf * b else []
        ranges = sorted([(lo + x * b, lo + (x + 1) * b) for x, f in zip(row_blocks, is_full) if f] + tail)
        merged: list[list[int]] = []
        for a, z in ranges:
            if merged and merged[-1][1] == a:
                merged[-1][1] = z
            else:
                merged.append([a, z])
        out.append(np.asarray(merged, dtype=np.int64).reshape(-1, 2))
    return out
