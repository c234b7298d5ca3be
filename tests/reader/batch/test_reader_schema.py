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


@pytest.mark.parametrize("kw", [dict(layout="flat"), dict(packed=False), dict(), dict(eval_mode=True)])
def test_batch_spec_is_what_the_reader_returns(cache, kw):
    opts = ReadOptions(seq_len=9, batch_size=4, ideal_readers=2, **kw)
    with Reader(cache, opts) as rd:
        x = rd.batch(2)
    spec = schema.batch_spec(opts.layout, opts.seq_len, 4)
    assert [k for k, _, _ in spec] == list(x)
    assert list(x) == list(FLAT_KEYS if opts.layout == "flat" else BATCH_KEYS)
    for k, d, s in spec:
        assert x[k].dtype == d and x[k].shape == s, k


def test_every_field_is_defined_once():
    names = [f.name for f in schema.TOKEN_ARRAYS + schema.FLAT_ARRAYS + schema.ROW_ARRAYS]
    assert len(names) == len(set(names)) == len(schema.FIELDS)
    with pytest.raises(ValueError, match="layout"):
        schema.fields("columns")
