"""reader.jax in one process with 8 virtual CPU devices: several meshes and partition specs, every read
mode, per-shard contents, rows read, sliding-window prefetch, resume, and a jit-ed toy step.

The multi-process version (real jax.distributed processes) is tests/reader/test_reader_jax_multiprocess.py.
"""

from __future__ import annotations

import threading

from jax_helpers.common import force_cpu_devices

force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax", reason="reader.jax needs the optional 'jax' extra")
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from cachegen import random_chunks, write_synthetic_cache  # noqa: E402
from jax_helpers.common import (CountingReader, expected_device_rows, make_toy_step,  # noqa: E402
                                spec_from_json, toy_reference)
from reader import ReadOptions, Reader  # noqa: E402
from reader.jax import JaxLoader, ROW_FIELDS, TOKEN_FIELDS, batch_shardings, device_rows, process_rows  # noqa: E402

if jax.device_count() < 8:  # pragma: no cover - only if another module initialized jax first
    pytest.skip(f"needs 8 CPU devices; jax was initialized with {jax.device_count()} before this module "
                f"set XLA_FLAGS (run with XLA_FLAGS=--xla_force_host_platform_device_count=8)",
                allow_module_level=True)

B, L = 8, 16

# (mesh shape, axis names, spec as JSON-ish list)
MESHES = [
    ((8,), ("data",), ["data"]),  # 1D data parallel
    ((4, 2), ("data", "model"), ["data", None]),  # 2D, batch on data, rows replicated over model
    ((2, 2, 2), ("data", "fsdp", "model"), [["data", "fsdp"], None]),  # batch over two mesh axes
    ((2, 4), ("data", "seq"), ["data", "seq"]),  # sequence axis sharded too
    ((4, 2), ("model", "data"), [["data", "model"], None]),  # minor axis first: interleaved device order
    ((8,), ("data",), []),  # fully replicated
]
MODES = {
    "packed": dict(packed=True),
    "unpacked": dict(packed=False),
    "packed_shuffled": dict(packed=True, shuffle_seed=3),
    "eval_packed": dict(packed=True, eval_mode=True),
    "eval_unpacked": dict(packed=False, eval_mode=True),
    "unpacked_shuffled": dict(packed=False, shuffle_seed=11),
}


def make_mesh(shape, names):
    return Mesh(np.array(jax.devices()).reshape(shape), names)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("jax") / "cache")
    rng = np.random.default_rng(2024)
    write_synthetic_cache(root, random_chunks(rng, 12), chunks_per_shard=[4, 4, 4])
    return root


def options(mode, **kw):
    return ReadOptions(seq_len=L, batch_size=B, ideal_readers=3, **MODES[mode], **kw)


@pytest.mark.parametrize("shape,names,spec", MESHES)
def test_rows_per_device_follow_the_sharding(shape, names, spec):
    mesh = make_mesh(shape, names)
    tok, row = batch_shardings(mesh, spec_from_json(spec))
    want = expected_device_rows(shape, names, spec, B)
    got = device_rows(tok, B, L)
    for k, d in enumerate(mesh.devices.flat):
        assert got[d].tolist() == want[k]
    # per-row arrays are partitioned like the batch axis of the token arrays
    for d, idx in row.addressable_devices_indices_map((B,)).items():
        assert np.arange(B)[idx[0]].tolist() == got[d].tolist()
    # one process holds every device here, so it reads each row exactly once
    assert process_rows(tok, B, L).tolist() == list(range(B))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape,names,spec", MESHES)
