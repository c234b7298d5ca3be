"""``ReadOptions(packing="best_fit")`` through the reader: the rows are each chunk's best-fit rows, window
after window, their counts are stored in ``index/best_fit-L{L}-W{W}.json``, a read decodes only the
windows its rows lie in and releases a window's row groups once past them, both layouts carry the rows,
and reading during a build, mixtures, reader workers and the command line work as for any other example
kind.

Batches against a brute-force reference, R-invariance, seek == iterate, shuffles and eval passes are in
tests/reader/test_reader_props.py (every example kind); the packer itself in
tests/reader/order/test_reader_packing.py."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import threading

import numpy as np
import pytest

from reader import ChunkError, ReadOptions, Reader, expand_flat
from reader.batch.schema import BATCH_KEYS
from reader.cli.main import main
from reader.mixture.mixture_file import MixtureError
from reader.order.packing import WINDOW_TOKENS, count_best_fit_windows, window_bounds
from reader.storage.index import ExampleIndex

import cachegen
from mixgen import write_components, write_mixture

L = 16
RGT = 30  # row-group tokens of the module's cache
W = 60  # window target: its chunks (up to ~500 tokens) have one to several windows


def chunks_with_long_documents(seed: int, n: int) -> list:
    """Chunks with documents of 1..40 tokens and some of 100 (longer than L = 16: full pieces and a
    continuation piece); every token id distinct."""
    rng = np.random.default_rng(seed)
    out, nxt = [], 1
    for _ in range(n):
        docs = []
        for _ in range(int(rng.integers(0, 9))):
            m = 100 if rng.random() < 0.15 else int(rng.integers(1, 41))
            docs.append(np.arange(nxt, nxt + m, dtype=np.int32))
            nxt += m
        out.append(docs)
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("best-fit") / "cache")
    chunks = chunks_with_long_documents(1, 13)
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=[7, 6], row_group_tokens=RGT)
    return root, chunks


def opts(**kw) -> ReadOptions:
    return ReadOptions(**{**dict(seq_len=L, batch_size=8, ideal_readers=4, packing="best_fit",
                                 best_fit_window_tokens=W), **kw})


def same(a: dict, b: dict, keys=None) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in (keys or a))


def rg_docs(docs, rgt=RGT) -> list:
    return [hi - lo for lo, hi in cachegen.row_groups([len(d) for d in docs], rgt)]


def rg_tokens(docs, rgt=RGT) -> list:
    return [sum(len(d) for d in docs[lo:hi]) for lo, hi in cachegen.row_groups([len(d) for d in docs], rgt)]


def test_packed_is_an_alias_of_packing():
    """packed=False is packing="unpacked", packed=True alone is "concat": equal options, and equal batches below."""
    assert ReadOptions(packed=False) == ReadOptions(packing="unpacked") == ReadOptions(packed=False, packing="unpacked")
    assert ReadOptions(packed=True) == ReadOptions() == ReadOptions(packing="concat", packed=True)
    assert ReadOptions(packing="best_fit", packed=True) == ReadOptions(packing="best_fit")
    assert [ReadOptions(packing=p).packed for p in ("concat", "best_fit", "unpacked")] == [True, True, False]
    assert hash(ReadOptions(packed=False)) == hash(ReadOptions(packing="unpacked"))
    # packing="concat" was the default beside packed=False, as dataclasses.replace passes it on
    assert ReadOptions(packed=False, packing="concat") == dataclasses.replace(ReadOptions(), packed=False) \
        == ReadOptions(packing="unpacked")
    for packed, packing in ((False, "best_fit"), (True, "unpacked")):
        with pytest.raises(ValueError, match=rf"^packing='{packing}' and packed={packed} disagree"):
            ReadOptions(packed=packed, packing=packing)


def test_options_refuse_best_fit_without_packing_and_unknown_packings():
    with pytest.raises(ValueError, match="packing='best_fit'.*packed=False"):
        ReadOptions(packed=False, packing="best_fit")
    with pytest.raises(ValueError, match="packing must be one of"):
        ReadOptions(packing="first_fit")
    assert ReadOptions().packing == "concat" and ReadOptions(packed=False).packing == "unpacked"
    assert opts().packing == "best_fit"
    assert ReadOptions(packing="best_fit").best_fit_window_tokens == WINDOW_TOKENS == 4 << 20
    with pytest.raises(ValueError, match="best_fit_window_tokens=60 applies to packing='best_fit' only"):
        ReadOptions(best_fit_window_tokens=60)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="best_fit_window_tokens must be an integer >= 1"):
            opts(best_fit_window_tokens=bad)


def test_an_eval_pass_is_every_chunks_rows_in_order(cache):
    """One stream, no loop: the rows are chunk 0's best-fit rows (window after window), then chunk 1's, ...:
    each row holds the pieces the brute-force packer names, continuation piece first, padded at its end."""
    root, chunks = cache
    want = []
    for docs in chunks:
        want += [[(docs[d], s, m) for d, s, m in row] for row in cachegen.best_fit_chunk(docs, L, RGT, W)]
    assert any(len(window_bounds(rg_tokens(docs), W)) > 2 for docs in chunks), "no chunk has two windows"
    with Reader(root, opts(eval_mode=True)) as r:
        assert r.num_examples == len(want)
        got = [x for _, x in r.iter_batches()]
    batch = {k: np.concatenate([x[k] for x in got]) for k in got[0]}
    assert (batch["valid"][:len(want)]).all() and not batch["valid"][len(want):].any()
    continued = 0
    for i, row in enumerate(want):
        t = 0
        for seg, (doc, s, m) in enumerate(row, start=1):
            assert batch["targets"][i, t:t + m].tolist() == doc[s:s + m].tolist()
            assert batch["positions"][i, t:t + m].tolist() == list(range(s, s + m))
            assert batch["inputs"][i, t] == (doc[s - 1] if s else 0)
            assert (batch["segment_ids"][i, t:t + m] == seg).all()
            continued += s > 0 and m < L and len(row) > 1
            t += m
        assert not batch["loss_mask"][i, t:].any() and not batch["targets"][i, t:].any()
        assert batch["loss_mask"][i, :t].all()
    assert continued, "no row shares a continuation piece: the cache does not exercise the rule"


def test_counts_are_stored_in_the_index_and_used(cache, monkeypatch):
    root, chunks = cache
    with Reader(root, opts()) as r:
        want = r.batch(5)
    got = json.load(open(os.path.join(root, "index", f"best_fit-L{L}-W{W}.json")))
    assert got["format"] == "chunkledger-best_fit-index" and got["seq_len"] == L and got["window_tokens"] == W
    windows = [count_best_fit_windows([len(d) for d in c], rg_docs(c), L, W).tolist() for c in chunks]
    assert got["windows"] == windows and got["counts"] == [sum(w) for w in windows]
    assert max(len(w) for w in windows) > 1

    def refuse(self, table, c):
        raise AssertionError("the stored index should have been used")

    monkeypatch.setattr(ExampleIndex, "_count", refuse)
    with Reader(root, opts()) as r:
        assert same(r.batch(5), want)


def test_the_window_is_part_of_the_order(cache):
    """Another window target packs other rows, counted in its own index file."""
    root, chunks = cache
    with Reader(root, opts(eval_mode=True)) as a, Reader(root, opts(eval_mode=True, best_fit_window_tokens=10**6)) as b:
        assert a.num_examples == sum(len(cachegen.best_fit_chunk(c, L, RGT, W)) for c in chunks)
        assert b.num_examples == sum(len(cachegen.best_fit_chunk(c, L, RGT, 10**6)) for c in chunks)
        assert b.num_examples < a.num_examples  # whole chunks pack tighter than windows
    assert os.path.exists(os.path.join(root, "index", f"best_fit-L{L}-W{10**6}.json"))


def test_a_read_decodes_only_the_window_its_rows_lie_in(tmp_path):
    """The point of windows: the first rows of a chunk need its first window's row groups, not the chunk."""
    root = str(tmp_path / "cache")
    rng = np.random.default_rng(5)
    docs, nxt = [], 1
    for m in rng.integers(1, 40, 300).tolist():
        docs.append(np.arange(nxt, nxt + m, dtype=np.int32))
        nxt += m
    cachegen.write_synthetic_cache(root, [docs], row_group_tokens=RGT)
    bounds = window_bounds(rg_tokens(docs), 400)
    assert len(bounds) > 4
    with Reader(root, opts(eval_mode=True, batch_size=2, best_fit_window_tokens=400)) as r:
        x = r.batch(0)
        assert r.store.decodes == bounds[1]  # window 0's row groups, each once
        assert {k[2] for k in r.store._lru if k[0] == "rg"} == set(range(int(bounds[1])))
        want = cachegen.best_fit_chunk(docs, L, RGT, 400)[:2]
        assert [x["targets"][i][x["loss_mask"][i]].tolist() for i in range(2)] == \
            [np.concatenate([d[s:s + m] for d, s, m in ([(docs[d], s, m) for d, s, m in row])]).tolist()
             for row in want]


