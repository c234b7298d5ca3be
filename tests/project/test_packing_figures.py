"""The best-fit figures of benchmarks/packing_cost.py on a small cache, against counts made by hand and by the
brute-force packer (no timing: the rates are measured by the benchmark only)."""

from __future__ import annotations

import numpy as np
import pytest

import cachegen
from benchmarks import packing_cost, report
from packing_ref import reference_chunk_best_fit


def docs_of(lengths, first=1):
    out = []
    for n in lengths:
        out.append(np.arange(first, first + n, dtype=np.int32))
        first += n
    return out, first


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    rng = np.random.default_rng(3)
    lengths = [[0, 25, 3, 10, 0, 8, 2], [7, 5, 4, 2, 1], [], [13, 14, 2]]
    lengths += [rng.integers(1, 40, int(rng.integers(1, 12))).tolist() for _ in range(6)]
    chunks, nxt = [], 1
    for ls in lengths:
        docs, nxt = docs_of(ls, nxt)
        chunks.append(docs)
    root = str(tmp_path_factory.mktemp("packing-figures") / "cache")
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=[5, 5], row_group_tokens=16)
    return root, [np.asarray(x, np.int64) for x in lengths]


def brute(chunks, groups, L, W, continuations=1):
    """The figures straight from their definitions, over the reference packer's rows and token by token."""
    def rows_of(c):
        return sum(len(reference_chunk_best_fit(n.tolist(), g.tolist(), L, W, c)) for n, g in zip(chunks, groups))

    packed = [reference_chunk_best_fit(n.tolist(), g.tolist(), L, W, continuations) for n, g in zip(chunks, groups)]
    rows = sum(len(p) for p in packed)
    tokens = sum(int(n.sum()) for n in chunks)
    one, plain = (1 - tokens / (rows_of(c) * L) for c in (1, None))
    docs = sum(int((n > 0).sum()) for n in chunks)
    pieces = [(c, p) for c, rows_c in enumerate(packed) for row in rows_c for p in row]
    cut = {(c, d) for c, (d, s, _) in pieces if s > 0}
    cut_tokens = sum(m for _, (_, s, m) in pieces if s > 0)
    every = [int(x) for n in chunks for x in n]
    # concatenation: token t of the whole order lies in row t // L; a document is cut when a row starts inside it
    start, cc_docs, cc_tokens = 0, 0, 0
    for n in every:
        inside = [t for t in range(start + 1, start + n) if t % L == 0]  # row starts past the document's first token
        cc_docs += bool(inside)
        cc_tokens += start + n - inside[0] if inside else 0
        start += n
    concat_rows = -(-tokens // L)
    pieces = sum(-(-n // L) for n in every)
    return {
        "best_fit_rows": rows, "best_fit_padding": (rows * L - tokens) / (rows * L),
        "best_fit_one_continuation_padding": one, "plain_bfd_padding": plain,
        "best_fit_padding_over_plain_bfd": (rows * L - tokens) / (rows * L) - plain,
        "best_fit_cut_documents": len(cut) / docs, "best_fit_cut_tokens": cut_tokens / tokens,
        "concat_padding": (concat_rows * L - tokens) / (concat_rows * L), "concat_cut_documents": cc_docs / docs,
        "concat_cut_tokens": cc_tokens / tokens, "unpacked_padding": (pieces * L - tokens) / (pieces * L),
        "unpacked_cut_documents": sum(n > L for n in every) / docs,
        "unpacked_cut_tokens": sum(max(0, n - L) for n in every) / tokens,
    }


@pytest.mark.parametrize("L", [4, 10, 16])
@pytest.mark.parametrize("W", [20, 10**6])
@pytest.mark.parametrize("continuations", [1, 4])
def test_figures_of_a_cache_equal_their_definitions(small_cache, L, W, continuations):
    root, lengths = small_cache
    chunks = packing_cost.cache_lengths(root)
    groups = packing_cost.cache_row_groups(root)
    assert [c.tolist() for c in chunks] == [n.tolist() for n in lengths]
    assert [g.tolist() for g in groups] == [[hi - lo for lo, hi in cachegen.row_groups(n.tolist(), 16)]
                                            for n in lengths]
    got = packing_cost.cache_figures(chunks, L, groups, W, continuations)
    want = brute(chunks, groups, L, W, continuations)
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k
    assert got["best_fit_short_documents_cut"] == 0
    assert (got["best_fit_windows"] > sum(1 for g in groups if g.size)) == (W == 20)


def test_figures_by_hand():
    # L = 10: best fit rows 10 | 10 | 5+3 | 10 | 8+2 (document 1 cut: 15 tokens) and 7+2+1 | 5+4: 67 tokens
    # in 7 rows; concat: 7 rows too; unpacked: 12 rows (25 gives 3).
    chunks = [np.asarray([0, 25, 3, 10, 0, 8, 2]), np.asarray([7, 5, 4, 2, 1])]
    whole = [np.asarray([7]), np.asarray([5])]  # one row group each
    got = packing_cost.cache_figures(chunks, 10, whole)
    assert got["best_fit_rows"] == 7 and got["best_fit_padding"] == pytest.approx(3 / 70)
    assert got["best_fit_cut_documents"] == pytest.approx(1 / 10)
    assert got["best_fit_cut_tokens"] == pytest.approx(15 / 67)
    assert got["unpacked_padding"] == pytest.approx(1 - 67 / 120)
    assert got["concat_padding"] == pytest.approx(3 / 70)
    # The second chunk in row groups [7 5] [4 2 1], windows of 10 tokens (T = 19: n = 2, cut after 12 tokens):
    # 7 | 5 then 4+2+1: one row more, 10 more tokens of padding
    got = packing_cost.cache_figures(chunks, 10, [np.asarray([7]), np.asarray([2, 3])], 10)
    assert got["best_fit_rows"] == 8 and got["best_fit_padding"] == pytest.approx(13 / 80)
    assert got["best_fit_windows"] == 3


def test_short_documents_cut_counts_what_a_packing_cuts(monkeypatch):
    """The figure that must stay 0 does see cuts: with concatenation in best fit's place it counts the
    documents of at most L tokens that a window boundary falls in."""
    chunks = [np.asarray([6, 6, 3, 12]), np.asarray([9, 1])]  # L = 8: rows at 0, 8, 16, 24 of chunk 0
    monkeypatch.setattr(packing_cost.packing, "best_fit_rows", lambda n, L, **caps: packing_cost.packing.concat_rows(n, L))
    got = packing_cost.cache_figures(chunks, 8, [np.asarray([4]), np.asarray([2])])
    # chunk 0: 6 | 6 (cut at 8) | 3 | 12 (cut at 16 and 24: longer than L); chunk 1: 9 (longer), 1
    assert got["best_fit_short_documents_cut"] == 1


def test_row_groups_as_the_build_cuts_them():
    rng = np.random.default_rng(2)
    for _ in range(50):
        n = rng.integers(0, 30, int(rng.integers(0, 40)))
        got = packing_cost.row_groups_of(n, 25)
        assert got.tolist() == [hi - lo for lo, hi in cachegen.row_groups(n.tolist(), 25)]


def test_smaller_chunks_keep_every_document_in_order():
    rng = np.random.default_rng(1)
    chunks = [rng.integers(1, 50, int(rng.integers(0, 40))) for _ in range(7)]
    small = packing_cost.split_chunks(chunks, 4)
    assert np.array_equal(np.concatenate(small), np.concatenate(chunks))
    assert all(x.size for x in small) and len(small) <= 4 * len(chunks)
    per = 0
    for n in chunks:  # runs of one chunk: about a quarter of its tokens each, cut at document ends
        k = len([1 for _ in packing_cost.split_chunks([n], 4)])
        assert k <= 4 and (k == 0) == (n.size == 0)
        per += k
    assert per == len(small)


def test_the_report_shows_the_packing_table():
    kinds, Ls = ("padding", "cut_documents", "cut_tokens"), (256, 2048, 8192)
    fig = {f"{p}_{k}_L{L}": 0.5 for p in ("best_fit", "concat", "unpacked") for k in kinds for L in Ls}
    fig.update({f"best_fit_{k}_L{L}_small": 0.25 for k in kinds for L in Ls})
    fig.update({f"{p}_padding_L{L}": 0.0125 for p in ("best_fit_one_continuation", "plain_bfd") for L in Ls})
    fig.update({"best_fit_vs_concat_L2048": 0.9, "best_fit_real_tokens_per_s_L2048": 9e7, "packing_chunks": 3,
                "packing_split": 8, "reader_num_workers": 2, "packing_continuations": 4,
                "long_docs_best_fit_padding_L256": 0.001, "long_docs_best_fit_one_continuation_padding_L256": 0.06,
                "long_docs_plain_bfd_padding_L256": 0.0009, "long_docs_tokens": 64 << 20})
    text = "\n".join(report.packing_table(fig))
    assert "| 2048 | best fit | 50.00% | 0.500 | 0.500 | 90.00 M tok/s | 0.900 |" in text
    assert "| 8192 | best fit, smaller chunks | 25.00% |" in text and "2 reader workers" in text
    assert "| 256 | plain BFD | 1.25% |" in text and "| 256 | best fit, one continuation per row | 1.25% |" in text
    assert "at most 4 continuation pieces per row" in text
    assert "64 Mi tokens, the same windows): L=256: best fit 0.10%, one continuation per row 6.00%, plain BFD 0.09%." \
        in text
