"""reader.torch: TokenBatches through real torch DataLoaders (0, 1, 2 workers) and torchdata's
StatefulDataLoader, resumes onto other worker counts and world sizes, and expand_flat in torch ops.

The reference is always the plain reader: rank r of W must get ``Reader(cache, opts, num_readers=W,
reader_index=r).batch(b)``, and W = 1 gives the global batch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="reader.torch needs the optional 'torch' extra")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import cachegen  # noqa: E402
from reader import ReadOptions, Reader, expand_flat as np_expand_flat  # noqa: E402
from reader.torch import STATE_KEY, TokenBatches, as_tensors, expand_flat, resume_step  # noqa: E402
from cache_strategies import caches, has_empty_stream  # noqa: E402
from torch_helpers.common import as_numpy, assert_item_equals, write_cache  # noqa: E402
from torch_helpers.marks import DATALOADER_WARNINGS  # noqa: E402

pytestmark = DATALOADER_WARNINGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L, B = 8, 4

MODES = {
    "shuffled": dict(shuffle_seed=3),
    "shuffled_flat": dict(shuffle_seed=3, layout="flat"),
    "eval": dict(eval_mode=True),
    "eval_flat": dict(eval_mode=True, layout="flat"),
    "unpacked": dict(packed=False),
}


def options(mode: str, **kw) -> ReadOptions:
    return ReadOptions(seq_len=L, batch_size=B, ideal_readers=2, **MODES[mode], **kw)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(str(tmp_path_factory.mktemp("torch") / "cache"), L, B)


def take(loader, n: int | None) -> list:
    out = []
    for item in loader:
        out.append(item)
        if n is not None and len(out) == n:
            break
    return out


def test_importing_reader_does_not_import_torch():
    """The light reader: ``import reader`` and every module but reader.torch* (and reader.jax*, jax's own)
    leave torch unimported; reader.torch itself does not pull in jax."""
    code = (
        "import importlib, pkgutil, sys, reader\n"
        "for m in pkgutil.walk_packages(reader.__path__, 'reader.'):\n"
        "    if not m.name.startswith(('reader.torch', 'reader.jax')) and not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "assert 'reader.workers.pool' in sys.modules and 'reader.cli.main' in sys.modules\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchdata', 'jax'))\n"
        "import reader.torch\n"
        "jax = sorted(m for m in sys.modules if m.split('.')[0] == 'jax')\n"
        "print(bad, jax); sys.exit(1 if bad or jax else 0)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("mode", ["shuffled", "shuffled_flat", "eval", "eval_flat", "unpacked"])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_dataloader_yields_exactly_the_readers_batches(cache, mode, num_workers):
    """Any num_workers: the DataLoader yields batch 0, 1, 2, ... in order, each equal (dtypes, shapes,
    values) to the plain reader's; an eval pass ends after num_batches items, the last one padded."""
    opts = options(mode)
    ds = TokenBatches(cache, opts, rank=0, world_size=1)
    with Reader(cache, opts) as ref:
        n = ref.num_batches
        got = take(DataLoader(ds, batch_size=None, num_workers=num_workers), None if n else 11)
        if n is not None:
            assert len(got) == n == len(ds) and not ref.batch(n - 1)["valid"].all()
        for b, item in enumerate(got):
            assert_item_equals(item, ref.batch(b), step=b)
            assert type(item) is dict
            if num_workers:  # the item crossed from the worker as one buffer, every field a view of it
                assert len({t.untyped_storage().data_ptr() for k, t in item.items() if k != "step"}) == 1


@pytest.mark.parametrize("mode,num_workers", [("shuffled", 2), ("eval_flat", 2), ("unpacked", 0)])
def test_each_rank_gets_its_rows_and_together_the_global_batch(cache, mode, num_workers):
    opts = options(mode)
    with Reader(cache, opts) as ref:
        count = 7 if ref.num_batches is None else ref.num_batches
        parts = []
        for r in range(2):
            ds = TokenBatches(cache, opts, rank=r, world_size=2)
            assert ds.rows.tolist() == list(range(r, B, 2))
            parts.append(take(DataLoader(ds, batch_size=None, num_workers=num_workers), count))
            with Reader(cache, opts, num_readers=2, reader_index=r) as mine:
                for b, item in enumerate(parts[-1]):
                    assert_item_equals(item, mine.batch(b), step=b)
        for b in range(count):
            want = ref.batch(b)
            for k, v in want.items():
                whole = np.empty_like(v)
                for r in range(2):
                    whole[r::2] = as_numpy(parts[r][b][k], v)
                assert np.array_equal(whole, v), (k, b)


def test_batch_size_must_split_over_the_world(cache, monkeypatch):
    with pytest.raises(ValueError, match=r"batch_size=4\) is the GLOBAL batch and must be a multiple of world_size 3"):
        TokenBatches(cache, options("shuffled"), rank=0, world_size=3)
    with pytest.raises(ValueError, match="rank 2 out of range for world_size 2"):
        TokenBatches(cache, options("shuffled"), rank=2, world_size=2)
    with pytest.raises(ValueError, match="needs world_size too"):
        TokenBatches(cache, options("shuffled"), rank=1)
    ds = TokenBatches(cache, options("shuffled"))  # no torch.distributed here: rank 0 of 1
    assert (ds.rank, ds.world_size) == (0, 1)
    with pytest.raises(TypeError, match="no len"):
        len(ds)
    monkeypatch.setenv("WORLD_SIZE", "8")  # torchrun's, before init_process_group: every rank would be rank 0
    with pytest.raises(ValueError, match="WORLD_SIZE=8.*init_process_group"):
        TokenBatches(cache, options("shuffled"))
    assert TokenBatches(cache, options("shuffled"), rank=3, world_size=4).rows.tolist() == [3]


def test_start_iter_from_and_a_loaded_step_apply_once(cache):
    opts = options("eval")
    with Reader(cache, opts) as ref:
        n = ref.num_batches
        ds = TokenBatches(cache, opts, start=n - 3)
        assert len(ds) == 3
        assert [it["step"] for it in ds] == [n - 3, n - 2, n - 1]
        assert [it["step"] for it in ds.iter_from(n - 2)] == [n - 2, n - 1]
        ds.load_state_dict({"step": n - 1})
        assert ds.state_dict()["step"] == n - 1 and len(ds) == 1
        last = list(ds)
        assert [it["step"] for it in last] == [n - 1]
        assert_item_equals(last[0], ref.batch(n - 1))
        assert ds.state_dict()["step"] == n and ds.state_dict()["finished"]
        assert [it["step"] for it in ds][:1] == [n - 3]  # the loaded step applied to one iteration
        # a state saved at the end of a pass: the next iteration is a new pass from start
        ds.load_state_dict({**ds.state_dict(), "finished": True})
        assert [it["step"] for it in ds] == [n - 3, n - 2, n - 1]


def test_the_state_of_an_in_process_iteration_is_the_next_step(cache):
    ds = TokenBatches(cache, options("shuffled"), start=5)
    assert ds.state_dict()["step"] == 5
    it = iter(DataLoader(ds, batch_size=None, num_workers=0))
    assert ds.state_dict()["step"] == 5
    for _ in range(3):
        item = next(it)
    assert item["step"] == 7 and ds.state_dict()["step"] == 8 and resume_step(ds.state_dict()) == 8
    sd = ds.state_dict()
    assert sd[STATE_KEY] == 1 and (sd["start"], sd["worker_id"], sd["num_workers"]) == (5, 0, 1)


def test_bad_states_are_refused_with_the_fix(cache):
    ds = TokenBatches(cache, options("shuffled"))
    worker_state = {STATE_KEY: 1, "step": 9, "start": 0, "worker_id": 1, "num_workers": 2, "finished": False}
    with pytest.raises(ValueError, match="state of DataLoader worker 1 of 2.*whole state_dict"):
        ds.load_state_dict(worker_state)
    with pytest.raises(ValueError, match="not a TokenBatches or StatefulDataLoader state"):
        resume_step({"epoch": 3})
    with pytest.raises(ValueError, match="holds no TokenBatches state"):
        resume_step({"_num_yielded": 3, "dataset_state": None})
    with pytest.raises(TypeError):
        ds.load_state_dict(12)


# --------------------------------------------------------------------------------------------------
# torchdata's StatefulDataLoader


def stateful(ds, num_workers, every=1):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(ds, batch_size=None, num_workers=num_workers, snapshot_every_n_steps=every)


@pytest.mark.parametrize("saved_workers,every,rule", [(0, 1, None), (2, 1, None), (2, 3, None), (1, 1, None),
                                                       (2, 1, "spans")])
def test_stateful_dataloader_resumes_on_any_worker_count(cache, saved_workers, every, rule):
    """A StatefulDataLoader's state taken after k items restores (1) natively, with the same worker
    count, and (2) onto any other worker count through TokenBatches.load_state_dict; both continue at
    batch k, and a state taken after the native restore still gives the right step (under the cache's
    default pass rule, "streams", and under "spans")."""
    pytest.importorskip("torchdata")
    opts = options("shuffled", pass_rule=rule)
    with Reader(cache, opts) as ref:
        loader = stateful(TokenBatches(cache, opts), saved_workers, every)
        it = iter(loader)
        seen = [next(it)["step"] for _ in range(5)]
        sd = loader.state_dict()
        assert seen == [0, 1, 2, 3, 4] and resume_step(sd) == 5
        del it
        native = stateful(TokenBatches(cache, opts), saved_workers, every)
        native.load_state_dict(sd)
        it = iter(native)
        got = [next(it) for _ in range(4)]
        for b, item in zip(range(5, 9), got):
            assert_item_equals(item, ref.batch(b), step=b)
        assert resume_step(native.state_dict()) == 9
        del it
        for workers in (0, 2, 3):
            ds = TokenBatches(cache, opts)
            ds.load_state_dict(sd)
            got = take(stateful(ds, workers), 4)
            for b, item in zip(range(5, 9), got):
                assert_item_equals(item, ref.batch(b), step=b)


def test_a_native_restore_onto_another_worker_count_says_how_to_resume(cache):
    pytest.importorskip("torchdata")
    loader = stateful(TokenBatches(cache, options("shuffled")), 2)
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    del it
    other = stateful(TokenBatches(cache, options("shuffled")), 1)
    other.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"saved with \(2; this loader has 1\).*TokenBatches.load_state_dict"):
        next(iter(other))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_eval_pass_resumes_to_its_end_and_a_finished_state_starts_a_new_pass(cache, workers):
    pytest.importorskip("torchdata")
    opts = options("eval_flat")
    with Reader(cache, opts) as ref:
        n = ref.num_batches
        loader = stateful(TokenBatches(cache, opts), workers)
        it = iter(loader)
        for _ in range(n - 3):
            next(it)
        mid = loader.state_dict()
        assert resume_step(mid) == n - 3
        rest = list(it)
        assert [x["step"] for x in rest] == [n - 3, n - 2, n - 1]
        end = loader.state_dict()
        assert resume_step(end) == n
        for other in (0, 3):  # the rest of the pass on another worker count
            ds = TokenBatches(cache, opts)
            ds.load_state_dict(mid)
            got = list(stateful(ds, other))
            assert [x["step"] for x in got] == [n - 3, n - 2, n - 1]
            assert_item_equals(got[-1], ref.batch(n - 1))
        again = stateful(TokenBatches(cache, opts), workers)
        again.load_state_dict(end)  # finished: torchdata starts a new pass, and so do we
        assert [x["step"] for x in again] == list(range(n))
        ds = TokenBatches(cache, opts)
        ds.load_state_dict(end)
        assert [x["step"] for x in stateful(ds, 2 - workers)] == list(range(n))


