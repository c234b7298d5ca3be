"""Views (ReadOptions.view): a read of a view is the read of a cache built from the kept documents alone, in
every kind of example, pass rule and shuffle; it is R-invariant, seekable and resumable; it follows a running
build (kept fields); its attribute and index files are verified; every error names the clause or the view."""

from __future__ import annotations

import html
import json
import os
import re

import numpy as np
import pytest

from cachegen import batches_during_and_after_build, random_chunks, write_attribute_set, write_synthetic_cache
from mixgen import write_mixture
from reader import Reader, ReadOptions
from reader.format import attributes as attrs
from reader.format import spec as fmt
from reader.mixture.mixture_file import MixtureError
from reader.storage.view_syntax import ViewError, parse_view

KINDS = {"concat": {}, "best_fit": {"packing": "best_fit"}, "unpacked": {"packed": False}}
VIEW = "not exact_duplicate and score >= 0.3 and dump in ['A']"


def corpus(seed: int = 0, n: int = 7):
    """Chunks with kept fields (``score``, ``dump``) and exact-duplicate marks (every fifth document marked)."""
    rng = np.random.default_rng(seed)
    chunks = random_chunks(rng, n, max_docs=8, max_len=30)
    fields = [{"score": [f"{rng.random():.3f}" if rng.random() > 0.05 else None for _ in c],
               "dump": [("A" if rng.random() < 0.7 else "B") for _ in c]} for c in chunks]
    return chunks, fields


def marks_of(chunks) -> list[np.ndarray]:
    """Every fifth document (by global index, from the sixth on) marked as a copy of document 0."""
    out, g = [], 0
    for c in chunks:
        idx = np.arange(g, g + len(c))
        out.append(np.where((idx % 5 == 4), 0, -1).astype(np.int64))
        g += len(c)
    return out


def kept(chunks, fields, marks):
    return [[d for d, s, dm, k in zip(c, f["score"], f["dump"], m) if k < 0 and s is not None and float(s) >= 0.3
             and dm == "A"] for c, f, m in zip(chunks, fields, marks)]


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """``(view cache, copy of its kept documents)``, both format version 4."""
    tmp = tmp_path_factory.mktemp("views")
    chunks, fields = corpus()
    marks = marks_of(chunks)
    full, copy = str(tmp / "full"), str(tmp / "copy")
    write_synthetic_cache(full, chunks, fields=fields, row_group_tokens=80, format_version=4,
                          chunks_per_shard=[4, 3])  # (row groups of several documents, some dropped between kept ones)
    write_attribute_set(full, "duplicates", attrs.EXACT, [{"keeper": m} for m in marks], {})
    write_synthetic_cache(copy, kept(chunks, fields, marks), row_group_tokens=20, format_version=4,
                          chunks_per_shard=[4, 3])
    return full, copy


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings("ignore::reader.order.passes.RepeatedRowsWarning")
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rule", [dict(pass_rule="spans", shuffle_seed=3), dict(pass_rule="streams"),
                                  dict(eval_mode=True)])
def test_a_view_reads_as_a_copy_of_its_kept_documents(caches, kind, rule):
    full, copy = caches
    opts = ReadOptions(seq_len=16, batch_size=4, ideal_readers=2, **KINDS[kind], **rule)
    with Reader(full, ReadOptions(**{**opts.__dict__, "view": VIEW})) as rv, Reader(copy, opts) as rc:
        n = rc.num_batches or 12
        assert n > 2
        for b in range(n):
            assert same(rv.batch(b), rc.batch(b)), b
        if rule.get("pass_rule") == "spans":
            assert rv.examples_per_pass == rc.examples_per_pass


