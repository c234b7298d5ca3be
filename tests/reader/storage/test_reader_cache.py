"""Opening caches: finished ledgers, the progress view of a running build, waiting, ledger mismatches."""

import json
import os
import random
import shutil
import tempfile

import numpy as np
import pytest

from reader import Cache, CacheNotReady, FormatError, ReadOptions, Reader
from reader.order import streams
from reader.format import spec as fmt

import cachegen


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="cl-cache-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _chunks(seed, n):
    rng = np.random.default_rng(seed)
    return cachegen.random_chunks(rng, n, max_docs=4, max_len=30, huge_len=120)


def test_finished_cache_table_is_the_ledger(tmp):
    chunks = _chunks(0, 7)
    entries = cachegen.write_synthetic_cache(tmp, chunks, chunks_per_shard=[3, 4])
    c = Cache(tmp)
    assert c.complete
    assert c.table.paths == [e["path"] for e in entries]
    assert c.table.tokens.tolist() == [sum(len(d) for d in ch) for ch in chunks]


def test_progress_view_is_the_longest_written_prefix_of_the_final_order(tmp):
    chunks = _chunks(1, 9)
    cps, comp = [2, 3, 4], [False, True, True]
    final = [tuple(x) for x in streams.round_robin_order(cps).tolist()]
    # written: chunks 0, 1, 2, 4, 5 of the global order; shard 2 (compressed) has no _DONE yet
    cachegen.write_synthetic_cache(tmp, chunks, finished=False, chunks_per_shard=cps, compressed=comp,
                                   written=[0, 1, 2, 4, 5])
    c = Cache(tmp)
    assert not c.complete
    # global order: (0,0) (1,0) (2,0) (0,1) (1,1) (2,1) (1,2) (2,2) (2,3); (0,1) = index 3 is missing
    assert [(int(s), int(k)) for s, k in zip(c.table.shard, c.table.index_in_shard)] == final[:3]
    # writing (0,1) extends the prefix through index 5
    cachegen.write_chunk(tmp, 0, 1, chunks[3])
    assert c.refresh()
    assert len(c.table) == 6
    # (1,2) = index 6: shard 1 is compressed and not done, chunk (2,2) unknown -> write it out of order
    cachegen.write_chunk(tmp, 2, 2, chunks[7])
    c.refresh()
    assert len(c.table) == 6
    cachegen.write_chunk(tmp, 1, 2, chunks[6])
    c.refresh()
    assert len(c.table) == 8  # rounds up to 2 fixed: shard 2 has >= 3 chunks, shard 1 >= 3
    cachegen.write_chunk(tmp, 2, 3, chunks[8])
    c.refresh()
    assert len(c.table) == 8  # is there a chunk (1,3)? unknown until shard 1 is done
    with open(os.path.join(tmp, fmt.shard_done_path(1)), "w") as f:
        f.write(fmt.dumps({"chunks": 3, "uncompressed_bytes": 3000}))
    c.refresh()
    assert len(c.table) == 9
    assert [(int(s), int(k)) for s, k in zip(c.table.shard, c.table.index_in_shard)] == final


def test_a_poll_reads_what_changed_not_the_whole_build(tmp):
    """Following a build lists no directory of an uncompressed shard (their chunk counts are in the plan)
    and fetches each sidecar once; only a compressed shard still being streamed is listed."""
    chunks = _chunks(4, 40)
    cps, comp = [10, 10, 10, 10], [False, False, False, True]
    rr = streams.round_robin_order(cps)
    cachegen.write_synthetic_cache(tmp, chunks, finished=False, chunks_per_shard=cps, compressed=comp,
                                   written=range(20))
    c = Cache(tmp)
    calls = []
    real_ls, real_cat, real_cat_file, real_find = c.fs.ls, c.fs.cat, c.fs.cat_file, c.fs.find
    c.fs.ls = lambda path, *a, **k: calls.append(("ls", path)) or real_ls(path, *a, **k)
    c.fs.find = lambda path, *a, **k: calls.append(("find", path)) or real_find(path, *a, **k)
    c.fs.cat = lambda paths, *a, **k: calls.extend(("cat", p) for p in paths) or real_cat(paths, *a, **k)
    c.fs.cat_file = lambda path, *a, **k: calls.append(("cat", path)) or real_cat_file(path, *a, **k)
    real_read = c.storage.read  # local files are read through the door, not fsspec
    c.storage.read = lambda path, *a, **k: calls.append(("cat", path)) or real_read(path, *a, **k)
    assert len(c.table) == 20
    for i in range(20, 24):
        cachegen.write_chunk(tmp, int(rr[i][0]), int(rr[i][1]), chunks[i])
    calls.clear()
    c.refresh()
    assert len(c.table) == 24
    listed = [p for op, p in calls if op in ("ls", "find")]
    assert len(listed) == 1 and listed[0].endswith(fmt.shard_dir(3))  # the compressed shard only
    fetched = [p for op, p in calls if op == "cat" and p.endswith(".json") and "ledger" not in p]
    new = {os.path.join(tmp, fmt.sidecar_path(int(s), int(k))) for s, k in rr[20:24]}
    assert new <= set(fetched)  # the four new sidecars ...
    assert not any(p.endswith(fmt.sidecar_path(int(s), int(k))) for p in fetched for s, k in rr[:20])  # only
    assert len(fetched) <= 4 + 16 + 1  # ... plus at most one batch of probes past the end (and the plan)


