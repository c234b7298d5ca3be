"""Best fit with several continuation pieces per row and varlen fields through ``reader.torch``:
``token_loader`` with DataLoader workers serves the plain reader's batches (either layout, with loss
masks), ``reader.torch.expand_flat`` rebuilds the arrays layout from the flat one, and attention run on
``cu_seqlens`` the way varlen kernels run it (each piece on its own, causal) equals attention under the
``segment_ids`` mask."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="reader.torch needs the optional 'torch' extra")

import cachegen  # noqa: E402
from reader import ReadOptions, Reader  # noqa: E402
from reader.batch.schema import BATCH_KEYS, VARLEN_FIELDS  # noqa: E402
from reader.torch import TokenBatches, as_tensors, expand_flat, token_loader  # noqa: E402
from torch_helpers.common import assert_item_equals  # noqa: E402
from torch_helpers.marks import DATALOADER_WARNINGS  # noqa: E402

L, B, M = (cachegen.VARLEN_LOADER_OPTIONS[k] for k in ("seq_len", "batch_size", "max_segments"))

pytestmark = DATALOADER_WARNINGS


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return cachegen.write_varlen_loader_cache(str(tmp_path_factory.mktemp("varlen-torch") / "cache"), 21)


def options(**kw) -> ReadOptions:
    return ReadOptions(**cachegen.VARLEN_LOADER_OPTIONS, **kw)


@pytest.mark.parametrize("layout", ["arrays", "flat"])
def test_token_loader_workers_serve_the_readers_batches(cache, layout):
    opts = options(layout=layout, eval_mode=True)
    ds = TokenBatches(cache, opts, rank=1, world_size=2)
    with Reader(cache, opts, num_readers=2, reader_index=1) as ref:
        got = list(token_loader(ds, num_workers=2))
        assert len(got) == ref.num_batches
        for b, item in enumerate(got):
            want = ref.batch(b)
            assert_item_equals(item, want, step=b)
            if layout == "flat":  # expanded in torch: the arrays layout's fields, varlen ones passed through
                with Reader(cache, options(eval_mode=True), num_readers=2, reader_index=1) as arrays:
                    full = expand_flat(item)
                    for k, v in arrays.batch(b).items():
                        assert np.array_equal(full[k].numpy(), v), (k, b)
                    assert not set(full) & {"tokens", "continuation_columns"}
    assert not bool(got[-1]["valid"].all())


def attention_by_segment_ids(q, k, v, seg):
    """Causal attention within each document piece of a row, as a mask from ``segment_ids`` (padding
    attends to itself only, so no row of the mask is empty)."""
    n = seg.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    same = (seg[:, None] == seg[None, :]) & (seg[:, None] > 0)
    mask = (same & causal) | torch.eye(n, dtype=torch.bool)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_by_cu_seqlens(q, k, v, cu):
    """What a varlen kernel (flash-attn's ``*_varlen_func``, causal) computes from ``cu_seqlens``: each
    sequence ``[cu[i], cu[i+1])`` attended on its own; zero-length ones are nothing."""
    out = torch.zeros_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            out[:, a:b] = torch.nn.functional.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b],
                                                                           is_causal=True)
    return out


def test_varlen_attention_on_cu_seqlens_equals_the_segment_mask(cache):
    torch.manual_seed(0)
    H, D = 2, 8
    with Reader(cache, options(shuffle_seed=4)) as r:
        several = 0
        for b in range(6):
            x = as_tensors(r.batch(b))
            seg, cu = x["segment_ids"], x["cu_seqlens"]
            q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64) for _ in range(3))
            # per row: the row's cu_seqlens
            for i in range(B):
                real = seg[i] > 0
                want = attention_by_segment_ids(q[i], k[i], v[i], seg[i])
                got = attention_by_cu_seqlens(q[i], k[i], v[i], cu[i])
                torch.testing.assert_close(got[:, real], want[:, real])
                several += int(seg[i].max() > 1)
                assert int(x["max_seqlen"][i]) == max(int((seg[i] == s).sum()) for s in range(1, int(seg[i].max()) + 1))
            # the whole batch as one sequence of B * L tokens (reader.batch.schema): rows' entries plus r * L, then B * L
            flat_cu = torch.cat([(cu + L * torch.arange(B)[:, None].to(cu.dtype)).reshape(-1),
                                 torch.tensor([B * L], dtype=cu.dtype)])
            assert bool((flat_cu[1:] >= flat_cu[:-1]).all())
            fq, fk, fv = (t.permute(1, 0, 2, 3).reshape(H, B * L, D) for t in (q, k, v))
            got = attention_by_cu_seqlens(fq, fk, fv, flat_cu).reshape(H, B, L, D).permute(1, 0, 2, 3)
            for i in range(B):
                real = seg[i] > 0
                torch.testing.assert_close(got[i][:, real], attention_by_segment_ids(q[i], k[i], v[i], seg[i])[:, real])
        assert several, "no row holds several pieces: the attention does not see a document boundary"


def test_expand_flat_keeps_the_varlen_fields_and_drops_the_slots(cache):
    with Reader(cache, options(layout="flat")) as f, Reader(cache, options()) as a:
        for b in range(6):
            got = expand_flat(as_tensors(f.batch(b)))
            want = a.batch(b)
            for key in BATCH_KEYS + VARLEN_FIELDS:
                assert np.array_equal(got[key].numpy(), want[key]), (key, b)
