"""ReadOptions(num_workers=W): batches assembled by reader workers into shared memory (reader/workers/pool.py)."""

import dataclasses
import gc
import glob
import os
import shutil
import signal
import tempfile

import numpy as np
import pytest

from reader import ChunkError, ReadOptions, Reader
from reader.workers import pool as rw

import cachegen


@pytest.fixture(scope="module")
def cache():
    rng = np.random.default_rng(11)
    chunks = cachegen.random_chunks(rng, 14, max_docs=9, max_len=70)
    d = tempfile.mkdtemp(prefix="cl-workers-")
    cachegen.write_synthetic_cache(d, chunks, chunks_per_shard=[5, 5, 4], row_group_tokens=24)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def same(a: dict, b: dict, where="") -> None:
    assert list(a) == list(b), where
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (where, k)
        assert np.array_equal(a[k], b[k]), (where, k)


def in_process(cache, opts, start, count, num_readers=1, reader_index=0):
    with Reader(cache, dataclasses.replace(opts, num_workers=0), num_readers, reader_index) as rd:
        return [(b, {k: v.copy() for k, v in x.items()}) for b, x in rd.iter_batches(start, count)]


def shm_files():
    """This process's shared-memory slots (their names carry the pid: other test runs on the machine have theirs)."""
    return set(glob.glob(os.path.join(rw._shm_dir(), f"chunkledger-{os.getpid()}-*")))


