"""Every corpus format in a build: the same text as JSON Lines, a JSON array, Parquet (two codecs, small and
large row groups), Arrow (stream and file) and a save_to_disk directory gives the same documents and tokens;
kept fields; dead letters with their row; refusals before the build; a damaged file is an error."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from build_helpers import DIRECT_MP2, FNAPI, build, load_ledger, read_dead_letters, tree_bytes
from columnar_files import (cache_documents, corpus_table, every_format, reference_tokens, write_arrow,
                            write_jsonl, write_parquet)
from pipelines.errors import BuildError
from reader.format import spec as fmt

N = 240
CHUNK = 6000
KEEP = "source,id"


@pytest.fixture(scope="module")
def table():
    return corpus_table(N, seed=5)


@pytest.fixture(scope="module")
def inputs(table, tmp_path_factory):
    return every_format(tmp_path_factory.mktemp("formats"), table)


@pytest.mark.parametrize("text_key", ["text", "metadata.text"])
def test_every_format_gives_the_same_documents_and_tokens(inputs, table, tmp_path, text_key):
    want = reference_tokens(table, text_key, append_eos=True)
    fields = [{"source": s, "id": str(i)} for i, s in enumerate(table.column("source").to_pylist())]
    for name, path in inputs.items():
        out, _ = build(tmp_path, [path], name=name, chunk_bytes=CHUNK, text_key=text_key, keep_fields=KEEP,
                       append_eos=True)
        docs = cache_documents(out)
        assert [d["tokens"] for d in docs] == want, name
        assert [d["fields"] for d in docs] == fields, name
        ledger = load_ledger(out)
        assert ledger["format_version"] == 4 and ledger["config"]["keep_fields"] == ["source", "id"]
        assert ledger["totals"]["docs"] == N and ledger["totals"]["bad_records"] == 0
        formats = {i["format"] for i in ledger["inputs"]}
        if name.startswith(("parquet", "arrow", "save")):
            # provenance: (shard, row), rows numbered per file; chunks are runs of whole groups
            per_shard = {}
            for d in docs:
                per_shard.setdefault(d["shard"], []).append(d["offset"])
            assert all(v == list(range(len(v))) for v in per_shard.values()), name
            assert all(i["rows"] == len(per_shard[i["shard"]]) for i in ledger["inputs"])
            for c in ledger["chunks"]:
                assert c["byte_range"] is None and c["row_range"][1] - c["row_range"][0] == c["docs"]
            assert formats <= {"parquet", "arrow"}
        else:
            assert formats == {name}
            assert all("row_range" not in c for c in ledger["chunks"])
        if name == "save_to_disk":
            assert [os.path.basename(i["path"]) for i in ledger["inputs"]] == \
                [f"data-0000{k}-of-00003.arrow" for k in range(3)]


@pytest.mark.slow
def test_one_build_mixes_formats_with_the_same_bytes_on_every_runner_and_worker_count(inputs, tmp_path):
    paths = [p for name, p in inputs.items() if name != "save_to_disk"]
    args = dict(chunk_bytes=CHUNK, keep_fields=KEEP, max_bad_fraction=1.0)
    one, _ = build(tmp_path, paths, name="fnapi", runner=FNAPI, **args)
    two, _ = build(tmp_path, paths, name="direct2", runner=DIRECT_MP2, **args)
    ref = tree_bytes(one)
    assert tree_bytes(two) == ref
    ledger = load_ledger(one)
    # f.arrow, s.arrow, sl.parquet, t.json, t.jsonl, zs.parquet
    assert [i["format"] for i in ledger["inputs"]] == ["arrow", "arrow", "parquet", "json_array", "jsonl",
                                                       "parquet"]
    assert ledger["totals"]["docs"] == 6 * N


def test_kept_fields_are_read_for_any_range_and_counted_and_batches_do_not_change(inputs, table, tmp_path,
                                                                                  capsys):
    from reader import ReadOptions, Reader
    from reader.cli.main import main as reader_cli
    from reader.storage.cache import Cache

    path = inputs["parquet_zstd_small_groups"]
    kept, _ = build(tmp_path, [path], name="kept", chunk_bytes=CHUNK, keep_fields=KEEP)
    plain, _ = build(tmp_path, [path], name="plain", chunk_bytes=CHUNK)
    assert "keep_fields" not in load_ledger(plain)["config"] and load_ledger(plain)["format_version"] == 4
    cache = Cache(kept)
    sources = table.column("source").to_pylist()
    got = cache.fields(17, 203)
    assert got == {"source": sources[17:203], "id": [str(i) for i in range(17, 203)]}
    assert reader_cli(["inspect", kept, "--by", "source"]) == 0
    out = capsys.readouterr().out
    tokens = {s: sum(len(t) for t, src in zip(reference_tokens(table), sources) if src == s) for s in set(sources)}
    for s, n in tokens.items():
        assert f"{sources.count(s):,}" in out.split(s, 1)[1].split("\n")[0]
        assert f"{n:,}" in out.split(s, 1)[1].split("\n")[0]
    opts = ReadOptions(seq_len=64, batch_size=4, ideal_readers=2, shuffle_seed=3)
    with Reader(kept, opts) as a, Reader(plain, opts) as b:
        for step in (0, 5, 11):
            x, y = a.batch(step), b.batch(step)
            assert x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x)


def test_a_float_field_is_kept_and_a_view_filters_on_it(table, tmp_path):
    """FineWeb's language_score is a float column: a version 4 build keeps it as its shortest exact text, the
    same from Parquet and from JSON Lines, and a view reads only the documents that pass a threshold."""
    import random

    from build_helpers import write_shard
    from reader import ReadOptions, Reader
    from reader.storage.cache import Cache

    rng = random.Random(4)
    scores = [rng.random() for _ in range(len(table))]
    fineweb = table.select(["text"]).append_column("language_score", pa.array(scores, pa.float64()))
    pq_path = write_parquet(tmp_path / "fineweb.parquet", fineweb)
    js_path = write_shard(str(tmp_path / "fineweb.jsonl"), fineweb.to_pylist())
    caches = [build(tmp_path, [p], name=name, chunk_bytes=CHUNK, keep_fields="language_score")[0]
              for name, p in (("pq", pq_path), ("js", js_path))]
    for out in caches:
        assert load_ledger(out)["config"]["keep_floats"] is True
        assert Cache(out).fields(0, len(scores)) == {"language_score": [repr(x) for x in scores]}
    from reader.storage.views import tally

    lengths = [len(t) for t in reference_tokens(table)]
    for out in caches:
        got = tally(Cache(out), "language_score >= 0.5")
        assert got["kept_documents"] == sum(x >= 0.5 for x in scores) > 0
        assert got["kept_tokens"] == sum(n for n, x in zip(lengths, scores) if x >= 0.5)
    opts = ReadOptions(seq_len=64, batch_size=4, ideal_readers=2, shuffle_seed=3, view="language_score >= 0.5")
    with Reader(caches[0], opts) as a, Reader(caches[1], opts) as b:
        for step in (0, 3):
            x, y = a.batch(step), b.batch(step)
            assert all((x[k] == y[k]).all() for k in x)


def test_bad_rows_are_dead_letters_with_their_row_and_reason(tmp_path):
    texts = [b"good one", None, b"", b"caf\xe9 latin-1", b"fine", b"x" * 3000, b"last"]
    t = pa.table({"text": pa.array(texts, pa.binary()), "n": pa.array([1, 2, None, 4, 5, 6, 7], pa.int64())})
    os.makedirs(tmp_path / "in")
    path = write_parquet(tmp_path / "in" / "bad.parquet", t, row_group_size=3)
    out, _ = build(tmp_path, [path], chunk_bytes=1024, keep_fields="n", max_bad_fraction=1.0, max_doc_bytes=2000)
    docs = cache_documents(out)
    assert [(d["offset"], d["fields"]) for d in docs] == [(0, {"n": "1"}), (4, {"n": "5"}), (6, {"n": "7"})]
    dead = read_dead_letters(out)
    assert [(d["row"], d["reason"]) for d in dead] == [(1, "null_text"), (2, "empty_text"), (3, "invalid_utf8"),
                                                       (5, "too_long")]
    assert dead[0]["value"] is None and dead[1]["value"] == "" and "value_base64" in dead[2]
    assert dead[3]["size"] == 3000 and dead[3]["value"] == "x" * 3000 and dead[3]["file"] == path
    assert load_ledger(out)["bad_records"] == {"empty_text": 1, "invalid_utf8": 1, "null_text": 1, "too_long": 1}


def test_an_over_long_json_array_element_is_too_long_like_a_line(tmp_path):
    records = [{"text": "short one"}, {"text": "word " * 2000}, {"text": "after it"}]
    os.makedirs(tmp_path / "in")
    for name, body in (("a.json", json.dumps(records)), ("b.jsonl", "".join(json.dumps(r) + "\n" for r in records))):
        (tmp_path / "in" / name).write_text(body)
    outs = {name: build(tmp_path, [str(tmp_path / "in" / name)], name=name, chunk_bytes=1024, max_doc_bytes=5000,
                        max_bad_fraction=1.0)[0] for name in ("a.json", "b.jsonl")}
    for out in outs.values():
        assert [d["reason"] for d in read_dead_letters(out)] == ["too_long"]
        (dead,) = read_dead_letters(out)
        assert dead["size"] == len(json.dumps(records[1])) and dead["line"] == json.dumps(records[1])[:4096]
        assert len(cache_documents(out)) == 2
    assert [d["tokens"] for d in cache_documents(outs["a.json"])] == \
        [d["tokens"] for d in cache_documents(outs["b.jsonl"])]


@pytest.mark.parametrize("name,setup,says", [
    ("wrong extension", lambda d, t: write_jsonl(d / "corpus.txt", t), "unknown format (extension '.txt')"),
    ("Parquet named .jsonl", lambda d, t: shutil.copy(write_parquet(d / "x.parquet", t), d / "corpus.jsonl") and None,
     "holds a Parquet file; rename it to *.parquet"),
    ("unknown format", lambda d, t: (d / "corpus.bin").write_bytes(b"\x00" * 64), "unknown format"),
    ("missing column", lambda d, t: write_parquet(d / "corpus.parquet", t.drop_columns(["text"])),
     "has no column 'text' (--text_key text). Its columns: id (int64), source (string), metadata (struct"),
    ("missing JSON key", lambda d, t: write_jsonl(d / "corpus.jsonl", t.rename_columns(
        ["id", "content", "source", "metadata"])), "have no key 'text' (--text_key text). Their keys"),
])
def test_refusals_before_the_build_name_the_file(table, tmp_path, name, setup, says):
    d = tmp_path / "in"
    d.mkdir()
    setup(d, table)
    with pytest.raises(BuildError) as e:
        build(tmp_path, [str(d / "corpus*")])
    assert says in str(e.value) and str(d / "corpus") in str(e.value)
    assert not os.path.exists(tmp_path / "cache" / fmt.LEDGER_NAME)  # nothing written
    if name == "missing JSON key":
        assert "pass --text_key content?" in str(e.value)


def test_a_damaged_file_is_an_error_naming_it_never_a_shorter_cache(table, tmp_path):
    os.makedirs(tmp_path / "in")
    path = write_parquet(tmp_path / "in" / "d.parquet", table, compression="zstd", row_group_size=40)
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(3).column(1)  # the text column chunk of row group 3
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    data = bytearray(open(path, "rb").read())
    middle = start + col.total_compressed_size // 2
    data[middle:middle + 64] = bytes(64)  # inside a page's compressed bytes
    open(path, "wb").write(bytes(data))
    with pytest.raises(BuildError) as e:
        build(tmp_path, [path], chunk_bytes=CHUNK)
    assert f"input file {path} is damaged" in str(e.value) and "row group 3" in str(e.value)
    assert load_ledger(str(tmp_path / "cache"))["finished"] is False
    assert os.path.exists(tmp_path / "cache" / "_FAILED.json")
    cut = write_arrow(tmp_path / "in" / "cut.arrow", table)
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) // 2)
    with pytest.raises(BuildError, match=f"input file {cut} is damaged: .*truncated"):
        build(tmp_path, [cut], name="cut", chunk_bytes=CHUNK)
