"""The reader's promises with the growing-window shuffle on: reading during a build, the small
first window, per-host locality with lanes = R*, and seeds that change what is read."""

import os
import random
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from reader import CacheNotReady, EmptyStream, ReadOptions, Reader
from reader.format import spec as fmt
from reader.order import shuffle
from reader.order import streams
from reader.batch.release import ReleasePolicy

import cachegen

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "example_ids", "epochs", "valid")


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="cl-shuffle-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _chunks(seed, n, max_docs=5):
    rng = np.random.default_rng(seed)
    nxt, out = 1, []
    for _ in range(n):
        docs = []
        for _ in range(int(rng.integers(1, max_docs + 1))):
            k = int(rng.choice([1, 3, 8, 15, 40]))
            docs.append(np.arange(nxt, nxt + k, dtype=np.int32))
            nxt += k
        out.append(docs)
    return out


def _cfg(r_star, seed=11):
    return shuffle.ShuffleConfig(seed=seed, first_window=4 * r_star, growth=2.0, max_window=32 * r_star,
                               block_size=2 * r_star, mix_size=8 * r_star, lanes=r_star)


@pytest.mark.parametrize("packed,seed", [(True, 0), (False, 1)])
def test_shuffled_reading_during_build_equals_reading_after(tmp, packed, seed):
    chunks = _chunks(20 + seed, 12)
    cps = [5, 4, 3]
    opts = ReadOptions(seq_len=5, batch_size=4, packed=packed, ideal_readers=4, shuffle=_cfg(4, seed))
    got, want = cachegen.batches_during_and_after_build(tmp, chunks, cps, opts, 25, first=[0, 1], seed=seed)
    assert [b for b, _ in got] == [b for b, _ in want]
    for (_, x), (_, y) in zip(got, want):
        for k in KEYS:
            assert np.array_equal(x[k], y[k]), k


def test_first_window_is_readable_from_the_first_chunks_alone(tmp):
    """Training starts at once: window 0 (4 positions of each stream) lies in the first chunk of every
    stream, so its batches are served while only chunks 0..R*-1 exist; the next window needs more."""
    r_star, L, B = 2, 4, 4
    chunks = [[np.arange(100 * c + 1, 100 * c + 41, dtype=np.int32)] for c in range(6)]  # 10 examples each
    cfg = shuffle.ShuffleConfig(seed=3, first_window=8, growth=2.0, max_window=64, block_size=2, mix_size=4,
                              lanes=r_star)
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=r_star, shuffle=cfg)
    full = os.path.join(tmp, "full")
    cachegen.write_synthetic_cache(full, chunks, chunks_per_shard=[3, 3])
    part = os.path.join(tmp, "part")
    cachegen.write_synthetic_cache(part, chunks, chunks_per_shard=[3, 3], finished=False, written=[0, 1])
    with Reader(full, opts) as ref, Reader(part, opts, wait_timeout_s=0.3, poll_interval_s=0.05) as rd:
        for b in (0, 1):  # window 0 = examples [0, 8) = batches 0 and 1
            got, want = rd.batch(b), ref.batch(b)
            for k in KEYS:
                assert np.array_equal(got[k], want[k]), (b, k)
        # window 1 = rows 4..11 of each stream: rows 10, 11 lie in chunks 2 and 3, not written yet
        with pytest.raises(CacheNotReady):
            for b in range(2, 6):
                rd.batch(b)
        assert rd.store.opened <= {0, 1}


@pytest.mark.parametrize("r_star,R", [(4, 2), (4, 4), (2, 1), (8, 2)])
def test_each_host_reads_only_its_streams_with_shuffle(tmp, r_star, R):
    chunks = _chunks(5, 16)
    n = len(chunks)
    cachegen.write_synthetic_cache(tmp, chunks, chunks_per_shard=[8, 8], row_group_tokens=9)
    opts = ReadOptions(seq_len=3, batch_size=2 * r_star, ideal_readers=r_star, shuffle=_cfg(r_star))
    for r in range(R):
        with Reader(tmp, opts, num_readers=R, reader_index=r) as rd:
            epochs = [int(x["epochs"].max()) for _, x in rd.iter_batches(0, 12)]
            mine = streams.streams_of_reader(r_star, R, r)
            last = max(epochs) + 1
            allowed = {p % n for s in mine for p in range(s, (last + 1) * n, r_star)}
            assert rd.store.opened and rd.store.opened <= allowed, (r, sorted(rd.store.opened))


