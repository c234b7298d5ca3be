"""Property tests for the growing-window shuffle (reader.order.shuffle, reader.order.ciphers)."""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from reader.order import ciphers
from reader.order import shuffle
from reader.order.shuffle import ShuffleConfig, shuffle_example_indices, shuffle_window_of, unshuffle_example_indices


@st.composite
def configs(draw):
    lanes = draw(st.integers(1, 5))
    first = draw(st.integers(1, 40))
    maxw = draw(st.integers(first, 300))
    block = draw(st.integers(1, 30))
    mix = draw(st.integers(1, 120))
    growth = draw(st.sampled_from([1.0, 1.3, 1.5, 2.0, 3.0]))
    seed = draw(st.integers(-(2**70), 2**70))
    return ShuffleConfig(seed=seed, first_window=first, growth=growth, max_window=maxw,
                         block_size=block, mix_size=mix, lanes=lanes)


def windows_upto(cfg, n, epoch_length=None):
    _, lo, hi = shuffle_window_of(np.arange(n), cfg, epoch_length=epoch_length)
    return sorted(set(zip(lo.tolist(), hi.tolist())))


@settings(max_examples=150, deadline=None)
@given(configs(), st.integers(1, 1500))
def test_bijection_on_every_window_infinite(cfg, n):
    i = np.arange(n)
    p = shuffle_example_indices(i, cfg)
    w, lo, hi = shuffle_window_of(i, cfg)
    # every index stays in its window and in its lane
    assert ((p >= lo) & (p < hi)).all()
    assert (p % cfg.lanes == i % cfg.lanes).all()
    # windows tile [0, inf): window k+1 starts where window k ends
    wins = windows_upto(cfg, n)
    assert wins[0][0] == 0 and all(a[1] == b[0] for a, b in zip(wins, wins[1:]))
    for a, b in wins:  # a bijection on each window (complete windows computed whole)
        q = shuffle_example_indices(np.arange(a, b), cfg)
        assert sorted(q.tolist()) == list(range(a, b))
    # the inverse undoes it
    assert (unshuffle_example_indices(p, cfg) == i).all()


@settings(max_examples=150, deadline=None)
@given(configs(), st.integers(0, 1500))
def test_bijection_with_finite_length_and_partial_last_window(cfg, n):
    i = np.arange(n)
    p = shuffle_example_indices(i, cfg, epoch_length=n)
    assert sorted(p.tolist()) == list(range(n))
    assert (p % cfg.lanes == i % cfg.lanes).all()
    if n:
        _, lo, hi = shuffle_window_of(i, cfg, epoch_length=n)
        assert ((p >= lo) & (p < hi)).all() and hi.max() == n
    assert (unshuffle_example_indices(p, cfg, epoch_length=n) == i).all()
    with pytest.raises(ValueError):
        shuffle_example_indices(np.array([n]), cfg, epoch_length=n)


@settings(max_examples=60, deadline=None)
@given(configs(), st.lists(st.integers(0, 10**12), min_size=1, max_size=30))
def test_vectorized_equals_scalar_and_any_shape(cfg, idx):
    arr = np.array(idx, dtype=np.int64)
    vec = shuffle_example_indices(arr, cfg)
    scal = [int(shuffle_example_indices(np.array([x]), cfg)[0]) for x in idx]
    assert vec.tolist() == scal
    # 0-d and 2-d inputs keep their shape
    assert int(shuffle_example_indices(np.int64(idx[0]), cfg)) == scal[0]
    if len(idx) % 2 == 0:
        assert shuffle_example_indices(arr.reshape(2, -1), cfg).reshape(-1).tolist() == scal


def test_window_sizes_grow_to_max_and_defaults_documented():
    cfg = ShuffleConfig(seed=0)
    assert (cfg.first_window, cfg.growth, cfg.max_window, cfg.block_size, cfg.mix_size, cfg.lanes) == (
        1024, 2.0, 1 << 22, 8192, 16384, 1)
    wins = windows_upto(ShuffleConfig(seed=0, first_window=10, growth=2.0, max_window=100), 1000)
    sizes = [b - a for a, b in wins]
    assert sizes[:5] == [10, 20, 40, 80, 100] and set(sizes[4:-1]) == {100}
    eras = windows_upto(ShuffleConfig(seed=0, first_window=64, growth=1.0, max_window=64), 640)
    assert [b - a for a, b in eras] == [64] * 10
    # lanes: windows are whole rows of `lanes` examples
    assert all(a % 4 == 0 for a, _ in windows_upto(ShuffleConfig(seed=0, first_window=10, lanes=4), 500))


