"""Loss masks of supervised caches (the ``loss_spans`` column): every kind of read, both layouts, mixtures
with plain caches, reader workers, ``drop_long``, and what validate, inspect and export say."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

import cachegen
import mixgen
from reader import FLAT_KEYS, ChunkError, ReadOptions, Reader, expand_flat
from reader.batch.schema import TOKEN_FIELDS
from reader.cli.main import main as cli
from reader.format import sidecar
from reader.format import spec as fmt
from reader.storage.pages import fast_list_values

KINDS = {"concat": dict(), "best_fit": dict(packing="best_fit"), "unpacked": dict(packed=False)}


def unique_chunks(rng, n, *, max_len=30, huge_len=80, first=1):
    """Chunks of documents with distinct token ids (a test finds any token), some long, a few empty."""
    chunks, nxt = [], first
    for docs in cachegen.random_chunks(rng, n, max_len=max_len, huge_prob=0.2, huge_len=huge_len, empty_prob=0.1):
        out = []
        for d in docs:
            out.append(np.arange(nxt, nxt + len(d), dtype=np.int32))
            nxt += len(d)
        chunks.append(out)
    return chunks, nxt


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A masked cache over two shards, with documents of no loss, all loss and a few loss runs."""
    rng = np.random.default_rng(11)
    chunks, _ = unique_chunks(rng, 10)
    chunks[3].insert(1, np.zeros(0, np.int32))  # an empty document
    masks = cachegen.random_masks(rng, chunks, none_prob=0.15)
    root = str(tmp_path_factory.mktemp("sft") / "cache")
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=[5, 5], row_group_tokens=23,
                                   spans=cachegen.spans_of(masks))
    return root, chunks, masks


def mask_of(chunks, masks) -> dict[int, bool]:
    return {t: f for docs, ms in zip(chunks, masks) for d, m in zip(docs, ms) for t, f in zip(d.tolist(), m.tolist())}


def same(a, b, keys=TOKEN_FIELDS) -> None:
    for k in keys:
        assert np.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("eval_mode", [False, True])
def test_masked_batches_are_the_reference_in_both_layouts(sft, kind, eval_mode):
    root, chunks, masks = sft
    R, B = (1, 3) if eval_mode else (2, 4)
    lossy = not_lossy = 0
    for L in (1, 7, 20):
        opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=R, eval_mode=eval_mode, **KINDS[kind])
        ref = cachegen.Reference(chunks, L, R, loop=not eval_mode, masks=masks, **KINDS[kind])
        with Reader(root, opts) as rd:
            assert rd.masked
            n = rd.num_batches if eval_mode else 5
            for b in range(n):
                x = rd.batch(b)
                want = [ref.example(b * B + i) for i in range(B)]
                for k in TOKEN_FIELDS:
                    assert np.array_equal(x[k], np.stack([e[k] for e in want])), (L, b, k)
                real = x["segment_ids"] > 0
                lossy += int(x["loss_mask"].sum())
                not_lossy += int((real & ~x["loss_mask"]).sum())
                if opts.packed:
                    with Reader(root, dataclasses.replace(opts, layout="flat")) as fl:
                        y = fl.batch(b)
                    assert list(y) == list(FLAT_KEYS[:3]) + ["loss_mask"] + list(FLAT_KEYS[3:])
                    assert not (y["loss_mask"] & ~real).any()  # flags only on real tokens
                    same(expand_flat(y), x)
    assert lossy and not_lossy, "the masks do not exercise both values"


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shuffle_seed", [None, 4])
def test_seek_equals_iterate_with_masks(sft, kind, shuffle_seed):
    """Iterating (slabs of 16 batches: a stream's windows of consecutive batches copied as one run when
    batch_size == ideal_readers) equals seeking to each batch (one batch a pass), in both layouts."""
    root = sft[0]
    for layout in ("arrays", "flat") if kind != "unpacked" else ("arrays",):
        opts = ReadOptions(seq_len=3, batch_size=4, ideal_readers=4, shuffle_seed=shuffle_seed, layout=layout,
                           **KINDS[kind])
        with Reader(root, opts, num_readers=2, reader_index=1) as a, \
                Reader(root, opts, num_readers=2, reader_index=1) as c:
            it = list(a.iter_batches(0, 20))
            for b, x in it[5:] + it[:5]:
                y = c.batch(b)
                for k in x:
                    assert np.array_equal(x[k], y[k]), (layout, b, k)
            assert "loss_mask" in it[0][1]


