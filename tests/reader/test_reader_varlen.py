"""Best fit's caps and varlen output through the reader: several continuation pieces per row (the default for
caches of format version 4; older caches keep one), ``max_segments`` (best fit packs within it, unpacked rows
hold one piece, concat reads refuse it), index files named by the caps, and ``cu_seqlens``/``max_seqlen``
against ``segment_ids``, in both layouts, with loss masks, in a mixture, with reader workers and during a
build; and the padding of long documents at L = 256 as the command line's ``batches`` reads them.

Batches against the brute-force packer with caps (R-invariance, seek == iterate, both layouts): the
``best_fit_capped`` kind of tests/reader/test_reader_props.py. The loaders: test_reader_varlen_jax.py and
test_reader_varlen_torch.py in tests/reader/."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from reader import ReadOptions, Reader, expand_flat
from reader.batch.schema import BATCH_KEYS, TOKEN_FIELDS, VARLEN_FIELDS
from reader.cli.main import main
from reader.order import packing

import cachegen
from mixgen import write_components, write_mixture

L, B, RGT, W = 16, 8, 40, 200


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("varlen") / "cache")
    chunks = cachegen.long_document_chunks(np.random.default_rng(5), 12, L)
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=[6, 6], row_group_tokens=RGT)
    return root, chunks


def opts(**kw) -> ReadOptions:
    return ReadOptions(**{**dict(seq_len=L, batch_size=B, ideal_readers=4, packing="best_fit", best_fit_window_tokens=W,
                                 best_fit_continuations=4), **kw})


def unpacked(**kw) -> ReadOptions:
    return ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, packed=False, **kw)


def varlen_of(segment_ids: np.ndarray, M: int) -> tuple[np.ndarray, np.ndarray]:
    """``cu_seqlens`` and ``max_seqlen`` straight from their definition, from ``segment_ids`` alone."""
    cu, top = np.zeros((len(segment_ids), M + 1), np.int32), np.zeros(len(segment_ids), np.int32)
    for r, ids in enumerate(segment_ids):
        ends = [int(np.flatnonzero(ids == k).max()) + 1 for k in range(1, int(ids.max()) + 1)]
        assert len(ends) <= M
        cu[r, 1:] = ends + [ends[-1] if ends else 0] * (M - len(ends))
        top[r] = max(np.diff([0] + ends), default=0)
    return cu, top


def check_varlen(x: dict, M: int) -> int:
    """The varlen fields of a batch (either layout) against its segment_ids; returns the pieces seen."""
    arrays = expand_flat(x) if "tokens" in x else x
    cu, top = varlen_of(arrays["segment_ids"], M)
    assert x["cu_seqlens"].dtype == np.int32 and x["max_seqlen"].dtype == np.int32
    assert np.array_equal(x["cu_seqlens"], cu) and np.array_equal(x["max_seqlen"], top)
    # the entries end at the row's real tokens, and padding rows are all zeros
    assert np.array_equal(x["cu_seqlens"][:, -1], (arrays["segment_ids"] > 0).sum(axis=1))
    assert not x["cu_seqlens"][~x["valid"]].any()
    return int(arrays["segment_ids"].max(axis=1).sum())


def test_options():
    with pytest.raises(ValueError, match=r"max_segments=4: concat rows cut the stream every seq_len tokens .* "
                                         r"Use packing='best_fit'"):
        ReadOptions(max_segments=4)
    with pytest.raises(ValueError, match="varlen=True writes cu_seqlens with max_segments \\+ 1 entries"):
        ReadOptions(packing="best_fit", varlen=True)
    with pytest.raises(ValueError, match="best_fit_continuations=2 applies to packing='best_fit' only"):
        ReadOptions(packed=False, best_fit_continuations=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_segments must be None or an integer >= 1"):
            ReadOptions(packing="best_fit", max_segments=bad)
        with pytest.raises(ValueError, match="best_fit_continuations must be None or an integer >= 1"):
            ReadOptions(packing="best_fit", best_fit_continuations=bad)
    o = ReadOptions(packing="best_fit")
    assert [o.continuations(v) for v in (1, 2, 3, 4, 5)] == [1, 1, 1, 4, 4]
    assert ReadOptions(packing="best_fit", best_fit_continuations=2).continuations(3) == 2
    assert ReadOptions(packing="best_fit", max_segments=3).continuations(4) == 3
    assert o.continuation_slots([2, 4]) == 3 and o.continuation_slots([3]) == 0
    assert ReadOptions().continuation_slots([4]) == 0  # concat rows: one continuation piece, at column 0
    assert ReadOptions(packed=False, max_segments=1, varlen=True).varlen_segments == 1


def test_a_version_4_cache_packs_continuation_pieces_together_by_default(cache, tmp_path):
    root, chunks = cache
    v4 = str(tmp_path / "v4")
    cachegen.write_synthetic_cache(v4, chunks, chunks_per_shard=[6, 6], row_group_tokens=RGT, format_version=4)
    plain = ReadOptions(seq_len=L, batch_size=B, packing="best_fit", best_fit_window_tokens=W, eval_mode=True)
    want = {c: sum(len(cachegen.best_fit_chunk(d, L, RGT, W, continuations=c)) for d in chunks) for c in (1, 4)}
    assert want[4] < want[1]
    with Reader(v4, plain) as new, Reader(root, plain) as old, Reader(v4, dataclasses.replace(plain, layout="flat")) as f:
        assert (new.num_examples, old.num_examples) == (want[4], want[1])
        assert (new.continuation_slots, old.continuation_slots, f.continuation_slots) == (3, 0, 3)
        assert "continuation_columns" in f.batch(0) and "continuation_columns" not in Reader(root, dataclasses.replace(
            plain, layout="flat")).batch(0)
        for b in range(new.num_batches):
            assert all(np.array_equal(v, new.batch(b)[k]) for k, v in expand_flat(f.batch(b)).items()), b
    assert os.path.exists(os.path.join(v4, "index", f"best_fit-L{L}-W{W}-C4.bin"))  # (version 4: the block format)
    assert os.path.exists(os.path.join(root, "index", f"best_fit-L{L}-W{W}.json"))
    # an explicit option reads the older cache with the newer rule, and the newer one with the older rule
    with Reader(root, dataclasses.replace(plain, best_fit_continuations=4)) as a, \
            Reader(v4, dataclasses.replace(plain, best_fit_continuations=1)) as b:
        assert (a.num_examples, b.num_examples) == (want[4], want[1])


@pytest.mark.parametrize("caps, name", [({}, "-C4"), ({"best_fit_continuations": 2}, "-C2"),
                                        ({"max_segments": 3}, "-C3-S3"), ({"best_fit_continuations": 1,
                                                                            "max_segments": 5}, "-S5")])
def test_index_file_names_carry_the_caps(cache, caps, name):
    root, chunks = cache
    o = opts(**caps)
    with Reader(root, o) as r:
        r.batch(0)
        c = r.order.continuations
    got = json.load(open(os.path.join(root, "index", f"best_fit-L{L}-W{W}{name}.json")))
    windows = [packing.count_best_fit_windows([len(d) for d in docs], [hi - lo for lo, hi in cachegen.row_groups(
        [len(d) for d in docs], RGT)], L, W, continuations=c, max_segments=o.max_segments).tolist() for docs in chunks]
    assert got["windows"] == windows and got["counts"] == [sum(w) for w in windows]


@pytest.mark.parametrize("o", [opts(max_segments=2, eval_mode=True), opts(max_segments=2, layout="flat", eval_mode=True),
                               unpacked(max_segments=1, eval_mode=True)])
def test_max_segments_caps_every_row(cache, o):
    root, chunks = cache
    every = np.sort(np.concatenate([d for docs in chunks for d in docs]))
    with Reader(root, o) as r:
        got = [expand_flat(x) if "tokens" in x else x for _, x in r.iter_batches()]
    seg = np.concatenate([x["segment_ids"] for x in got])
    assert seg.max(axis=1).max() == o.max_segments  # the cap is reached, and never passed
    real = np.concatenate([x["targets"][x["loss_mask"]] for x in got])
    assert np.array_equal(np.sort(real), every)  # every token once


@pytest.mark.parametrize("o", [opts(max_segments=6, varlen=True), opts(max_segments=6, varlen=True, layout="flat"),
                               opts(max_segments=6, varlen=True, layout="flat", shuffle_seed=3),
                               opts(max_segments=6, varlen=True, eval_mode=True),
                               opts(max_segments=2, varlen=True, eval_mode=True, layout="flat"),
                               unpacked(max_segments=1, varlen=True), unpacked(max_segments=3, varlen=True, eval_mode=True)])
def test_varlen_fields_follow_segment_ids(cache, o):
    root, _ = cache
    with Reader(root, o) as r, Reader(root, dataclasses.replace(o, layout="arrays")) as a:
        pieces = 0
        for b, x in r.iter_batches(0, r.num_batches or 12):
            assert list(x)[-6:-4] == list(VARLEN_FIELDS) and x["cu_seqlens"].shape == (B, o.max_segments + 1)
            pieces += check_varlen(x, o.max_segments)
            y = a.batch(b)  # the same in the arrays layout, and expand_flat keeps them
            assert all(np.array_equal(x[k], y[k]) for k in VARLEN_FIELDS)
            if o.layout == "flat":
                e = expand_flat(x)
                assert all(np.array_equal(e[k], y[k]) for k in BATCH_KEYS + VARLEN_FIELDS)
        assert pieces > (12 * B if o.packing == "best_fit" else 0)


def test_varlen_with_loss_masks_and_reader_workers(tmp_path):
    root = str(tmp_path / "masked")
    chunks = cachegen.long_document_chunks(np.random.default_rng(8), 10, L)
    masks = cachegen.random_masks(np.random.default_rng(9), chunks)
    cachegen.write_synthetic_cache(root, chunks, spans=cachegen.spans_of(masks), row_group_tokens=RGT)
    for layout in ("arrays", "flat"):
        o = opts(max_segments=5, varlen=True, layout=layout, shuffle_seed=1)
        with Reader(root, o) as one:
            want = [(b, {k: v.copy() for k, v in x.items()}) for b, x in one.iter_batches(0, 10)]
        with Reader(root, dataclasses.replace(o, num_workers=2)) as two:
            got = list(two.iter_batches(0, 10))
        assert [b for b, _ in got] == [b for b, _ in want]
        for (b, x), (_, y) in zip(got, want):
            assert list(x) == list(y) and all(np.array_equal(x[k], y[k]) for k in x), b
            assert "loss_mask" in x
            check_varlen(x, 5)
            seg = expand_flat(x)["segment_ids"] if layout == "flat" else x["segment_ids"]
            assert not (expand_flat(x)["loss_mask"] if layout == "flat" else x["loss_mask"])[seg == 0].any()


def test_varlen_in_a_mixture(tmp_path):
    paths, _ = write_components(str(tmp_path), [6, 5], max_docs=8, max_len=40)
    f = write_mixture(str(tmp_path / "mix.json"), [("a", "c0", 0.6), ("b", "c1", 0.4)], block=8)
    for layout in ("arrays", "flat"):
        o = opts(max_segments=4, varlen=True, shuffle_seed=2, layout=layout)
        with Reader(f, o) as r:
            comps = set()
            for _, x in r.iter_batches(0, 6):
                check_varlen(x, 4)
                comps |= set(x["components"].tolist())
        assert comps == {0, 1}


def test_a_mixture_reads_each_component_by_its_own_format_version(tmp_path):
    """Components of versions 2 and 4 under default options: each serves its own rule's rows (one
    continuation piece per row, four), and the flat batches have the slots the larger rule needs."""
    chunks = [cachegen.long_document_chunks(np.random.default_rng(s), 6, L) for s in (40, 41)]
    paths = [str(tmp_path / f"c{i}") for i in range(2)]
    for p, c, v in zip(paths, chunks, (2, 4)):
        cachegen.write_synthetic_cache(p, c, chunks_per_shard=[3, 3], row_group_tokens=RGT, format_version=v)
    f = write_mixture(str(tmp_path / "mix.json"), [("old", "c0", 0.5), ("new", "c1", 0.5)], block=8)
    o = ReadOptions(seq_len=L, batch_size=B, ideal_readers=2, packing="best_fit", best_fit_window_tokens=W,
                    shuffle_seed=5)
    with Reader(f, dataclasses.replace(o, layout="flat")) as flat, Reader(f, o) as arrays:
        assert flat.continuation_slots == 3
        assert [x.continuations for x in arrays.order.orders] == [1, 4]
        comp, k = arrays.order.assign(np.arange(6 * B))
        alone = [Reader(p, o) for p in paths]
        try:
            for b in range(6):
                x, y = flat.batch(b), arrays.batch(b)
                assert all(np.array_equal(v, y[key]) for key, v in expand_flat(x).items())
                assert (x["continuation_columns"][y["components"] == 0] == L).all()  # the old rule: none
                for row in range(B):
                    i = b * B + row
                    want = alone[comp[i]].examples([k[i]])
                    assert all(np.array_equal(y[key][row], want[key][0]) for key in TOKEN_FIELDS + ("epochs", "valid"))
        finally:
            for a in alone:
                a.close()


@pytest.mark.parametrize("extra", [{}, {"eval_mode": True}])
def test_reading_during_the_build_equals_the_finished_cache(tmp_path, extra):
    chunks = cachegen.long_document_chunks(np.random.default_rng(3), 10, L)
    o = opts(batch_size=4, max_segments=3, varlen=True, layout="flat", **extra)
    got, want = cachegen.batches_during_and_after_build(str(tmp_path), chunks, [4, 3, 3], o, 8,
                                                        compressed=[False, True, False], first=(0, 1))
    assert [b for b, _ in got] == [b for b, _ in want]
    for (b, x), (_, y) in zip(got, want):
        assert all(np.array_equal(x[k], y[k]) for k in y), b


def test_long_documents_pad_as_little_as_plain_best_fit_decreasing(tmp_path):
    """Pages of 200-5,000 tokens at L = 256, most of them longer than L, from a cache of format version 4
    read as ``python -m reader batches`` reads it (its default layout): within a point of plain best-fit
    decreasing on the same windows' pieces and under 1%; one continuation piece per row pads over 4%."""
    L = 256
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(200), np.log(5000), 400)).astype(np.int64)
    docs = [rng.integers(1, 50000, size=int(n), dtype=np.int32) for n in lengths]
    chunks = [docs[:200], docs[200:]]
    root, out = str(tmp_path / "pages"), str(tmp_path / "pages.npz")
    cachegen.write_synthetic_cache(root, chunks, row_group_tokens=8192, format_version=4)
    assert main(["batches", root, "--seq_len", str(L), "--batch_size", "64", "--packing", "best_fit", "--eval",
                 "--count", "0", "--out", out]) == 0
    got = np.load(out)
    valid = got["valid"].reshape(-1)
    real = got["loss_mask"].reshape(-1, L)[valid].sum()
    assert real == lengths.sum()
    padding = 1 - real / (valid.sum() * L)

    def rows(continuations):
        return sum(packing.best_fit_chunk_rows([len(d) for d in c], [hi - lo for lo, hi in cachegen.row_groups(
            [len(d) for d in c], 8192)], L, packing.WINDOW_TOKENS, continuations=continuations).num_rows for c in chunks)

    plain, today = (1 - lengths.sum() / (rows(c) * L) for c in (None, 1))
    assert padding <= plain + 0.01 and padding <= 0.01 and today > 0.04, (padding, plain, today)


