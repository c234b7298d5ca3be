"""layout="flat": packed windows in seqax's flat-tokens encoding, and expand_flat back to the arrays."""

import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from reader import FLAT_KEYS, ReadOptions, Reader, expand_flat

import cachegen
from cache_strategies import caches, has_empty_stream


@pytest.fixture
def flat_tokens_example():
    """The flat-tokens format's worked example: the documents [[1, 2], [3, 4, 5], [6, 7, 8]] in one chunk."""
    d = tempfile.mkdtemp(prefix="cl-flat-")
    cachegen.write_synthetic_cache(d, [[[1, 2], [3, 4, 5], [6, 7, 8]]])
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_flat_tokens_example_encodes_as_that_format_says(flat_tokens_example):
    opts = ReadOptions(seq_len=8, batch_size=1, ideal_readers=1, eval_mode=True, layout="flat")
    with Reader(flat_tokens_example, opts) as rd:
        x = rd.batch(0)
    assert set(x) == set(FLAT_KEYS)
    # the flat-tokens format's example: encoded tokens [3, 4, 7, 8, 10, 13, 14, 16]; column 0 (no previous token) is 0
    assert x["tokens"].dtype == np.uint32 and x["tokens"].tolist() == [[0, 3, 4, 7, 8, 10, 13, 14, 16]]
    assert x["first_positions"].tolist() == [0] and x["num_tokens"].tolist() == [8]
    y = expand_flat(x)
    # ... and expands to that example's inputs and targets
    assert y["inputs"].tolist() == [[0, 1, 0, 3, 4, 0, 6, 7]]
    assert y["targets"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert y["segment_ids"].tolist() == [[1, 1, 2, 2, 2, 3, 3, 3]]
    assert y["positions"].tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]


def test_a_window_starting_inside_a_document_carries_the_previous_token(flat_tokens_example):
    opts = ReadOptions(seq_len=3, batch_size=3, ideal_readers=1, eval_mode=True, layout="flat")
    with Reader(flat_tokens_example, opts) as rd:
        x = rd.batch(0)
    # windows [1 2 3] [4 5 6] [7 8 pad]: the 2nd starts inside [3 4 5] (previous token 3, position 1)
    assert x["tokens"].tolist() == [[0, 3, 4, 7], [2 * 3, 8, 10, 13], [2 * 6, 14, 16, 0]]
    assert x["first_positions"].tolist() == [0, 1, 1]
    assert x["num_tokens"].tolist() == [3, 3, 2]
    y = expand_flat(x)
    assert y["inputs"].tolist() == [[0, 1, 0], [3, 4, 0], [6, 7, 0]]
    assert y["positions"].tolist() == [[0, 1, 0], [1, 2, 0], [1, 2, 0]]
    assert y["loss_mask"].tolist() == [[True] * 3, [True] * 3, [True, True, False]]


def test_flat_needs_packed_and_a_known_layout():
    with pytest.raises(ValueError, match="unpacked"):
        ReadOptions(packed=False, layout="flat")
    with pytest.raises(ValueError, match="layout must be one of"):
        ReadOptions(layout="dense")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=caches(), L=st.integers(1, 12), B=st.sampled_from([1, 2, 4, 6]), r_star=st.sampled_from([1, 2, 3, 4]),
       mode=st.sampled_from(["train", "shuffle", "eval"]), rgt=st.sampled_from([3, 7, 64]),
       start=st.integers(0, 30))
def test_expand_flat_equals_the_arrays_layout(data, L, B, r_star, mode, rgt, start):
    """Over random caches (row groups as small as 3 tokens, chunk and row-group boundaries inside windows,
    empty chunks, padding at the end of an eval pass, shuffling), ``expand_flat`` of every flat batch is
    the arrays batch, key for key and bit for bit; and iter_batches serves the same flat batches."""
    chunks, cps = data
    if mode != "eval" and has_empty_stream(chunks, r_star, True, L):
        return
    if mode == "eval" and sum(len(d) for c in chunks for d in c) == 0:
        return
    kw = dict(seq_len=L, batch_size=B, ideal_readers=r_star, eval_mode=mode == "eval",
              shuffle_seed=7 if mode == "shuffle" else None)
    d = tempfile.mkdtemp(prefix="cl-flat-")
    try:
        cachegen.write_synthetic_cache(d, chunks, chunks_per_shard=cps, row_group_tokens=rgt)
        with Reader(d, ReadOptions(**kw)) as ra, Reader(d, ReadOptions(**kw, layout="flat")) as rf:
            count = 6 if mode != "eval" else max(0, min(6, ra.num_batches - start))
            for b, fb in rf.iter_batches(start, count):
                ab = ra.batch(b)
                assert np.array_equal(fb["tokens"], rf.batch(b)["tokens"])
                got = expand_flat(fb)
                assert set(got) == set(ab)
                for k in ab:
                    assert got[k].dtype == ab[k].dtype, k
                    assert np.array_equal(got[k], ab[k]), (k, b)
                # the encoding itself: 2 * target + start bit, where a document starts
                starts = (ab["positions"] == 0) & ab["loss_mask"]
                want = np.where(ab["loss_mask"], 2 * ab["targets"].astype(np.int64) + starts, 0)
                assert np.array_equal(fb["tokens"][:, 1:], want)
                # column 0: the previous token of the same document, 0 when the window begins one
                assert np.array_equal(fb["tokens"][:, 0], 2 * ab["inputs"][:, 0].astype(np.int64))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_two_readers_rows_are_the_global_flat_batch():
    rng = np.random.default_rng(3)
    chunks = cachegen.random_chunks(rng, 9, max_docs=7, max_len=60)
    d = tempfile.mkdtemp(prefix="cl-flat-")
    try:
        cachegen.write_synthetic_cache(d, chunks, row_group_tokens=16)
        opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat", shuffle_seed=1)
        with Reader(d, opts) as g, Reader(d, opts, 2, 0) as r0, Reader(d, opts, 2, 1) as r1:
            for b in (0, 3, 50):
                whole = g.batch(b)
                for rd in (r0, r1):
                    part = rd.batch(b)
                    for k in FLAT_KEYS:
                        assert np.array_equal(part[k], whole[k][rd.my_rows]), (k, b)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_window_over_two_row_groups_that_begins_a_document():
    """Row groups [1 2 3][4 5] and [6 7 8 9]: the window [4 5 6] begins a document inside the first row
    group and ends in the second, so its previous-token slot is 0, not 2 * 3."""
    d = tempfile.mkdtemp(prefix="cl-flat-")
    try:
        cachegen.write_synthetic_cache(d, [[[1, 2, 3], [4, 5], [6, 7, 8, 9]]], row_group_tokens=5)
        opts = ReadOptions(seq_len=3, batch_size=3, ideal_readers=1, eval_mode=True, layout="flat")
        with Reader(d, opts) as rd:
            assert rd.store.meta(0).rg_token_starts.tolist() == [0, 5, 9]
            x = rd.batch(0)
        assert x["tokens"].tolist() == [[0, 3, 4, 6], [0, 9, 10, 13], [2 * 6, 14, 16, 18]]
        assert x["first_positions"].tolist() == [0, 0, 1]
    finally:
        shutil.rmtree(d, ignore_errors=True)
