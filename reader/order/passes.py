"""Passes: which row of the data global example ``i`` is, under either pass rule. Pure functions, no I/O.

A *pass* is ``E`` consecutive global examples, ``E`` being the rows of an eval pass at the same options:
whole ``L``-token rows of the concatenation for concat reads, examples for unpacked and best-fit reads
(docs/FORMAT.md, "Passes").

* ``"spans"`` (:class:`Spans`, the default from format version 4): global example ``i`` is example
  ``k = i mod E`` of pass ``p = i div E``. A shuffled read permutes ``k`` inside its pass,
  ``k' = pi_p(k)``: the growing-window shuffle of ``[0, E)`` (:mod:`reader.order.shuffle`, ``epoch_length
  = E``, its last window cut at the pass's end), its windows keyed by the pass too, so each pass is
  ordered differently; unshuffled, ``k' = k``. Lane ``s = k' mod R*`` is *span* ``s`` and ``j = k' div R*``
  its position: the row is eval row ``span_start(s) + j``. The ``R*`` spans cut the eval pass's rows into
  contiguous runs of ``floor(E / R*)`` rows, the first ``E mod R*`` of them one row longer, so every pass is
  a permutation of the eval pass's rows, found in O(1).
* ``"streams"`` (:class:`StreamLanes`, the rule before version 4): stream ``s`` is
  ``loop(all_chunks)[s::R*]`` (:mod:`reader.order.streams`); a pass covers the data only when the streams
  are equal.

Both classes also answer, for a shuffled read, the questions of the release policy and the prefetcher
(:mod:`reader.batch.release`, :mod:`reader.batch.prefetch`) in *lane rows*: a lane's positions, one after
the other over the whole read (``spans``: pass ``p``'s position ``t`` is lane row ``p * P + t``, ``P =
ceil(E / R*)`` rows per pass), so those modules need not know the rule.
"""

from __future__ import annotations

import numpy as np

from reader.order.shuffle import (ShuffleConfig, mix_of_rows, mix_sources_of_lanes, shuffle_example_indices,
                                  shuffle_window_of)

PASS_RULES = ("spans", "streams")


class RepeatedRowsWarning(RuntimeWarning):
    """A read serves rows twice within a pass (``pass_rule="streams"`` on fewer chunks than ``R*`` or
    unequal streams)."""


def stream_repeats(rows: int, holds: np.ndarray) -> int:
    """Under ``"streams"``, about how many of a pass's ``rows`` (``E``) rows repeat rows of the same pass when
    stream ``s`` holds ``holds[s]`` rows in its first epoch: it serves ``ceil((E - s) / R*)`` rows of a pass,
    and one holding fewer loops back over chunks, which other streams serve too."""
    s = np.arange(holds.size, dtype=np.int64)
    serves = np.maximum(rows - s + holds.size - 1, 0) // holds.size
    return int(np.maximum(serves - holds, 0).sum())