def test_global_batch_equals_plain_reader(cache, mode, shape, names, spec):
    opts = options(mode)
    ref_reader = Reader(cache, opts, num_readers=1, reader_index=0)
    counting = CountingReader(Reader(cache, opts, num_readers=1, reader_index=0))
    mesh = make_mesh(shape, names)
    loader = JaxLoader(counting, None, mesh, spec_from_json(spec), prefetch=0)
    steps = [0, 1, 5] if ref_reader.num_batches is None else list(range(ref_reader.num_batches))
    for b in steps:
        ref = ref_reader.batch(b)
        got = loader.global_batch(b)
        assert set(got) == set(TOKEN_FIELDS + ROW_FIELDS)
        for name, arr in got.items():
            assert arr.shape == ((B, L) if name in TOKEN_FIELDS else (B,))
            want_dtype = ref[name].dtype
            if want_dtype == np.int64 and not jax.config.jax_enable_x64:
                want_dtype = np.dtype(np.int32)  # documented: int64 fields are int32 without x64
            assert arr.dtype == want_dtype, name
            assert arr.sharding.mesh.shape == mesh.shape
            np.testing.assert_array_equal(np.asarray(arr), ref[name], err_msg=f"{name} batch {b}")
            assert len(arr.addressable_shards) == 8
            for shard in arr.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), ref[name][shard.index],
                                              err_msg=f"{name} batch {b} device {shard.device}")
    # one rows() call per batch, each row once, although a mesh may replicate rows over devices
    assert [b for b, _ in counting.calls] == steps
    assert all(rows == list(range(B)) for _, rows in counting.calls)
    assert loader.stats["rows_loaded"] == B * len(steps)


def test_eval_mode_masks_padding_and_ends(cache):
    opts = options("eval_packed")
    ref_reader = Reader(cache, opts, num_readers=1, reader_index=0)
    n = ref_reader.num_batches
    assert n is not None and n >= 2
    mesh = make_mesh((4, 2), ("data", "model"))
    with JaxLoader(cache, opts, mesh, P("data", None), prefetch=3) as loader:
        assert loader.num_batches == n
        got = list(loader.iter_batches())
    assert [b for b, _ in got] == list(range(n))
    last = got[-1][1]
    valid = np.asarray(last["valid"])
    assert not valid.all(), "the synthetic cache is sized so that the last eval batch is padded"
    assert not np.asarray(last["loss_mask"])[~valid].any()
    assert (np.asarray(last["example_ids"])[~valid] == -1).all()
    total_valid = sum(int(np.asarray(bt["valid"]).sum()) for _, bt in got)
    assert total_valid == sum(int(ref_reader.batch(b)["valid"].sum()) for b in range(n))
    # iterating from the middle of the pass (resume) yields the rest of the pass
    with JaxLoader(cache, opts, mesh, P("data", None), start=n - 1) as loader:
        tail = list(loader.iter_batches())
    assert [b for b, _ in tail] == [n - 1]
    np.testing.assert_array_equal(np.asarray(tail[0][1]["inputs"]), np.asarray(last["inputs"]))


@pytest.mark.parametrize("mode,explicit_mesh", [("packed_shuffled", False), ("unpacked", True)])
def test_jit_toy_step_resumes_identically(cache, mode, explicit_mesh):
    opts = options(mode)
    ref_reader = Reader(cache, opts, num_readers=1, reader_index=0)
    steps, k = 7, 3
    want = toy_reference([ref_reader.batch(b) for b in range(steps)], L)
    toy = make_toy_step(L)
    if explicit_mesh:  # jax.make_mesh: Explicit axis types (sharding in types), as in the docs/JAX.md example
        mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"))
        spec = NamedSharding(mesh, P(("data", "fsdp"), None))
    else:
        mesh = make_mesh((2, 2, 2), ("data", "fsdp", "model"))
        spec = P(("data", "fsdp"), None)

    def run(start, state):
        out = []
        with JaxLoader(cache, opts, None if explicit_mesh else mesh, spec, start=start, prefetch=2) as loader:
            for step, batch in loader.iter_batches(count=steps - start):
                state, per_segment = toy(state, batch)
                out.append((step, int(state), sha_of(per_segment)))
        return out

    from jax_helpers.common import sha as sha_of

    straight = run(0, np.int32(0))
    assert [(s, st, h) for s, st, h in straight] == [(i,) + want[i] for i in range(steps)]
    resumed = run(k, np.int32(straight[k - 1][1]))  # restart: checkpointed state + step number only
    assert resumed == straight[k:]


