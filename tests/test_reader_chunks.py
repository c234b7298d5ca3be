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