@pytest.mark.parametrize("kind", ["concat", "best_fit"])
def test_a_view_is_r_invariant_seekable_and_resumable(caches, kind):
    full, _ = caches
    opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=4, shuffle_seed=1, view=VIEW, **KINDS[kind])
    with Reader(full, opts) as one:
        want = [{k: v.copy() for k, v in x.items()} for _, x in one.iter_batches(0, 6)]
        for b in (5, 2, 0):  # seek = iterate
            assert same(one.batch(b), want[b])
        assert [b for b, x in one.iter_batches(3, 3) if same(x, want[b])] == [3, 4, 5]  # resume from the step alone
    with Reader(full, ReadOptions(**{**opts.__dict__, "num_workers": 2})) as workers:  # (each opens the view)
        assert [b for b, x in workers.iter_batches(1, 4) if same(x, want[b])] == [1, 2, 3, 4]
    for R in (2, 4):
        readers = [Reader(full, opts, num_readers=R, reader_index=r) for r in range(R)]
        try:
            for b in range(6):
                got = {k: np.empty_like(v) for k, v in want[b].items()}
                for rd in readers:
                    part = rd.batch(b)
                    for k in got:
                        got[k][rd.my_rows] = part[k]
                assert same(got, want[b]), (R, b)
        finally:
            for rd in readers:
                rd.close()


@pytest.mark.filterwarnings("ignore::reader.order.passes.RepeatedRowsWarning")
def test_a_view_of_kept_fields_follows_a_running_build(tmp_path):
    chunks, fields = corpus(seed=4, n=9)
    opts = ReadOptions(seq_len=8, batch_size=4, ideal_readers=2, pass_rule="streams", view="score >= 0.5")
    got, want = batches_during_and_after_build(str(tmp_path), chunks, [5, 4], opts, 8, fields=fields,
                                               format_version=4)
    assert [b for b, x in got] == [b for b, x in want] and all(same(a[1], b[1]) for a, b in zip(got, want))
    copy = str(tmp_path / "copy")
    write_synthetic_cache(copy, [[d for d, s in zip(c, f["score"]) if s is not None and float(s) >= 0.5]
                                 for c, f in zip(chunks, fields)], chunks_per_shard=[5, 4], row_group_tokens=9,
                          format_version=4)
    with Reader(copy, ReadOptions(**{**opts.__dict__, "view": None}), num_readers=2, reader_index=1) as rc:
        assert all(same(x, rc.batch(b)) for b, x in want)


def test_a_view_needing_marks_waits_for_no_build_it_says_so(tmp_path):
    chunks, fields = corpus(seed=5)
    live = str(tmp_path / "live")
    write_synthetic_cache(live, chunks, fields=fields, finished=False, format_version=4)
    with pytest.raises(ViewError, match=r"'not exact_duplicate' needs duplicate marks.*still running.*"
                                        r"python -m pipelines.dedup"):
        Reader(live, ReadOptions(seq_len=8, batch_size=2, pass_rule="streams", view="not exact_duplicate"))


def test_errors_name_the_clause_or_the_view(caches):
    full, copy = caches
    base = dict(seq_len=16, batch_size=4, ideal_readers=2)
    with pytest.raises(ViewError, match=r"clause 'lang >= 0.5': .* keeps no field 'lang' \(it keeps: score, dump\)"):
        Reader(full, ReadOptions(**base, view=["lang >= 0.5"]))
    with pytest.raises(ViewError, match=r"near_duplicates/manifest.json is missing: compute them with "
                                        r"python -m pipelines.dedup .* --near"):
        Reader(full, ReadOptions(**base, view="not near_duplicate(0.8)"))
    with pytest.raises(ViewError, match=r"clause 'exact_duplicate\(mine\)'.*compute them"):
        Reader(full, ReadOptions(**base, view="exact_duplicate(mine)"))
    with pytest.raises(ViewError, match=r"clause 'dump > 3': field 'dump' holds 'A'.*not a number"):
        with Reader(full, ReadOptions(**base, view="dump > 3")) as r:
            r.batch(0)
    with pytest.raises(ViewError, match=r"the view \"dump in \['C'\] and score >= 0.3\" keeps no document of its"):
        Reader(full, ReadOptions(**base, view="score >= 0.3 and dump in ['C']"))
    with pytest.raises(ViewError, match=r"clause 'score >=': expected a number"):
        ReadOptions(**base, view="not exact_duplicate and score >=")
    with pytest.raises(ViewError, match="keeps no field"):  # a cache without kept fields
        Reader(copy, ReadOptions(**base, view="score >= 0.5"))


