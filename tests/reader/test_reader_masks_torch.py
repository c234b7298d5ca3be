"""Loss masks through ``reader.torch``: ``TokenBatches`` in a DataLoader with workers serves the plain reader's
batches of a cache with loss masks (``loss_mask`` in either layout), and ``reader.torch.expand_flat`` applies
the numpy rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import cachegen
from reader import ReadOptions, Reader, expand_flat
from reader.batch.schema import TOKEN_FIELDS
from reader.torch import TokenBatches, as_tensors, expand_flat as torch_expand_flat
from torch_helpers.common import assert_item_equals
from torch_helpers.marks import DATALOADER_WARNINGS

L, B = 16, 8

pytestmark = DATALOADER_WARNINGS


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("masks-torch") / "cache")
    rng = np.random.default_rng(23)
    chunks = cachegen.random_chunks(rng, 10, max_docs=8, max_len=12, huge_len=50, huge_prob=0.2)
    masks = cachegen.random_masks(rng, chunks)
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=[5, 5], row_group_tokens=20,
                                   spans=cachegen.spans_of(masks))
    return root


@pytest.mark.parametrize("layout", ["arrays", "flat"])
def test_token_batches_carry_the_mask(cache, layout):
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, layout=layout, eval_mode=True)
    ds = TokenBatches(cache, opts, rank=1, world_size=2)
    with Reader(cache, opts, num_readers=2, reader_index=1) as ref:
        got = list(DataLoader(ds, batch_size=None, num_workers=2))
        assert len(got) == ref.num_batches
        lossy = 0
        for b, item in enumerate(got):
            want = ref.batch(b)
            assert "loss_mask" in want
            assert_item_equals(item, want, step=b)
            mask = want["loss_mask"] if layout == "arrays" else expand_flat(want)["loss_mask"]
            real = (want["segment_ids"] if layout == "arrays" else expand_flat(want)["segment_ids"]) > 0
            lossy += int((real & ~mask).sum())
        assert lossy, "no real token without loss: the masks are not exercised"


def test_torch_expand_flat_applies_the_numpy_rule(cache):
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, layout="flat", eval_mode=True)
    with Reader(cache, opts) as rd:
        flat = rd.batch(rd.num_batches - 1)  # the padded end of the pass
    assert not flat["valid"].all()
    flat["loss_mask"][~flat["valid"]] = True  # flags on padding: the rule keeps real tokens only
    want = expand_flat(flat)
    got = torch_expand_flat(as_tensors(flat))
    for k in TOKEN_FIELDS:
        assert np.array_equal(got[k].numpy(), want[k]), k
    assert got["loss_mask"].dtype == torch.bool and not want["loss_mask"][~flat["valid"]].any()
