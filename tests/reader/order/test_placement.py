"""Example placement (reader/order/placement.py) as a pure module: unpacked examples against the plain rule
(a document of n tokens is pieces of L from token 0), best-fit rows cut out of their windows against the
O(n^2) reference packing, and the counts that disagree with the documents."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reader.order import placement
from reader.order.packing import count_best_fit_windows

from packing_ref import reference_chunk_best_fit


def starts_of(lengths):
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30), st.sampled_from([1, 3, 8, 16]), st.randoms())
def test_unpacked_examples_are_documents_cut_every_seq_len(lengths, L, rnd):
    lengths = np.asarray(lengths, np.int64)
    starts = starts_of(lengths)
    want = [(int(starts[d]) + s, s, min(L, int(n) - s)) for d, n in enumerate(lengths) for s in range(0, int(n), L)]
    cum = placement.pieces_cum(lengths, L, len(want))
    offsets = np.asarray(rnd.sample(range(len(want)), len(want)), np.int64)  # any order
    got = placement.locate(cum, lengths, starts[:-1], offsets, L)
    assert list(zip(*(a.tolist() for a in got))) == [want[o] for o in offsets.tolist()]


def test_a_dropped_document_yields_no_example_but_keeps_its_tokens_place():
    lengths = np.asarray([3, 9, 2], np.int64)  # L = 4, drop_long: the 9 is read as empty
    seen = np.where(lengths > 4, 0, lengths)
    cum = placement.pieces_cum(seen, 4)
    got = placement.locate(cum, lengths, starts_of(lengths)[:-1], np.arange(2), 4)
    assert [a.tolist() for a in got] == [[0, 12], [0, 0], [3, 2]]


@st.composite
def chunks(draw):
    L = draw(st.sampled_from([2, 5, 8, 16]))
    lengths = draw(st.lists(st.integers(0, 3 * L + 1), min_size=1, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(lengths)), max_size=6)))
    rg_docs = np.diff([0, *cuts, len(lengths)])
    caps = draw(st.sampled_from([{}, {"continuations": 2}, {"continuations": None, "max_segments": 2},
                                 {"continuations": 1, "max_segments": 3}]))
    return lengths, rg_docs, L, draw(st.integers(1, 4 * L + 40)), caps


def windows_rows(lengths, rg_docs, L, W, caps):
    """Every window's rows, placed from its own documents as a reader gets them (doc_starts in the chunk)."""
    lengths = np.asarray(lengths, np.int64)
    doc_bounds, starts = starts_of(rg_docs), starts_of(lengths)
    per = count_best_fit_windows(lengths, rg_docs, L, W, **caps)
    bounds, first = placement.windows(np.diff(starts[doc_bounds]), W, per)
    got = {}
    for w in range(bounds.size - 1):
        a, b = int(doc_bounds[bounds[w]]), int(doc_bounds[bounds[w + 1]])
        got[w] = placement.window_rows(lengths[a:b], starts[a:b + 1], L, first, w, **caps)
    return first, got


@settings(max_examples=300, deadline=None)
@given(chunks(), st.randoms())
def test_best_fit_rows_are_the_reference_packings_pieces(case, rnd):
    lengths, rg_docs, L, W, caps = case
    ref = reference_chunk_best_fit(lengths, rg_docs.tolist(), L, W, **caps)
    starts = starts_of(lengths)
    # per row: (token offset in the chunk, position in its document, tokens, column), pieces in row order
    want = [[(int(starts[d]) + s, s, m, c)
             for (d, s, m), c in zip(row, itertools.accumulate([0] + [m for *_, m in row]))] for row in ref]
    first, got = windows_rows(lengths, rg_docs, L, W, caps)
    assert int(first[-1]) == len(ref)
    n = len(ref)
    lo = rnd.randrange(n + 1)
    for offsets in (list(range(n)), list(range(lo, rnd.randrange(lo, n + 1))),  # consecutive: slices
                    [rnd.randrange(n) for _ in range(rnd.randrange(12))] if n else []):  # any rows, repeats
        offsets = np.asarray(offsets, np.int64)
        asked = []
        pc = placement.rows(first, offsets, lambda w: asked.append(w) or got[w])
        # only the windows the rows lie in are asked for (a window asked for is decoded)
        assert set(asked) == {int(np.searchsorted(first, o, side="right")) - 1 for o in offsets.tolist()}
        rows = [list(zip(*(a[pc.ptr[k]:pc.ptr[k + 1]].tolist() for a in (pc.starts, pc.first_positions, pc.lengths,
                                                                          pc.columns))))
                for k in range(offsets.size)]
        assert rows == [want[o] for o in offsets.tolist()]


def test_counts_that_disagree_with_the_documents_say_what_each_makes():
    lengths = np.asarray([5, 3], np.int64)
    with pytest.raises(placement.Disagrees,
                       match="its documents make 3 unpacked examples of 4 tokens, the index says 2"):
        placement.pieces_cum(lengths, 4, 2)
    with pytest.raises(placement.Disagrees,
                       match="its row groups make 1 packing windows of 10 tokens, the index lists 2"):
        placement.windows([5, 3], 10, np.asarray([1, 1]))
    _, first = placement.windows([5, 3], 10, np.asarray([1]))
    with pytest.raises(placement.Disagrees, match="its packing window 0 pack into 2 rows of 4, the index says 1"):
        placement.window_rows(lengths, starts_of(lengths), 4, first, 0)