def one_long_chunk(tmp_path) -> tuple[str, list]:
    """A cache of one chunk of 2000 documents of 1..199 tokens in row groups of 2000 tokens: windows of
    8000 tokens give it many."""
    root = str(tmp_path / "cache")
    rng = np.random.default_rng(6)
    docs, nxt = [], 1
    for m in rng.integers(1, 200, 2000).tolist():
        docs.append(np.arange(nxt, nxt + m, dtype=np.int32))
        nxt += m
    cachegen.write_synthetic_cache(root, [docs], row_group_tokens=2000)
    return root, docs


def test_a_read_releases_each_window(tmp_path):
    """Reading a chunk in order, row groups of the windows it has passed leave the cache: a pass holds
    about a window, not the chunk."""
    root, docs = one_long_chunk(tmp_path)
    groups = rg_docs(docs, 2000)
    window = 8000
    bounds = window_bounds(rg_tokens(docs, 2000), window)
    with Reader(root, opts(eval_mode=True, batch_size=4, best_fit_window_tokens=window, prefetch_threads=0)) as r:
        most = 0
        for _ in r.iter_batches():
            most = max(most, sum(k[0] == "rg" for k in r.store._lru))
        assert r.store.decodes == len(groups)  # every row group decoded once
        assert most <= 2 * int(np.diff(bounds).max())  # about a window held (the next may be loading)
        assert most < len(groups) / 2