def test_iteration_equals_global_batch_and_plain_iterator(cache):
    opts = options("packed")
    mesh = make_mesh((8,), ("data",))
    plain = Reader(cache, opts, num_readers=1, reader_index=0)
    with JaxLoader(cache, opts, mesh, P("data"), start=4, prefetch=3, threads=2) as loader:
        got = list(loader.iter_batches(count=5))
        again = loader.global_batch(6)
    assert [b for b, _ in got] == [4, 5, 6, 7, 8]
    for (b, bt), (pb, pbt) in zip(got, plain.iter_batches(start=4, count=5)):
        assert b == pb
        for name in TOKEN_FIELDS + ROW_FIELDS:
            np.testing.assert_array_equal(np.asarray(bt[name]), pbt[name])
    for name in TOKEN_FIELDS:
        np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(got[2][1][name]))


class WindowProbe:
    """Reader proxy that records which batches have been requested, for the sliding-window test."""

    def __init__(self, reader):
        self.reader, self.options, self.num_batches = reader, reader.options, None
        self.requested: list[int] = []
        self.cond = threading.Condition()

    def rows(self, b, rows):
        with self.cond:
            self.requested.append(int(b))
            self.cond.notify_all()
        return self.reader.rows(b, rows)

    def wait_for(self, steps, timeout=30.0):
        with self.cond:
            ok = self.cond.wait_for(lambda: set(steps) <= set(self.requested), timeout=timeout)
        assert ok, f"batches {sorted(set(steps) - set(self.requested))} were never requested"


@pytest.mark.parametrize("prefetch,threads", [(1, 1), (3, 1), (4, 4)])
def test_prefetch_is_a_sliding_window(cache, prefetch, threads):
    """While the step holds batch b, exactly batches b+1..b+prefetch are requested: the window is refilled
    one batch at a time (a 'fetch N, drain N' loader would leave b+1.. unrequested at window edges)."""
    probe = WindowProbe(Reader(cache, options("packed"), num_readers=1, reader_index=0))
    loader = JaxLoader(probe, None, make_mesh((8,), ("data",)), P("data"), start=10, prefetch=prefetch,
                       threads=threads)
    n = 3 * prefetch + 2
    it = loader.iter_batches(count=n)
    for b, _batch in it:
        ahead = [s for s in range(b + 1, b + prefetch + 1) if s < 10 + n]
        probe.wait_for(ahead)
        with probe.cond:
            assert max(probe.requested) == (ahead[-1] if ahead else b)  # never further than the window
            assert sorted(probe.requested) == list(range(10, max(probe.requested) + 1))
    assert sorted(probe.requested) == list(range(10, 10 + n))
    loader.close()


def test_bad_configurations_are_explained(cache):
    opts = options("packed")
    reader = Reader(cache, opts, num_readers=1, reader_index=0)
    six = Reader(cache, ReadOptions(seq_len=L, batch_size=6, ideal_readers=3), num_readers=1, reader_index=0)
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by the 4 batch shards"):
        JaxLoader(six, None, make_mesh((4, 2), ("data", "model")), P("data", None))
    with pytest.raises(ValueError, match="seq_len 16 is not divisible by the 3 sequence shards"):
        JaxLoader(reader, None, Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("data", "seq")), P("data", "seq"))
    with pytest.raises(ValueError, match="mesh axis 'nope'"):
        JaxLoader(reader, None, make_mesh((8,), ("data",)), P("nope"))
    with pytest.raises(ValueError, match="unknown fields"):
        JaxLoader(reader, None, make_mesh((8,), ("data",)), P("data"), fields=["tokens"])
    with pytest.raises(ValueError, match="opts"):
        JaxLoader(cache, None, make_mesh((8,), ("data",)), P("data"))


