"""Columnar and JSON-array inputs keep the builder's promises: SIGKILL and rerun give a byte-identical cache,
a running build's cache is readable, train/validation splits, an input changed in place rebuilds exactly its
changed chunks (a finished cache refuses), a resized input is refused while its chunks exist."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys

import pyarrow as pa
import pytest

from build_helpers import REPO, build, load_ledger, read_dead_letters, tree_bytes
from columnar_files import cache_documents, corpus_table, write_arrow, write_json_array, write_parquet
from pipelines.errors import BuildError
from reader.format import spec as fmt

CHUNK = 5000
FRACTION, SEED = 0.25, 3
SPLITS = ("train", "validation")


def make_corpus(d) -> dict[str, list[str]]:
    """A Parquet file (with bad rows), an Arrow stream and a gzipped JSON array; shard -> the texts by row."""
    os.makedirs(d, exist_ok=True)
    t = corpus_table(150, seed=9)
    texts = t.column("text").to_pylist()
    bad = [None if i % 37 == 5 else ("" if i % 41 == 7 else x) for i, x in enumerate(texts)]
    write_parquet(d / "a.parquet", t.set_column(1, "text", pa.array(bad, pa.string())), row_group_size=20)
    u = corpus_table(120, seed=10)
    write_arrow(d / "b.arrow", u, batch_rows=25)
    v = corpus_table(25, seed=11)
    with gzip.GzipFile(d / "c.json.gz", "wb", mtime=0) as f:
        f.write(json.dumps(v.to_pylist()).encode())
    return {0: bad, 1: u.column("text").to_pylist(), 2: v.column("text").to_pylist()}


def argv(inputs: str, out: str, *extra: str) -> list[str]:
    return ["--input", inputs, "--output", out, "--tokenizer", "tiktoken:cl100k_base", "--chunk_bytes", str(CHUNK),
            "--max_bad_fraction", "1.0", "--keep_fields", "source", "--runner=FnApiRunner", *extra]


def build_args(**kw):
    return dict(chunk_bytes=CHUNK, max_bad_fraction=1.0, keep_fields="source", **kw)


def run_killed(args: list[str], kill_at: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "tests", "support", "kill_at.py"), kill_at, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def is_validation(text: str) -> bool:
    """docs/FORMAT.md's split rule, written out again."""
    h = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=b"chunkledger-split", salt=SEED.to_bytes(16, "big"))
    return int.from_bytes(h.digest(), "big") < int(FRACTION * 2.0 ** 64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("columnar_in")
    return d, make_corpus(d)


def test_splits_route_each_document_by_its_text_as_a_plain_build_orders_them(corpus, tmp_path):
    d, texts = corpus
    plain, _ = build(tmp_path, [str(d / "*")], name="plain", **build_args())
    split, _ = build(tmp_path, [str(d / "*")], name="split", validation_fraction=FRACTION, split_seed=SEED,
                     **build_args())
    docs = cache_documents(plain)
    by_split = {s: cache_documents(os.path.join(split, s)) for s in SPLITS}
    rank = {}  # the JSON array's documents are numbered by byte offset: its k-th is element k (all good)
    for doc in docs:
        rank[doc["shard"], doc["offset"]] = doc["offset"] if doc["shard"] < 2 else sum(k[0] == 2 for k in rank)
    text_of = [texts[doc["shard"]][rank[doc["shard"], doc["offset"]]] for doc in docs]
    assert by_split["validation"] == [doc for doc, t in zip(docs, text_of) if is_validation(t)]
    assert by_split["train"] == [doc for doc, t in zip(docs, text_of) if not is_validation(t)]
    assert 0 < len(by_split["validation"]) < len(docs) / 2
    # bad rows: dead-lettered once, in train
    assert read_dead_letters(os.path.join(split, "train")) == read_dead_letters(plain) != []
    assert not os.path.exists(os.path.join(split, "validation", fmt.BAD_DIR))
    for s in SPLITS:
        ledger = load_ledger(os.path.join(split, s))
        assert ledger["format_version"] == 4 and ledger["config"]["split"]["name"] == s


def prefix_of_final(root: str, final: dict) -> int:
    """A running build's cache shows a prefix of its final chunk list; returns its length."""
    from reader.storage.cache import Cache

    cache = Cache(root)
    assert not cache.complete
    n = len(cache.table)
    assert cache.table.paths == [c["path"] for c in final["chunks"][:n]]
    assert cache.table.checksums == [c["checksum"] for c in final["chunks"][:n]]
    return n


def test_kill_points_then_rerun_is_byte_identical_and_readable_meanwhile(corpus, tmp_path):
    from reader.cli.main import main as reader_cli

    d, _ = corpus
    clean, _ = build(tmp_path, [str(d / "*")], name="clean", **build_args())
    files = tree_bytes(clean)
    final = load_ledger(clean)
    _, res = build(tmp_path, [str(d / "*")], name="clean", **build_args())  # a finished cache: checked, kept
    assert res["counters"]["chunks_skipped"] == len(final["chunks"]) and tree_bytes(clean) == files
    writes = len(files) + 1  # every file once, and the plan ledger
    # the compressed JSON array is built first (the largest unit), then the columnar chunks in order
    points = ["1:after_rename", "3:before_rename", f"{writes // 3}:after_rename", f"{writes // 2}:before_rename",
              f"{writes * 2 // 3}:after_rename", f"{writes * 5 // 6}:before_rename", f"{writes}:before_rename"]
    partial = 0
    for i, point in enumerate(points):
        out = str(tmp_path / f"k{i}")
        proc = run_killed(argv(str(d / "*"), out), point)
        assert proc.returncode == -signal.SIGKILL, (point, proc.stdout, proc.stderr[-2000:])
        assert load_ledger(out)["finished"] is False
        n = prefix_of_final(out, final)
        partial += 0 < n < len(final["chunks"])
        assert reader_cli(["validate", out]) == 0
        _, res = build(tmp_path, [str(d / "*")], name=f"k{i}", **build_args())
        assert res["resumed"]
        assert tree_bytes(out) == files, f"resume after kill at {point} differs from a clean build"
    assert partial >= 2, "fewer than two kill points left a partly written cache to read"


def unfinish(out: str) -> None:
    """A finished cache turned into what a kill just before the final ledger write leaves."""
    plan = load_ledger(out)
    plan.update(finished=False, chunks=[], totals={}, bad_records={})
    for inp in plan["inputs"]:
        if inp["compression"] != "none":
            inp["chunks"] = None
        inp.pop("uncompressed_bytes")
    with open(os.path.join(out, fmt.LEDGER_NAME), "w") as f:
        f.write(fmt.dumps_ledger(plan))


def edit_in_place(path: str, old: bytes, new: bytes) -> None:
    data = open(path, "rb").read()
    assert data.count(old) == 1 and len(old) == len(new), old
    open(path, "wb").write(data.replace(old, new))


def test_an_input_changed_in_place_rebuilds_exactly_its_changed_chunks(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    t = corpus_table(200, seed=12)
    # no codec and no statistics: a same-length edit of one text changes the file's bytes there and nowhere else
    write_parquet(d / "a.parquet", t, compression="none", row_group_size=20, write_statistics=False,
                  use_dictionary=False)
    write_arrow(d / "b.arrow", t, batch_rows=20)
    write_json_array(d / "c.json", t)
    out, _ = build(tmp_path, [str(d / "*")], **build_args())
    unfinish(out)
    for name in ("a.parquet", "b.arrow", "c.json"):
        edit_in_place(str(d / name), b"doc 57: ", b"DOC 57: ")
    _, res = build(tmp_path, [str(d / "*")], **build_args())
    c = res["counters"]
    assert c["chunks_input_changed"] == 3 and c["chunks_written"] == 3
    assert c["chunks_skipped"] == len(res["ledger"]["chunks"]) - 3
    fresh, _ = build(tmp_path, [str(d / "*")], name="fresh", **build_args())
    assert tree_bytes(out) == tree_bytes(fresh)
    # a finished cache is never rebuilt from other inputs
    edit_in_place(str(d / "a.parquet"), b"doc 58: ", b"DOC 58: ")
    with pytest.raises(BuildError, match=f"input file {d / 'a.parquet'} changed since the cache in .* was finished"):
        build(tmp_path, [str(d / "*")], **build_args())
    # a file rewritten with other row groups (another size) no longer lines up with its chunks
    unfinish(out)
    write_parquet(d / "a.parquet", t, compression="none", row_group_size=30)
    with pytest.raises(BuildError, match=f"input file {d / 'a.parquet'} \\(shard 0\\) changed size since this build"):
        build(tmp_path, [str(d / "*")], **build_args())


def test_a_damaged_json_array_keeps_no_chunk_of_its_shard(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    t = corpus_table(100, seed=13)
    body = json.dumps(t.to_pylist()).encode()
    (d / "a.json").write_bytes(body[:len(body) * 2 // 3])  # cut inside the array
    with pytest.raises(BuildError, match=f"input file {d / 'a.json'} is damaged: not one JSON array: the file "
                                         "ends inside the array"):
        build(tmp_path, [str(d / "a.json")], **build_args())
    assert not os.path.exists(tmp_path / "cache" / fmt.shard_dir(0)) or \
        not any(n.endswith(".json") for n in os.listdir(tmp_path / "cache" / fmt.shard_dir(0)))