def test_reading_ahead_decodes_the_windows_the_next_batches_enter_once(tmp_path):
    """What a reader worker does while it waits for its next slab (``Reader.read_ahead``): decode the
    windows the next batches enter, one row group a step, so that their reads decode nothing; never a row
    group the reads have passed (every row group is decoded once, also when it starts mid-read), and the
    batches are the same."""
    root, docs = one_long_chunk(tmp_path)
    o = opts(eval_mode=True, batch_size=4, best_fit_window_tokens=8000, prefetch_threads=0)
    bounds = window_bounds(rg_tokens(docs, 2000), 8000)
    groups = len(rg_docs(docs, 2000))
    assert len(bounds) > 5
    with Reader(root, o) as r:
        want = [x for _, x in r.iter_batches()]
    slab = 16  # batches read between two read-aheads (a worker's slab)
    with Reader(root, o) as r:
        assert r.lookahead_batches() > 2 * slab
        steps = on_demand = 0
        for b in range(0, len(want), slab):
            before = r.store.decodes
            got = r.batches(b, min(slab, len(want) - b))
            assert all(same(x, y) for x, y in zip(got, want[b:b + slab])), b
            on_demand += r.store.decodes - before
            steps += sum(1 for _ in r.read_ahead(b + slab))
        assert r.store.decodes == groups  # each row group once
        assert on_demand == bounds[1]  # the first window alone is decoded by a read
        assert steps == groups - bounds[1]
    with Reader(root, o) as r:  # nothing from the end of the read on
        assert list(r.read_ahead(0, 0)) == [] and r.store.decodes == 0
    with Reader(root, o) as r:  # reading ahead from inside a window, part of which the reads released
        b = 0
        while b < len(want) // 2 or r.release.released_before(0) in bounds.tolist():
            r.batch(b)
            b += 1
        assert sum(1 for _ in r.read_ahead(b)) > 0
        assert all(same(x, y) for x, y in zip(r.batches(b, len(want) - b), want[b:]))
        assert r.store.decodes == groups
    with Reader(root, dataclasses.replace(o, packing="concat", best_fit_window_tokens=WINDOW_TOKENS)) as r:
        # (concat decodes a row group at a time: nothing to read ahead)
        assert list(r.read_ahead(0)) == [] and r.store.decodes == 0


