"""Reader liveness: a reader that holds work and makes no progress for ReadOptions.worker_timeout_s raises
ReaderStalled naming the worker and its batches, instead of hanging training; a reader waiting for a
running build is making progress and does not.

Stalls are real: a worker process stopped with SIGSTOP, or the storage port's reads of chunk files blocked
on a lock the test holds (what a storage read that never returns looks like). Every test restores what it stopped
or blocked, and pytest-timeout bounds it should the code under test hang.
"""

import os
import shutil
import signal
import tempfile
import time

import numpy as np
import pytest

import cachegen
import stalls
from reader import ReadOptions, Reader, ReaderStalled
from reader.workers import pool as rw

TIMEOUT_S = 2.0  # worker_timeout_s in these tests
BOUND_S = 30.0  # the error must arrive well within this (it is due after TIMEOUT_S to 1.25 x TIMEOUT_S)


@pytest.fixture(scope="module")
def cache():
    rng = np.random.default_rng(3)
    chunks = cachegen.random_chunks(rng, 12, max_docs=9, max_len=70)
    d = tempfile.mkdtemp(prefix="cl-stalls-")
    cachegen.write_synthetic_cache(d, chunks, chunks_per_shard=[6, 6], row_group_tokens=24)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def options(**kw) -> ReadOptions:
    return ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, layout="flat", worker_timeout_s=TIMEOUT_S, **kw)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def hanging_chunks(cache, tmp_path):
    with stalls.hanging_chunks(cache, str(tmp_path / "cache")) as root:
        yield root


@pytest.mark.timeout(120)
def test_a_stopped_reader_worker_raises_naming_it_and_its_batches(cache):
    with Reader(cache, options(num_workers=2)) as rd:
        pool = rw.WorkerPool(rd, 0, None)
        it = iter(pool)
        next(it)
        victim = pool._procs[1]
        os.kill(victim.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            with pytest.raises(ReaderStalled, match=rf"^reader worker 1 \(pid {victim.pid}\) made no progress for 2 s "
                                                    r"while assembling batches \d+\.\.\d+ .*worker_timeout_s=2"):
                for _ in range(100_000):
                    next(it)
            elapsed = time.monotonic() - t0
        finally:
            if victim.poll() is None:
                os.kill(victim.pid, signal.SIGCONT)
                victim.kill()
                victim.wait()
        assert TIMEOUT_S <= elapsed < BOUND_S
        assert all(p.poll() is not None for p in pool._procs), "the workers were not killed"


@pytest.mark.timeout(120)
def test_a_reader_worker_stuck_on_a_storage_read_raises(hanging_chunks):
    with Reader(hanging_chunks, options(num_workers=2)) as rd:
        pool = rw.WorkerPool(rd, 0, None)
        t0 = time.monotonic()
        with pytest.raises(ReaderStalled, match=r"^reader worker \d \(pid \d+\) made no progress for 2 s while "
                                                r"assembling batches 0\.\.\d+"):
            next(iter(pool))
        assert TIMEOUT_S <= time.monotonic() - t0 < BOUND_S
        assert all(p.poll() is not None for p in pool._procs)


@pytest.mark.timeout(120)
def test_a_read_stuck_in_this_process_raises(hanging_chunks):
    """num_workers=0: the read-ahead thread blocks on the storage read; the consumer does not."""
    with Reader(hanging_chunks, options()) as rd:
        t0 = time.monotonic()
        with pytest.raises(ReaderStalled, match=r"^the reader made no progress for 2 s while assembling batches "
                                                r"0\.\.\d+ in this process"):
            next(rd.iter_batches(0))
        assert TIMEOUT_S <= time.monotonic() - t0 < BOUND_S


@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_waiting_for_a_running_build_is_progress_not_a_stall(tmp_path, num_workers):
    """The build writes nothing for 3 x worker_timeout_s while the reader waits for its chunks: no error
    (each poll of the build counts as progress), and then the same batches as the finished cache."""
    rng = np.random.default_rng(8)
    chunks = cachegen.random_chunks(rng, 8, max_docs=5, max_len=40)
    opts = ReadOptions(seq_len=8, batch_size=8, ideal_readers=4, layout="flat", worker_timeout_s=1.0,
                       num_workers=num_workers)
    done, live = str(tmp_path / "done"), str(tmp_path / "live")
    entries = cachegen.write_synthetic_cache(done, chunks, chunks_per_shard=[4, 4], row_group_tokens=9)
    with Reader(done, opts) as ref:
        want = [(b, {k: v.copy() for k, v in x.items()}) for b, x in ref.iter_batches(0, 12)]
    cachegen.write_synthetic_cache(live, chunks, finished=False, chunks_per_shard=[4, 4], written=[0],
                                   row_group_tokens=9)
    got = []

    def consume():
        with Reader(live, opts, wait_timeout_s=120, poll_interval_s=0.05) as rd:
            got.extend((b, {k: v.copy() for k, v in x.items()}) for b, x in rd.iter_batches(0, 12))

    # the reader waits for the build for three times worker_timeout_s (the time that passes is the test)
    cachegen.waits_then_finishes(consume, 3 * opts.worker_timeout_s, live, done, entries, join_s=120)
    assert [b for b, _ in got] == [b for b, _ in want]
    for (b, x), (_, y) in zip(got, want):
        for k in y:
            assert np.array_equal(x[k], y[k]), (b, k)


def test_worker_timeout_must_be_positive():
    with pytest.raises(ValueError, match="worker_timeout_s must be > 0"):
        ReadOptions(worker_timeout_s=0)
