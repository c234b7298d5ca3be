"""The mixture order's index math (reader/mixture/quotas.py) against a brute-force reference that assigns items
one by one from the definition (docs/MIXTURES.md): exact block proportions, drift, seeking, schedule
continuity, exact integer arithmetic far out."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from reader.order.ciphers import feistel, hash_key
from reader.mixture.quotas import QUANTUM, QuotaIndex, MixtureQuotas, arrange, quantise

SETTINGS = dict(max_examples=30, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
TAG = 41  # the arrangement's cipher tag, part of the definition


def floor_f(x: Fraction) -> int:
    return x.numerator // x.denominator


def reference(plan: MixtureQuotas, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(component, k)`` of examples ``0 .. n-1``, item by item: in each lane, walk the positions, find
    the segment and block, build the block's labels from the floor counts (exact fractions) and the
    keyed permutation, and count the items of each component handed out so far."""
    R, b, C = plan.lanes, plan.block, plan.num_components
    comp = np.full(n, -1, np.int64)
    k = np.full(n, -1, np.int64)
    for lane in range(R):
        taken = [0] * C
        t = 0
        while t * R + lane < n:
            i = t * R + lane
            s = max(j for j, e in enumerate(plan.starts) if e <= i)
            first = -((lane - plan.starts[s]) // R)  # ceil((E_s - lane) / R)
            tau, q = divmod(t - first, b)
            P = plan.prefixes[s]

            def F(c, tt):
                return floor_f(Fraction(tt * b * P[c], QUANTUM) + Fraction(2 * lane + 1, 2 * R))

            counts = [(F(c + 1, tau + 1) - F(c, tau + 1)) - (F(c + 1, tau) - F(c, tau)) for c in range(C)]
            labels = np.repeat(np.arange(C), counts)
            pi = int(feistel(np.asarray([q]), b, hash_key(plan.seed, TAG, s, lane, tau))[0])
            c = int(labels[pi])
            comp[i], k[i] = c, taken[c] * R + lane
            taken[c] += 1
            t += 1
    return comp, k


@st.composite
def plans(draw, max_components=4):
    C = draw(st.integers(1, max_components))
    R = draw(st.sampled_from([1, 2, 3, 4, 8]))
    b = draw(st.sampled_from([4, 8, 16, 32]))
    B = draw(st.integers(1, 12))
    segs = draw(st.integers(1, 3))
    starts = [0] + sorted(draw(st.lists(st.integers(1, 40), min_size=segs - 1, max_size=segs - 1, unique=True)))
    prefixes = []
    for _ in starts:
        ws = [draw(st.sampled_from([0, 0.05, 0.1, 0.25, 1 / 3, 0.5, 0.7, 1, 3])) for _ in range(C)]
        ws[draw(st.integers(0, C - 1))] = 1.0  # one positive weight at least
        while True:  # a nonzero weight below 1/b is refused: zero the smallest such (the largest stays)
            p = quantise(ws)
            small = [c for c in range(C) if 0 < (p[c + 1] - p[c]) * b < QUANTUM]
            if not small:
                break
            ws[min(small, key=lambda c: ws[c])] = 0
        prefixes.append(p)
    return MixtureQuotas(lanes=R, block=b, seed=draw(st.integers(0, 2**64 - 1)),
                   starts=tuple(x * B for x in starts), prefixes=tuple(prefixes))


@given(plans())
@settings(**SETTINGS)
def test_assign_equals_the_one_by_one_reference(plan):
    n = 3 * plan.block * plan.lanes + plan.starts[-1] + 7
    want_c, want_k = reference(plan, n)
    got_c, got_k = QuotaIndex(plan).assign(np.arange(n))
    assert np.array_equal(got_c, want_c) and np.array_equal(got_k, want_k)
    # seek == iterate: any subset, in any order, on a fresh index
    rng = np.random.default_rng(plan.seed % 1000)
    pick = rng.permutation(n)[: max(1, n // 3)]
    c2, k2 = QuotaIndex(plan, cache_blocks=1).assign(pick)
    assert np.array_equal(c2, want_c[pick]) and np.array_equal(k2, want_k[pick])
    # totals in closed form
    idx = QuotaIndex(plan)
    for end in sorted({0, 1, n // 2, n - 1, n, *plan.starts}):
        if end <= n:
            assert idx.consumed(end).tolist() == np.bincount(want_c[:end], minlength=plan.num_components).tolist()


@given(plans())
@settings(**SETTINGS)
def test_every_component_continues_where_it_was_across_weight_changes(plan):
    """Per lane, component c's items are its examples l, l + R*, l + 2 R*, ... in order: nothing served
    twice, nothing skipped, whatever the schedule does (each component continues where it was)."""
    R = plan.lanes
    n = 2 * plan.block * R + plan.starts[-1] + 5
    comp, k = QuotaIndex(plan).assign(np.arange(n))
    for lane in range(R):
        for c in range(plan.num_components):
            ks = k[lane::R][comp[lane::R] == c]
            assert ks.tolist() == [j * R + lane for j in range(ks.size)]


@given(plans(max_components=5))
@settings(**SETTINGS)
def test_every_block_holds_its_weight_and_drift_stays_below_one(plan):
    """Every global block of K = b * R* examples from a segment start holds round(weight * K) items of
    each component in running terms (the count after m blocks is within 1/2 of m K w); every lane-block
    of b positions likewise within 1 per lane."""
    R, b, C = plan.lanes, plan.block, plan.num_components
    K = b * R
    idx = QuotaIndex(plan)
    for s, E in enumerate(plan.starts):
        w = np.diff(np.asarray(plan.prefixes[s], dtype=object)) / QUANTUM  # exact Fractions via object
        stop = plan.starts[s + 1] if s + 1 < len(plan.starts) else E + 4 * K
        m = (stop - E) // K
        if m == 0:
            continue
        comp, _ = idx.assign(E + np.arange(m * K + R))
        per_block = np.stack([np.bincount(comp[j * K:(j + 1) * K], minlength=C) for j in range(m)])
        running = np.cumsum(per_block, axis=0)
        for c in range(C):
            w = Fraction(plan.prefixes[s][c + 1] - plan.prefixes[s][c], QUANTUM)
            for j in range(m):
                assert abs(running[j, c] - w * (j + 1) * K) < 1, (s, j, c, running[j, c])
            for lane in range(R):  # per lane: blocks of b positions from the lane's first one in the segment
                first = -((lane - E) // R) * R + lane - E  # index in comp of the lane's first position
                lane_comp = comp[first::R][: m * b]
                run = np.cumsum([(lane_comp[j * b:(j + 1) * b] == c).sum() for j in range(m)])
                assert all(abs(int(r) - w * (j + 1) * b) < 1 for j, r in enumerate(run))
        assert (per_block.sum(axis=1) == K).all()


def test_block_arrangement_is_a_permutation_of_the_counts():
    plan = MixtureQuotas(lanes=4, block=64, seed=9, starts=(0,), prefixes=(quantise([0.5, 0.25, 0.25]),))
    labels, ranks, before = arrange(plan, np.asarray([0, 0]), np.asarray([1, 3]), np.asarray([5, 5]))
    for j, lane in enumerate((1, 3)):
        assert np.bincount(labels[j], minlength=3).tolist() == (plan.counts(0, lane, 6) - plan.counts(0, lane, 5)).tolist()
        for c in range(3):  # ranks count the earlier items of the same component
            assert ranks[j][labels[j] == c].tolist() == list(range(int((labels[j] == c).sum())))
        assert before[j].tolist() == plan.counts(0, lane, 5).tolist()
    assert not np.array_equal(labels[0], labels[1])  # each lane-block has its own key


def test_far_indices_are_exact():
    """Block numbers near 2**40: the floors are taken in Python ints, equal to exact fractions."""
    P = quantise([0.1, 0.2, 0.7])
    plan = MixtureQuotas(lanes=64, block=1024, seed=1, starts=(0,), prefixes=(P,))
    for tau in (0, 1, 12345, 2**39 + 17, 2**40 - 2):
        for lane in (0, 31, 63):
            want = [floor_f(Fraction(tau * 1024 * p, QUANTUM) + Fraction(2 * lane + 1, 128)) for p in P]
            assert plan.cumulative(0, lane, tau) == want
            assert (plan.counts(0, lane, tau + 1) - plan.counts(0, lane, tau)).sum() == 1024
    ex = np.asarray([(2**40 - 3) * 1024 * 64 + 5])
    c, k = QuotaIndex(plan).assign(ex)
    assert 0 <= c[0] < 3 and k[0] % 64 == 5
    with pytest.raises(ValueError, match="past"):
        QuotaIndex(plan).assign(np.asarray([2**40 * 1024 * 64]))


def test_quantised_weights_are_exact_and_end_at_one():
    assert quantise([0.7, 0.3]) == (0, round(Fraction(0.7) / (Fraction(0.7) + Fraction(0.3)) * QUANTUM), QUANTUM)
    assert quantise([1, 0, 1]) == (0, QUANTUM // 2, QUANTUM // 2, QUANTUM)
    assert quantise([0.1] * 10)[-1] == QUANTUM
    with pytest.raises(ValueError):
        quantise([0, 0])
    with pytest.raises(ValueError):
        quantise([1, -1, 2])
    plan = MixtureQuotas(lanes=2, block=8, seed=0, starts=(0,), prefixes=(quantise([1, 9]),))
    assert plan.min_weight_error() == (0, 0)  # 0.1 * 8 < 1
    assert MixtureQuotas(lanes=2, block=16, seed=0, starts=(0,), prefixes=(quantise([1, 9]),)).min_weight_error() is None


def test_zero_weight_components_get_nothing_and_others_continue():
    plan = MixtureQuotas(lanes=2, block=8, seed=3, starts=(0, 40, 80),
                   prefixes=(quantise([1, 0, 1]), quantise([0, 1, 1]), quantise([1, 1, 0])))
    comp, k = QuotaIndex(plan).assign(np.arange(120))
    assert not (comp[:40] == 1).any() and not (comp[40:80] == 0).any() and not (comp[80:] == 2).any()
    want_c, want_k = reference(plan, 120)
    assert np.array_equal(comp, want_c) and np.array_equal(k, want_k)