def test_the_syntax_has_one_canonical_text():
    a = parse_view("not exact_duplicate and dump in ['B', 'A'] and language_score >= 0.90")
    b = parse_view(["language_score>=0.9", "dump in [\"A\",'B',]", "not exact_duplicate(duplicates)"])
    assert a.text == b.text == "dump in ['A', 'B'] and language_score >= 0.9 and not exact_duplicate"
    assert a.key == b.key and parse_view("") is None and parse_view([]) is None
    assert parse_view("not near_duplicate(0.80, mine)").text == "not near_duplicate(0.8, mine)"
    for bad, what in [("a > 1 or b < 2", "expected 'and'"), ("not a > 1", "'not' goes before"),
                      ("near_duplicate(1.5)", r"lie in \(0, 1\]"), ("a in [1, 'x']", "mixes numbers and strings"),
                      ("__import__('os')", "expected a comparison"), ("a == b", "expected a number or a quoted")]:
        with pytest.raises(ViewError, match=what):
            parse_view(bad)


def test_a_kept_field_of_a_nested_key_has_its_dotted_name(tmp_path):
    chunks, fields = corpus(seed=13)
    root = str(tmp_path / "c")
    write_synthetic_cache(root, chunks, fields=[{"meta.dump": f["dump"], "score": f["score"]} for f in fields],
                          row_group_tokens=80, format_version=4)
    copy = str(tmp_path / "copy")
    write_synthetic_cache(copy, [[d for d, dm in zip(c, f["dump"]) if dm == "B"] for c, f in zip(chunks, fields)],
                          row_group_tokens=80, format_version=4)
    opts = ReadOptions(seq_len=16, batch_size=4, ideal_readers=2, eval_mode=True)
    with Reader(root, ReadOptions(**{**opts.__dict__, "view": "meta.dump == 'B'"})) as rv, Reader(copy, opts) as rc:
        assert rv.num_batches == rc.num_batches and all(same(rv.batch(b), rc.batch(b)) for b in range(rc.num_batches))


def test_an_edited_attribute_or_index_file_is_refused(tmp_path):
    chunks, fields = corpus(seed=2)
    root = str(tmp_path / "c")
    write_synthetic_cache(root, chunks, fields=fields, row_group_tokens=20, format_version=4)
    write_attribute_set(root, "duplicates", attrs.EXACT, [{"keeper": m} for m in marks_of(chunks)], {})
    opts = ReadOptions(seq_len=16, batch_size=4, ideal_readers=2, view="not exact_duplicate")
    with Reader(root, opts) as r:
        want = [r.batch(b) for b in range(4)]
    index = os.path.join(root, "index", f"view-{parse_view(opts.view).key}.bin")
    assert os.path.exists(index)

    # damaged bytes: not ours, counted again (the same batches)
    data = bytearray(open(index, "rb").read())
    data[-3] ^= 0xFF
    open(index, "wb").write(bytes(data))
    with Reader(root, opts) as r:
        assert all(same(r.batch(b), want[b]) for b in range(4))

    # a well-formed file whose counts are not what the chunks keep: refused naming it
    from reader.format import blocks
    head, parts = blocks.read_parts(open(index, "rb").read(), index)
    docs, tokens = parts["chunks"]["docs"].copy(), parts["chunks"]["tokens"].copy()
    docs[0] -= 1
    head.pop("parts")
    open(index, "wb").write(blocks.write_parts(head, {"chunks": [("docs", "int64", docs), ("tokens", "int64", tokens)]},
                                               1024))
    with pytest.raises(fmt.DamagedCache, match=r"index/view-.*\.bin: chunk 0 keeps .* the file says"):
        with Reader(root, opts) as r:
            for b in range(4):
                r.batch(b)
    os.remove(index)

    # an attribute file edited: refused naming it
    rel = attrs.file_path("duplicates", 0, 1)
    path = os.path.join(root, rel)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(fmt.DamagedCache, match=r"chunk-000001\.parquet: its size or sha256 is not the one"):
        Reader(root, opts)