def test_seeds_change_the_batches_and_a_window_is_a_permutation_of_the_plain_examples(tmp):
    chunks = _chunks(9, 10)
    cachegen.write_synthetic_cache(tmp, chunks, chunks_per_shard=[5, 5], row_group_tokens=9)
    base = dict(seq_len=4, batch_size=8, ideal_readers=4)
    plain = Reader(tmp, ReadOptions(**base))
    a = Reader(tmp, ReadOptions(**base, shuffle=_cfg(4, seed=1)))
    b = Reader(tmp, ReadOptions(**base, shuffle=_cfg(4, seed=2)))
    try:
        # window 1 of _cfg(4) = examples [16, 48) = batches 2..5: same multiset of examples, new order
        rows = lambda rd: [tuple(t) for bb in range(2, 6) for t in rd.batch(bb)["targets"].tolist()]  # noqa: E731
        pa, pb, pp = rows(a), rows(b), rows(plain)
        assert sorted(pa) == sorted(pp) == sorted(pb)
        assert pa != pp and pa != pb
    finally:
        for rd in (plain, a, b):
            rd.close()


@st.composite
def shuffled_setups(draw):
    n = draw(st.integers(2, 9))
    seed = draw(st.integers(0, 10**6))
    chunks = _chunks(seed, n, max_docs=4)
    r_star = draw(st.sampled_from([1, 2, 4]))
    R = draw(st.sampled_from([d for d in (1, 2, 4, 8) if d % r_star == 0 or r_star % d == 0]))
    cfg = shuffle.ShuffleConfig(seed=draw(st.integers(0, 2**40)), first_window=draw(st.integers(1, 12)),
                              growth=draw(st.sampled_from([1.0, 1.5, 2.0])), max_window=draw(st.integers(12, 60)),
                              block_size=draw(st.integers(1, 6)), mix_size=draw(st.integers(1, 24)), lanes=r_star)
    return chunks, r_star, R, cfg, draw(st.booleans()), draw(st.integers(1, 6)), draw(st.integers(0, 40))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(shuffled_setups())
def test_R_invariance_and_seek_equals_iterate_with_shuffle(tmp, setup):
    chunks, r_star, R, cfg, packed, L, start = setup
    root = tempfile.mkdtemp(dir=tmp)
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=[len(chunks)], row_group_tokens=7)
    B = 2 * R
    opts = ReadOptions(seq_len=L, batch_size=B, packed=packed, ideal_readers=r_star, shuffle=cfg)
    with Reader(root, opts) as one:
        try:
            whole = {b: one.batch(b) for b in range(start, start + 3)}
        except EmptyStream:
            assume(False)  # a stream that never yields anything is a clear error, tested elsewhere
        for r in range(R):
            with Reader(root, opts, num_readers=R, reader_index=r) as rd:
                rows = streams.reader_rows(B, R, r)
                for b, got in rd.iter_batches(start, 3):  # seek to `start`, then iterate
                    for k in KEYS:
                        assert np.array_equal(got[k], whole[b][k][rows]), (r, b, k)
        # the same rows come back when asked for directly, in any order
        for b in range(start, start + 3):
            again = one.rows(b, np.arange(B)[::-1])
            for k in KEYS:
                assert np.array_equal(again[k], whole[b][k][::-1]), k


def _release_setup(tmp):
    chunks = cachegen.random_chunks(np.random.default_rng(21), 8, empty_prob=0.0, huge_prob=0.0,
                                    max_docs=80, max_len=40)
    cachegen.write_synthetic_cache(tmp, chunks, chunks_per_shard=[4, 4], row_group_tokens=16)
    # rows of 4 tokens; blocks of 8 rows (32 tokens: about two row groups), groups of 4 blocks, windows
    # of 4, 8, 16, 32 and then 64 rows (two mixes)
    cfg = shuffle.ShuffleConfig(seed=5, first_window=8, growth=2.0, max_window=128, block_size=16,
                              mix_size=64, lanes=2)
    return chunks, cfg


@pytest.mark.parametrize("layout,rule", [("flat", "streams"), ("arrays", "streams"), ("flat", "spans"),
                                         ("arrays", "spans")])
