"""Best-fit-decreasing packing (reader/order/packing.py) against a plain O(n^2) reference, its invariants, a
chunk's packing windows and their composition, concat packing, and the padding / cut figures."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reader.order.packing import (
    PackedRows,
    best_fit_chunk_rows,
    best_fit_rows,
    concat_rows,
    count_best_fit_rows,
    count_best_fit_windows,
    packing_figures,
    window_bounds,
    window_docs,
)

from packing_ref import reference_best_fit, reference_chunk_best_fit, reference_windows


def as_lists(rows: PackedRows):
    return [
        [(int(d), int(s), int(n)) for d, s, n in zip(rows.doc[a:b], rows.start[a:b], rows.length[a:b])]
        for a, b in zip(rows.row_ptr[:-1], rows.row_ptr[1:])
    ]


@st.composite
def lengths_and_seq_len(draw):
    L = draw(st.sampled_from([1, 2, 3, 5, 8, 10, 16, 64, 1000]))
    # A few distinct values make ties (equal remainders, equal capacities) common.
    pool = draw(st.lists(st.integers(0, 3 * L + 1), min_size=1, max_size=4))
    value = st.one_of(st.sampled_from(pool), st.integers(0, 3 * L + 1), st.sampled_from([0, L, 2 * L, L - 1]))
    return draw(st.lists(value, max_size=60)), L


@settings(max_examples=400, deadline=None)
@given(lengths_and_seq_len())
def test_best_fit_equals_reference(case):
    lengths, L = case
    rows = best_fit_rows(lengths, L)
    assert as_lists(rows) == reference_best_fit(lengths, L)
    assert count_best_fit_rows(lengths, L) == rows.num_rows


@settings(max_examples=300, deadline=None)
@given(lengths_and_seq_len())
def test_best_fit_invariants(case):
    lengths, L = case
    rows = best_fit_rows(lengths, L)
    assert rows.row_ptr.dtype == np.int64 and rows.start.dtype == np.int64
    assert rows.doc.dtype == np.int32 and rows.length.dtype == np.int32
    assert rows.row_ptr[0] == 0 and rows.row_ptr[-1] == len(rows.doc)
    assert np.all(np.diff(rows.row_ptr) > 0)  # no empty row
    assert np.all(rows.length >= 1)
    # Each document is covered exactly, by its pieces at 0, L, 2L, ...; a document <= L stays whole.
    pieces = sorted(zip(rows.doc.tolist(), rows.start.tolist(), rows.length.tolist()))
    expected = [(d, s, min(L, n - s)) for d, n in enumerate(lengths) for s in range(0, n, L)]
    assert pieces == expected
    firsts = []
    for row in as_lists(rows):
        assert sum(n for _, _, n in row) <= L
        # at most one continuation piece, first; then document starts in document order
        assert all(s == 0 for _, s, _ in row[1:])
        assert row[1:] == sorted(row[1:])
        assert len(row) == 1 or all(n < L for _, _, n in row)  # full pieces are alone
        firsts.append(min(p[:2] for p in row))
    assert firsts == sorted(firsts)  # rows ordered by their earliest piece


CAPS = st.tuples(st.sampled_from([1, 2, 3, 4, None]), st.sampled_from([None, None, 1, 2, 3, 5]))


@settings(max_examples=400, deadline=None)
@given(lengths_and_seq_len(), CAPS)
def test_capped_best_fit_equals_reference(case, caps):
    lengths, L = case
    C, M = caps
    rows = best_fit_rows(lengths, L, continuations=C, max_segments=M)
    assert as_lists(rows) == reference_best_fit(lengths, L, C, M)
    assert count_best_fit_rows(lengths, L, continuations=C, max_segments=M) == rows.num_rows
    for row in as_lists(rows):
        conts = [s > 0 for _, s, _ in row]
        assert C is None or sum(conts) <= C
        assert M is None or len(row) <= M
        assert conts == sorted(conts, reverse=True)  # its continuation pieces first
        assert sum(n for _, _, n in row) <= L
    # the caps never cut a document: pieces at 0, L, 2L, ... as without them
    pieces = sorted(zip(rows.doc.tolist(), rows.start.tolist(), rows.length.tolist()))
    assert pieces == [(d, s, min(L, n - s)) for d, n in enumerate(lengths) for s in range(0, n, L)]


@pytest.mark.parametrize("caps", [(2, None), (4, None), (None, None), (4, 3), (1, 2)])
def test_random_capped_chunks_match_reference(caps):
    rng = np.random.default_rng(sum(c or 0 for c in caps))
    for _ in range(60):
        L = int(rng.choice([16, 64]))
        lengths = rng.integers(0, 4 * L, rng.integers(30, 120)).tolist()
        assert as_lists(best_fit_rows(lengths, L, continuations=caps[0], max_segments=caps[1])) == \
            reference_best_fit(lengths, L, *caps)


def test_continuation_pieces_share_rows():
    # L = 10, lengths [13, 14, 2]: with one continuation piece per row the 3 and the 4 take a row each (the
    # 2 joins the 4); with two they share one, and the 2 goes with them (capacity 3 left)
    assert as_lists(best_fit_rows([13, 14, 2], 10, continuations=2)) == [
        [(0, 0, 10)], [(0, 10, 3), (1, 10, 4), (2, 0, 2)], [(1, 0, 10)]]
    # four tails of 2 with three per row: the fourth opens a row of its own
    assert as_lists(best_fit_rows([12] * 4, 10, continuations=3)) == [
        [(0, 0, 10)], [(0, 10, 2), (1, 10, 2), (2, 10, 2)], [(1, 0, 10)], [(2, 0, 10)], [(3, 0, 10)], [(3, 10, 2)]]
    # max_segments caps every piece: [3 3 3 1] in L = 10 is one row, or [3 3] [3 1] with two per row
    assert as_lists(best_fit_rows([3, 3, 3, 1], 10)) == [[(0, 0, 3), (1, 0, 3), (2, 0, 3), (3, 0, 1)]]
    assert as_lists(best_fit_rows([3, 3, 3, 1], 10, max_segments=2)) == [[(0, 0, 3), (1, 0, 3)], [(2, 0, 3), (3, 0, 1)]]
    with pytest.raises(ValueError, match="max_segments must be None or an integer >= 1"):
        best_fit_rows([1], 4, max_segments=0)
    with pytest.raises(ValueError, match="continuations must be None or an integer >= 1"):
        count_best_fit_rows([1], 4, continuations=0)


@pytest.mark.parametrize("L", [16, 64, 1000])
def test_random_chunks_match_reference(L):
    # Longer chunks than Hypothesis tends to draw: rows reach a capacity out of creation order here
    # (a FIFO per capacity differs from the rule on about a third of these).
    rng = np.random.default_rng(L)
    for _ in range(100):
        lengths = rng.integers(0, rng.choice([L, 3 * L]) + 1, rng.integers(30, 120)).tolist()
        assert as_lists(best_fit_rows(lengths, L)) == reference_best_fit(lengths, L)


def test_fifo_per_capacity_is_not_enough():
    # Row 1 (5, then 4) reaches capacity 1 before row 0 (7, then 2); the last 1 still goes to row 0.
    rows = best_fit_rows([7, 5, 4, 2, 1], 10)
    assert as_lists(rows) == [[(0, 0, 7), (3, 0, 2), (4, 0, 1)], [(1, 0, 5), (2, 0, 4)]]


def test_one_continuation_piece_per_row_and_first():
    # The 3 (document 0's tail) may not join the 4 (document 1's tail): it opens a row of its own, and the
    # 2 goes to the fuller of the two.
    rows = best_fit_rows([13, 14, 2], 10)
    assert as_lists(rows) == [[(0, 0, 10)], [(0, 10, 3)], [(1, 0, 10)], [(1, 10, 4), (2, 0, 2)]]
    # A continuation piece leads its row even when the row's other pieces come earlier in the chunk; the
    # row is ordered by its earliest piece, (0, 0).
    assert as_lists(best_fit_rows([4, 15], 10)) == [[(1, 10, 5), (0, 0, 4)], [(1, 0, 10)]]


def test_worked_example_of_the_docs():
    rows = best_fit_rows([0, 25, 3, 10, 0, 8, 2], 10)
    assert rows.row_ptr.tolist() == [0, 1, 2, 4, 5, 7]
    assert as_lists(rows) == [
        [(1, 0, 10)],
        [(1, 10, 10)],
        [(1, 20, 5), (2, 0, 3)],
        [(3, 0, 10)],
        [(5, 0, 8), (6, 0, 2)],
    ]


def test_large_seq_len_and_many_pieces_match_reference():
    # Capacities spread over many bitmap words (L = 2**17), and enough rows for the heaps to matter.
    rng = np.random.default_rng(7)
    L = 1 << 17
    lengths = np.minimum(rng.lognormal(np.log(30_000), 1.2, 300).astype(np.int64), 5 * L)
    lengths[::17] = L  # whole rows
    lengths[::23] = 0
    assert as_lists(best_fit_rows(lengths, L)) == reference_best_fit(lengths.tolist(), L)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 40)), max_size=30), st.integers(1, 60))
def test_windows_follow_the_rule(row_group_tokens, W):
    got = window_bounds(row_group_tokens, W)
    assert got.dtype == np.int64 and got.tolist() == reference_windows(row_group_tokens, W)
    assert np.all(np.diff(got) > 0)  # whole row groups, none empty


def test_windows_by_hand():
    # T = 100, W = 25: n = 4, runs end at the first row-group end at or after 25, 50, 75 tokens
    assert window_bounds([10] * 10, 25).tolist() == [0, 3, 5, 8, 10]
    assert window_bounds([10] * 10, 100).tolist() == [0, 10]
    assert window_bounds([10] * 10, 10**9).tolist() == [0, 10]  # n = max(1, round(T/W)) = 1
    # T/W = 1.5 rounds up (n = 2: the first run ends at the first row-group end at or after 7.5), 1.4 down
    assert window_bounds([5, 5, 5], 10).tolist() == [0, 2, 3]
    assert window_bounds([7, 7], 10).tolist() == [0, 2]
    # a row group longer than a window: the runs that end inside it are empty and left out
    assert window_bounds([1, 50, 1], 10).tolist() == [0, 2, 3]
    assert window_bounds([], 10).tolist() == [0] and window_bounds([0, 0], 10).tolist() == [0, 2]
    # (i+1)·T in exact integers: no overflow with many tokens and tiny windows
    assert window_bounds([2**40, 2**40], 1).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="window_tokens"):
        window_bounds([1], 0)


@st.composite
def chunks_with_row_groups(draw):
    lengths, L = draw(lengths_and_seq_len())
    cuts = sorted(draw(st.lists(st.integers(0, len(lengths)), max_size=8)))
    rg_docs = np.diff([0, *cuts, len(lengths)]).tolist() if lengths else draw(st.sampled_from([[], [0]]))
    return lengths, rg_docs, L, draw(st.integers(1, 4 * L + 40))


@settings(max_examples=400, deadline=None)
@given(chunks_with_row_groups())
def test_a_chunks_rows_are_its_windows_rows_in_order(case):
    lengths, rg_docs, L, W = case
    rows = best_fit_chunk_rows(lengths, rg_docs, L, W)
    want = reference_chunk_best_fit(lengths, rg_docs, L, W)
    assert as_lists(rows) == want
    counts = count_best_fit_windows(lengths, rg_docs, L, W)
    assert int(counts.sum()) == rows.num_rows
    # each window's rows are exactly the reference's for that window's documents, and hold only them
    docs = window_docs(lengths, rg_docs, W)
    assert docs.size == counts.size + 1
    first = 0
    for a, b, k in zip(docs[:-1].tolist(), docs[1:].tolist(), counts.tolist()):
        mine = as_lists(rows)[first:first + k]
        assert [[(d - a, s, m) for d, s, m in row] for row in mine] == reference_best_fit(lengths[a:b], L)
        assert all(a <= d < b for row in mine for d, _, _ in row)
        first += k


def test_windows_of_a_chunk_by_hand():
    # L = 10, row groups [8] [7] [2 3]: T = 20, W = 10 -> n = 2, the first run ends at the first row-group end
    # at or after 10 tokens (15): windows [8 7] and [2 3], packed apart
    lengths, rg_docs = [8, 7, 2, 3], [1, 1, 2]
    assert window_docs(lengths, rg_docs, 10).tolist() == [0, 2, 4]
    assert as_lists(best_fit_chunk_rows(lengths, rg_docs, 10, 10)) == [
        [(0, 0, 8)], [(1, 0, 7)], [(2, 0, 2), (3, 0, 3)]]
    assert count_best_fit_windows(lengths, rg_docs, 10, 10).tolist() == [2, 1]
    # one window (W = 20 or more): the whole chunk packed together, 8 + 2 and 7 + 3
    assert as_lists(best_fit_chunk_rows(lengths, rg_docs, 10, 20)) == [[(0, 0, 8), (2, 0, 2)], [(1, 0, 7), (3, 0, 3)]]
    assert count_best_fit_windows(lengths, rg_docs, 10, 20).tolist() == [2]
    with pytest.raises(ValueError, match="add up to the 4 documents"):
        window_docs(lengths, [1, 1], 10)


@pytest.mark.parametrize(
    "lengths, L, message",
    [
        ([1, -2], 4, "must be >= 0"),
        ([1.5], 4, "integer array"),
        ([[1]], 4, "1-D"),
        ([1], 0, "seq_len"),
        ([1], 2.0, "seq_len"),
    ],
)
def test_bad_input_is_a_clear_error(lengths, L, message):
    with pytest.raises(ValueError, match=message):
        best_fit_rows(lengths, L)


def reference_concat(lengths, L):
    """Token by token: tag each token (doc, position), cut into windows, merge runs of one document."""
    tokens = [(d, i) for d, n in enumerate(lengths) for i in range(n)]
    out = []
    for w in range(0, len(tokens), L):
        row = []
        for d, i in tokens[w : w + L]:
            if row and row[-1][0] == d:
                row[-1] = (d, row[-1][1], row[-1][2] + 1)
            else:
                row.append((d, i, 1))
        out.append(row)
    return out


@settings(max_examples=200, deadline=None)
@given(lengths_and_seq_len())
def test_concat_equals_token_by_token_reference(case):
    lengths, L = case
    if sum(lengths) > 5000:
        lengths = lengths[:5]
    assert as_lists(concat_rows(lengths, L)) == reference_concat(lengths, L)


def test_figures_by_hand():
    lengths = [0, 25, 3, 10, 0, 8, 2]  # 48 tokens, 5 documents with tokens
    # Best fit, L = 10: rows 10 | 10 | 5+3 | 10 | 8+2; only document 1 is cut, its pieces at 10 and 20.
    bf = packing_figures(best_fit_rows(lengths, 10), lengths, 10)
    assert (bf.rows, bf.tokens, bf.documents) == (5, 48, 5)
    assert bf.padding_fraction == pytest.approx(2 / 50)
    assert bf.cut_document_fraction == pytest.approx(1 / 5)
    assert bf.cut_token_fraction == pytest.approx(15 / 48)
    # Concat, L = 10: d1[0:10] | d1[10:20] | d1[20:25] d2 d3[0:2] | d3[2:10] d5[0:2] | d5[2:8] d6 (8 tokens).
    # Cut: d1 (pieces at 10, 20: 15 tokens), d3 (at 2: 8 tokens), d5 (at 2: 6 tokens).
    cc = packing_figures(concat_rows(lengths, 10), lengths, 10)
    assert (cc.rows, cc.tokens, cc.documents) == (5, 48, 5)
    assert cc.padding_fraction == pytest.approx(2 / 50)
    assert cc.cut_document_fraction == pytest.approx(3 / 5)
    assert cc.cut_token_fraction == pytest.approx(29 / 48)
    # Best fit with L = 4 on [3, 3, 2]: rows 3 | 3 | 2 (no two fit together: 3 + 2 > 4), 4 padding of 12.
    small = packing_figures(best_fit_rows([3, 3, 2], 4), [3, 3, 2], 4)
    assert (small.rows, small.padding_fraction, small.cut_document_fraction) == (3, pytest.approx(4 / 12), 0.0)
    # Concat of the same: 3 + 1 | 2 + 2 (8 tokens, no padding); document 1 is cut at token 1 (2 tokens).
    small_cc = packing_figures(concat_rows([3, 3, 2], 4), [3, 3, 2], 4)
    assert (small_cc.rows, small_cc.padding_fraction) == (2, 0.0)
    assert small_cc.cut_document_fraction == pytest.approx(1 / 3)
    assert small_cc.cut_token_fraction == pytest.approx(2 / 8)
    empty = packing_figures(best_fit_rows([0, 0], 4), [0, 0], 4)
    assert empty == (0, 0, 0, 0.0, 0.0, 0.0)