# --------------------------------------------------------------------------------------------------
# Reader worker processes (DataLoader num_workers=0), tensors that outlive the iteration


@pytest.mark.slow
def test_reader_workers_serve_zero_copy_tensors_that_stay_unchanged(cache):
    opts = options("shuffled", num_workers=2)
    with Reader(cache, options("shuffled")) as ref:
        ds = TokenBatches(cache, opts)
        kept = take(DataLoader(ds, batch_size=None, num_workers=0), 24)
        for b, item in enumerate(kept):  # checked after the pool served later batches
            assert_item_equals(item, ref.batch(b), step=b)
        ds.close()
    with pytest.raises(ValueError, match=r"ReadOptions\(num_workers=2\).*DataLoader worker"):
        take(DataLoader(TokenBatches(cache, opts), batch_size=None, num_workers=1), 1)


def test_as_tensors_shares_memory_and_views_uint32_as_int32():
    tok = np.array([[0, 3, 4294967295]], dtype=np.uint32)
    ids = np.array([7], dtype=np.int64)
    t = as_tensors({"tokens": tok, "example_ids": ids})
    assert t["tokens"].dtype == torch.int32 and t["tokens"].tolist() == [[0, 3, -1]]
    ids[0] = 9
    assert t["example_ids"].tolist() == [9]  # no copy
    ro = np.arange(3, dtype=np.int32)
    ro.setflags(write=False)
    assert as_tensors({"x": ro})["x"].tolist() == [0, 1, 2]


