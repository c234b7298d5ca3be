"""reader.storage.store: checksums verified on first read, damaged files named, row groups decoded lazily, LRU budget."""

import json
import os
import shutil
import tempfile
import weakref

import numpy as np
import pytest

from reader import ChunkError, ReadOptions, Reader
from reader.format import spec as fmt
from reader.format.sidecar import SIDECAR_ONLY_KEYS
from reader.order import streams

import cachegen


@pytest.fixture
def cache_dir():
    d = tempfile.mkdtemp(prefix="cl-chunks-")
    rng = np.random.default_rng(5)
    chunks = cachegen.random_chunks(rng, 6, empty_prob=0.0, max_docs=8, max_len=50)
    entries = cachegen.write_synthetic_cache(d, chunks, row_group_tokens=16)
    yield d, chunks, entries
    shutil.rmtree(d, ignore_errors=True)


def _damage(path, how, at=None):
    data = bytearray(open(path, "rb").read())
    if how == "flip":
        data[len(data) // 2 if at is None else at] ^= 0x40
    elif how == "truncate":
        data = data[: len(data) - 7]
    elif how == "append":
        data += b"\0"
    open(path, "wb").write(bytes(data))


def _sidecar(root, entry):
    return json.load(open(os.path.join(root, fmt.sidecar_path(entry["shard"], entry["index_in_shard"]))))


@pytest.mark.parametrize("how,where,match", [
    ("flip", "row group", "checksum mismatch in row group 0"),  # a byte of the first row group's range
    ("flip", "footer", "footer checksum mismatch"),  # a byte of the thrift FileMetaData
    ("truncate", None, "truncated"),
    ("append", None, "longer than recorded"),
])
@pytest.mark.parametrize("packed", [True, False])
def test_damaged_chunk_raises_naming_the_file(cache_dir, how, where, match, packed):
    root, chunks, entries = cache_dir
    victim = entries[0]["path"]
    side = _sidecar(root, entries[0])
    at = None
    if where == "row group":
        off, length = side["row_group_index"][0][:2]
        at = off + length // 2
    elif where == "footer":
        at = side["footer"][0] + 10
    _damage(os.path.join(root, victim), how, at)
    opts = ReadOptions(seq_len=8, batch_size=1, ideal_readers=1, packed=packed, index_cache=False)
    with Reader(root, opts) as rd:
        with pytest.raises(ChunkError, match=match) as e:
            rd.batch(0)
        assert victim in str(e.value)
        with pytest.raises(ChunkError):  # again: never served later from a half-initialised cache either
            list(rd.iter_batches(0, 2))


def test_damaged_sidecar_raises_naming_it(cache_dir):
    root, chunks, entries = cache_dir
    path = os.path.join(root, fmt.sidecar_path(0, 0))
    side = _sidecar(root, entries[0])
    side["row_group_index"][0][3] += 1  # a token count the ledger's sidecar_checksum does not cover
    open(path, "w").write(fmt.dumps(side))
    with Reader(root, ReadOptions(seq_len=8, batch_size=1, ideal_readers=1)) as rd:
        with pytest.raises(ChunkError, match="sidecar checksum mismatch") as e:
            rd.batch(0)
        assert fmt.sidecar_path(0, 0) in str(e.value)


def test_row_groups_are_fetched_by_byte_range(cache_dir):
    """Reading one row group fetches the sidecar, the footer and that row group's bytes, not the file."""
    root, chunks, entries = cache_dir
    e = max(entries, key=lambda e: len(_sidecar(root, e)["row_group_index"]))
    side = _sidecar(root, e)
    c = entries.index(e)
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as rd:
        t, _ = rd.store.tokens(c, 0, 2)
        assert t.tolist() == np.concatenate(chunks[c])[:2].tolist()
        sidecar_bytes = os.path.getsize(os.path.join(root, fmt.sidecar_path(0, e["index_in_shard"])))
        assert rd.store.fetches == 1 and rd.store.meta_fetches == 1
        assert rd.store.bytes_fetched == sidecar_bytes + side["footer"][1] + side["row_group_index"][0][1]
        assert rd.store.bytes_fetched - sidecar_bytes < e["bytes"]


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
    with Reader(root, ReadOptions(seq_len=4, batch_size=2, ideal_readers=2)) as rd:
        # stay inside the first pass of every stream: a stream that wraps around reads its first chunk
        # again, and a sequential read has already released those row groups (decoded again, as intended)
        one_pass = streams.StreamIndex(rd.cache.table.tokens, 2, loop=False, complete=True)
        batches = min(int(one_pass.stream_length(s)) for s in range(2)) // 4 - 1
        assert batches > 10
        n = 0
        for b, _ in rd.iter_batches(0, batches):
            n += 1
        assert rd.store.decodes <= total_rgs
        assert rd.store.fetches <= total_rgs and n > 0  # each row group fetched (and verified) once
        assert rd.store.meta_fetches <= len(entries)  # each chunk opened once


def test_memory_budget_bounds_the_cache(cache_dir):
    root, chunks, entries = cache_dir
    budget = 3000
    with Reader(root, ReadOptions(seq_len=8, batch_size=2, ideal_readers=2, memory_budget_bytes=budget)) as rd:
        largest = 0
        for b, _ in rd.iter_batches(0, 60):
            largest = max(largest, max(v[1] for v in rd.store._lru.values()))
            assert rd.store.used_bytes <= budget + largest
        assert rd.store.meta_fetches > len(entries)  # evicted and fetched again (and verified again)


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


def test_sidecars_without_row_group_index_fall_back_to_whole_files(cache_dir):
    """A cache written before sidecars carried the row-group index still reads (whole files, verified)."""
    root, chunks, entries = cache_dir
    ledger = json.load(open(os.path.join(root, fmt.LEDGER_NAME)))
    for c in ledger["chunks"]:
        c.pop("sidecar_checksum")
        path = os.path.join(root, fmt.sidecar_path(c["shard"], c["index_in_shard"]))
        side = {k: v for k, v in json.load(open(path)).items() if k not in SIDECAR_ONLY_KEYS}
        open(path, "w").write(fmt.dumps(side))
    open(os.path.join(root, fmt.LEDGER_NAME), "w").write(fmt.dumps_ledger(ledger))
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as rd:
        want = np.concatenate([np.concatenate(c) for c in chunks])
        got = np.concatenate([rd.batch(b)["targets"][0] for b in range(want.size // 4)])
        assert got.tolist() == want[:got.size].tolist()
        assert rd.store.fetches == len(entries)  # each file once, whole
    _damage(os.path.join(root, entries[0]["path"]), "flip")
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as rd:
        with pytest.raises(ChunkError, match="checksum mismatch"):
            rd.batch(0)


def test_local_files_stay_open_within_a_bound_and_close_with_the_reader(cache_dir, monkeypatch):
    """Local row-group reads go through kept-open files: at most _MAX_OPEN_FILES of them, every byte still
    verified (a file evicted under a concurrent read stays usable until that read ends), all closed by
    close()."""
    import concurrent.futures as cf

    from reader.storage import store as store_mod

    monkeypatch.setattr(store_mod, "_MAX_OPEN_FILES", 2)
    root, chunks, entries = cache_dir
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1, memory_budget_bytes=1)) as rd:
        store = rd.store
        assert store._local

        def read(c):
            m = store.meta(c)
            got = [store.row_group(c, g).tokens for g in range(m.num_row_groups)]
            return np.concatenate(got).tolist()

        with cf.ThreadPoolExecutor(4) as pool:
            for _ in range(3):  # budget 1 byte: every call fetches (and verifies) again
                for c, toks in zip(range(len(entries)), pool.map(read, range(len(entries)))):
                    assert toks == np.concatenate(chunks[c]).tolist()
                assert len(store._files) <= 2
        files = list(store._files.values())
        assert files and not any(f.closed for f in files)
    assert all(f.closed for f in files) and not store._files


def test_a_released_row_group_leaves_the_cache_and_is_freed(cache_dir):
    """release() drops a row group from the cache at once (its bytes leave used_bytes, the store keeps no
    reference to it); what the caller still holds stays valid, and a later read decodes it again."""
    root, chunks, entries = cache_dir
    c = max(range(len(entries)), key=lambda i: len(_sidecar(root, entries[i])["row_group_index"]))
    assert len(_sidecar(root, entries[c])["row_group_index"]) >= 3
    got = np.concatenate(chunks[c])
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as rd:
        st = rd.store
        held = st.row_group(c, 0).tokens[:5]  # a view, still alive below
        want = held.copy()
        rg1 = st.row_group(c, 1)
        gone = weakref.ref(rg1.padded)
        used, n1 = st.used_bytes, rg1.nbytes
        del rg1
        assert st.release_range(c, 0, 2) == 2 and st.release_range(c, 0, 2) == 0
        assert not [k for k in st._lru if k[0] == "rg"]
        assert st.used_bytes < used - n1
        assert gone() is None  # nothing in the store refers to a released row group
        decodes = st.decodes
        for g in (2, 0):
            lo, hi = (int(x) for x in st.meta(c).rg_token_starts[g:g + 2])
            assert st.row_group(c, g).tokens.tolist() == got[lo:hi].tolist()
        assert st.decodes == decodes + 2  # row group 0 decoded again
        assert np.array_equal(held, want)


def test_a_sequential_read_releases_what_it_has_passed():
    """Unshuffled packed reading keeps only the row groups ahead of its windows (shuffled reads:
    test_reader_shuffle.py)."""
    root = tempfile.mkdtemp(prefix="cl-chunks-")
    try:
        # long enough that the row groups alive at once (a pass of up to 8 batches, two passes queued,
        # the lookahead) are few against all those decoded
        chunks = cachegen.random_chunks(np.random.default_rng(8), 8, empty_prob=0.0, huge_prob=0.0,
                                        max_docs=160, max_len=50)
        cachegen.write_synthetic_cache(root, chunks, row_group_tokens=16)
        with Reader(root, ReadOptions(seq_len=4, batch_size=2, ideal_readers=2)) as rd:
            one_pass = streams.StreamIndex(rd.cache.table.tokens, 2, loop=False, complete=True)
            for b, _ in rd.iter_batches(0, min(int(one_pass.stream_length(s)) for s in range(2)) // 4 - 1):
                pass
            st = rd.store
            assert st.decodes >= 100
            assert len([k for k in st._lru if k[0] == "rg"]) < st.decodes / 4  # the cache holds what is ahead
        with Reader(root, ReadOptions(seq_len=4, batch_size=2, ideal_readers=2, shuffle_seed=1)) as rd:
            for b, _ in rd.iter_batches(0, 100):
                pass
            assert not rd.release._released  # the per-chunk rule is for unshuffled reads only
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_evicted_row_groups_are_dropped_within_the_budget(tmp_path):
    """Under a budget of a few row groups, loading more evicts the oldest: the store stays within its budget
    and keeps no reference to what it evicted (or released); every load past the budget decodes again."""
    root = str(tmp_path)
    rng = np.random.default_rng(3)
    cachegen.write_synthetic_cache(root, [[rng.integers(1, 1000, 20).astype(np.int32) for _ in range(12)]],
                                   row_group_tokens=16)
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as rd:
        st = rd.store
        groups = range(st.meta(0).num_row_groups)  # one chunk: its layout is used by every load, never evicted
        assert len(groups) >= 8
        largest = max(st.row_group(0, g).nbytes for g in groups)
        assert st.decodes == len(groups)
        assert st.release_range(0, 0, len(groups)) == len(groups)
        assert not [k for k in st._lru if k[0] == "rg"]
        st.budget = st.used_bytes + 3 * largest  # the chunk's layout and three row groups
        refs = []
        for g in groups:
            refs.append(weakref.ref(st.row_group(0, g).padded))
            assert st.used_bytes <= st.budget
        cached = [k for k in st._lru if k[0] == "rg"]
        assert 3 <= len(cached) < len(groups) and cached[-1] == ("rg", 0, len(groups) - 1)
        assert sum(r() is not None for r in refs) == len(cached)  # the evicted ones are freed
        assert st.decodes == 2 * len(groups)


def test_row_groups_looks_up_many_in_key_order(cache_dir):
    root, chunks, entries = cache_dir
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as rd:
        st = rd.store
        c = max(range(len(entries)), key=lambda i: len(_sidecar(root, entries[i])["row_group_index"]))
        first = st.row_group(c, 1)  # cached; the others are loaded on the way
        keys = [(c, 2), (c, 1), (c, 0), (c, 2)]
        got = st.row_groups(keys)
        assert list(got) == [(c, 2), (c, 1), (c, 0)] and got[(c, 1)] is first
        assert st.decodes == 3
        toks = np.concatenate(chunks[c])
        starts = st.meta(c).rg_token_starts
        for (_, g), rg in got.items():
            assert rg is st.row_group(c, g)
            assert rg.tokens.tolist() == toks[starts[g]:starts[g + 1]].tolist()