def test_a_short_record_is_never_cut_and_a_long_one_only_at_multiples_of_seq_len(sft):
    root, chunks, masks = sft
    flags = mask_of(chunks, masks)
    L = 20
    docs = [d for c in chunks for d in c if len(d)]
    assert any(len(d) > L for d in docs) and any(len(d) <= L for d in docs)
    for kind in ("best_fit", "unpacked"):
        opts = ReadOptions(seq_len=L, batch_size=4, ideal_readers=1, eval_mode=True, **KINDS[kind])
        with Reader(root, opts) as rd:
            got = [x for _, x in rd.iter_batches()]
        tg, seg, pos, lm = (np.concatenate([x[k] for x in got]) for k in ("targets", "segment_ids", "positions",
                                                                         "loss_mask"))
        where = {t: (r, c) for r, c in zip(*np.nonzero(seg)) for t in [int(tg[r, c])]}
        for d in docs:
            at = [where[t] for t in d.tolist()]
            rows = np.asarray([r for r, _ in at])
            cols = np.asarray([c for _, c in at])
            piece = np.arange(len(d)) // L  # a long document: pieces of L tokens from its start
            if len(d) <= L:
                assert (rows == rows[0]).all(), (kind, "a short record cut over rows")
            for p in np.unique(piece):
                r, c = rows[piece == p], cols[piece == p]
                assert (r == r[0]).all() and np.array_equal(c, c[0] + np.arange(c.size)), (kind, "a piece split")
                assert len(np.unique(seg[r, c])) == 1 and pos[r[0], c[0]] == p * L
            assert lm[rows, cols].tolist() == [flags[t] for t in d.tolist()], kind


def test_a_mixture_of_a_text_and_an_sft_cache(tmp_path):
    rng = np.random.default_rng(5)
    text, nxt = unique_chunks(rng, 6)
    sft_chunks, _ = unique_chunks(rng, 6, first=nxt)
    masks = cachegen.random_masks(rng, sft_chunks)
    cachegen.write_synthetic_cache(str(tmp_path / "text"), text, row_group_tokens=9)
    cachegen.write_synthetic_cache(str(tmp_path / "sft"), sft_chunks, row_group_tokens=9,
                                   spans=cachegen.spans_of(masks))
    mix = mixgen.write_mixture(str(tmp_path / "mix.json"), [("text", "text", 1.0), ("sft", "sft", 2.0)])
    plain = mixgen.write_mixture(str(tmp_path / "plain.json"), [("a", "text", 1.0), ("b", "text", 1.0)])
    flags = mask_of(sft_chunks, masks)
    for kind in sorted(KINDS):
        opts = ReadOptions(seq_len=8, batch_size=8, ideal_readers=2, shuffle_seed=3, **KINDS[kind])
        with Reader(mix, opts) as rd:
            assert rd.masked
            seen = set()
            for b in range(6):
                x = rd.batch(b)
                real = x["segment_ids"] > 0
                for r, t in zip(*np.nonzero(real)):
                    c = int(x["components"][r])
                    seen.add(c)
                    # text rows: the plain rule (every real token); SFT rows: the stored mask
                    assert x["loss_mask"][r, t] == (flags[int(x["targets"][r, t])] if c == 1 else True), (kind, b)
                assert not (x["loss_mask"] & ~real).any()
                if opts.packed:
                    with Reader(mix, dataclasses.replace(opts, layout="flat")) as fl:
                        y = fl.batch(b)
                        assert fl.ahead_bytes == (2 + 3 * fl.slab) * sum(a.nbytes for a in y.values())  # mask too
                    assert "loss_mask" in y
                    same(expand_flat(y), x)
            assert seen == {0, 1}
        with Reader(plain, dataclasses.replace(opts, layout="flat") if opts.packed else opts) as rd:
            assert not rd.masked and (not opts.packed or list(rd.batch(0)) == list(FLAT_KEYS))


@pytest.mark.parametrize("layout", ["arrays", "flat"])
def test_the_read_ahead_budget_counts_the_mask(sft, layout):
    root, _, _ = sft
    with Reader(root, ReadOptions(seq_len=8, batch_size=4, ideal_readers=2, layout=layout)) as rd:
        batch = rd.batch(0)
        assert rd.ahead_bytes == (2 + 3 * rd.slab) * sum(a.nbytes for a in batch.values())


