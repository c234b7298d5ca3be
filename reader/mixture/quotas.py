"""The mixture order's index math: global example ``i`` -> ``(component, component example k)``.

Pure functions of a :class:`MixtureQuotas` (weights, schedule, lanes, block size, seed) and the index; no
I/O, nothing per example held. docs/MIXTURES.md is the prose definition; changing anything here
changes the order.

* **Lanes.** Example ``i`` lies in lane ``l = i mod R*`` at lane position ``t = i // R*`` (``R*`` =
  ideal_readers, the streams every component shares). An item of component ``c`` in lane ``l`` is
  ``c``'s example ``k = j * R* + l``, ``j`` being how many items of ``c`` lane ``l`` had before it: so
  lane ``l`` reads only stream ``l`` of every component, each in that component's own order.
* **Segments.** The schedule cuts the order at global examples ``E_s = start_batch_s * B``; in lane
  ``l`` segment ``s`` starts at position ``t_{s,l} = ceil((E_s - l) / R*)``.
* **Counts.** Weights are normalised and quantised once to integer prefix sums ``P_0 = 0 <= P_1 <=
  ... <= P_C = 2**32``. After ``tau`` whole lane-blocks of ``b`` positions since the segment start,
  lane ``l`` holds ``F_c(tau) = floor(tau * b * P_c / 2**32 + (2l + 1) / (2 R*))`` items of components
  ``0 .. c-1`` (``F_C = tau * b``). Summed over the lanes (Hermite's identity) that is
  ``round(tau * K * P_c / 2**32)`` with ``K = b * R*``: every block of ``K`` examples from the segment
  start holds each component's weight times ``K``, with a running error below 1.
* **Inside a lane-block** the ``n_c = G_c(tau + 1) - G_c(tau)`` items of each component (``G_c = F_{c+1}
  - F_c``) are placed by a keyed Feistel permutation of ``[0, b)`` (key: seed, segment, lane, block):
  position ``q`` holds label ``A[pi(q)]`` of the sorted labels ``A``; the items of one component keep
  their order (rank among equal labels in position order).

All floors are taken in Python integers, so every platform computes the same order.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from fractions import Fraction
from typing import Sequence

import numpy as np

from reader.order.ciphers import feistel, hash_key

QUANTUM_BITS = 32
QUANTUM = 1 << QUANTUM_BITS  # weights are quantised to multiples of 2**-32
DEFAULT_BLOCK = 1024  # lane positions per block (b); a global block holds K = b * R* examples
_TAG_ARRANGE = 41  # cipher key tag (part of the definition of the order)
_TAU_BITS = 40  # block numbers inside a segment and lane stay below 2**40 (b * 2**40 positions)


def quantise(weights: Sequence[Fraction | int | float]) -> tuple[int, ...]:
    """Integer prefix sums ``P_0 = 0, ..., P_C = QUANTUM`` of the normalised weights (exact: the weights
    are taken as exact fractions, each ``P_c`` rounded once, half to even)."""
    ws = [Fraction(w) for w in weights]
    if any(w < 0 for w in ws) or not any(ws):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {[float(w) for w in ws]}")
    # in integers over a common denominator (Fraction arithmetic per component is 50x slower)
    den = math.lcm(*(w.denominator for w in ws))
    nums = [w.numerator * (den // w.denominator) for w in ws]
    total = sum(nums)
    out, acc = [0], 0
    for n in nums:
        acc += n
        q, r = divmod(acc * QUANTUM, total)
        out.append(q + (2 * r > total or (2 * r == total and q % 2 == 1)))  # round half to even
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class MixtureQuotas:
    """Everything the mixture order depends on besides the index.

    Attributes:
      lanes: ``R*`` (ideal_readers).
      block: ``b``, lane positions per block.
      seed: keys the arrangement inside blocks.
      starts: ``E_s``, the first global example of each segment (``starts[0] == 0``, increasing).
      prefixes: per segment, the quantised prefix sums ``P_0 .. P_C`` (:func:`quantise`).
    """

    lanes: int
    block: int
    seed: int
    starts: tuple[int, ...]
    prefixes: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        if self.lanes < 1 or self.block < 1:
            raise ValueError(f"lanes and block must be >= 1, got {self.lanes}, {self.block}")
        if not self.starts or self.starts[0] != 0 or any(b <= a for a, b in zip(self.starts, self.starts[1:])):
            raise ValueError(f"segment starts must begin at 0 and increase, got {self.starts}")
        if len(self.prefixes) != len(self.starts):
            raise ValueError("one prefix-sum tuple per segment")
        for p in self.prefixes:
            if len(p) != len(self.prefixes[0]) or p[0] != 0 or p[-1] != QUANTUM or list(p) != sorted(p):
                raise ValueError(f"prefix sums must run from 0 to {QUANTUM}, non-decreasing: {p}")

    @property
    def num_components(self) -> int:
        return len(self.prefixes[0]) - 1

    def lane_start(self, s: int, lane: int) -> int:
        """``t_{s,l}``: the first position of lane ``lane`` in segment ``s``."""
        return -((lane - self.starts[s]) // self.lanes)

    def cumulative(self, s: int, lane: int, tau: int) -> list[int]:
        """``F_0 .. F_C``: items of components ``0..c-1`` in the first ``tau`` blocks of lane ``lane`` in
        segment ``s`` (Python ints: exact for any ``tau``)."""
        r2 = 2 * self.lanes
        tb, add, den = r2 * tau * self.block, (2 * lane + 1) * QUANTUM, r2 * QUANTUM
        return [(tb * p + add) // den for p in self.prefixes[s]]

    def counts(self, s: int, lane: int, tau: int) -> np.ndarray:
        """``G_c(tau)``: items of each component in the first ``tau`` blocks (int64 [C])."""
        return np.diff(np.asarray(self.cumulative(s, lane, tau), dtype=np.int64))

    def min_weight_error(self) -> tuple[int, int] | None:
        """``(segment, component)`` of the first nonzero quantised weight below ``1 / b``, or None."""
        for s, p in enumerate(self.prefixes):
            for c in range(self.num_components):
                w = p[c + 1] - p[c]
                if w and w * self.block < QUANTUM:
                    return s, c
        return None


def _block_counts(plan: MixtureQuotas, s: np.ndarray, lane: np.ndarray, tau: np.ndarray):
    """``(before, cum)`` of lane-blocks ``(s, lane, tau)``: int64 [m, C] items of each component in the
    lane's earlier blocks of the segment, and int64 [m, C + 1] cumulative counts inside the block."""
    C = plan.num_components
    m = len(s)
    f = np.empty((m, 2, C + 1), np.int64)
    for j, (sj, lj, tj) in enumerate(zip(s.tolist(), lane.tolist(), tau.tolist())):
        f[j, 0], f[j, 1] = plan.cumulative(sj, lj, tj), plan.cumulative(sj, lj, tj + 1)
    cum = f[:, 1] - f[:, 0]
    if (np.diff(cum, axis=1) < 0).any():
        raise ValueError("a nonzero weight below 1 / block gives a negative block count (validate the plan)")
    return np.diff(f[:, 0], axis=1), cum