def test_a_shuffled_read_releases_the_mixes_it_has_passed(tmp, monkeypatch, layout, rule):
    """Once the reads pass a mix, the row groups inside its source blocks leave the cache (without
    releasing it keeps them all); nothing is decoded more often than without releasing, and the
    batches (also read again after the release) are the permuted plain examples."""
    _, cfg = _release_setup(tmp)
    B, N = 4, 126  # 2 rows of each stream per batch: 252 rows = windows 0..6, within one pass
    opts = ReadOptions(seq_len=4, batch_size=B, ideal_readers=2, shuffle=cfg, layout=layout, pass_rule=rule)
    with Reader(tmp, opts) as rd:
        E = rd.examples_per_pass
        if rule == "streams":
            assert 2 * N < min(int(rd.stream_index().pass_units([s])[0]) // 4 for s in range(2))  # one pass
        else:
            assert B * N < E  # one pass
        got = [rd.batch(b) for b in range(N)]
        st = rd.store
        released_decodes = st.decodes
        cached = len([k for k in st._lru if k[0] == "rg"])
        assert released_decodes >= 60
        assert cached < released_decodes / 3  # the cache holds the current window's mixes, not all
        again = [rd.batch(b) for b in (0, 7, 100)]  # released long ago: decoded again, same batches
        assert st.decodes > released_decodes
    monkeypatch.setattr(ReleasePolicy, "examples_read", lambda self, ex: None)
    with Reader(tmp, opts) as rd, Reader(tmp, ReadOptions(seq_len=4, batch_size=B, ideal_readers=2,
                                                           layout=layout, pass_rule=rule)) as plain:
        for b in range(N):
            want = rd.batch(b)
            for k in want:
                assert np.array_equal(got[b][k], want[k]), (b, k)
        assert rd.store.decodes == released_decodes  # releasing never made a row group decode twice
        assert len([k for k in rd.store._lru if k[0] == "rg"]) == released_decodes  # all kept, none released
        for b, x in zip((0, 7, 100), again):
            want = plain.examples(cachegen.shuffled_sources(rule, b * B + np.arange(B), cfg, E))
            for k in x:
                if k != "example_ids":
                    assert np.array_equal(x[k], want[k]), (b, k)


@pytest.mark.parametrize("rule", ["streams", "spans"])
def test_shuffled_prefetch_and_release_give_the_same_batches(tmp, rule):
    """With the background threads: iter_batches (prefetching, releasing) equals batch() one by one on a
    reader that never releases, and the release keeps up with the prefetch (also over the end of a pass
    of the spans rule, whose last window is cut there)."""
    _, cfg = _release_setup(tmp)
    opts = ReadOptions(seq_len=4, batch_size=4, ideal_readers=2, shuffle=cfg, layout="flat", pass_rule=rule)
    with Reader(tmp, opts) as rd, Reader(tmp, opts) as ref:
        ref.release.examples_read = lambda ex: None
        n, start = 0, 0
        if rule == "spans":  # from 150 batches before the end of pass 0 into pass 1
            start = max(0, rd.examples_per_pass // 4 - 150)
        for b, x in rd.iter_batches(start, 220):
            want = ref.batch(b)
            for k in want:
                assert np.array_equal(x[k], want[k]), (b, k)
            n += 1
        assert n == 220
        assert len([k for k in rd.store._lru if k[0] == "rg"]) < rd.store.decodes / 2
        assert len([k for k in ref.store._lru if k[0] == "rg"]) == ref.store.decodes


@pytest.mark.parametrize("rule", ["streams", "spans"])
def test_shuffled_prefetch_loads_exactly_the_row_groups_of_each_mix(tmp, rule):
    """The shuffled prefetch loads a mix's row groups when its first batch comes into view: the
    row groups its batches read, no more, no fewer."""
    _, cfg = _release_setup(tmp)
    B = 4
    opts = ReadOptions(seq_len=4, batch_size=B, ideal_readers=2, shuffle=cfg, pass_rule=rule)
    rows = np.arange(188)  # windows 0..6 (within one pass over the data)
    with Reader(tmp, opts) as rd:
        _, glo, ghi = rd.order.lanes().mixes(rows)
        assert rule == "streams" or rd.order.lanes().pass_rows > 188
    mixes = sorted(set(zip(glo.tolist(), ghi.tolist())))
    assert len(mixes) >= 8 and any(hi - lo == 32 for lo, hi in mixes)  # windows of two mixes too
    for lo, hi in mixes:
        first, last = lo * 2 // B, (hi * 2 - 1) // B
        with Reader(tmp, opts) as ref:
            for b in range(first, last + 1):
                ref.batch(b)
            want = {k for k in ref.store._lru if k[0] == "rg"}
        with Reader(tmp, opts) as rd:
            assert rd.prefetcher.whole_mixes
            for fut in rd.prefetcher.prefetch(first):
                fut.result()
            got = {k for k in rd.store._lru if k[0] == "rg"}
            assert got == want, (lo, hi)
            decodes = rd.store.decodes
            for b in range(first, last + 1):
                rd.batch(b)
            assert rd.store.decodes == decodes  # everything was there already