def test_reading_ahead_ends_quietly_on_a_damaged_chunk_and_lets_a_bug_through(tmp_path, monkeypatch):
    """Reading ahead leaves a damaged chunk (or one not built yet) to the real read, which reports it (or
    waits); any other error is a bug and must not be swallowed."""
    root, _ = one_long_chunk(tmp_path)
    o = opts(eval_mode=True, batch_size=4, best_fit_window_tokens=8000, prefetch_threads=0)
    with Reader(root, o) as r:
        def damaged(c):
            raise ChunkError(f"chunk {c}: damaged")
        monkeypatch.setattr(r.order.placer, "windows", damaged)
        assert list(r.read_ahead(0)) == [] and r.store.decodes == 0
        def bug(c):
            raise TypeError("a bug")
        monkeypatch.setattr(r.order.placer, "windows", bug)
        with pytest.raises(TypeError, match="a bug"):
            list(r.read_ahead(0))


def test_a_prefetch_that_runs_after_the_reads_passed_its_batches_decodes_nothing_they_released(tmp_path, monkeypatch):
    """A prefetch planned ahead of the reads can wait on the store's threads behind whole windows being
    decoded; by the time it runs, the reads may have passed its batches and released their row groups.
    It must not decode those again (best fit decoded 6-16% of a pass's row groups twice)."""
    root, docs = one_long_chunk(tmp_path)
    o = opts(eval_mode=True, batch_size=4, best_fit_window_tokens=8000, prefetch_threads=0)
    with Reader(root, o) as r:
        r.batch(0)
        queued = []  # the prefetch's tasks, held as if queued behind decodes
        monkeypatch.setattr(r.store, "submit", lambda fn, *args: queued.append((fn, args)) or cf.Future())
        r.prefetch(1, None, 20)
        assert queued
        monkeypatch.undo()
        b = 1
        while b <= 20 or r.release.released_before(0) == 0:
            r.batch(b)
            b += 1
        before = r.store.decodes
        for fn, args in queued:
            fn(*args)
        assert r.store.decodes == before


def test_a_window_is_packed_once_when_two_threads_ask_for_it(cache, monkeypatch):
    """A read and the prefetch often reach a window together: the second waits for the first's packing
    instead of packing it again. The first is held inside the window's decoding until the second has
    looked for the window among those being packed (no timing involved)."""
    root, chunks = cache
    c = next(i for i, docs in enumerate(chunks) if docs)
    with Reader(root, opts(prefetch_threads=0)) as r:
        r.stream_index()  # (the counts per window, as any read has them)
        idx, store = r.order.placer, r.store
        inside, asked, packed, got = threading.Event(), threading.Event(), [], {}

        class Watched(dict):  # the windows being packed; notes when the second thread looks
            def get(self, key, default=None):
                if threading.current_thread().name == "second":
                    asked.set()
                return super().get(key, default)

        idx._packing = Watched()
        window_docs = store.window_docs

        def held(*args):
            packed.append(threading.current_thread().name)
            if threading.current_thread().name == "first":
                inside.set()
                asked.wait(60)
            return window_docs(*args)

        monkeypatch.setattr(store, "window_docs", held)

        def ask():
            got[threading.current_thread().name] = idx.window_rows(c, 0)

        first, second = threading.Thread(target=ask, name="first"), threading.Thread(target=ask, name="second")
        first.start()
        assert inside.wait(60)
        second.start()
        for t in (first, second):
            t.join(60)
        assert asked.is_set() and not first.is_alive() and not second.is_alive()
        assert packed == ["first"] and got["first"] is got["second"]