@pytest.mark.parametrize("layout", ["arrays", "flat"])
def test_reader_workers_carry_the_mask(sft, layout):
    root, _, _ = sft
    opts = ReadOptions(seq_len=9, batch_size=8, ideal_readers=4, layout=layout, shuffle_seed=1)
    with Reader(root, opts, num_readers=2, reader_index=1) as plain, \
            Reader(root, dataclasses.replace(opts, num_workers=2), num_readers=2, reader_index=1) as workers:
        got = list(workers.iter_batches(0, 5))
        for b, x in got:
            want = plain.batch(b)
            assert list(x) == list(want)
            for k in want:
                assert np.array_equal(x[k], want[k]), (b, k)
        assert "loss_mask" in got[0][1]


@pytest.mark.parametrize("kind", ["best_fit", "unpacked"])
def test_drop_long_skips_long_documents_and_counts_them(sft, kind):
    root, chunks, masks = sft
    L = 20
    keep = [[d for d in c if len(d) <= L] for c in chunks]
    keep_masks = [[m for d, m in zip(c, ms) if len(d) <= L] for c, ms in zip(chunks, masks)]
    long = [d for c in chunks for d in c if len(d) > L]
    assert long
    opts = ReadOptions(seq_len=L, batch_size=3, ideal_readers=1, eval_mode=True, drop_long=True, **KINDS[kind])
    ref = cachegen.Reference(keep, L, 1, loop=False, masks=keep_masks, **KINDS[kind])
    for _ in range(2):  # counted, then from the index file
        with Reader(root, opts) as rd:
            assert rd.dropped_long == {"documents": len(long), "tokens": sum(len(d) for d in long)}
            assert rd.num_examples == ref.num_examples()
            for b, x in rd.iter_batches():
                for i in range(3):
                    if b * 3 + i < ref.num_examples():
                        e = ref.example(b * 3 + i)
                        for k in TOKEN_FIELDS:
                            assert np.array_equal(x[k][i], e[k]), (b, i, k)
    window = f"-W{opts.best_fit_window_tokens}" if opts.packing == "best_fit" else ""
    index_file = os.path.join(root, "index", f"{opts.packing}-L{L}{window}-drop_long.json")
    with open(index_file) as f:
        index = json.load(f)
    for lie in ([[-1, 0]] * len(index["dropped"]), [[10 ** 9, 1]] * len(index["dropped"]), [[0, 0]]):
        with open(index_file, "w") as f:  # counts that cannot be this cache's: counted again
            json.dump(dict(index, dropped=lie), f)
        with Reader(root, opts) as rd:
            assert rd.dropped_long == {"documents": len(long), "tokens": sum(len(d) for d in long)}
    with Reader(root, dataclasses.replace(opts, drop_long=False)) as rd:  # its own index: long ones cut
        assert rd.dropped_long == {"documents": 0, "tokens": 0}
        assert rd.num_examples > ref.num_examples()
    with pytest.raises(ValueError, match="drop_long"):
        ReadOptions(seq_len=L, drop_long=True)


