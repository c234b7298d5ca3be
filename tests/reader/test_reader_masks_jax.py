"""Loss masks through ``reader.jax``: ``JaxLoader`` (flat rows and their ``loss_mask`` expanded on the devices,
in this process and through reader workers) serves the plain reader's batches of a cache with loss masks and
of a mixture with a plain cache; ``reader.jax.expand_flat`` applies the same rule as numpy's. (TokenBatches:
test_reader_masks_torch.py, a module without jax, as its DataLoader workers fork.)"""

from __future__ import annotations

import dataclasses

from jax_helpers.common import force_cpu_devices

force_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import cachegen  # noqa: E402
import mixgen  # noqa: E402
from reader import ReadOptions, Reader, expand_flat  # noqa: E402
from reader.jax import ROW_FIELDS, TOKEN_FIELDS, JaxLoader, expand_flat as jax_expand_flat  # noqa: E402

L, B = 16, 8


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """A cache with loss masks, and a mixture of it with a plain cache."""
    root = tmp_path_factory.mktemp("masks-jax")
    rng = np.random.default_rng(17)
    text, nxt = mixgen.unique_chunks(8, 1, rng, max_docs=6, max_len=30)
    sft, _ = mixgen.unique_chunks(8, nxt, rng, max_docs=6, max_len=30)
    masks = cachegen.random_masks(rng, sft)
    cachegen.write_synthetic_cache(str(root / "text"), text, chunks_per_shard=[4, 4], row_group_tokens=20)
    cachegen.write_synthetic_cache(str(root / "sft"), sft, chunks_per_shard=[4, 4], row_group_tokens=20,
                                   spans=cachegen.spans_of(masks))
    mix = mixgen.write_mixture(str(root / "mix.json"), [("text", "text", 1.0), ("sft", "sft", 1.0)])
    return str(root / "sft"), mix


def mesh() -> Mesh:
    devices = jax.devices()
    return Mesh(np.array(devices[:8 if len(devices) >= 8 else 1]), ("data",))


@pytest.mark.parametrize("which", ["sft", "mixture"])
@pytest.mark.parametrize("kw", [dict(), dict(packing="best_fit"), dict(num_workers=2)])
def test_jax_loader_serves_the_readers_masked_batches(caches, which, kw):
    source = caches[0] if which == "sft" else caches[1]
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, shuffle_seed=5, **kw)
    with JaxLoader(source, opts, mesh(), P("data"), start=2, prefetch=2) as loader, \
            Reader(source, dataclasses.replace(opts, num_workers=0)) as plain:
        assert loader.reader.masked and loader.flat  # flat rows and their loss_mask go to the devices
        lossy = 0
        for b, batch in loader.iter_batches(count=4):
            want = plain.batch(b)
            real = want["segment_ids"] > 0
            lossy += int((real & ~want["loss_mask"]).sum())
            for name in TOKEN_FIELDS + ROW_FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[name]), want[name], err_msg=f"{name} batch {b}")
        assert lossy, "no real token without loss: the masks are not exercised"


def test_jax_expand_flat_applies_the_numpy_rule(caches):
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, layout="flat", eval_mode=True)
    with Reader(caches[0], opts) as rd:
        flat = rd.batch(rd.num_batches - 1)  # the padded end of the pass
    assert not flat["valid"].all()
    flat["loss_mask"][~flat["valid"]] = True  # flags on padding: the rule keeps real tokens only
    want = expand_flat(flat)
    got = jax.jit(jax_expand_flat)({k: flat[k] for k in ("tokens", "first_positions", "num_tokens", "loss_mask")})
    for k in TOKEN_FIELDS:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)
    assert not want["loss_mask"][~flat["valid"]].any()