@pytest.mark.parametrize("opts,R,r,start", [
    (ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat"), 1, 0, 0),
    (ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat", shuffle_seed=3), 1, 0, 7),
    (ReadOptions(seq_len=12, batch_size=8, ideal_readers=4), 2, 1, 3),
    (ReadOptions(seq_len=12, batch_size=12, ideal_readers=4, packed=False, shuffle_seed=5), 1, 0, 0),
])
def test_worker_batches_equal_one_process_bit_for_bit(cache, opts, R, r, start):
    """Every key, dtype and value, for both layouts, shuffled or not, packed or not, any host, any start."""
    want = in_process(cache, opts, start, 25, R, r)
    with Reader(cache, dataclasses.replace(opts, num_workers=2), R, r) as rd:
        got = list(rd.iter_batches(start, 25))  # all kept: the ring must not reuse a held batch's slot
    assert [b for b, _ in got] == list(range(start, start + 25))
    for (b, x), (_, y) in zip(got, want):
        same(x, y, b)


def test_eval_pass_ends_with_the_padded_last_batch(cache):
    opts = ReadOptions(seq_len=10, batch_size=12, ideal_readers=4, eval_mode=True, layout="flat")
    want = in_process(cache, opts, 0, None)
    with Reader(cache, dataclasses.replace(opts, num_workers=3)) as rd:
        got = [(b, {k: v.copy() for k, v in x.items()}) for b, x in rd.iter_batches()]
        assert len(got) == rd.num_batches
    assert len(got) == len(want) and not want[-1][1]["valid"].all()
    for (b, x), (_, y) in zip(got, want):
        same(x, y, b)


def test_slots_are_reused_when_the_caller_lets_go_and_never_while_it_holds(cache):
    before = shm_files()
    opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat", num_workers=2)
    want = in_process(cache, opts, 0, 40)
    with Reader(cache, opts) as rd:
        pool = rw.WorkerPool(rd, 0, 40)
        held = []
        for b, x in pool:
            same(x, want[b][1], b)  # the batch is filled before it is handed out
            if b % 10 == 0:
                held.append((b, x))  # kept past the ring: its slot must be replaced, not overwritten
        for b, x in held:
            same(x, want[b][1], f"held {b}")
        # a new slot for each slab with a batch still held when its slot came round again, and no other
        assert len({b // pool.slab for b, _ in held}) > 1
        assert pool._nslot == pool.depth + len({b // pool.slab for b, _ in held})
    del x, held, pool
    gc.collect()
    assert not shm_files() - before, "shared-memory files left behind"


def test_ring_size_stays_at_depth_when_batches_are_dropped(cache):
    opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat", num_workers=2)
    with Reader(cache, opts) as rd:
        pool = rw.WorkerPool(rd, 0, 60)
        for b, x in pool:
            assert x["example_ids"][0] == b * 8
        assert pool._nslot == pool.depth


def test_a_worker_error_is_raised_in_the_consumer_with_its_traceback(cache, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(cache, bad)
    victim = sorted(glob.glob(os.path.join(bad, "chunks", "shard-00000", "chunk-*.parquet")))[1]
    with open(victim, "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 3] ^= 0xFF
    with open(victim, "wb") as f:
        f.write(bytes(data))
    opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat", num_workers=2)
    with Reader(bad, opts) as rd:
        with pytest.raises(ChunkError) as e:
            for _ in rd.iter_batches(0, 200):
                pass
    assert "chunk-000001.parquet" in str(e.value)
    assert any("raised in reader worker" in n for n in getattr(e.value, "__notes__", []))


def test_a_worker_that_dies_is_reported_and_the_others_stop(cache):
    opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat", num_workers=2)
    with Reader(cache, opts) as rd:
        pool = rw.WorkerPool(rd, 0, None)
        it = iter(pool)
        next(it)
        os.kill(pool._procs[1].pid, signal.SIGKILL)
        with pytest.raises(rw.WorkerError, match=r"worker 1 .* exited with code -9"):
            for _ in range(100):
                next(it)
        assert all(p.poll() is not None for p in pool._procs)


def test_closing_early_stops_the_workers_and_removes_the_shared_files(cache):
    before = shm_files()
    opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat", num_workers=2)
    rd = Reader(cache, opts)
    it = rd.iter_batches(0, None)  # endless training stream
    b, x = next(it)
    pool = next(iter(rd._pools))
    procs = list(pool._procs)
    assert not shm_files() - before  # the names go once every worker has mapped them
    it.close()
    assert all(p.poll() is not None for p in procs)
    assert np.array_equal(x["example_ids"], np.arange(8))  # a batch outlives its iterator
    rd.close()
    del x, it, pool
    gc.collect()
    assert not shm_files() - before


def test_the_batch_must_split_evenly_over_readers_and_workers(cache):
    opts = ReadOptions(seq_len=16, batch_size=6, ideal_readers=4, num_workers=4)
    with Reader(cache, opts) as rd:
        with pytest.raises(ValueError, match="multiple of num_readers x num_workers"):
            next(rd.iter_batches(0, 3))
    with pytest.raises(ValueError, match="num_workers"):
        ReadOptions(num_workers=-1)


def test_workers_read_a_running_build_like_one_process(tmp_path):
    rng = np.random.default_rng(5)
    chunks = cachegen.random_chunks(rng, 10, max_docs=5, max_len=40)
    opts = ReadOptions(seq_len=8, batch_size=8, ideal_readers=4, layout="flat", num_workers=2)
    got, want = cachegen.batches_during_and_after_build(str(tmp_path), chunks, [4, 6], opts, 30)
    assert len(got) == len(want) == 30
    for (b, x), (_, y) in zip(got, want):
        same(x, y, b)


def test_workers_with_prefetch_threads_serve_the_same_batches(cache, monkeypatch):
    """On a remote cache the workers keep their prefetch threads and copy iter_batches' batches into the
    slots (here: a local cache the parent is told is remote)."""
    from reader.storage.cache import Cache

    opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat", shuffle_seed=2, num_workers=2)
    want = in_process(cache, opts, 5, 30)
    with Reader(cache, opts) as rd:
        monkeypatch.setattr(Cache, "is_local", property(lambda self: False))
        got = list(rd.iter_batches(5, 30))
        monkeypatch.undo()
    for (b, x), (_, y) in zip(got, want, strict=True):
        same(x, y, b)


def test_a_full_shared_memory_folder_is_a_clear_error_not_a_crash(cache, monkeypatch):
    """posix_fallocate reserves the slot's pages up front: a full /dev/shm (Docker's 64 MB default) fails
    with a message naming the fix, instead of SIGBUS when a worker first writes."""
    import errno

    def full(fd, off, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    before = shm_files()
    monkeypatch.setattr(os, "posix_fallocate", full)
    opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat", num_workers=2)
    with Reader(cache, opts) as rd:
        with pytest.raises(OSError, match="--shm-size"):
            next(rd.iter_batches(0, 3))
    assert not shm_files() - before


def test_workers_start_no_blas_threads_unless_asked(cache, monkeypatch):
    """Workers run with OPENBLAS_NUM_THREADS=1 (they do no linear algebra, and OpenBLAS's threads spin
    while a worker starts); a value the caller set is kept."""
    import psutil

    opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat", num_workers=2)
    for env, want in ((None, "1"), ("3", "3")):
        if env is None:
            monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OPENBLAS_NUM_THREADS", env)
        with Reader(cache, opts) as rd:
            pool = rw.WorkerPool(rd, 0, 4)
            it = iter(pool)
            next(it)
            assert [psutil.Process(p.pid).environ().get("OPENBLAS_NUM_THREADS") for p in pool._procs] == [want] * 2
            it.close()
