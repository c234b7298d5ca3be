"""Best-fit rows through ``reader.torch.TokenBatches`` in a DataLoader with workers: the plain reader's batches,
for either layout, to the padded end of an eval pass."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="reader.torch needs the optional 'torch' extra")

from torch.utils.data import DataLoader  # noqa: E402

import cachegen  # noqa: E402
from reader import ReadOptions, Reader  # noqa: E402
from reader.torch import TokenBatches  # noqa: E402
from torch_helpers.common import assert_item_equals  # noqa: E402
from torch_helpers.marks import DATALOADER_WARNINGS  # noqa: E402

L, B = 16, 8

pytestmark = DATALOADER_WARNINGS


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return cachegen.write_best_fit_loader_cache(str(tmp_path_factory.mktemp("best-fit-torch") / "cache"))


def options(**kw) -> ReadOptions:
    return ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, packing="best_fit", **kw)


def test_token_batches_with_dataloader_workers_serve_the_readers_best_fit_batches(cache):
    for layout in ("arrays", "flat"):
        opts = options(layout=layout, eval_mode=True)
        ds = TokenBatches(cache, opts, rank=1, world_size=2)
        with Reader(cache, opts, num_readers=2, reader_index=1) as ref:
            n = ref.num_batches
            got = list(DataLoader(ds, batch_size=None, num_workers=2))
            assert len(got) == n
            for b, item in enumerate(got):
                assert_item_equals(item, ref.batch(b), step=b)
        assert isinstance(got[0]["valid"], torch.Tensor) and not bool(got[-1]["valid"].all())