def test_an_index_that_disagrees_with_the_chunks_is_a_clear_error(tmp_path):
    root = str(tmp_path / "cache")
    chunks = chunks_with_long_documents(4, 4)
    cachegen.write_synthetic_cache(root, chunks, row_group_tokens=RGT)
    with Reader(root, opts(batch_size=4)) as r:
        r.batch(0)
    path = os.path.join(root, "index", f"best_fit-L{L}-W{W}.json")
    good = json.load(open(path))
    got = dict(good)
    got["windows"] = [[n + 1 for n in w] for w in got["windows"]]  # fingerprint kept: a damaged index file
    got["counts"] = [sum(w) for w in got["windows"]]
    open(path, "w").write(json.dumps(got))
    with Reader(root, opts(batch_size=4)) as r:
        with pytest.raises(ChunkError, match=r"chunk-000000\.parquet: the documents of its packing window 0 pack "
                                             r"into \d+ rows of 16, the index says \d+\. Delete "
                                             r".*best_fit-L16-W60\.json"):
            r.batch(0)
    got = dict(good)
    got["windows"] = [[sum(w)] for w in got["windows"]]  # the right total, in one window
    open(path, "w").write(json.dumps(got))
    assert len(good["windows"][0]) > 1
    with Reader(root, opts(batch_size=4)) as r:
        with pytest.raises(ChunkError, match=r"chunk-000000\.parquet: its row groups make \d+ packing windows of "
                                             r"60 tokens, the index lists 1\. Delete .*best_fit-L16-W60\.json"):
            r.batch(0)


@pytest.mark.parametrize("extra", [{}, {"shuffle_seed": 4}, {"eval_mode": True}])
def test_flat_layout_expands_to_the_arrays_layout(cache, extra):
    root, _ = cache
    with Reader(root, opts(**extra)) as a, Reader(root, opts(layout="flat", **extra)) as f:
        for b in range(6 if not extra.get("eval_mode") else a.num_batches):
            x, y = a.batch(b), f.batch(b)
            assert same(expand_flat(y), x, BATCH_KEYS), b
            assert y["num_tokens"].tolist() == x["loss_mask"].sum(axis=1).tolist()
            # column 0 (which expand_flat ignores at a document start): the token before a continuation
            # piece (token ids run on within a document here), 0 before a row that starts a document
            tok = y["tokens"]
            before = np.where(y["first_positions"] > 0, (tok[:, 1] >> 1) - 1, 0)
            assert (tok[:, 0] >> 1).tolist() == before.tolist() and not (tok[:, 0] & 1).any(), b


@pytest.mark.parametrize("o,R,r,start", [
    (opts(layout="flat"), 1, 0, 0),
    (opts(shuffle_seed=3), 1, 0, 4),
    (opts(layout="flat", shuffle_seed=3), 2, 1, 2),
])
def test_reader_workers_equal_one_process(cache, o, R, r, start):
    root, _ = cache
    with Reader(root, o, R, r) as rd:
        want = [(b, {k: v.copy() for k, v in x.items()}) for b, x in rd.iter_batches(start, 20)]
    with Reader(root, dataclasses.replace(o, num_workers=2), R, r) as rd:
        got = list(rd.iter_batches(start, 20))
    assert [b for b, _ in got] == [b for b, _ in want]
    for (b, x), (_, y) in zip(got, want):
        assert list(x) == list(y) and same(x, y), b


@pytest.mark.parametrize("extra", [{}, {"eval_mode": True}])
def test_reading_during_the_build_equals_the_finished_cache(tmp_path, extra):
    chunks = chunks_with_long_documents(2, 10)
    o = opts(batch_size=4, **extra)
    got, want = cachegen.batches_during_and_after_build(str(tmp_path), chunks, [4, 3, 3], o, 8,
                                                        compressed=[False, True, False], first=(0, 1))
    assert [b for b, _ in got] == [b for b, _ in want]
    for (b, x), (_, y) in zip(got, want):
        assert same(x, y), b