def test_huge_indices_stay_exact():
    cfg = ShuffleConfig(seed=5, lanes=16)
    i = np.array([2**62 + 12345, 2**40 + 7, 10**15], dtype=np.int64)
    p = shuffle_example_indices(i, cfg)
    _, lo, hi = shuffle_window_of(i, cfg)
    assert ((p >= lo) & (p < hi)).all() and (unshuffle_example_indices(p, cfg) == i).all()


def test_bad_configs_are_rejected_with_a_message():
    for kw in ({"first_window": 0}, {"growth": 0.5}, {"first_window": 10, "max_window": 5},
               {"block_size": -1}, {"lanes": 0}, {"growth": float("nan")}):
        with pytest.raises(ValueError, match="ShuffleConfig"):
            ShuffleConfig(seed=1, **kw)
    with pytest.raises(ValueError, match="non-negative"):
        shuffle_example_indices(np.array([-1]), ShuffleConfig(seed=1))


def _order(cfg, n):
    return shuffle_example_indices(np.arange(n), cfg)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**64 - 1))
def test_different_seeds_give_different_orders(seed):
    base = dict(first_window=64, max_window=4096, block_size=32, mix_size=512)
    a = _order(ShuffleConfig(seed=seed, **base), 20000)
    b = _order(ShuffleConfig(seed=seed + 1, **base), 20000)
    _, lo, hi = shuffle_window_of(np.arange(20000), ShuffleConfig(seed=seed, **base))
    for s in np.unique(lo):  # every window (also the 64-example first one) is ordered differently
        m = lo == s
        assert (a[m] != b[m]).any()


def test_each_pass_over_the_data_gets_a_different_permutation():
    # With max-size windows tiling [0, inf), the k-th window of every later pass is a different
    # permutation of its (relative) positions: compare the pattern pi(i) - start across windows.
    cfg = ShuffleConfig(seed=9, first_window=1000, growth=1.0, max_window=1000, block_size=10, mix_size=100)
    p = _order(cfg, 5000).reshape(5, 1000) - (np.arange(5) * 1000)[:, None]
    assert len({tuple(row) for row in p.tolist()}) == 5
    # and a finite epoch_length changes only the clipped last window
    q = shuffle_example_indices(np.arange(4500), cfg, epoch_length=4500)
    assert (q[:4000] == _order(cfg, 4000)).all() and sorted(q[4000:].tolist()) == list(range(4000, 4500))


def test_io_structure_blocks_are_contiguous_and_mixes_bounded():
    # At max window: every mix of `mix_size` consecutive outputs draws from exactly
    # mix_size/block_size blocks of block_size contiguous examples, each block once and whole.
    cfg = ShuffleConfig(seed=2, first_window=4096, growth=1.0, max_window=4096, block_size=64, mix_size=512)
    p = _order(cfg, 4096 * 3)
    for g in range(0, p.size, 512):
        blocks = p[g:g + 512] // 64
        uniq, counts = np.unique(blocks, return_counts=True)
        assert uniq.size == 8 and (counts == 64).all()
        # rank-major interleave: the 8 consecutive outputs of a rank come from 8 different blocks
        assert all(np.unique(blocks[k:k + 8]).size == 8 for k in range(0, 512, 8))


def test_lanes_keep_streams_but_do_not_move_in_lockstep():
    cfg = ShuffleConfig(seed=4, first_window=256, growth=1.0, max_window=256, block_size=16, mix_size=64, lanes=4)
    p = _order(cfg, 1024).reshape(-1, 4)  # rows of 4 lanes
    assert (p % 4 == np.arange(4)).all()
    rows = p // 4
    assert not (rows == rows[:, :1]).all()


GOLDEN_CFG = dict(seed=12345, first_window=16, growth=2.0, max_window=256, block_size=8, mix_size=32, lanes=2)


