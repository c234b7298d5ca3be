"""reader.storage.pages: the PLAIN page fast path decodes exactly what pyarrow decodes, or steps aside."""

import os
import shutil
import tempfile

import numpy as np
import pytest

from reader import ReadOptions, Reader
from reader.storage.pages import fast_plain_values

import cachegen


@pytest.mark.parametrize("options", [
    dict(compression="zstd", use_dictionary=False, write_statistics=False),
    dict(compression="none", use_dictionary=False),
    dict(compression="snappy", use_dictionary=False, data_page_size=64),
    dict(compression="gzip", use_dictionary=False, data_page_version="2.0", data_page_size=100),
    dict(compression="zstd", use_dictionary=False, data_page_version="2.0", write_statistics=True),
    dict(compression="zstd", use_dictionary=True),  # dictionary pages: pyarrow's reader (fallback)
    dict(compression="lz4", use_dictionary=False),  # codec the fast path does not handle: fallback
])
def test_fast_token_decoding_equals_pyarrow(options):
    rng = np.random.default_rng(3)
    chunks = cachegen.random_chunks(rng, 3, empty_prob=0.0, max_docs=12, max_len=200, huge_prob=0.2)
    chunks[1].insert(2, np.zeros(0, np.int32))  # an empty document inside a row group
    d = tempfile.mkdtemp(prefix="cl-fast-")
    try:
        cachegen.write_synthetic_cache(d, chunks, row_group_tokens=150, writer_options=options)
        with Reader(d, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as fast, \
                Reader(d, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as slow:
            slow.store.fast_decode = False
            for c in range(3):
                m = fast.store.meta(c)
                for g in range(len(m.rg_token_starts) - 1):
                    a, b = fast.store.row_group(c, g), slow.store.row_group(c, g)
                    assert np.array_equal(a.padded, b.padded) and np.array_equal(a.positions, b.positions)
                n0 = int(m.rg_token_starts[1])
                data = open(os.path.join(d, m.path), "rb").read()
                used = fast_plain_values(data, m.file_meta.row_group(0).column(0), n0) is not None
                off, length = (int(x) for x in m.rg_ranges[0])  # the same from the row group's range alone
                again = fast_plain_values(data[off:off + length], m.file_meta.row_group(0).column(0), n0, base=off)
                assert (again is not None) == used
                assert used == (options["compression"] != "lz4" and not options["use_dictionary"])
                want = np.concatenate([np.asarray(x, np.int32) for x in chunks[c]])
                got = np.concatenate([fast.store.row_group(c, g).tokens for g in range(len(m.rg_token_starts) - 1)])
                assert np.array_equal(got, want)
    finally:
        shutil.rmtree(d, ignore_errors=True)
