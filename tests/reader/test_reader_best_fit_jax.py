"""Best-fit rows through ``reader.jax.JaxLoader`` (which reads the flat layout and expands it on the devices):
the plain reader's batches. (TokenBatches: test_reader_best_fit_torch.py, a module without jax, as its
DataLoader workers fork.)"""

from __future__ import annotations


from jax_helpers.common import force_cpu_devices

force_cpu_devices()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import cachegen  # noqa: E402
from reader import ReadOptions, Reader  # noqa: E402

L, B = 16, 8

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return cachegen.write_best_fit_loader_cache(str(tmp_path_factory.mktemp("best-fit-loaders") / "cache"))


def options(**kw) -> ReadOptions:
    return ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, packing="best_fit", **kw)


def test_jax_loader_serves_the_readers_best_fit_batches(cache):
    jax = pytest.importorskip("jax", reason="reader.jax needs the optional 'jax' extra")
    from jax.sharding import Mesh, PartitionSpec as P

    from reader.jax import JaxLoader, ROW_FIELDS, TOKEN_FIELDS

    devices = jax.devices()
    mesh = Mesh(np.array(devices[:8 if len(devices) >= 8 else 1]), ("data",))
    opts = options(shuffle_seed=2)
    with JaxLoader(cache, opts, mesh, P("data"), start=3, prefetch=2) as loader, Reader(cache, opts) as plain:
        got = list(loader.iter_batches(count=4))
        assert [b for b, _ in got] == [3, 4, 5, 6]
        several = 0
        for b, batch in got:
            want = plain.batch(b)
            several += int((want["segment_ids"].max(axis=1) > 1).sum())
            for name in TOKEN_FIELDS + ROW_FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[name]), want[name], err_msg=f"{name} batch {b}")
        assert several, "no row of several pieces: the cache does not exercise best-fit rows"
