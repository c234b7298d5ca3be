"""Chunk fetching: checksums verified on first read, damaged files named, row groups decoded lazily, LRU budget."""

import os
import shutil
import tempfile

import numpy as np
import pytest

from reader import ChunkError, ReadOptions, Reader
from reader import format as fmt

import cachegen


@pytest.fixture
def cache_dir():
    d = tempfile.mkdtemp(prefix="cl-chunks-")
    rng = np.random.default_rng(5)
    chunks = cachegen.random_chunks(rng, 6, empty_prob=0.0, max_docs=8, max_len=50)
    entries = cachegen.write_synthetic_cache(d, chunks, row_group_tokens=16)
    yield d, chunks, entries
    shutil.rmtree(d, ignore_errors=True)


def _damage(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "flip":
        data[len(data) // 2] ^= 0x40
    elif how == "truncate":
        data = data[: len(data) - 7]
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how,match", [("flip", "checksum mismatch"), ("truncate", "truncated")])
@pytest.mark.parametrize("packed", [True, False])
def test_damaged_chunk_raises_naming_the_file(cache_dir, how, match, packed):
    root, chunks, entries = cache_dir
    victim = entries[0]["path"]
    _damage(os.path.join(root, victim), how)
    opts = ReadOptions(seq_len=8, batch_size=1, ideal_readers=1, packed=packed, index_cache=False)
    with Reader(root, opts) as rd:
        with pytest.raises(ChunkError, match=match) as e:
            if packed:
                rd.batch(0)
            else:
                rd.batch(0)
        assert victim in str(e.value)
        with pytest.raises(ChunkError):  # again: never served later from a half-initialised cache either
            list(rd.iter_batches(0, 2))


def test_missing_chunk_raises_naming_the_file(cache_dir):
    root, _, entries = cache_dir
    os.remove(os.path.join(root, entries[2]["path"]))
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as rd:
        with pytest.raises(ChunkError, match=entries[2]["path"] + ": missing"):
            for b, _ in rd.iter_batches(0, 10_000):
                pass


def test_only_needed_row_groups_are_decoded(cache_dir):
    root, chunks, entries = cache_dir
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as rd:
        x = rd.batch(0)
        assert x["targets"][0].tolist() == np.concatenate(chunks[0])[:4].tolist()
        assert rd.store.decodes == 1
        assert rd.store.opened == {0}


def test_each_row_group_is_decoded_about_once_when_reading_sequentially(cache_dir):
    root, chunks, entries = cache_dir
    total_rgs = 0
    for e in entries:
        import pyarrow.parquet as pq
        total_rgs += pq.ParquetFile(os.path.join(root, e["path"])).metadata.num_row_groups
    tokens = sum(e["tokens"] for e in entries)
    with Reader(root, ReadOptions(seq_len=4, batch_size=2, ideal_readers=2)) as rd:
        n = 0
        for b, _ in rd.iter_batches(0, tokens // 8 - 2):
            n += 1
        assert rd.store.decodes <= total_rgs
        assert rd.store.fetches <= len(entries) and n > 0  # each chunk fetched (and verified) once


def test_memory_budget_bounds_the_cache(cache_dir):
    root, chunks, entries = cache_dir
    budget = 3000
    with Reader(root, ReadOptions(seq_len=8, batch_size=2, ideal_readers=2, memory_budget_bytes=budget)) as rd:
        largest = 0
        for b, _ in rd.iter_batches(0, 60):
            largest = max(largest, max(v[1] for v in rd.store._lru.values()))
            assert rd.store.used_bytes <= budget + largest
        assert rd.store.fetches > len(entries)  # evicted and fetched again (and verified again)


def test_validate_chunk_reports_every_problem(cache_dir):
    from reader.cache import Cache
    from reader.chunks import validate_chunk
    root, _, entries = cache_dir
    c = Cache(root)
    assert all(validate_chunk(c, i) == [] for i in range(len(entries)))
    _damage(os.path.join(root, entries[1]["path"]), "flip")
    os.remove(os.path.join(root, fmt.sidecar_path(0, 3)))
    assert "checksum mismatch" in " ".join(validate_chunk(c, 1))
    assert "sidecar missing" in " ".join(validate_chunk(c, 3))


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
                from reader.chunks import fast_token_values
                n0 = int(m.rg_token_starts[1])
                used = fast_token_values(m.data, m.file_meta.row_group(0).column(0), n0) is not None
                assert used == (options["compression"] != "lz4" and not options["use_dictionary"])
                want = np.concatenate([np.asarray(x, np.int32) for x in chunks[c]])
                got = np.concatenate([fast.store.row_group(c, g).tokens for g in range(len(m.rg_token_starts) - 1)])
                assert np.array_equal(got, want)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_prefetch_loads_what_a_batch_needs_in_the_background(cache_dir):
    root, chunks, entries = cache_dir
    with Reader(root, ReadOptions(seq_len=8, batch_size=4, ideal_readers=2), num_readers=2, reader_index=1) as rd:
        futs = rd.prefetch(3, rows=[0, 1, 2, 3])
        assert futs
        for f in futs:
            f.result()
        decoded, fetched = rd.store.decodes, rd.store.fetches
        assert fetched > 0 and decoded > 0
        rd.rows(3, [0, 1, 2, 3])  # everything it needs is already there
        assert (rd.store.decodes, rd.store.fetches) == (decoded, fetched)
