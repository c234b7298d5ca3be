"""Matching and planning inputs (pipelines/inputs/matching.py, pipelines/plan.py): formats found per file, a
save_to_disk directory as its .arrow files, columnar layouts planned from metadata, the work units and the
ledger's format version (3 only when the cache uses what version 3 added)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from build_helpers import work_units, write_shard
from columnar_files import corpus_table, save_to_disk, write_arrow, write_json_array, write_parquet
from pipelines.errors import BuildError
from pipelines.inputs.columnar import ColumnarChunk
from pipelines.inputs.matching import match_inputs, plan_inputs
from pipelines.options import build_arg_parser, chunk_config
from pipelines.plan import make_plan
from reader.format import spec as fmt


def config(*extra: str):
    args = build_arg_parser().parse_args(["--input", "x", "--output", "y", "--tokenizer", "t", "--chunk_bytes",
                                          "4000", *extra])
    return chunk_config(args)


def test_formats_are_found_per_file_and_columnar_files_planned(tmp_path):
    t = corpus_table(100)
    d = tmp_path / "in"
    d.mkdir()
    write_parquet(d / "a.parquet", t, row_group_size=10)
    write_arrow(d / "b.arrow", t, batch_rows=30)
    write_json_array(d / "c.json", t)
    write_shard(str(d / "d.jsonl.gz"), t.to_pylist())
    files = match_inputs([str(d / "*")])
    assert [(os.path.basename(f.path), f.format, f.layout) for f in files] == [
        ("a.parquet", "parquet", None), ("b.arrow", "arrow", None), ("c.json", "json_array", None),
        ("d.jsonl.gz", "jsonl", None)]
    cfg = config("--keep_fields", "source")
    plan = make_plan({"spec": "t"}, cfg, plan_inputs(files, cfg))
    a, b, c, e = plan.inputs
    assert (a.rows, b.rows) == (100, 100) and a.chunks == len(a.layout.chunks) > 1 and b.chunks > 1
    assert (c.chunks, e.chunks) == (fmt.num_chunks(c.size, 4000), None)
    ledger = plan.ledger()
    assert ledger["format_version"] == 4 and ledger["config"]["keep_fields"] == ["source"]
    assert [i["format"] for i in ledger["inputs"]] == ["parquet", "arrow", "json_array", "jsonl"]
    assert [i.get("rows") for i in ledger["inputs"]] == [100, 100, None, None]
    units = work_units(plan)
    columnar = [u for u in units if u.columnar is not None]
    assert len(columnar) == a.chunks + b.chunks and all(isinstance(u.columnar, ColumnarChunk) for u in columnar)
    assert [u.columnar.index for u in columnar if u.shard == 0] == list(range(a.chunks))  # in order
    assert {(u.shard, u.format) for u in units if u.streamed} == {(2, "json_array"), (3, "jsonl")}
    # a unit carries its chunk's groups only, never the whole file's
    assert all(len(u.columnar.group_rows) == u.columnar.span[1] - u.columnar.span[0] for u in columnar)


def test_a_new_jsonl_build_is_version_4_and_a_rerun_keeps_its_cache_version(tmp_path):
    path = write_shard(str(tmp_path / "a.jsonl"), [{"text": "one"}])
    cfg = config()
    plan = make_plan({"spec": "t"}, cfg, plan_inputs(match_inputs([path]), cfg))
    ledger = plan.ledger()
    assert ledger["format_version"] == 4 and "keep_fields" not in ledger["config"]
    # the plan's inputs also carry their fingerprint (checked before the ledger is finished; never in a
    # finished ledger, whose inputs keep exactly the others: tests/end_to_end/test_build_cache_hostile.py)
    assert set(ledger["inputs"][0]) == {"shard", "path", "size", "compression", "chunks", "crc32c", "format",
                                        "fingerprint"}
    # a rerun of a version 2 cache writes version 2, exactly as before (no input "format"); 1 becomes 2
    for resumed, written in ((1, 2), (2, 2), (3, 3), (4, 4)):
        old = dataclasses.replace(plan, resumes=resumed).ledger()
        assert old["format_version"] == written
        assert ("format" in old["inputs"][0]) == (written >= 3)


def test_a_save_to_disk_directory_is_its_arrow_files(tmp_path):
    t = corpus_table(50)
    saved = save_to_disk(tmp_path / "ds", t, num_shards=2)
    files = match_inputs([saved])
    assert [os.path.basename(f.path) for f in files] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert {f.format for f in files} == {"arrow"}
    state = json.loads((tmp_path / "ds" / "state.json").read_text())
    state["_data_files"].reverse()
    (tmp_path / "ds" / "state.json").write_text(json.dumps(state))
    with pytest.raises(BuildError, match="lists its .arrow files out of name order"):
        match_inputs([saved])


def test_planning_refuses_a_missing_column_or_text_key_naming_what_the_file_has(tmp_path):
    t = corpus_table(30)
    parquet = write_parquet(tmp_path / "a.parquet", t)
    cfg = config("--text_key", "body")
    with pytest.raises(BuildError, match=f"input file {parquet} has no column 'body' .* Its columns: id .*; pass "
                                         "--text_key text\\?"):
        plan_inputs(match_inputs([parquet]), cfg)
    jsonl = write_shard(str(tmp_path / "b.jsonl"), [{"content": f"doc {i}", "id": i} for i in range(30)])
    with pytest.raises(BuildError, match=f"input file {jsonl}: 30 of the first 30 records have no key 'body' "
                                         "\\(--text_key body\\). Their keys .*: content \\(30\\), id \\(30\\); pass "
                                         "--text_key content\\?"):
        plan_inputs(match_inputs([jsonl]), cfg)
    half = write_shard(str(tmp_path / "c.jsonl"), [{"body": "x"}] * 15 + [{"content": "y"}] * 15)
    assert plan_inputs(match_inputs([half]), cfg)[0].path == half  # half of them have it: bad records, if any


def test_a_directory_of_mixed_files_names_every_unknown_one_and_the_globs_to_use(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a.jsonl", "b.jsonl.gz", "c.parquet"):
        write_shard(str(tmp_path / "d" / name), [{"text": "x"}]) if "parquet" not in name else \
            write_parquet(tmp_path / "d" / name, corpus_table(3))
    for name in ("notes.txt", "README", "b.jsonl.gz.part"):
        (tmp_path / "d" / name).write_text("x")
    with pytest.raises(BuildError) as e:
        match_inputs(["d/*"])
    d = tmp_path / "d"
    assert str(e.value) == (
        f"3 input files of unknown format: {d}/README (no extension), {d}/b.jsonl.gz.part (extension '.part'), "
        f"{d}/notes.txt (extension '.txt'); leave them out, e.g. --input 'd/*.jsonl' --input 'd/*.jsonl.gz' "
        "--input 'd/*.parquet' (formats accepted: .jsonl, .ndjson or .json (each plain, .gz or .zst), .parquet, "
        ".arrow (Arrow IPC stream or file), or a directory written by datasets' save_to_disk)")
    assert [os.path.basename(f.path) for f in match_inputs(["d/*.jsonl", "d/*.jsonl.gz", "d/*.parquet"])] == [
        "a.jsonl", "b.jsonl.gz", "c.parquet"]
