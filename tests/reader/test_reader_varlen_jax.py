"""Best fit with several continuation pieces per row and varlen fields through ``reader.jax.JaxLoader``: it
reads the flat layout (continuation pieces past column 0 in their slots) and expands it on the devices;
``cu_seqlens`` and ``max_seqlen`` are sharded like the rows; in one process and through reader workers,
with loss masks. (TokenBatches: test_reader_varlen_torch.py, a module without jax.)"""

from __future__ import annotations

import dataclasses

from jax_helpers.common import force_cpu_devices

force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax", reason="reader.jax needs the optional 'jax' extra")
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import cachegen  # noqa: E402
from reader import ReadOptions, Reader  # noqa: E402
from reader.batch.schema import VARLEN_FIELDS  # noqa: E402
from reader.jax import ROW_FIELDS, TOKEN_FIELDS, JaxLoader, expand_flat  # noqa: E402

L, B, M = (cachegen.VARLEN_LOADER_OPTIONS[k] for k in ("seq_len", "batch_size", "max_segments"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return cachegen.write_varlen_loader_cache(str(tmp_path_factory.mktemp("varlen-jax") / "cache"), 12)


def options(**kw) -> ReadOptions:
    return ReadOptions(**cachegen.VARLEN_LOADER_OPTIONS, **kw)


def mesh():
    devices = jax.devices()
    return Mesh(np.array(devices[:8 if len(devices) >= 8 else 1]), ("data",))


@pytest.mark.parametrize("workers", [0, 2])
def test_jax_loader_serves_the_readers_batches_with_varlen_fields(cache, workers):
    opts = options(shuffle_seed=2, num_workers=workers)
    with JaxLoader(cache, opts, mesh(), P("data"), start=1, prefetch=2) as loader, \
            Reader(cache, dataclasses.replace(opts, num_workers=0)) as plain:
        assert loader.flat and loader.fields == TOKEN_FIELDS + VARLEN_FIELDS + ROW_FIELDS
        assert loader.reader.continuation_slots == 3
        got = list(loader.iter_batches(count=4))
        later = 0
        for b, batch in got:
            want = plain.batch(b)
            for name in TOKEN_FIELDS + VARLEN_FIELDS + ROW_FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[name]), want[name], err_msg=f"{name} batch {b}")
            assert batch["cu_seqlens"].shape == (B, M + 1)
            assert tuple(batch["cu_seqlens"].sharding.spec) == tuple(batch["max_seqlen"].sharding.spec)[:1] + (None,)
            # the rows' shards on each device are those rows' entries
            for shard in batch["cu_seqlens"].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want["cu_seqlens"][shard.index[0]])
        with Reader(cache, dataclasses.replace(opts, num_workers=0, layout="flat")) as flat:
            for b, _ in got:
                later += int((flat.batch(b)["continuation_columns"] < L).sum())
        assert later, "no row holds a continuation piece past column 0: the cache does not exercise the slots"


def test_jax_expand_flat_is_the_arrays_layout(cache):
    with Reader(cache, options(layout="flat")) as f, Reader(cache, options()) as a:
        expand = jax.jit(expand_flat)
        for b in range(8):
            x, y = f.batch(b), a.batch(b)
            got = expand({k: v for k, v in x.items() if k not in ROW_FIELDS + VARLEN_FIELDS})
            for k in TOKEN_FIELDS:
                np.testing.assert_array_equal(np.asarray(got[k]), y[k], err_msg=f"{k} batch {b}")