def block_labels(plan: MixtureQuotas, s: np.ndarray, lane: np.ndarray, tau: np.ndarray, upto: np.ndarray,
                 cum: np.ndarray | None = None) -> np.ndarray:
    """The components at positions ``0 .. upto[j] - 1`` of each lane-block ``j`` = ``(s, lane, tau)[j]``,
    concatenated (int64): position ``q`` holds ``A[pi(q)]``, ``A`` the block's labels in sorted order
    and ``pi`` the keyed Feistel permutation of ``[0, b)``. One cipher call for all blocks."""
    b, C = plan.block, plan.num_components
    m = len(s)
    if cum is None:
        cum = _block_counts(plan, s, lane, tau)[1]
    upto = np.asarray(upto, dtype=np.int64)
    blk = np.repeat(np.arange(m, dtype=np.int64), upto)
    pos = np.arange(blk.size, dtype=np.int64) - np.repeat(np.cumsum(upto) - upto, upto)
    keys = hash_key(plan.seed, _TAG_ARRANGE, s, lane, tau)
    src = feistel(pos, b, np.broadcast_to(keys, (m,))[blk])
    # which cumulative interval pi(q) falls in: blocks side by side (offset j * b) in one search
    edges = (cum[:, 1:] + np.arange(m, dtype=np.int64)[:, None] * b).reshape(-1)
    return np.searchsorted(edges, src + blk * b, side="right") - blk * C


def arrange(plan: MixtureQuotas, s: np.ndarray, lane: np.ndarray, tau: np.ndarray):
    """The arrangement of lane-blocks ``(s, lane, tau)`` (arrays of ``m``): ``(labels, ranks, before)``.

    ``labels`` int32 [m, b]: the component at each position (:func:`block_labels`); ``ranks`` int64
    [m, b]: how many items of the same component precede it in the block; ``before`` int64 [m, C]:
    ``G_c(tau)``, the items of each component in the lane's earlier blocks of the segment.
    """
    b, C = plan.block, plan.num_components
    m = len(s)
    before, cum = _block_counts(plan, s, lane, tau)
    labels = block_labels(plan, s, lane, tau, np.full(m, b, np.int64), cum).reshape(m, b)
    # ranks among equal labels, in position order: a stable sort of (block, label)
    key = (np.arange(m, dtype=np.int64)[:, None] * C + labels).reshape(-1)
    order = np.argsort(key, kind="stable")
    ks = key[order]
    ranks = np.empty(m * b, np.int64)
    ranks[order] = np.arange(m * b, dtype=np.int64) - np.searchsorted(ks, ks, side="left")
    return labels.astype(np.int32), ranks.reshape(m, b), before