def test_a_best_fit_mixture_serves_each_components_own_rows(tmp_path):
    paths, _ = write_components(str(tmp_path), [6, 5], max_docs=8, max_len=40)
    f = write_mixture(str(tmp_path / "mix.json"), [("a", "c0", 0.6), ("b", "c1", 0.4)], block=8)
    o = opts(shuffle_seed=2)
    with Reader(f, o) as r:
        got = [x for _, x in r.iter_batches(0, 6)]
        comp, k = r.order.assign(np.arange(6 * 8))
    alone = [Reader(p, o) for p in paths]
    try:
        for i in range(comp.size):
            b, row = divmod(i, 8)
            want = alone[comp[i]].examples([k[i]])
            assert got[b]["components"][row] == comp[i] and got[b]["example_ids"][row] == i
            for key in ("inputs", "targets", "segment_ids", "positions", "loss_mask", "epochs", "valid"):
                assert np.array_equal(got[b][key][row], want[key][0]), (i, key)
    finally:
        for a in alone:
            a.close()
    assert set(comp.tolist()) == {0, 1}


def test_a_mixture_component_cannot_choose_its_own_packing(tmp_path):
    """Every component is read with the run's options (docs/MIXTURES.md): a component's own packing is an
    unknown key of the mixture file."""
    paths, _ = write_components(str(tmp_path), [3, 3])
    doc = {"mixture": 1, "components": [{"name": "a", "path": "c0", "weight": 1, "packing": "best_fit"},
                                        {"name": "b", "path": "c1", "weight": 1}]}
    f = tmp_path / "mix.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(MixtureError, match=r"unknown key components\[0\].'packing'"):
        Reader(str(f), opts())


def test_cli_batches_with_packing(cache, tmp_path, capsys):
    root, _ = cache
    out = str(tmp_path / "b.npz")
    assert main(["batches", root, "--seq_len", str(L), "--batch_size", "8", "--ideal_readers", "4",
                 "--packing", "best_fit", "--best_fit_window_tokens", str(W), "--start", "2", "--count", "3",
                 "--out", out]) == 0
    got = np.load(out)
    recorded = json.loads(str(got["options"]))
    assert recorded["packing"] == "best_fit" and recorded["best_fit_window_tokens"] == W
    with Reader(root, opts()) as r:
        for i, b in enumerate(range(2, 5)):
            x = r.batch(b)
            for k in BATCH_KEYS:
                assert np.array_equal(got[k][i], x[k]), (b, k)
    capsys.readouterr()
    assert main(["batches", root, "--seq_len", str(L), "--batch_size", "8", "--unpacked", "--packing", "best_fit",
                 "--out", out]) == 2
    assert "--packing best_fit" in capsys.readouterr().err
    assert main(["batches", root, "--seq_len", str(L), "--batch_size", "8", "--best_fit_window_tokens", "60",
                 "--out", out]) == 2
    assert "best_fit_window_tokens=60 applies to packing='best_fit' only" in capsys.readouterr().err


def test_the_prefetch_names_the_same_row_groups_for_a_few_pieces_and_for_many(cache, monkeypatch):
    """A best-fit plan names every piece of its rows; the prefetch finds their row groups by a bisect per
    piece for a few and by one numpy search for many. Both name the row groups the pieces lie in, past
    those the reads released."""
    from reader.batch import prefetch

    root, _ = cache
    rng = np.random.default_rng(0)
    with Reader(root, opts()) as r:
        pf = r.prefetcher
        c = max(range(len(r.cache.table)), key=lambda i: r.store.meta(i).num_row_groups)
        meta = r.store.meta(c)
        starts = meta.rg_token_starts
        assert meta.num_row_groups >= 4
        tokens = rng.integers(0, int(r.cache.table.tokens[c]), 3 * prefetch._FEW_TOKENS)
        monkeypatch.setattr(r.release, "released_before", lambda _: 2)
        want = sorted({int(g) for g in np.searchsorted(starts, tokens, side="right") - 1 if g >= 2})
        for few in (prefetch._FEW_TOKENS, tokens.size):  # the numpy search, then bisect
            monkeypatch.setattr(prefetch, "_FEW_TOKENS", few)
            assert pf._missing(c, meta, tokens) == want