def test_fields_subset(cache):
    opts = options("packed")
    loader = JaxLoader(Reader(cache, opts, num_readers=1, reader_index=0), None, make_mesh((8,), ("data",)),
                       P("data"), fields=["inputs", "loss_mask"])
    assert set(loader.global_batch(2)) == {"inputs", "loss_mask"}


@pytest.mark.parametrize("cli_args,mode", [(["--shuffle_seed", "3"], "packed_shuffled"),
                                           (["--eval", "--unpacked"], "eval_unpacked")])
def test_equals_the_batches_command(cache, tmp_path, cli_args, mode):
    """The global batch equals what `python -m reader batches` writes for the same options."""
    from reader.cli import main as cli

    out = str(tmp_path / "batches.npz")
    start, count = 1, 2
    assert cli.main(["batches", cache, "--seq_len", str(L), "--batch_size", str(B), "--ideal_readers", "3",
                     "--start", str(start), "--count", str(count), "--out", out] + cli_args) == 0
    written = np.load(out)
    assert written["batch_index"].tolist() == [start, start + 1]
    mesh = make_mesh((2, 2, 2), ("data", "fsdp", "model"))
    with JaxLoader(cache, options(mode), mesh, P(("data", "fsdp"), None), start=start) as loader:
        got = list(loader.iter_batches(count=count))
    for k, (b, batch) in enumerate(got):
        for name in TOKEN_FIELDS + ROW_FIELDS:
            np.testing.assert_array_equal(np.asarray(batch[name]), written[name][k], err_msg=f"{name} batch {b}")


def test_reads_while_the_build_runs(tmp_path):
    """A loader started on a half-written cache waits for the missing chunks (in its prefetch threads) and
    yields the same global batches as the finished cache."""
    import time

    from cachegen import finish_cache, write_chunk
    from reader.order import streams

    rng = np.random.default_rng(99)
    chunks = random_chunks(rng, 12)
    cps = [4, 4, 4]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    write_synthetic_cache(full, chunks, chunks_per_shard=cps)
    entries = write_synthetic_cache(part, chunks, chunks_per_shard=cps, finished=False, written=range(2))
    rr = streams.round_robin_order(cps)

    def finish_build():
        time.sleep(0.2)
        for i, docs in enumerate(chunks):
            if entries[i] is None:
                entries[i] = write_chunk(part, int(rr[i][0]), int(rr[i][1]), docs)
        finish_cache(part, entries)

    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=3, packed=True)
    mesh = make_mesh((4, 2), ("data", "model"))
    builder = threading.Thread(target=finish_build)
    with JaxLoader(part, opts, mesh, P("data", None), prefetch=2,
                   reader_kwargs={"wait_timeout_s": 60, "poll_interval_s": 0.05}) as loader:
        builder.start()
        got = list(loader.iter_batches(count=3))
    builder.join()
    ref = Reader(full, opts, num_readers=1, reader_index=0)
    for b, batch in got:
        want = ref.batch(b)
        for name in TOKEN_FIELDS + ROW_FIELDS:
            np.testing.assert_array_equal(np.asarray(batch[name]), want[name], err_msg=f"{name} batch {b}")


def test_int64_fields_never_wrap_silently(cache):
    """Without jax_enable_x64, example ids past int32 raise a clear error instead of wrapping around."""
    if jax.config.jax_enable_x64:
        pytest.skip("jax_enable_x64 is on: int64 fields stay int64 and cannot overflow")

    class FarAlong(CountingReader):  # the real reader, as if the run were 2**31 examples further along
        def rows(self, b, rows):
            out = dict(super().rows(b, rows))
            out["example_ids"] = out["example_ids"] + (1 << 31)
            return out

    mesh = make_mesh((8,), ("data",))
    far = FarAlong(Reader(cache, options("packed"), num_readers=1, reader_index=0))
    with pytest.raises(OverflowError, match="jax_enable_x64"):
        JaxLoader(far, None, mesh, P("data")).global_batch(0)
    ok = JaxLoader(far, None, mesh, P("data"), fields=TOKEN_FIELDS + ("valid",)).global_batch(0)
    assert set(ok) == set(TOKEN_FIELDS) | {"valid"}