@pytest.mark.slow
def test_spawned_workers_pickle_the_dataset(cache):
    """Under the spawn start method the dataset travels by pickle (no reader inside) and each worker
    opens its own."""
    opts = options("shuffled")
    ds = TokenBatches(cache, opts)
    list(zip(range(2), ds))  # this process has an open reader now; it must not be pickled
    got = take(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"), 4)
    with Reader(cache, opts) as ref:
        for b, item in enumerate(got):
            assert_item_equals(item, ref.batch(b), step=b)


# --------------------------------------------------------------------------------------------------
# expand_flat in torch ops


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=caches(), seq=st.integers(1, 12), batch=st.sampled_from([1, 2, 4]), r_star=st.sampled_from([1, 2, 3]),
       mode=st.sampled_from(["train", "shuffle", "eval"]), rgt=st.sampled_from([3, 64]))
def test_torch_expand_flat_equals_the_arrays_layout(data, seq, batch, r_star, mode, rgt):
    """Over random caches, reader.torch.expand_flat of the flat items a DataLoader yields equals the
    arrays layout bit for bit, and numpy's reader.expand_flat of the same batch."""
    chunks, cps = data
    if mode != "eval" and has_empty_stream(chunks, r_star, True, seq):
        return
    if mode == "eval" and sum(len(d) for c in chunks for d in c) == 0:
        return
    kw = dict(seq_len=seq, batch_size=batch, ideal_readers=r_star, eval_mode=mode == "eval",
              shuffle_seed=7 if mode == "shuffle" else None)
    d = tempfile.mkdtemp(prefix="cl-torch-")
    try:
        cachegen.write_synthetic_cache(d, chunks, chunks_per_shard=cps, row_group_tokens=rgt)
        ds = TokenBatches(d, ReadOptions(**kw, layout="flat"))
        with Reader(d, ReadOptions(**kw)) as ra, Reader(d, ReadOptions(**kw, layout="flat")) as rf:
            for item in take(DataLoader(ds, batch_size=None), 5):
                b = item["step"]
                want, flat = ra.batch(b), rf.batch(b)
                got = expand_flat(item)
                np_got = np_expand_flat(flat)
                assert set(got) == set(want) | {"step"} and got["step"] == b
                for k, v in want.items():
                    assert got[k].dtype == {np.dtype(np.bool_): torch.bool, np.dtype(np.int64): torch.int64}.get(
                        v.dtype, torch.int32), k
                    assert np.array_equal(got[k].numpy(), v), (k, b)
                    assert np.array_equal(got[k].numpy(), np_got[k]), (k, b)
        ds.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 5), seq=st.integers(1, 9), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["int32", "uint32", "int64", "numpy"]))
def test_torch_expand_flat_reads_every_bit(rows, seq, seed, kind):
    """Any uint32 pattern (token ids up to 2**31 - 1, start bits anywhere, any lengths): the torch version
    equals numpy's, from int32 bits, torch uint32, int64 values or the numpy array itself."""
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, 2**32, size=(rows, seq + 1), dtype=np.uint64).astype(np.uint32)
    tok[:, 1:][rng.random((rows, seq)) < 0.3] |= 1
    batch = {"tokens": tok, "first_positions": rng.integers(0, 10**6, rows).astype(np.int32),
             "num_tokens": rng.integers(0, seq + 1, rows).astype(np.int32),
             "example_ids": rng.integers(-1, 10**12, rows), "valid": rng.random(rows) < 0.8}
    want = np_expand_flat(batch)
    tb = as_tensors(batch)
    tb["tokens"] = {"int32": tb["tokens"], "uint32": torch.from_numpy(tok.view(np.int32)).view(torch.uint32),
                    "int64": torch.from_numpy(tok.astype(np.int64)), "numpy": tok}[kind]
    got = expand_flat(tb)
    assert set(got) == set(want)
    for k, v in want.items():
        assert np.array_equal(got[k].numpy(), v), k