def test_identical_across_processes_and_pinned():
    idx = [0, 1, 2, 15, 16, 17, 100, 1000, 10**6, 10**12]
    here = shuffle_example_indices(np.array(idx), ShuffleConfig(**GOLDEN_CFG)).tolist()
    code = ("import json, numpy as np; from reader.order.shuffle import ShuffleConfig, shuffle_example_indices; "
            f"print(json.dumps(shuffle_example_indices(np.array({idx}), ShuffleConfig(**{GOLDEN_CFG!r})).tolist()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "random", "PATH": "/usr/bin:/bin"}, cwd=".")
    assert json.loads(out.stdout) == here
    assert here == GOLDEN  # changing these values changes every shuffled cache order: a format change


GOLDEN = [8, 1, 12, 7, 42, 47, 76, 932, 999946, 1000000000124]


def test_for_reader_derives_sizes_from_how_the_reader_reads():
    cfg = ShuffleConfig.for_reader(7, seq_len=512, ideal_readers=16, batch_size=64, row_group_tokens=32768)
    assert cfg.lanes == 16 and cfg.seed == 7
    assert cfg.block_rows == 4 * 64  # 4 row groups of 64 examples per stream
    assert cfg.mix_blocks == 8 and cfg.max_window >= 4 * cfg.mix_size
    roomy = ShuffleConfig.for_reader(7, seq_len=512, ideal_readers=16, batch_size=256, row_group_tokens=8192)
    assert roomy.mix_blocks == 2 * (256 // 16)  # two consecutive batches use disjoint blocks
    # 1 Mi-token row groups: a group decodes whole row groups; kept under max_mix_bytes (512 MiB)
    big = ShuffleConfig.for_reader(7, seq_len=2048, ideal_readers=16, batch_size=256, row_group_tokens=1 << 20)
    rg_rows = (1 << 20) // 2048
    assert big.block_rows == rg_rows and big.mix_blocks == 2
    assert big.mix_blocks * (big.block_rows + rg_rows) * 2048 * 8 * 16 <= 1 << 29
    more = ShuffleConfig.for_reader(7, seq_len=2048, ideal_readers=16, batch_size=256, row_group_tokens=1 << 20,
                                    max_mix_bytes=1 << 32)
    assert more.mix_blocks > big.mix_blocks
    assert ShuffleConfig.for_reader(7, seq_len=8, ideal_readers=2, batch_size=4, max_window=99).max_window == 99


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**63), st.sampled_from([(4, 16), (2, 8), (8, 64)]), st.integers(0, 3))
def test_consecutive_batches_draw_from_disjoint_blocks(seed, lanes_batch, window):
    lanes, batch = lanes_batch
    cfg = ShuffleConfig.for_reader(seed, seq_len=64, ideal_readers=lanes, batch_size=batch,
                                   examples_per_row_group=4, first_window=4 * lanes * 64, max_window=64 * lanes * 64)
    _, lo, hi = shuffle_window_of(np.arange(10**6), cfg)
    starts = np.unique(lo)
    a, b = int(starts[window]), int(starts[window + 1])
    p = shuffle_example_indices(np.arange(a, b), cfg)
    block = (p // cfg.lanes - a // cfg.lanes) // (cfg.block_rows if b - a >= cfg.mix_size else
                                                  (b - a) // cfg.lanes // cfg.mix_blocks)
    lane = p % cfg.lanes
    for t in range(0, p.size - 2 * batch + 1, batch):  # batches t/batch and t/batch + 1 (aligned)
        key = block[t:t + 2 * batch] * cfg.lanes + lane[t:t + 2 * batch]
        assert np.unique(key).size == key.size  # no (lane, block) drawn twice in two batches


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 2**64 - 1))
def test_spread_is_a_stratified_bijection(n, key):
    x = np.arange(n)
    y = ciphers.spread(x, n, np.uint64(key))
    assert sorted(y.tolist()) == list(range(n))
    assert (ciphers.spread(y, n, np.uint64(key), inverse=True) == x).all()
    m = max(1, (n - 1).bit_length())
    if n == 1 << m and m >= 3:  # no cycle-walking: aligned runs of 2**j ranks hit distinct strata
        for j in (1, 2, 3):
            strata = (y >> (m - j)).reshape(-1, 1 << j)
            assert all(len(set(row)) == (1 << j) for row in strata.tolist())


def test_shuffle_quality_benchmark_quick_mode_measures_what_it_claims():
    from benchmarks import shuffle_quality

    res = shuffle_quality.run(quick=True, log=lambda *_: None)
    for name in shuffle_quality.ORDERS:
        for key in ("within_doc", "between_doc_steady", "displacement_mean", "entropy", "io_rg_amp", "io_chunk_amp"):
            assert f"{name}_{key}" in res
    assert res["none_within_doc"] == 1.0 and res["none_displacement_max"] == 0.0 and res["none_io_rg_amp"] == 1.0
    assert res["ours_io_rg_amp"] <= 1.5 < res["full_io_rg_amp"]  # streaming-like I/O, unlike a full shuffle
    assert res["ours_within_doc_steady"] < res["eras_within_doc_steady"] < res["none_within_doc_steady"]
    assert res["ours_between_doc_steady"] < res["none_between_doc_steady"] / 10
    assert 0 < res["ours_displacement_max"] < res["full_displacement_max"]
    assert res["ours_io_chunk_half_mix_budget_amp"] > 2 * res["ours_io_chunk_amp"]  # the documented cliff


