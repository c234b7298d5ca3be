"""reader/batch/assemble.py's window runs against a brute-force definition (the whole read path is tested
through the Reader in test_reader_props.py, test_reader_layouts.py and test_reader_mixture.py)."""

import numpy as np
from hypothesis import given, settings, strategies as st

from reader.batch.assemble import window_runs

L = 4


def brute_runs(recs):
    """Maximal runs of consecutive windows (offset + L) of one row group, with their rows classified."""
    out, i = [], 0
    while i < len(recs):
        j = i + 1
        while j < len(recs) and recs[j][:2] == recs[i][:2] and recs[j][2] == recs[j - 1][2] + L:
            j += 1
        c, g, a, r = recs[i]
        rows = [x[3] for x in recs[i:j]]
        steps = {y - x for x, y in zip(rows, rows[1:])}
        if len(rows) == 1:
            out.append((c, g, a, r, 1))
        elif len(steps) == 1 and min(steps) > 0:
            out.append((c, g, a, ("slice", r, rows[-1] + 1, min(steps)), len(rows)))
        else:
            out.append((c, g, a, ("rows", *rows), len(rows)))
        i = j
    return out


def as_plain(runs):
    def rows(x):
        if isinstance(x, slice):
            return ("slice", x.start, x.stop, x.step)
        return x if isinstance(x, int) else ("rows", *np.asarray(x).tolist())
    return [(c, g, a, rows(r), k) for c, g, a, r, k in runs]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=40,
                unique=True), st.data())
def test_window_runs_equal_the_definition(windows, data):
    rows = data.draw(st.permutations(range(len(windows))))
    if data.draw(st.booleans()):  # rows in window order, equally spaced: a stream's windows of a batch
        step = data.draw(st.integers(1, 3))
        rows = [step * i for i in range(len(windows))]
    recs = [(c, g, m * L, r) for (c, g, m), r in zip(sorted(windows), rows)]
    got = window_runs(np.asarray(recs, dtype=np.int64), L)
    assert as_plain(got) == brute_runs(recs)
    assert all(isinstance(r, int) for *_, r, k in got if k == 1)
