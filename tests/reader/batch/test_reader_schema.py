"""reader.batch.schema: the one batch schema is what the reader returns, in every layout."""

import shutil
import tempfile

import numpy as np
import pytest

from reader import BATCH_KEYS, FLAT_KEYS, ReadOptions, Reader
from reader.batch import schema

import cachegen


@pytest.fixture(scope="module")
def cache():
    rng = np.random.default_rng(11)
    chunks = cachegen.random_chunks(rng, 14, max_docs=9, max_len=70)
    d = tempfile.mkdtemp(prefix="cl-schema-")
    cachegen.write_synthetic_cache(d, chunks, chunks_per_shard=[5, 5, 4], row_group_tokens=24)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("kw", [dict(layout="flat"), dict(packed=False), dict(), dict(eval_mode=True),
                                dict(packing="best_fit", layout="flat"), dict(packed=False, max_segments=3, varlen=True),
                                dict(packing="best_fit", layout="flat", best_fit_continuations=3, max_segments=5,
                                     varlen=True)])
def test_batch_spec_is_what_the_reader_returns(cache, kw):
    opts = ReadOptions(seq_len=9, batch_size=4, ideal_readers=2, **kw)
    with Reader(cache, opts) as rd:
        x = rd.batch(2)
        slots = rd.continuation_slots
    # (the synthetic cache is of format version 2: best fit's default is one continuation piece, no slots)
    assert slots == (opts.best_fit_continuations or 1) - 1
    spec = schema.batch_spec(opts.layout, opts.seq_len, 4, continuations=slots, segments=opts.varlen_segments)
    assert [k for k, _, _ in spec] == list(x)
    want = list(FLAT_KEYS if opts.layout == "flat" else BATCH_KEYS)
    if slots:
        want[3:3] = schema.CONTINUATION_FIELDS
    if opts.varlen:
        want[-4:-4] = schema.VARLEN_FIELDS
    assert list(x) == want
    for k, d, s in spec:
        assert x[k].dtype == d and x[k].shape == s, k
    if opts.varlen:
        assert x["cu_seqlens"].shape == (4, opts.max_segments + 1) and x["max_seqlen"].shape == (4,)
    if slots:
        assert x["continuation_columns"].shape == (4, slots)


def test_every_field_is_defined_once():
    names = [f.name for f in schema.TOKEN_ARRAYS + schema.FLAT_ARRAYS + schema.CONTINUATION_ARRAYS
             + schema.VARLEN_ARRAYS + schema.ROW_ARRAYS]
    assert len(names) == len(set(names)) == len(schema.FIELDS)
    with pytest.raises(ValueError, match="layout"):
        schema.fields("columns")