@pytest.mark.parametrize("packed,eval_mode,seed", [(True, False, 0), (False, False, 1), (True, True, 2),
                                                   (False, True, 3)])
# the default rule ("streams" follows a version 2 build, "spans" waits for a version 4 build to finish), and a
# version 4 build followed under "streams" (through the chunks' entries, then the finished table)
@pytest.mark.parametrize("version,rule", [(2, None), (4, None), (4, "streams")])
def test_reading_during_build_equals_reading_after(tmp, packed, eval_mode, seed, version, rule):
    chunks = _chunks(10 + seed, 12)
    cps, comp = [5, 4, 3], [False, True, False]
    opts = ReadOptions(seq_len=7, batch_size=4, packed=packed, ideal_readers=3, eval_mode=eval_mode, pass_rule=rule)
    got, want = cachegen.batches_during_and_after_build(tmp, chunks, cps, opts, 30, compressed=comp, first=[0],
                                                        seed=seed, format_version=version)
    assert [b for b, _ in got] == [b for b, _ in want]
    for (_, x), (_, y) in zip(got, want):
        for k in x:
            assert np.array_equal(x[k], y[k]), k


def test_waiting_past_the_written_part_times_out_with_a_clear_error(tmp):
    chunks = [[np.arange(1, 11, dtype=np.int32)] for _ in range(4)]
    cachegen.write_synthetic_cache(tmp, chunks, finished=False, written=[0, 1])
    with Reader(tmp, ReadOptions(seq_len=5, batch_size=2, ideal_readers=1), wait_timeout_s=0.3,
                poll_interval_s=0.05) as rd:
        assert rd.batch(1)["targets"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
        with pytest.raises(CacheNotReady, match="still running.*wait_timeout_s=0.3"):
            rd.batch(2)
    with Reader(tmp, ReadOptions(seq_len=5, batch_size=2, eval_mode=True), wait_timeout_s=0.2,
                poll_interval_s=0.05) as rd:
        with pytest.raises(CacheNotReady):
            rd.num_batches  # the end of an eval pass is known only when the build is done


def test_a_spans_read_of_a_running_build_waits_for_it_and_says_so_once(tmp, caplog):
    """Under "spans" a training read of an unfinished cache waits for the finished ledger (a pass needs
    every row), logs that once with the way to follow the build ("streams"), and times out naming both;
    an eval read and a "streams" read serve the written prefix as before."""
    chunks = [[np.arange(10 * c + 1, 10 * c + 11, dtype=np.int32)] for c in range(4)]
    cachegen.write_synthetic_cache(tmp, chunks, finished=False, written=[0, 1], format_version=4)
    with caplog.at_level("WARNING", logger="chunkledger.reader"):
        with Reader(tmp, ReadOptions(seq_len=5, batch_size=2, ideal_readers=1), wait_timeout_s=0.3,
                    poll_interval_s=0.05) as rd:
            for _ in range(2):
                with pytest.raises(CacheNotReady, match="pass_rule='spans' serves each pass as a permutation.*"
                                                        "wait_timeout_s=0.3"):
                    rd.batch(0)
            assert list(rd.prefetch(0)) == []  # a prefetch waits for nothing and fails nothing
    said = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert len(said) == 1 and "ReadOptions(pass_rule='streams') reads while it builds" in said[0]
    for opts in (ReadOptions(seq_len=5, batch_size=2, ideal_readers=1, pass_rule="streams"),
                 ReadOptions(seq_len=5, batch_size=2, eval_mode=True)):
        with Reader(tmp, opts, wait_timeout_s=0.3) as rd:
            assert rd.batch(1)["targets"].tolist() == [[11, 12, 13, 14, 15], [16, 17, 18, 19, 20]]
    entries = cachegen.write_synthetic_cache(tmp + "-done", chunks, format_version=4)
    with Reader(tmp, ReadOptions(seq_len=5, batch_size=2, ideal_readers=1), wait_timeout_s=30,
                poll_interval_s=0.05) as rd:
        import threading

        later = threading.Timer(0.5, cachegen.finish_build_from, (tmp, tmp + "-done", entries))
        later.start()
        assert rd.batch(3)["targets"].tolist() == [[31, 32, 33, 34, 35], [36, 37, 38, 39, 40]]
        later.join()
    shutil.rmtree(tmp + "-done", ignore_errors=True)


def test_missing_ledger_names_the_path(tmp):
    with pytest.raises(FileNotFoundError, match="not a chunkledger cache.*empty"):
        Cache(tmp)


def test_ledger_out_of_round_robin_order_is_rejected(tmp):
    cachegen.write_synthetic_cache(tmp, _chunks(3, 4), chunks_per_shard=[2, 2])
    path = os.path.join(tmp, fmt.LEDGER_NAME)
    led = json.load(open(path))
    led["chunks"][0], led["chunks"][1] = led["chunks"][1], led["chunks"][0]
    open(path, "w").write(fmt.dumps_ledger(led))
    with pytest.raises(FormatError, match="ledger.json.*round-robin"):
        Cache(tmp)


def test_ledger_chunk_count_mismatch_with_inputs_is_rejected(tmp):
    cachegen.write_synthetic_cache(tmp, _chunks(4, 4), chunks_per_shard=[2, 2])
    path = os.path.join(tmp, fmt.LEDGER_NAME)
    led = json.load(open(path))
    led["inputs"][1]["chunks"] = 3
    open(path, "w").write(fmt.dumps_ledger(led))
    with pytest.raises(FormatError, match="should have 3 chunks"):
        Cache(tmp)


def test_cachegen_writes_round_robin_shards_and_row_group_metadata(tmp):
    import pyarrow.parquet as pq
    chunks = [[np.arange(1, 40, dtype=np.int32), np.arange(5, dtype=np.int32)], [], [np.arange(3, dtype=np.int32)]]
    entries = cachegen.write_synthetic_cache(tmp, chunks, chunks_per_shard=[1, 2], row_group_tokens=20)
    assert [(e["shard"], e["index_in_shard"]) for e in entries] == [(0, 0), (1, 0), (1, 1)]
    pf = pq.ParquetFile(os.path.join(tmp, entries[0]["path"]))
    assert json.loads(pf.metadata.metadata[fmt.ROW_GROUP_TOKENS_KEY]) == [39, 5]
    assert pf.schema_arrow.remove_metadata() == fmt.CHUNK_SCHEMA
    assert json.load(open(os.path.join(tmp, fmt.sidecar_path(1, 1)))) == entries[2]


def test_unpacked_index_is_cached_beside_the_ledger_and_checked(tmp):
    chunks = _chunks(6, 6)
    cachegen.write_synthetic_cache(tmp, chunks)
    opts = ReadOptions(seq_len=5, batch_size=2, packed=False, ideal_readers=2)
    with Reader(tmp, opts) as r:
        want = r.batch(3)
    path = os.path.join(tmp, "index", "unpacked-L5.json")
    got = json.load(open(path))
    assert got["counts"] == [sum(-(-len(d) // 5) for d in c) for c in chunks]
    assert got["seq_len"] == 5

    class NoColumnReads(Reader):
        def _count_unpacked(self, table, c):
            raise AssertionError("the cached index should have been used")

    with NoColumnReads(tmp, opts) as r:
        assert all(np.array_equal(r.batch(3)[k], want[k]) for k in want)
    # a stale index (other chunks) is ignored and rewritten
    got["fingerprint"] = "0" * 64
    got["counts"] = [0] * len(chunks)
    open(path, "w").write(json.dumps(got))
    with Reader(tmp, opts) as r:
        assert all(np.array_equal(r.batch(3)[k], want[k]) for k in want)
    assert json.load(open(path))["fingerprint"] != "0" * 64


def test_read_only_cache_keeps_the_unpacked_index_in_memory(tmp, monkeypatch):
    chunks = _chunks(7, 4)
    cachegen.write_synthetic_cache(tmp, chunks)
    c = Cache(tmp)

    def refuse(*a, **k):
        raise PermissionError("read-only file system")

    from reader.storage import files

    monkeypatch.setattr(files, "write", refuse)  # every write goes through it (root ignores chmod)
    with Reader(c, ReadOptions(seq_len=5, batch_size=2, packed=False, ideal_readers=2)) as r:
        x = r.batch(0)
        assert x["valid"].all() and x["loss_mask"].any()
    assert not os.path.exists(os.path.join(tmp, "index"))