@pytest.mark.parametrize("kind", ["concat", "unpacked"])
def test_a_mixture_of_two_views_of_one_cache_reads_as_a_mixture_of_two_copies(tmp_path, kind):
    chunks, fields = corpus(seed=7, n=8)
    full = str(tmp_path / "full")
    write_synthetic_cache(full, chunks, fields=fields, row_group_tokens=20, format_version=4)
    views = {"a": "dump == 'A' and score >= 0.2", "b": "dump in ['B']"}
    copies = {}
    for name, keep in (("a", lambda s, d: d == "A" and s is not None and float(s) >= 0.2), ("b", lambda s, d: d == "B")):
        copies[name] = str(tmp_path / name)
        write_synthetic_cache(copies[name], [[doc for doc, s, d in zip(c, f["score"], f["dump"]) if keep(s, d)]
                                             for c, f in zip(chunks, fields)], row_group_tokens=20, format_version=4)
    doc = {"mixture": 1, "seed": 5, "components": [{"name": n, "path": full, "weight": w, "view": views[n]}
                                                   for n, w in (("a", 3), ("b", 1))]}
    (tmp_path / "views.json").write_text(json.dumps(doc))
    two = write_mixture(str(tmp_path / "copies.json"), [("a", copies["a"], 3), ("b", copies["b"], 1)], seed=5)
    opts = ReadOptions(seq_len=8, batch_size=8, ideal_readers=2, shuffle_seed=2, **KINDS[kind])
    with Reader(str(tmp_path / "views.json"), opts) as rv, Reader(two, opts) as rc:
        assert len(rv.cache.distinct) == 2 and rv.cache.distinct[0] is rv.cache.distinct[1]  # one cache opened
        for b in range(10):
            got, want = rv.batch(b), rc.batch(b)
            assert same(got, want), b
        assert set(np.unique(got["components"]).tolist()) == {0, 1}
    from reader.report.summary import mixture_summary  # inspect MIXTURE.json: each component's view, its passes
    views_info, copies_info = (mixture_summary(p, opts, 10) for p in (str(tmp_path / "views.json"), two))
    keys = ("documents", "tokens", "examples_per_pass", "examples_drawn", "passes")
    assert [[c[k] for k in keys] for c in views_info["components"]] == \
        [[c[k] for k in keys] for c in copies_info["components"]]
    doc["components"][1]["view"] = "not near_duplicate(0.9)"
    (tmp_path / "views.json").write_text(json.dumps(doc))
    with pytest.raises(MixtureError, match=r"components\[1\] \('b'\): view clause 'not near_duplicate\(0.9\)'"):
        Reader(str(tmp_path / "views.json"), opts)


def test_inspect_shows_what_a_view_keeps_per_input(caches, capsys):
    from reader.cli.main import main

    full, copy = caches
    chunks, fields = corpus()
    shard_of = [0, 1, 0, 1, 0, 1, 0]  # (round-robin order of shards of 4 and 3 chunks)
    kept_docs = kept(chunks, fields, marks_of(chunks))
    assert main(["inspect", full, "--json", "--view", VIEW]) == 0
    got = json.loads(capsys.readouterr().out)["view"]
    assert got["view"] == parse_view(VIEW).text
    assert got["kept_documents"] == sum(map(len, kept_docs))
    assert got["dropped_tokens"] == sum(map(len, sum(chunks, []))) - sum(map(len, sum(kept_docs, [])))
    for s, row in enumerate(got["by_input"]):
        assert row["kept_documents"] == sum(len(k) for k, sh in zip(kept_docs, shard_of) if sh == s)
        assert row["kept_documents"] + row["dropped_documents"] == sum(len(c) for c, sh in zip(chunks, shard_of)
                                                                       if sh == s)
    marked = int(sum((m >= 0).sum() for m in marks_of(chunks)))  # (all marked with document 0: one cluster)
    (c,) = got["clusters"]
    assert (c["set"], c["clusters"], c["marked"], c["sizes"]) == ("duplicates", 1, marked, {str(marked + 1): 1})
    assert c["largest"][0]["keeper"] == 0 and c["largest"][0]["copy"] == 4
    assert c["largest"][0]["keeper_tokens"] == list(chunks[0][0][:12])
    assert main(["inspect", full, "--view", VIEW]) == 0
    text = capsys.readouterr().out
    assert "view        " + parse_view(VIEW).text in text and "clusters    duplicates (exact_duplicates): 1 clusters" in text
    assert main(["inspect", full, "--view", "lang > 1"]) == 2
    assert "view clause 'lang > 1'" in capsys.readouterr().err


