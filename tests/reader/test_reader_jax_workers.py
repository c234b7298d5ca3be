"""JaxLoader with ReadOptions(num_workers=W): this process's rows come from reader worker processes
(reader/workers/pool.py, views of shared memory) and equal, bit for bit, what one process builds; the
worker pool serving an explicit set of rows; early close; jax arrays that alias the shared memory.

8 virtual CPU devices in one process, as in tests/reader/test_reader_jax.py.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import os

from jax_helpers.common import force_cpu_devices

force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax", reason="reader.jax needs the optional 'jax' extra")
pytestmark = pytest.mark.slow  # reader worker processes under JAX: make test only
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from cachegen import random_chunks, write_synthetic_cache  # noqa: E402
from jax_helpers.common import CountingReader  # noqa: E402
from reader import ReadOptions, Reader  # noqa: E402
from reader.workers import pool as rw  # noqa: E402
from reader.jax import ROW_FIELDS, TOKEN_FIELDS, JaxLoader  # noqa: E402

if jax.device_count() < 8:  # pragma: no cover - only if another module initialized jax first
    pytest.skip(f"needs 8 CPU devices; jax was initialized with {jax.device_count()} before this module "
                f"set XLA_FLAGS (run with XLA_FLAGS=--xla_force_host_platform_device_count=8)",
                allow_module_level=True)

B, L = 8, 16
FIELDS = TOKEN_FIELDS + ROW_FIELDS


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("jaxw") / "cache")
    rng = np.random.default_rng(2024)
    write_synthetic_cache(root, random_chunks(rng, 12), chunks_per_shard=[4, 4, 4], row_group_tokens=64)
    return root


def make_mesh(shape, names):
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def shm_files():
    """This process's shared-memory slots (their names carry the pid: other test runs on the machine have theirs)."""
    return set(glob.glob(os.path.join(rw._shm_dir(), f"chunkledger-{os.getpid()}-*")))


def host_copy(batch: dict) -> dict:
    """Every field of a batch of jax.Arrays on the host, with the shard of every device."""
    return {k: (np.array(v), {(s.device.id, str(s.index)): np.array(s.data) for s in v.addressable_shards})
            for k, v in batch.items()}


def same_batches(got, want):
    assert [b for b, _ in got] == [b for b, _ in want]
    for (b, x), (_, y) in zip(got, want):
        assert list(x) == list(y), b
        for k in x:
            (gx, gs), (wx, ws) = x[k], y[k]
            assert gx.dtype == wx.dtype and gx.shape == wx.shape, (b, k)
            np.testing.assert_array_equal(gx, wx, err_msg=f"{k} batch {b}")
            assert gs.keys() == ws.keys(), (b, k)
            for d in gs:
                np.testing.assert_array_equal(gs[d], ws[d], err_msg=f"{k} batch {b} shard {d}")


def load(cache, opts, mesh, spec, *, reader_source: bool, workers: int, **kw):
    """All batches of iter_batches(**kw) (on the host) with num_workers=workers; the loader's last stats."""
    opts = dataclasses.replace(opts, num_workers=workers)
    source = Reader(cache, opts) if reader_source else cache
    with JaxLoader(source, opts if not reader_source else None, mesh, spec, prefetch=2) as loader:
        got = []
        for b, x in loader.iter_batches(**kw):
            got.append((b, host_copy(x)))
            pools = list(loader._worker_pools)
            assert len(pools) == (1 if workers else 0) and all(len(p._procs) == workers for p in pools)
        if workers:
            assert not loader._worker_pools, "the pool is closed when the iteration ends"
        stats = dict(loader.stats)
    if reader_source:
        source.close()
    return got, stats


