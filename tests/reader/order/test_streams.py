"""Property tests for reader.order.streams (and reader.order.pieces) against brute-force definitions from
Levanter's cache design."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from reader.order import streams
from reader.order import pieces


def brute_round_robin(counts):
    out, j = [], 0
    while any(n > j for n in counts):
        out += [(i, j) for i, n in enumerate(counts) if n > j]
        j += 1
    return out


@given(st.lists(st.integers(0, 6), max_size=7))
def test_round_robin_matches_definition(counts):
    assert [tuple(x) for x in streams.round_robin_order(counts).tolist()] == brute_round_robin(counts)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.data())
def test_known_prefix_is_prefix_of_final_order(counts, data):
    final = data.draw(st.lists(st.booleans(), min_size=len(counts), max_size=len(counts)))
    lower = [n if f else data.draw(st.integers(0, n)) for n, f in zip(counts, final)]
    prefix = [tuple(x) for x in streams.known_order_prefix(lower, final).tolist()]
    full = brute_round_robin(counts)
    assert prefix == full[: len(prefix)]
    if all(final):
        assert prefix == full


def brute_stream_units(counts, r_star, s, epochs):
    """(epoch, chunk, offset) of each unit of loop(all_chunks)[s::R*], for `epochs` passes."""
    n = len(counts)
    out = []
    for p in range(s, n * epochs, r_star):
        e, c = divmod(p, n)
        out += [(e, c, o) for o in range(counts[c])]
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=9), st.integers(1, 7), st.data())
def test_locate_matches_looped_stream(counts, r_star, data):
    s = data.draw(st.integers(0, r_star - 1))
    idx = streams.StreamIndex(counts, r_star, loop=True)
    epochs = 3 * r_star  # enough passes to cover several periods
    ref = brute_stream_units(counts, r_star, s, epochs)
    if not ref:
        with pytest.raises(streams.EmptyStream):
            idx.locate(s, 0)
        return
    js = np.arange(len(ref))
    e, c, o = idx.locate_many(s, js)
    assert list(zip(e.tolist(), c.tolist(), o.tolist())) == ref


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=9), st.integers(1, 7), st.data())
def test_single_pass_and_pieces(counts, r_star, data):
    s = data.draw(st.integers(0, r_star - 1))
    idx = streams.StreamIndex(counts, r_star, loop=False)
    ref = brute_stream_units(counts, r_star, s, 1)
    assert idx.stream_length(s) == len(ref)
    if ref:
        e, c, o = idx.locate_many(s, np.arange(len(ref)))
        assert list(zip(e.tolist(), c.tolist(), o.tolist())) == ref
    with pytest.raises(streams.EndOfStream):
        idx.locate(s, len(ref))
    # pieces cover exactly the units, in order, and stop at the end
    start = data.draw(st.integers(0, len(ref)))
    stop = data.draw(st.integers(start, len(ref) + 5))
    got = [(e, c, o) for e, c, lo, hi in idx.pieces(s, start, stop) for o in range(lo, hi)]
    assert got == ref[start:stop]


def test_incomplete_index_waits_past_known_prefix():
    idx = streams.StreamIndex([3, 2, 4], 2, loop=True, complete=False)
    assert idx.locate(0, 6) == streams.Location(0, 2, 3)  # chunks 0 and 2 are stream 0's epoch 0
    with pytest.raises(streams.NotYetAvailable):
        idx.locate(0, 7)


def test_huge_position_is_cheap():
    counts = np.random.default_rng(0).integers(0, 1000, size=100_000)
    idx = streams.StreamIndex(counts, 64)
    loc = idx.locate(5, 10**12)
    assert 0 <= loc.offset < counts[loc.chunk]
    assert loc.chunk % 64 == (5 - loc.epoch * len(counts)) % 64


@given(st.integers(1, 16), st.integers(1, 16), st.integers(0, 50))
def test_readers_partition_every_batch(r_star, num_readers, b):
    batch_size = num_readers * 3
    rows = [streams.reader_rows(batch_size, num_readers, r) for r in range(num_readers)]
    assert sorted(np.concatenate(rows).tolist()) == list(range(batch_size))
    mine = streams.streams_of_reader(r_star, num_readers, 0)
    if mine is not None:
        idx = streams.batch_example_indices(b, batch_size)[rows[0]]
        assert set(streams.stream_position(idx, r_star)[0].tolist()) <= set(mine)


def test_unpacked_pieces():
    lengths = np.array([5, 1, 9])
    assert pieces.pieces_per_doc(lengths, 4).tolist() == [2, 1, 3]
    doc, lo, hi = pieces.unpacked_locate_in_chunk(lengths, 4, np.arange(6))
    assert list(zip(doc.tolist(), lo.tolist(), hi.tolist())) == [
        (0, 0, 4), (0, 4, 5), (1, 0, 1), (2, 0, 4), (2, 4, 8), (2, 8, 9)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=12), st.integers(1, 9), st.booleans(), st.booleans(),
       st.data())
def test_locate_streams_equals_locate_many_per_stream(counts, r_star, loop, complete, data):
    idx = streams.StreamIndex(counts, r_star, loop=loop, complete=complete)
    n = data.draw(st.integers(0, 30))
    s = np.asarray(data.draw(st.lists(st.integers(0, r_star - 1), min_size=n, max_size=n)), np.int64)
    j = np.asarray(data.draw(st.lists(st.integers(0, 200), min_size=n, max_size=n)), np.int64)

    def per_stream():
        e, c, o = (np.zeros(n, np.int64) for _ in range(3))
        for x in np.unique(s):
            m = s == x
            e[m], c[m], o[m] = idx.locate_many(int(x), j[m])
        return e, c, o

    try:
        want = per_stream()
    except (streams.EmptyStream, streams.EndOfStream, streams.NotYetAvailable) as err:
        with pytest.raises(type(err)):
            idx.locate_streams(s, j)
        return
    got = idx.locate_streams(s, j)
    for a, b in zip(got, want):
        assert np.array_equal(a, b)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1, max_size=4), st.integers(1, 9),
       st.data())
def test_stacked_streams_equal_each_index_alone(per_index, r_star, data):
    """Several indexes (different chunk counts, periods, empty chunks) located in one call: each row's
    answer is its own index's locate_streams, and the units left in its chunk are that chunk's count
    from the offset on. Indexes that one call cannot answer (an empty stream) are refused."""
    idxs = [streams.StreamIndex(c, r_star) for c in per_index]
    st_ = streams.StackedStreams.of(idxs)
    if any(int(i.epoch_table()[:, -1].min()) == 0 for i in idxs):
        assert st_ is None
        return
    n = data.draw(st.integers(0, 40))
    comps = np.asarray(data.draw(st.lists(st.integers(0, len(idxs) - 1), min_size=n, max_size=n)), np.int64)
    s = np.asarray(data.draw(st.lists(st.integers(0, r_star - 1), min_size=n, max_size=n)), np.int64)
    j = np.asarray(data.draw(st.lists(st.integers(0, 500), min_size=n, max_size=n)), np.int64)
    e, c, o, avail = st_.locate(comps, s, j)
    for k in range(n):
        idx = idxs[comps[k]]
        want = idx.locate_streams(s[k:k + 1], j[k:k + 1])
        assert (e[k], c[k], o[k]) == tuple(int(w[0]) for w in want), k
        assert avail[k] == idx.counts[c[k]] - o[k] > 0


def test_stacked_streams_need_finished_looping_indexes_with_one_r_star():
    loop = streams.StreamIndex([3, 4, 5], 2)
    assert streams.StackedStreams.of([loop, streams.StreamIndex([1, 2], 2)]) is not None
    for other in (streams.StreamIndex([1, 2], 3), streams.StreamIndex([1, 2], 2, loop=False),
                  streams.StreamIndex([1, 2], 2, complete=False)):
        assert streams.StackedStreams.of([loop, other]) is None