def test_both_loaders_serve_a_view(caches):
    pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    from reader.jax import JaxLoader
    from reader.torch import TokenBatches, token_loader

    full, _ = caches
    opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=2, shuffle_seed=1, view=VIEW)
    with Reader(full, opts) as r:
        want = [r.batch(b)["targets"] for b in range(3)]
    it = iter(token_loader(TokenBatches(full, opts, rank=0, world_size=1), num_workers=1))
    assert all(np.array_equal(next(it)["targets"].numpy(), w) for w in want)
    loader = JaxLoader(full, opts, mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    assert all(np.array_equal(np.asarray(loader.global_batch(b)["targets"]), w) for b, w in enumerate(want))


@pytest.mark.parametrize("kind", ["concat", "best_fit"])
def test_a_view_of_a_remote_cache_read_asynchronously_serves_the_local_batches(tmp_path, kind):
    from counting_fs import counting

    chunks, fields = corpus(seed=9)
    full = str(tmp_path / "c")  # (format version 2: counting:// serves byte ranges, not a version 4 table's reads)
    write_synthetic_cache(full, chunks, fields=fields, row_group_tokens=20, chunks_per_shard=[4, 3])
    write_attribute_set(full, "duplicates", attrs.EXACT, [{"keeper": m} for m in marks_of(chunks)], {})
    opts = ReadOptions(seq_len=16, batch_size=8, ideal_readers=2, shuffle_seed=4, view=VIEW, **KINDS[kind])
    with Reader(full, opts) as r:
        want = [{k: v.copy() for k, v in x.items()} for _, x in r.iter_batches(2, 6)]
    with counting():
        with Reader("counting://" + full, opts) as r:
            assert r.store.asynchronous
            got = [{k: v.copy() for k, v in x.items()} for _, x in r.iter_batches(2, 6)]
    assert all(same(a, b) for a, b in zip(got, want)) and len(got) == 6


def test_near_duplicates_are_left_out_at_the_threshold_asked(tmp_path):
    chunks, _ = corpus(seed=11)
    rng = np.random.default_rng(3)
    marks, jacs = [], []
    first = 0
    for c in chunks:
        marked = (np.arange(first, first + len(c)) > 0) & (rng.random(len(c)) < 0.4)
        marks.append(np.where(marked, 0, -1).astype(np.int64))
        jacs.append(np.where(marked, rng.choice([0.78, 0.85, 0.95], len(c)), 0).astype(np.float32))
        first += len(c)
    root = str(tmp_path / "c")
    write_synthetic_cache(root, chunks, row_group_tokens=20, format_version=4)
    write_attribute_set(root, "near_duplicates", attrs.NEAR, [{"keeper": m, "jaccard": j} for m, j in zip(marks, jacs)],
                        {"threshold": 0.75})
    for t in (0.8, 0.9):
        copy = str(tmp_path / f"copy{t}")
        write_synthetic_cache(copy, [[d for d, m, j in zip(c, ms, js) if not (m >= 0 and j >= np.float32(t))]
                                     for c, ms, js in zip(chunks, marks, jacs)], row_group_tokens=20, format_version=4)
        opts = ReadOptions(seq_len=16, batch_size=4, ideal_readers=2, eval_mode=True)
        with Reader(root, ReadOptions(**{**opts.__dict__, "view": f"not near_duplicate({t})"})) as rv, \
                Reader(copy, opts) as rc:
            assert rv.num_batches == rc.num_batches and all(same(rv.batch(b), rc.batch(b)) for b in range(rc.num_batches))
    with pytest.raises(ViewError, match=r"verified at Jaccard >= 0.75; a threshold below it"):
        Reader(root, ReadOptions(seq_len=16, batch_size=4, view="not near_duplicate(0.7)"))
    with pytest.raises(ViewError, match=r"holds near_duplicates, not exact_duplicates"):
        Reader(root, ReadOptions(seq_len=16, batch_size=4, view="not exact_duplicate(near_duplicates)"))


@pytest.mark.parametrize("kind", ["concat", "best_fit"])
def test_a_view_of_a_cache_with_loss_masks_keeps_each_document_s_mask(tmp_path, kind):
    from cachegen import random_masks, spans_of

    chunks, fields = corpus(seed=12)
    spans = spans_of(random_masks(np.random.default_rng(2), chunks))
    full, copy = str(tmp_path / "full"), str(tmp_path / "copy")
    # (row groups of several documents: some are dropped between kept ones)
    write_synthetic_cache(full, chunks, fields=fields, spans=spans, row_group_tokens=80, format_version=4)
    keep = [[s is not None and float(s) >= 0.4 for s in f["score"]] for f in fields]
    write_synthetic_cache(copy, [[d for d, k in zip(c, ks) if k] for c, ks in zip(chunks, keep)],
                          spans=[[sp for sp, k in zip(ss, ks) if k] for ss, ks in zip(spans, keep)],
                          row_group_tokens=20, format_version=4)
    opts = ReadOptions(seq_len=16, batch_size=4, ideal_readers=2, shuffle_seed=5, **KINDS[kind])
    with Reader(full, ReadOptions(**{**opts.__dict__, "view": "score >= 0.4"})) as rv, Reader(copy, opts) as rc:
        for b in range(8):
            got, want = rv.batch(b), rc.batch(b)
            assert same(got, want) and "loss_mask" in got, b


def test_batches_and_inspect_read_through_a_view(caches, tmp_path, capsys):
    from reader.cli.main import main

    full, copy = caches
    out = str(tmp_path / "b.npz")
    assert main(["batches", full, "--seq_len", "16", "--batch_size", "4", "--ideal_readers", "2", "--count", "3",
                 "--view", VIEW, "--out", out]) == 0
    capsys.readouterr()
    got = np.load(out)
    assert json.loads(str(got["options"]))["view"] == VIEW
    with Reader(copy, ReadOptions(seq_len=16, batch_size=4, ideal_readers=2)) as rc:
        assert all(np.array_equal(got["targets"][b], rc.batch(b)["targets"]) for b in range(3))
    assert main(["inspect", full, "--seq_len", "16", "--view", VIEW, "--json"]) == 0
    with Reader(copy, ReadOptions(seq_len=16)) as rc:  # (a pass is the view's)
        assert json.loads(capsys.readouterr().out)["passes"]["examples_per_pass"] == rc.examples_per_pass


@pytest.mark.parametrize("packing", ["unpacked", "best_fit"])
def test_index_with_a_view_writes_the_files_a_viewed_read_loads(tmp_path, packing, capsys, monkeypatch):
    from reader.cli.main import main
    from reader.storage import index as index_mod, views

    chunks, fields = corpus(seed=4)
    root = str(tmp_path / "c")
    write_synthetic_cache(root, chunks, fields=fields, row_group_tokens=20, format_version=4)
    write_attribute_set(root, "duplicates", attrs.EXACT, [{"keeper": m} for m in marks_of(chunks)], {})
    assert main(["index", root, "--seq_len", "16", "--packing", packing, "--view", VIEW]) == 0
    out = capsys.readouterr().out
    made = sorted(os.listdir(os.path.join(root, "index")))
    assert f"view-{parse_view(VIEW).key}.bin" in made and any(n.startswith(packing) and "-V" in n for n in made), made
    assert all(n in out for n in made)
    # a read through the view now loads both files: it counts no chunk again
    loaded, counted = [], []
    load, counts = views.View._load, index_mod.ExampleIndex.counts
    monkeypatch.setattr(views.View, "_load", lambda self, t: load(self, t) or loaded.append(self._n == len(t)))
    monkeypatch.setattr(index_mod.ExampleIndex, "counts",
                        lambda self, t: (counts(self, t), counted.append(self.counted))[0])
    opts = ReadOptions(seq_len=16, batch_size=4, ideal_readers=2, view=VIEW, packing=packing)
    with Reader(root, opts) as r:
        got = [r.batch(b) for b in range(3)]
    assert loaded and all(loaded) and counted and not any(counted), (loaded, counted)
    monkeypatch.undo()
    with Reader(root, ReadOptions(**{**opts.__dict__, "index_cache": False})) as r:
        assert all(same(r.batch(b), got[b]) for b in range(3))


def test_validate_counts_a_view_s_files_again_and_names_an_edited_one(tmp_path, capsys):
    from reader.cli.main import main
    from reader.format import blocks

    chunks, fields = corpus(seed=5)
    root = str(tmp_path / "c")
    write_synthetic_cache(root, chunks, fields=fields, row_group_tokens=20, format_version=4)
    write_attribute_set(root, "duplicates", attrs.EXACT, [{"keeper": m} for m in marks_of(chunks)], {})
    assert main(["index", root, "--seq_len", "16", "--packing", "unpacked", "--view", VIEW]) == 0
    capsys.readouterr()
    assert main(["validate", root]) == 0, capsys.readouterr().out
    capsys.readouterr()

    def edit(name: str, part: str, key: str) -> str:
        """The file ``index/NAME`` well formed, under its fingerprint, with its largest ``key`` one less."""
        path = os.path.join(root, "index", name)
        head, parts = blocks.read_parts(open(path, "rb").read(), path)
        cols = {k: np.asarray(v).copy() for k, v in parts[part].items()}
        cols[key][np.argmax(cols[key])] -= 1
        head.pop("parts")
        open(path, "wb").write(blocks.write_parts(head, {part: [(k, "int64", v) for k, v in cols.items()]}, 1024))
        return path

    for name in sorted(os.listdir(os.path.join(root, "index"))):
        before = open(os.path.join(root, "index", name), "rb").read()
        path = edit(name, *(("chunks", "docs") if name.startswith("view-") else ("chunks", "examples")))
        assert main(["validate", root]) == 1
        out = capsys.readouterr().out
        assert f"PROBLEM {path}: " in out and "delete it (readers make it again)" in out, out
        open(path, "wb").write(before)
    assert main(["validate", root]) == 0


def test_the_report_page_shows_what_a_view_keeps_per_input(caches, tmp_path, capsys):
    from reader.cli.main import main
    from reader.storage.cache import Cache

    full, copy = caches
    out = str(tmp_path / "rep")
    assert main(["report", full, "--out", out, "--seq_len", "16", "--batch_size", "4", "--view", VIEW]) == 0
    text = open(os.path.join(out, "index.html"), encoding="utf-8").read()
    kept, whole = Cache(copy).table, Cache(full).table
    section = text[text.index("<h2>View</h2>"):text.index("<h2>Figures</h2>")]
    row = re.search(r"<tr><td>all</td>((?:<td class='n'>[^<]*</td>)+)</tr>", section)
    assert row and re.findall(r">([^<]*)<", row.group(1))[::2] == [
        f"{int(kept.docs.sum()):,}", f"{int(whole.docs.sum()):,}", f"{int(kept.tokens.sum()):,}",
        f"{int(whole.tokens.sum()):,}", f"{kept.tokens.sum() / whole.tokens.sum():.1%}"], section
    assert section.count("<tr><td>") == 1 + len(Cache(full).ledger.inputs)  # all, then each input
    assert html.escape(parse_view(VIEW).text) in section and f"view {html.escape(VIEW)}" in text