# (mesh shape, axis names, spec, options, reader as source?, iter_batches kwargs)
CASES = {
    "1d_data_mesh": ((8,), ("data",), P("data"), dict(), False, dict(count=40)),
    "2d_data_model": ((4, 2), ("data", "model"), P("data", None), dict(), True, dict(count=30)),
    "2d_flat_start": ((4, 2), ("data", "model"), P("data", None), dict(), False, dict(start=13, count=30)),
    "seq_sharded": ((2, 4), ("data", "seq"), P("data", "seq"), dict(ideal_readers=3), True, dict(start=2, count=12)),
    "shuffled": ((8,), ("data",), P("data"), dict(shuffle_seed=3), False, dict(start=5, count=40)),
    "shuffled_unpacked": ((4, 2), ("data", "model"), P("data", None), dict(packed=False, shuffle_seed=11), True,
                          dict(count=20)),
    "eval": ((4, 2), ("data", "model"), P("data", None), dict(eval_mode=True), False, dict()),
    "eval_resumed": ((8,), ("data",), P("data"), dict(eval_mode=True, packed=False), True, dict(start=3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_workers_yield_the_in_process_batches_bit_for_bit(cache, case):
    """num_workers=2 against num_workers=0: every field, dtype and device shard, path or Reader source,
    1-D and 2-D meshes, a start > 0, shuffled reads, and eval mode to its padded last batch."""
    shape, names, spec, extra, reader_source, kw = CASES[case]
    opts = ReadOptions(**{**dict(seq_len=L, batch_size=B, ideal_readers=4), **extra})
    mesh = make_mesh(shape, names)
    want, _ = load(cache, opts, mesh, spec, reader_source=reader_source, workers=0, **kw)
    got, stats = load(cache, opts, mesh, spec, reader_source=reader_source, workers=2, **kw)
    same_batches(got, want)
    assert stats["batches"] == len(got) and stats["rows_loaded"] == B * len(got)
    if opts.eval_mode:
        n = Reader(cache, opts).num_batches
        assert [b for b, _ in got] == list(range(kw.get("start", 0), n))
        assert not got[-1][1]["valid"][0].all(), "the cache is sized so that the last eval batch is padded"
    else:
        assert [b for b, _ in got] == list(range(kw.get("start", 0), kw.get("start", 0) + kw["count"]))


def test_workers_with_prefetch_threads_serve_the_same_batches(cache, monkeypatch):
    """On a remote cache the workers keep their prefetch threads and plan ahead for their own rows (here:
    a local cache the parent is told is remote); shuffled, so the plan covers mixing groups too."""
    from reader.storage.cache import Cache

    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, shuffle_seed=2)
    mesh = make_mesh((4, 2), ("data", "model"))
    want, _ = load(cache, opts, mesh, P("data", None), reader_source=False, workers=0, start=3, count=30)
    monkeypatch.setattr(Cache, "is_local", property(lambda self: False))
    got, _ = load(cache, opts, mesh, P("data", None), reader_source=False, workers=2, start=3, count=30)
    same_batches(got, want)
    rows = [2, 3, 4, 5]
    with Reader(cache, dataclasses.replace(opts, num_workers=2)) as rd:
        pool = rw.WorkerPool(rd, 3, 30, rows=rows)
        for b, x in pool:
            y = rd.rows(b, rows)
            for k in x:
                np.testing.assert_array_equal(x[k], y[k], err_msg=f"{k} batch {b}")


def test_held_arrays_that_alias_shared_memory_never_change(cache):
    """On CPU, device_put aliases the workers' shared memory (zero copy). Arrays kept past the ring keep
    their slots: the pool gives the ring new slots instead of refilling them under the arrays."""
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, num_workers=2)
    mesh = make_mesh((8,), ("data",))
    reader = Reader(cache, opts)  # layout "arrays": every token field goes to the devices as it is
    with Reader(cache, dataclasses.replace(opts, num_workers=0)) as plain:
        want = [plain.batch(b) for b in range(60)]
    with JaxLoader(reader, None, mesh, P("data")) as loader:
        held = []
        it = loader.iter_batches(count=60)
        for b, batch in it:
            if b == 0:
                pool = next(iter(loader._worker_pools))
                slot_ptrs = [s.arrays["targets"].__array_interface__["data"][0] for s in pool._slots]
                ptr = batch["targets"].addressable_shards[0].data.unsafe_buffer_pointer()
                assert ptr in slot_ptrs, "jax copied the batch: this test no longer covers aliasing"
            held.append((b, batch))  # (read only below: np.asarray caches an array's host copy)
        assert pool._nslot > pool.depth, "held arrays keep their slots: the ring must have grown"
    for b, batch in held:  # 60 batches on: the first slots would have been refilled several times
        for k in FIELDS:
            got = np.asarray(batch[k])
            np.testing.assert_array_equal(got, want[b][k].astype(got.dtype), err_msg=f"{k} batch {b}")
    reader.close()


def test_closing_early_stops_the_workers_and_leaves_no_shared_memory(cache):
    before = shm_files()
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, num_workers=2)
    mesh = make_mesh((4, 2), ("data", "model"))
    loader = JaxLoader(cache, opts, mesh, P("data", None))
    it = loader.iter_batches()  # endless training stream
    b, x = next(it)
    pool = next(iter(loader._worker_pools))
    procs = list(pool._procs)
    assert len(procs) == 2 and all(p.poll() is None for p in procs)
    it.close()
    assert all(p.poll() is not None for p in procs), "closing the iterator stops the workers"
    assert not loader._worker_pools
    assert np.array_equal(np.asarray(x["example_ids"]), np.arange(B))  # a batch outlives its iterator
    # loader.close() stops the workers of an iterator that is still open
    it2 = loader.iter_batches(start=4)
    next(it2)
    pool2 = next(iter(loader._worker_pools))
    procs2 = list(pool2._procs)
    loader.close()
    assert all(p.poll() is not None for p in procs2), "loader.close() stops the workers"
    del x, it, it2, pool, pool2
    gc.collect()
    assert not shm_files() - before, "shared-memory files left behind"


