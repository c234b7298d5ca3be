"""reader/batch/layouts.py: the unpacked rows are written in blocks of rows (to keep temporaries in the CPU
cache); any block size gives the same batches as writing every row at once."""

from __future__ import annotations

import numpy as np
import pytest

import cachegen
from reader import ReadOptions, Reader
from reader.batch import layouts


@pytest.mark.parametrize("block_rows", [1, 3, 7])
def test_unpacked_rows_in_blocks_equal_rows_at_once(tmp_path, monkeypatch, block_rows):
    rng = np.random.default_rng(11)
    cachegen.write_synthetic_cache(str(tmp_path), cachegen.random_chunks(rng, 6, max_docs=12, max_len=60))
    opts = ReadOptions(seq_len=16, batch_size=24, packed=False, ideal_readers=2, eval_mode=True)

    def read_all():
        with Reader(str(tmp_path), opts) as r:
            return [batch for _, batch in r.iter_batches(0)]

    monkeypatch.setattr(layouts, "PIECE_BLOCK_ELEMENTS", 1 << 30)  # every row of a row group at once
    whole = read_all()
    monkeypatch.setattr(layouts, "PIECE_BLOCK_ELEMENTS", block_rows * opts.seq_len)
    blocks = read_all()
    assert len(whole) == len(blocks) > 2
    for a, b in zip(whole, blocks):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert any(a["loss_mask"].sum() for a in whole)  # real tokens were compared, not only padding