def test_a_failed_read_surfaces_at_its_step(cache):
    """An error while prefetching batch k is raised when the loop reaches step k, not earlier and not lost."""

    class FailsAt3(CountingReader):
        def rows(self, b, rows):
            if b == 3:
                raise TimeoutError("batch 3: cache not ready")
            return super().rows(b, rows)

    reader = FailsAt3(Reader(cache, options("packed"), num_readers=1, reader_index=0))
    seen = []
    with JaxLoader(reader, None, make_mesh((8,), ("data",)), P("data"), prefetch=3) as loader:
        with pytest.raises(TimeoutError, match="batch 3"):
            for b, _ in loader.iter_batches():
                seen.append(b)
    assert seen == [0, 1, 2]


@pytest.mark.parametrize("mode", ["packed", "packed_shuffled", "eval_packed"])
@pytest.mark.parametrize("shape,names,spec", MESHES)
def test_flat_layout_expands_on_the_devices_to_the_arrays_layout(cache, mode, shape, names, spec):
    """layout="flat": the loader ships flat-tokens rows and expands them under jit; every field, and every
    device's shard of it, equals the plain reader's arrays layout (also with the sequence axis sharded)."""
    ref_reader = Reader(cache, options(mode))
    mesh = make_mesh(shape, names)
    with JaxLoader(cache, options(mode), mesh, spec_from_json(spec), prefetch=0) as plain:
        assert plain.flat  # a loader made from a path reads packed examples flat by default
    with JaxLoader(ref_reader, None, mesh, spec_from_json(spec), prefetch=0) as own:
        assert not own.flat  # a Reader passed as source keeps its own layout ("arrays" by default)
    with JaxLoader(cache, options(mode, layout="flat"), mesh, spec_from_json(spec), prefetch=0) as loader:
        assert loader.flat
        steps = [0, 1, 7] if ref_reader.num_batches is None else list(range(ref_reader.num_batches))
        for b in steps:
            ref = ref_reader.batch(b)
            got = loader.global_batch(b)
            assert set(got) == set(TOKEN_FIELDS + ROW_FIELDS)
            for name in TOKEN_FIELDS:
                arr = got[name]
                assert arr.dtype == ref[name].dtype and arr.shape == (B, L), name
                assert arr.sharding.is_equivalent_to(loader.token_sharding, 2), name
                for shard in arr.addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), ref[name][shard.index],
                                                  err_msg=f"{name} batch {b} device {shard.device}")
            for name in ROW_FIELDS:
                np.testing.assert_array_equal(np.asarray(got[name]), ref[name].astype(np.asarray(got[name]).dtype))


def test_expand_flat_in_jax_equals_numpy(cache):
    from reader import expand_flat as expand_np
    from reader.jax import expand_flat as expand_jax

    with Reader(cache, options("eval_packed", layout="flat")) as rd:
        for b in range(rd.num_batches):
            x = rd.batch(b)
            want = expand_np(x)
            got = jax.jit(expand_jax)({k: x[k] for k in ("tokens", "first_positions", "num_tokens")})
            for k in TOKEN_FIELDS:
                np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=f"{k} batch {b}")


@pytest.mark.timeout(120)
def test_a_read_that_never_returns_raises_instead_of_hanging(cache, tmp_path):
    """The loader's read-ahead thread blocks reading a chunk that never arrives: after
    worker_timeout_s without progress the loop raises ReaderStalled naming the batch."""
    import stalls
    from reader import ReaderStalled

    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=2, worker_timeout_s=2)
    with stalls.hanging_chunks(cache, str(tmp_path / "cache")) as root:
        with JaxLoader(root, opts, make_mesh((8,), ("data",)), P("data", None)) as loader:
            with pytest.raises(ReaderStalled, match=r"^the reader made no progress for 2 s while assembling "
                                                    r"global batch 0 for JaxLoader"):
                next(loader.iter_batches())