@pytest.mark.parametrize("rows", [[2, 3, 4, 5], [1, 3, 5, 7], [0, 1, 2, 3, 4, 5, 6, 7], [0, 4], [5, 6]])
@pytest.mark.parametrize("extra", [dict(layout="flat"), dict(shuffle_seed=4), dict(packed=False)])
def test_the_pool_serves_an_explicit_set_of_rows(cache, rows, extra):
    """Worker w serves rows[w::W] of any sorted set of rows (a process's block, or a strided set)."""
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, num_workers=2, **extra)
    with Reader(cache, opts) as rd:
        want = [rd.rows(b, rows) for b in range(3, 30)]
        pool = rw.WorkerPool(rd, 3, 27, rows=rows)
        got = [(b, {k: v.copy() for k, v in x.items()}) for b, x in pool]
    assert [b for b, _ in got] == list(range(3, 30))
    for (b, x), y in zip(got, want):
        assert list(x) == list(y)
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, (b, k)
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"{k} batch {b}")


def test_rows_that_do_not_split_over_the_workers_are_explained(cache):
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, num_workers=3)
    with Reader(cache, opts) as rd:
        with pytest.raises(ValueError, match=r"num_workers=3: the 4 rows .* over 3 workers.* divides 4"):
            rw.WorkerPool(rd, 0, 3, rows=[0, 1, 2, 3])
        with pytest.raises(ValueError, match="sorted set of distinct rows"):
            rw.WorkerPool(rd, 0, 3, rows=[3, 0, 1])
        with pytest.raises(ValueError, match=r"num_workers=3\): the 8 rows .* 3 worker processes; use a "
                                             r"num_workers that divides 8"):
            JaxLoader(rd, None, make_mesh((8,), ("data",)), P("data"))
        with pytest.raises(TypeError, match=r"needs a reader.Reader or a cache path .* CountingReader"):
            JaxLoader(CountingReader(rd), None, make_mesh((8,), ("data",)), P("data"))