class QuotaIndex:
    """Global example -> (component, component example) for one :class:`MixtureQuotas`, with caches.

    Block arrangements (``b`` labels and component indices each, about ``10 b`` bytes) are kept for the
    ``cache_blocks`` most recent lane-blocks (default: two per lane); the items each lane consumed
    before each segment (``C`` ints per segment and lane) once computed. Thread-safe.
    """

    def __init__(self, plan: MixtureQuotas, cache_blocks: int | None = None):
        self.plan = plan
        self._starts = np.asarray(plan.starts, dtype=np.int64)
        self._lock = threading.Lock()
        self._blocks: collections.OrderedDict[int, tuple[np.ndarray, np.ndarray]] = collections.OrderedDict()
        self._cap = cache_blocks or max(64, 2 * plan.lanes)  # reads move forward: a block or two per lane
        self._label_dtype = np.int16 if plan.num_components < (1 << 15) else np.int32
        zero = np.zeros((plan.lanes, plan.num_components), np.int64)
        zero.setflags(write=False)
        self._bases: list[np.ndarray] = [zero]  # per segment, computed in order on first use
        self._last: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # the blocks of the last assign

    # -- positions ------------------------------------------------------------------------------------
    def _where(self, ex: np.ndarray):
        """Segment, lane, block and position in the block of each example."""
        R, b = self.plan.lanes, self.plan.block
        s = np.searchsorted(self._starts, ex, side="right") - 1
        lane, t = ex % R, ex // R
        u = t + (lane - self._starts[s]) // R  # t - t_{s,l}
        tau, q = np.divmod(u, b)
        return s, lane, tau, q

    # -- the items each lane consumed before a segment ------------------------------------------------
    def _prefix_counts(self, s: np.ndarray, lane: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Items of each component in the first ``u`` positions of segment ``s`` in lane ``lane`` (arrays
        of ``m``; int64 [m, C]): whole blocks in closed form, one arrangement per partial block."""
        plan = self.plan
        C, b = plan.num_components, plan.block
        tau, q = np.divmod(u, b)
        out = np.stack([plan.counts(x, y, z) for x, y, z in zip(s.tolist(), lane.tolist(), tau.tolist())]) \
            if s.size else np.zeros((0, C), np.int64)
        part = np.flatnonzero(q > 0)
        if part.size:
            labels = block_labels(plan, s[part], lane[part], tau[part], q[part])
            lab = labels + np.repeat(np.arange(part.size, dtype=np.int64) * C, q[part])
            out[part] += np.bincount(lab, minlength=part.size * C).reshape(part.size, C)
        return out

    def bases(self, s: int) -> np.ndarray:
        """Items of each component that every lane holds before segment ``s`` (int64 [R*, C])."""
        with self._lock:
            have = len(self._bases)
            if s < have:
                return self._bases[s]
            acc = self._bases[-1]
        R = self.plan.lanes
        lanes = np.arange(R, dtype=np.int64)
        for x in range(have, s + 1):  # (two threads may both compute a segment: the same values)
            n = np.asarray([self.plan.lane_start(x, y) - self.plan.lane_start(x - 1, y) for y in range(R)], np.int64)
            acc = acc + self._prefix_counts(np.full(R, x - 1, np.int64), lanes, n)
            acc.setflags(write=False)
            with self._lock:
                if len(self._bases) == x:
                    self._bases.append(acc)
        with self._lock:
            return self._bases[s]

    # -- blocks ---------------------------------------------------------------------------------------
    def _entries(self, keys: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(labels, items before)`` of each lane-block key ``(s * R* + lane) << 40 | tau``."""
        with self._lock:
            got = [self._blocks.get(k) for k in keys.tolist()]
            for k, g in zip(keys.tolist(), got):
                if g is not None:
                    self._blocks.move_to_end(k)
        miss = [j for j, g in enumerate(got) if g is None]
        if miss:
            mk = keys[miss]
            sl, tau = mk >> _TAU_BITS, mk & ((1 << _TAU_BITS) - 1)
            s, lane = sl // self.plan.lanes, sl % self.plan.lanes
            labels, ranks, before = arrange(self.plan, s, lane, tau)
            bases = [self.bases(int(x))[int(y)] for x, y in zip(s.tolist(), lane.tolist())]
            with self._lock:
                for i, j in enumerate(miss):
                    items = (bases[i] + before[i])[labels[i]] + ranks[i]
                    lab = labels[i].astype(self._label_dtype)
                    lab.setflags(write=False)
                    items.setflags(write=False)
                    got[j] = self._blocks[int(mk[i])] = (lab, items)
                while len(self._blocks) > self._cap:
                    self._blocks.popitem(last=False)
        return got

    def _blocks_of(self, s: np.ndarray, lane: np.ndarray, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, inverse)``: the distinct lane-block keys of examples in segment ``s``, lane ``lane``,
        block ``tau`` (sorted), and each example's index among them. A read of consecutive batches lies in
        one segment and a block or two of every lane: counted there instead of sorted."""
        R = self.plan.lanes
        t0, t1 = int(tau.min()), int(tau.max())
        s0 = int(s[0])
        if t1 - t0 < 4 and int(s.min()) == int(s.max()) == s0:
            T = t1 - t0 + 1
            dense = lane * T + (tau - t0)  # sorted as the keys are: lane, then block
            seen = np.zeros(R * T, bool)
            seen[dense] = True
            present = np.flatnonzero(seen)
            inv = (np.cumsum(seen) - 1)[dense]
            lanes, blocks = np.divmod(present, T)
            return ((s0 * R + lanes) << _TAU_BITS) | (blocks + t0), inv
        uk, inv = np.unique(((s * R + lane) << _TAU_BITS) | tau, return_inverse=True)
        return uk, inv.reshape(-1)

    def assign(self, ex) -> tuple[np.ndarray, np.ndarray]:
        """``(components, k)`` of global examples ``ex``: each one's component and its example index in
        that component's own order (int64 arrays shaped like ``ex``)."""
        ex = np.asarray(ex, dtype=np.int64)
        flat = ex.reshape(-1)
        if flat.size and int(flat.min()) < 0:
            raise ValueError("example indices must be non-negative")
        comp = np.empty(flat.size, np.int64)
        items = np.empty(flat.size, np.int64)
        if flat.size:
            s, lane, tau, q = self._where(flat)
            if int(tau.max()) >> _TAU_BITS:
                raise ValueError(f"example {int(flat.max())} is past the {self.plan.block << _TAU_BITS} positions "
                                 "a segment lane can hold")
            uk, inv = self._blocks_of(s, lane, tau)
            last = self._last  # the blocks side by side (all have plan.block positions), as last time?
            if last is None or not np.array_equal(last[0], uk):
                entries = self._entries(uk)
                last = self._last = (uk, np.concatenate([lab for lab, _ in entries]),
                                     np.concatenate([its for _, its in entries]))
            flat_q = inv * self.plan.block + q
            comp[:] = last[1][flat_q]
            items[:] = last[2][flat_q]
            items = items * self.plan.lanes + lane
        return comp.reshape(ex.shape), items.reshape(ex.shape)

    # -- totals -----------------------------------------------------------------------------------------
    def lane_counts(self, end: int) -> np.ndarray:
        """Items of each component in each lane among global examples ``[0, end)`` (int64 [R*, C]);
        O(R* (S + b))."""
        R = self.plan.lanes
        lanes = np.arange(R, dtype=np.int64)
        t = np.maximum(0, -((lanes - int(end)) // R))  # positions of each lane below `end`
        s = np.searchsorted(self._starts, t * R + lanes, side="right") - 1  # the segment of position t
        u = t + (lanes - self._starts[s]) // R
        before = np.stack([self.bases(int(x))[y] for y, x in enumerate(s.tolist())])
        return before + self._prefix_counts(s, lanes, u)

    def consumed(self, end: int) -> np.ndarray:
        """Items of each component among global examples ``[0, end)`` (int64 [C]); O(R* (S + b))."""
        return self.lane_counts(end).sum(axis=0)

    def last_items(self, end: int) -> np.ndarray:
        """The largest example ``k`` of each component among global examples ``[0, end)`` (int64 [C]; -1:
        none): lane ``l``'s ``j``-th item is example ``j R* + l``, and a lane's items only grow."""
        n = self.lane_counts(end)
        k = (n - 1) * self.plan.lanes + np.arange(self.plan.lanes, dtype=np.int64)[:, None]
        return np.where(n > 0, k, -1).max(axis=0)

    def first_step_reaching(self, limits: np.ndarray, batch_size: int, max_step: int = 1 << 42) -> int | None:
        """The first step ``b`` whose batch draws an example ``k >= limits[c]`` of some component ``c``
        (``limits``: int64 [C], -1 for none), or None before ``max_step``: a binary search over steps, as
        what steps ``0..b`` draw only grows."""
        limits = np.asarray(limits, dtype=np.int64)
        watched = limits >= 0
        if not watched.any():
            return None

        def reached(b: int) -> bool:
            return bool((self.last_items((b + 1) * batch_size)[watched] >= limits[watched]).any())

        hi = 1
        while not reached(hi):
            if hi >= max_step:
                return None
            hi *= 2
        lo = -1  # reached(lo) is False (no step before 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if reached(mid):
                hi = mid
            else:
                lo = mid
        return hi
