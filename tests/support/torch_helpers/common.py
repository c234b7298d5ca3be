"""Shared by the reader.torch tests and their torch.distributed worker processes."""

from __future__ import annotations

import numpy as np
import torch

# the dtype each numpy field must arrive as (uint32 flat tokens: an int32 view of the same bits)
TORCH_DTYPE = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool,
               np.dtype(np.uint32): torch.int32}


def as_numpy(t: torch.Tensor, like: np.ndarray) -> np.ndarray:
    """A yielded tensor back as the reader's numpy dtype (int32 bits of uint32 tokens viewed as uint32)."""
    a = t.numpy()
    return a.view(np.uint32) if like.dtype == np.uint32 else a


def assert_item_equals(item, want: dict, step: int | None = None) -> None:
    """``item`` (a TokenBatches item) is the reader batch ``want``: same keys, dtypes, shapes and values."""
    if step is not None:
        assert item["step"] == step, (item["step"], step)
    assert set(item) - {"step"} == set(want), (sorted(item), sorted(want))
    for k, v in want.items():
        t = item[k]
        assert isinstance(t, torch.Tensor), (k, type(t))
        assert t.dtype == TORCH_DTYPE[v.dtype], (k, t.dtype, v.dtype)
        got = as_numpy(t, v)
        assert got.shape == v.shape, (k, got.shape, v.shape)
        assert np.array_equal(got, v), (k, item["step"])


def write_cache(root: str, seq_len: int, batch_size: int) -> str:
    """A small multi-shard cache whose eval pass ends 1 token into a window and 1 window into a batch, so
    the last window and the last eval batch are padded."""
    import cachegen

    chunks = cachegen.random_chunks(np.random.default_rng(5), 15)
    total = sum(len(d) for c in chunks for d in c)
    span = seq_len * batch_size
    chunks.append([np.arange(1, 1 + (1 - total) % span + span, dtype=np.int32)])
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=[6, 5, 5], row_group_tokens=32)
    return root