@pytest.mark.parametrize("options", [
    dict(compression="zstd", use_dictionary=["shard"], write_statistics=False),
    dict(compression="none", use_dictionary=False, data_page_size=64),
    dict(compression="snappy", use_dictionary=False, data_page_version="2.0", data_page_size=100),
    dict(compression="zstd", use_dictionary=True),  # dictionary pages: pyarrow's reader
])
def test_fast_loss_span_decoding_equals_pyarrow(tmp_path, options):
    rng = np.random.default_rng(8)
    chunks, _ = unique_chunks(rng, 3, max_len=200, huge_len=700)
    chunks[1].insert(0, np.zeros(0, np.int32))
    masks = cachegen.random_masks(rng, chunks, none_prob=0.3)
    cachegen.write_synthetic_cache(str(tmp_path), chunks, row_group_tokens=300, writer_options=options,
                                   spans=cachegen.spans_of(masks))
    with Reader(str(tmp_path), ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as fast, \
            Reader(str(tmp_path), ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as slow:
        slow.store.fast_decode = False
        for c in range(3):
            G = fast.store.meta(c).num_row_groups
            got = np.concatenate([fast.store.row_group(c, g).loss[1:] for g in range(G)] + [np.zeros(0, bool)])
            assert np.array_equal(got, np.concatenate([slow.store.row_group(c, g).loss[1:] for g in range(G)]
                                                      + [np.zeros(0, bool)]))
            assert np.array_equal(got, np.concatenate(masks[c] + [np.zeros(0, bool)]))
        m = fast.store.meta(0)
        off, length = (int(x) for x in m.rg_ranges[0])
        data = open(os.path.join(str(tmp_path), m.path), "rb").read()[off:off + length]
        used = fast_list_values(data, m.file_meta.row_group(0).column(4), int(m.rg_doc_starts[1]), base=off)
        assert (used is not None) == (options["use_dictionary"] is not True)  # the fast path read it


def _rewrite_ledger(root, change) -> None:
    path = os.path.join(root, fmt.LEDGER_NAME)
    ledger = json.load(open(path))
    change(ledger)
    open(path, "w").write(fmt.dumps_ledger(ledger))


def test_bad_spans_and_counts_are_clear_errors(tmp_path, capsys):
    docs = [np.arange(1, 11, dtype=np.int32), np.arange(11, 15, dtype=np.int32)]
    root = str(tmp_path / "bad")
    cachegen.write_synthetic_cache(root, [docs], spans=[[[2, 5, 4, 8], [0, 4]]])  # overlapping spans
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as rd:
        with pytest.raises(ChunkError, match=r"chunk-000000\.parquet: row group 0: its loss spans cannot be read "
                                             r"\(loss_spans out of order"):
            rd.batch(0)
    assert cli(["validate", root]) == 1
    assert "document 0 of the row group are not sorted, disjoint" in capsys.readouterr().out

    # a span past its document, inside the row group (every checksum made for it): its loss tokens went
    # to the next document with exit 0; refused when read, named by validate
    root = str(tmp_path / "past")
    cachegen.write_synthetic_cache(root, [docs], spans=[[[8, 12], []]])
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as rd:
        with pytest.raises(ChunkError, match=r"chunk-000000\.parquet: row group 0: its loss spans cannot be read "
                                             r"\(loss_spans of document 0 of the row group reach past its 10 tokens\)"):
            rd.batch(0)
    assert cli(["validate", root]) == 1
    assert "document 0 of the row group are not sorted, disjoint, non-empty ranges within its 10 tokens" in \
        capsys.readouterr().out

    root = str(tmp_path / "counts")
    cachegen.write_synthetic_cache(root, [docs], spans=[[[2, 5], [0, 4]]])
    assert cli(["validate", root]) == 0
    side = os.path.join(root, fmt.sidecar_path(0, 0))
    sc = json.load(open(side))
    sc["loss_tokens"] += 1  # the sidecar and the ledger agree with each other, not with the file
    open(side, "wb").write(sidecar.sidecar_bytes(sc))

    def entry(ledger):
        ledger["chunks"][0].update(loss_tokens=sc["loss_tokens"], sidecar_checksum=fmt.checksum(sidecar.sidecar_bytes(sc)))
        ledger["totals"]["loss_tokens"] = 1
    _rewrite_ledger(root, entry)
    capsys.readouterr()
    assert cli(["validate", root]) == 1
    out = capsys.readouterr().out
    assert "its loss spans cover 7 tokens, the ledger says loss_tokens 8" in out
    assert "totals.loss_tokens = 1, the chunk entries sum to 8" in out

    root = str(tmp_path / "unmasked")  # the ledger says chat, the chunk has no loss_spans
    cachegen.write_synthetic_cache(root, [docs])
    _rewrite_ledger(root, lambda ledger: ledger["config"].update(record_format="chat"))
    with Reader(root, ReadOptions(seq_len=4, batch_size=1, ideal_readers=1)) as rd:
        with pytest.raises(ChunkError, match="no loss_spans column"):
            rd.batch(0)
    capsys.readouterr()
    assert cli(["validate", root]) == 1
    assert "no loss_spans column, but the ledger's config.record_format is 'chat'" in capsys.readouterr().out


def test_export_refuses_and_inspect_shows_the_loss_share(sft, tmp_path, capsys):
    root, chunks, masks = sft
    for form in ("megatron", "flat-tokens"):
        assert cli(["export", root, "--format", form, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "a cache with loss masks" in err and "has a standard place for a loss mask" in err
        assert not os.listdir(tmp_path)
    assert cli(["inspect", root, "--json", "--seq_len", "20"]) == 0
    info = json.loads(capsys.readouterr().out)
    loss = sum(int(m.sum()) for ms in masks for m in ms)
    tokens = sum(len(d) for c in chunks for d in c)
    assert info["loss_tokens"] == loss and info["loss_token_share"] == pytest.approx(loss / tokens)
    long = [len(d) for c in chunks for d in c if len(d) > 20]
    assert info["longer_than_seq_len"] == {"seq_len": 20, "documents": len(long), "tokens": sum(long)}
    assert cli(["inspect", root, "--seq_len", "20"]) == 0
    assert f"loss tokens {loss} ({loss / tokens:.1%} of tokens)" in capsys.readouterr().out