def test_the_command_line_reads_with_the_caps(cache, tmp_path, capsys):
    """``batches``, ``inspect --read_batches`` and ``report`` take the packing options; the last two show the
    rows' padding and document pieces per row."""
    root, _ = cache
    caps = ["--packing", "best_fit", "--best_fit_window_tokens", str(W), "--best_fit_continuations", "3",
            "--max_segments", "4"]
    o = opts(best_fit_continuations=3, max_segments=4)
    with Reader(root, o) as r:
        want = [r.batch(b) for b in range(6)]
    seg = np.concatenate([x["segment_ids"] for x in want])
    out = str(tmp_path / "b.npz")
    assert main(["batches", root, "--seq_len", str(L), "--batch_size", str(B), "--ideal_readers", "4", *caps,
                 "--varlen", "--count", "2", "--out", out]) == 0
    got = np.load(out)
    assert np.array_equal(got["cu_seqlens"][1], varlen_of(want[1]["segment_ids"], 4)[0])
    assert json.loads(str(got["options"]))["max_segments"] == 4
    capsys.readouterr()
    assert main(["inspect", root, "--read_batches", "6", "--seq_len", str(L), "--batch_size", str(B),
                 "--ideal_readers", "4", *caps, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows == {"rows": 6 * B, "padding": pytest.approx(float((seg == 0).mean())),
                    "pieces_mean": pytest.approx(float(seg.max(axis=1).mean())), "pieces_max": 4}
    assert main(["inspect", root, "--read_batches", "6", "--seq_len", str(L), "--batch_size", str(B),
                 "--ideal_readers", "4", *caps]) == 0
    assert f"rows        {6 * B} rows: padding {(seg == 0).mean():.2%}, document pieces per row" in capsys.readouterr().out
    page = tmp_path / "report"
    assert main(["report", root, "--out", str(page), "--seq_len", str(L), "--batch_size", str(B), "--ideal_readers",
                 "4", *caps, "--steps", "5"]) == 0
    text = open(page / "index.html", encoding="utf-8").read()
    b5 = want[5]["segment_ids"]
    assert f"The batch's {B} rows: padding {(b5 == 0).mean():.2%}, document pieces per row " \
           f"{b5.max(axis=1).mean():.2f} on average" in text
    assert " ".join(caps) in text and "packed, best_fit" in text