def test_defaults_are_for_reader_of_the_pipeline_default_cache():
    d = ShuffleConfig(seed=3, lanes=16)
    f = ShuffleConfig.for_reader(3, seq_len=2048, ideal_readers=16, batch_size=64, row_group_tokens=1 << 20)
    assert d == f


@settings(max_examples=60, deadline=None)
@given(configs(), st.integers(1, 600))
def test_mix_sources_are_exactly_what_the_mix_reads(cfg, nrows):
    # mix_of_rows / mix_sources (used by the reader to release consumed row groups):
    # every output row lies in its mix; a mix's rows map onto exactly the listed source rows, in
    # every lane; and the mixes of a window read disjoint sources.
    rows = np.arange(nrows)
    win, glo, ghi = shuffle.mix_of_rows(rows, cfg)
    assert ((glo <= rows) & (rows < ghi)).all()
    wwin, wlo, whi = shuffle._row_windows(rows, cfg)
    assert np.array_equal(win, wwin) and (glo >= wlo).all() and (ghi <= whi).all()
    L = cfg.lanes
    for lane in sorted({0, L - 1}):
        src = shuffle_example_indices(rows * L + lane, cfg) // L
        seen: dict[int, set] = {}
        for g in np.unique(glo).tolist():
            in_mix = glo == g
            hi = int(ghi[in_mix][0])
            if hi > nrows:  # mix not wholly inside the sample
                continue
            rng = shuffle.mix_sources(g, lane, cfg)
            assert (np.diff(rng.reshape(-1)) > 0).all()  # sorted, merged, non-empty ranges
            want = np.concatenate([np.arange(a, z) for a, z in rng.tolist()])
            assert np.array_equal(np.sort(src[in_mix]), want)
            w = int(win[in_mix][0])
            assert not (seen.setdefault(w, set()) & set(want.tolist()))
            seen[w] |= set(want.tolist())
            # any row of the mix names the same mix; all lanes at once = lane by lane
            assert np.array_equal(shuffle.mix_sources(hi - 1, lane, cfg), rng)
            many = shuffle.mix_sources_of_lanes(g, range(L), cfg)
            assert np.array_equal(many[lane], rng)
            assert all(np.array_equal(m, shuffle.mix_sources(g, x, cfg)) for x, m in enumerate(many))


@settings(max_examples=80, deadline=None)
@given(configs(), st.integers(1, 700), st.integers(0, 3))
def test_passes_are_keyed_bijections_and_mix_sources_follow_the_cut(cfg, E, p):
    # the spans rule's shuffle (reader.order.passes): a bijection of [0, E) per pass, lanes kept, each pass
    # ordered by its own keys; mix_of_rows / mix_sources_of_lanes with epoch_length and passes list exactly
    # the sources of each mix (the last window cut at the longest lane's end, lanes one row shorter)
    k = np.arange(E)
    got = shuffle_example_indices(k, cfg, epoch_length=E, passes=p)
    assert sorted(got.tolist()) == list(range(E)) and (got % cfg.lanes == k % cfg.lanes).all()
    assert (unshuffle_example_indices(got, cfg, epoch_length=E, passes=p) == k).all()
    both = shuffle_example_indices(np.concatenate([k, k]), cfg, epoch_length=E, passes=np.repeat([p, p + 1], E))
    assert np.array_equal(both[:E], got)
    if E >= 64 * cfg.lanes and cfg.first_window >= 8 * cfg.lanes:  # (a few rows may well be permuted alike)
        assert not np.array_equal(both[E:], got)
    L = cfg.lanes
    P = -(-E // L)
    rows = np.arange(P)
    win, glo, ghi = shuffle.mix_of_rows(rows, cfg, epoch_length=E)
    assert ((glo <= rows) & (rows < ghi) & (ghi <= P)).all()
    for lane in sorted({0, L - 1, (E - 1) % L}):
        mine = rows[rows * L + lane < E]
        src = dict(zip(mine.tolist(), (got[mine * L + lane] // L).tolist()))
        seen: dict[int, set] = {}
        for g in np.unique(glo).tolist():
            in_mix = [t for t in mine.tolist() if glo[t] == g]
            rng = shuffle.mix_sources_of_lanes(g, [lane], cfg, epoch_length=E, passes=p)[0]
            want = np.concatenate([np.arange(a, z) for a, z in rng.tolist()]) if rng.size else np.zeros(0, int)
            assert sorted(src[t] for t in in_mix) == want.tolist()
            assert not (seen.setdefault(int(win[g]), set()) & set(want.tolist()))
            seen[int(win[g])] |= set(want.tolist())
            many = shuffle.mix_sources_of_lanes(g, range(L), cfg, epoch_length=E, passes=p)
            assert np.array_equal(many[lane], rng)
