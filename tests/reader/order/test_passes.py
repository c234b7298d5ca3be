"""The pass rules' arithmetic (reader.order.passes): every pass of the spans rule is a permutation of the
eval pass's rows, and the lane rows the release policy and the prefetcher follow name exactly the rows read."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from reader.order.passes import Spans, StreamLanes
from reader.order.shuffle import ShuffleConfig, shuffle_example_indices


def config(seed, lanes, small):
    if small:
        return ShuffleConfig(seed=seed, first_window=3, max_window=40, block_size=2, mix_size=6, lanes=lanes)
    return ShuffleConfig(seed=seed, lanes=lanes)


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 400), st.sampled_from([1, 2, 3, 4, 16, 64]), st.sampled_from([None, True, False]),
       st.integers(0, 5))
def test_every_pass_is_a_permutation_of_the_rows_in_contiguous_spans(E, r_star, shuffled, p):
    cfg = None if shuffled is None else config(p, r_star, shuffled)
    sp = Spans(E, r_star, cfg)
    starts = sp.span_start(np.arange(r_star + 1))
    assert starts[0] == 0 and starts[-1] == E
    sizes = np.diff(starts)
    assert sizes.tolist() == [len(x) for x in np.array_split(np.arange(E), r_star)]  # first E mod R* longer
    assert (sp.span_rows(np.arange(r_star)) == sizes).all()
    ex = p * E + np.arange(E)
    passes, s, j, row = sp.place(sp.sources(ex))
    assert (passes == p).all()
    assert sorted(row.tolist()) == list(range(E))
    assert ((j >= 0) & (j < sizes[s]) & (row == starts[s] + j)).all()
    if cfg is None:  # unshuffled: pass p's example k is span k mod R*, position k div R*
        k = np.arange(E)
        assert (s == k % r_star).all() and (j == k // r_star).all()


def test_tiny_data_fills_a_batch_from_the_next_passes():
    # 5 rows read with 16 spans: spans of one row or none; each pass serves the 5 rows once, in order
    sp = Spans(5, 16)
    p, s, j, row = sp.place(sp.sources(np.arange(16)))
    assert row.tolist() == [0, 1, 2, 3, 4] * 3 + [0] and p.tolist() == [0] * 5 + [1] * 5 + [2] * 5 + [3]
    assert (j == 0).all()
    # and shuffled: each lane holds one row of a pass, so there is nothing to permute
    cfg = ShuffleConfig(seed=1, lanes=16)
    assert Spans(5, 16, cfg).sources(np.arange(16)).tolist() == list(range(16))


def test_passes_are_shuffled_differently_and_the_sources_are_the_cipher_s():
    cfg = ShuffleConfig(seed=4, first_window=64, lanes=4)
    sp = Spans(1000, 4, cfg)
    src = sp.sources(np.arange(3000))
    a, b, c = (src[i * 1000:(i + 1) * 1000] - i * 1000 for i in range(3))
    assert not np.array_equal(a, b) and not np.array_equal(b, c)
    assert np.array_equal(b, shuffle_example_indices(np.arange(1000), cfg, epoch_length=1000, passes=1))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.sampled_from([1, 2, 3, 4, 8]), st.booleans(), st.integers(0, 3),
       st.sampled_from([1, 2, 4]))
def test_lane_rows_name_the_rows_each_mix_reads(E, r_star, small, p, R):
    # what the release policy and the prefetcher ask: an example's lane row lies in its mix and window, the
    # mix's sources in its lane hold the example's eval row, and reader r's lanes are those of its rows
    if r_star % R:
        R = 1
    cfg = config(7, r_star, small)
    sp = Spans(E, r_star, cfg)
    ex = p * E + np.arange(E)
    rows, lanes = sp.lane_rows(ex)
    _, _, _, evrow = sp.place(sp.sources(ex))
    _, mlo, mhi = sp.mixes(rows)
    assert ((mlo <= rows) & (rows < mhi)).all()
    assert ((rows // sp.pass_rows) == p).all()
    for i in range(0, E, max(1, E // 40)):
        t, lane = int(rows[i]), int(lanes[i])
        w_lo, w_hi = sp.shuffle_window(t)
        assert w_lo <= mlo[i] and mhi[i] <= w_hi and w_lo <= t < w_hi
        assert sp.shuffle_window_before(w_lo) <= w_lo
        got = []
        for a, z in sp.mix_sources(int(mlo[i]), [lane])[0].tolist():
            stream, r0, r1 = sp.stream_rows(lane, a, z)
            assert stream == 0
            got += range(r0, r1)
        assert evrow[i] in got
        assert lane in sp.reader_lanes(t, R, int(ex[i]) % R)


def test_stream_lanes_are_the_streams():
    cfg = ShuffleConfig(seed=0, first_window=8, lanes=4)
    sl = StreamLanes(cfg)
    rows, lanes = sl.lane_rows(np.arange(40))
    assert rows.tolist() == (np.arange(40) // 4).tolist() and lanes.tolist() == (np.arange(40) % 4).tolist()
    assert sl.stream_rows(3, 5, 9) == (3, 5, 9) and sl.reader_lanes(17, 2, 1) == [1, 3]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="rows >= 1"):
        Spans(0, 4)
    with pytest.raises(ValueError, match="lanes"):
        Spans(10, 4, ShuffleConfig(seed=0, lanes=2))


def test_the_worked_example_of_format_md():
    """docs/FORMAT.md, "Worked example: spans": E = 21 rows, R* = 16, B = 8."""
    sp = Spans(21, 16)
    assert sp.span_start(np.arange(17)).tolist() == [0, 2, 4, 6, 8] + list(range(10, 22))
    p, _, _, row = sp.place(sp.sources(np.arange(32)))
    assert row.reshape(4, 8).tolist() == [[0, 2, 4, 6, 8, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20],
                                          [1, 3, 5, 7, 9, 0, 2, 4], [6, 8, 10, 11, 12, 13, 14, 15]]
    assert p.tolist() == [0] * 21 + [1] * 11
    shuffled = Spans(21, 16, ShuffleConfig(seed=0, lanes=16))
    rest = list(range(10, 21))
    want = [[1, 3, 5, 7, 9] + rest + [0, 2, 4, 6, 8], [1, 3, 5, 6, 8] + rest + [0, 2, 4, 7, 9],
            [1, 2, 5, 6, 8] + rest + [0, 3, 4, 7, 9]]
    for q in range(3):
        assert shuffled.place(shuffled.sources(q * 21 + np.arange(21)))[3].tolist() == want[q]