class StreamLanes:
    """The lanes of a shuffled read under the ``"streams"`` rule: lane ``l`` is stream ``l``, its rows are
    the stream's positions (``pi`` acts on them with no epoch length)."""

    def __init__(self, cfg: ShuffleConfig):
        self.cfg = cfg
        self.lanes = cfg.lanes

    def lane_rows(self, ex: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(lane rows, lanes)`` of global examples ``ex``."""
        return ex // self.lanes, ex % self.lanes

    def mixes(self, rows: np.ndarray):
        """``(window, lo, hi)`` of each lane row: the mix's lane rows are ``[lo, hi)``."""
        return mix_of_rows(rows, self.cfg)

    def shuffle_window(self, row: int) -> tuple[int, int]:
        """The lane rows ``[lo, hi)`` of the window of lane row ``row``."""
        _, lo, hi = shuffle_window_of(np.asarray([row * self.lanes], np.int64), self.cfg)
        return int(lo[0]) // self.lanes, int(hi[0]) // self.lanes

    def shuffle_window_before(self, row: int) -> int:
        """The first lane row of the window before the one that starts at lane row ``row`` (in the same
        pass), or ``row`` when there is none."""
        return self.shuffle_window(row - 1)[0] if row > 0 else row

    def mix_sources(self, row: int, lanes) -> list[np.ndarray]:
        """The lane rows each lane of ``lanes`` reads for the mix of lane row ``row``: ``[k, 2]`` ranges."""
        return mix_sources_of_lanes(row, lanes, self.cfg)

    def last_example(self, row: int) -> int:
        """The last global example of lane row ``row``."""
        return (int(row) + 1) * self.lanes - 1

    def reader_lanes(self, row: int, num_readers: int, reader_index: int) -> list[int]:
        """The lanes reader ``r`` of ``R`` reads at lane row ``row`` (``R`` divides ``R*``)."""
        return list(range(reader_index % num_readers, self.lanes, num_readers))

    def stream_rows(self, lane: int, lo: int, hi: int) -> tuple[int, int, int]:
        """``(stream, a, b)``: lane rows ``[lo, hi)`` of lane ``lane`` are positions ``[a, b)`` of that stream
        of the read's :class:`reader.order.streams.StreamIndex`."""
        return lane, lo, hi


class Spans:
    """The ``"spans"`` rule for a read of ``rows`` (``E``) rows per pass and ``num_spans`` (``R*``) spans, shuffled
    by ``shuffle`` (lanes ``R*``) or not (None). See the module docstring."""

    def __init__(self, rows: int, num_spans: int, shuffle: ShuffleConfig | None = None):
        if rows < 1 or num_spans < 1:
            raise ValueError(f"a pass needs rows >= 1 and spans >= 1, got {rows} and {num_spans}")
        if shuffle is not None and shuffle.lanes != num_spans:
            raise ValueError(f"the shuffle's lanes ({shuffle.lanes}) must be the spans ({num_spans})")
        self.rows = int(rows)
        self.r = int(num_spans)
        self.cfg = shuffle
        self.lanes = self.r
        self._q, self._rem = divmod(self.rows, self.r)
        self.pass_rows = -(-self.rows // self.r)  # P: rows of the longest lane (span) in a pass

    # -- the rule ------------------------------------------------------------------------------------
    def span_start(self, s):
        """First eval row of span ``s`` (arrays too); ``span_start(R*) == E``."""
        return s * self._q + np.minimum(s, self._rem)

    def span_rows(self, s):
        """Rows of span ``s``: ``floor(E / R*)``, plus one for the first ``E mod R*`` spans."""
        return self._q + (np.asarray(s) < self._rem)

    def sources(self, ex: np.ndarray) -> np.ndarray:
        """The *source* of each global example: ``p * E + k'``, its pass and its permuted place in it."""
        ex = np.asarray(ex, dtype=np.int64)
        if self.cfg is None or not ex.size:
            return ex
        p, k = np.divmod(ex, self.rows)
        return p * self.rows + shuffle_example_indices(k, self.cfg, epoch_length=self.rows, passes=p)

    def place(self, src: np.ndarray):
        """``(pass, span, position in the span, eval row)`` of sources ``src`` (:meth:`sources`)."""
        p, k = np.divmod(np.asarray(src, dtype=np.int64), self.rows)
        s, j = k % self.r, k // self.r
        return p, s, j, self.span_start(s) + j

    # -- lanes, for the release policy and the prefetcher ---------------------------------------------
    def lane_rows(self, ex: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p, k = np.divmod(ex, self.rows)
        return p * self.pass_rows + k // self.r, k % self.r

    def mixes(self, rows: np.ndarray):
        p, t = np.divmod(rows, self.pass_rows)
        win, lo, hi = mix_of_rows(t, self.cfg, epoch_length=self.rows)
        base = p * self.pass_rows
        return win, base + lo, base + hi

    def shuffle_window(self, row: int) -> tuple[int, int]:
        p, t = divmod(int(row), self.pass_rows)
        _, lo, hi = shuffle_window_of(np.asarray([t * self.lanes], np.int64), self.cfg)
        base = p * self.pass_rows
        return base + int(lo[0]) // self.lanes, base + min(int(hi[0]) // self.lanes, self.pass_rows)

    def shuffle_window_before(self, row: int) -> int:
        return self.shuffle_window(row - 1)[0] if row % self.pass_rows else row

    def mix_sources(self, row: int, lanes) -> list[np.ndarray]:
        p, t = divmod(int(row), self.pass_rows)
        got = mix_sources_of_lanes(t, lanes, self.cfg, epoch_length=self.rows, passes=p)
        return [g + p * self.pass_rows for g in got]

    def last_example(self, row: int) -> int:
        p, t = divmod(int(row), self.pass_rows)
        return p * self.rows + min((t + 1) * self.r, self.rows) - 1

    def reader_lanes(self, row: int, num_readers: int, reader_index: int) -> list[int]:
        # reader r's examples i = r (mod R) are k = r - p E (mod R) of pass p, and R divides R*
        p = int(row) // self.pass_rows
        return list(range((reader_index - p * self.rows) % num_readers, self.lanes, num_readers))

    def stream_rows(self, lane: int, lo: int, hi: int) -> tuple[int, int, int]:
        # lane rows of one pass: eval rows of the lane's span (the eval pass is stream 0 of the index)
        base = int(lo) // self.pass_rows * self.pass_rows
        start, n = int(self.span_start(lane)), int(self.span_rows(lane))
        return 0, start + min(lo - base, n), start + min(hi - base, n)
