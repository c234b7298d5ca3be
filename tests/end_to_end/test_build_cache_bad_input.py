"""Bad input never crashes the build and never vanishes; input errors fail early with a clear message."""

from __future__ import annotations

import base64
import collections
import json
import os

import pytest
from apache_beam.metrics.metric import MetricsFilter

from build_helpers import load_ledger, read_dead_letters, read_documents, sample_texts, tree_bytes, write_shard
from reader.format import spec as fmt
from pipelines import build_cache
from pipelines.build_cache import BuildError
from build_helpers import BAD_LINES, build, check_cache, mixed_lines

# (line bytes, reason) for every kind of malformed line


def test_every_malformed_line_is_dead_lettered_with_its_reason(tmp_path):
    inputs, expected_bad = [], []
    for shard, name in enumerate(["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]):
        lines, bad = mixed_lines(shard)
        if shard == 0:  # make sure every reason occurs
            for raw, reason in BAD_LINES:
                bad.append((sum(len(x) + 1 for x in lines), reason, raw))
                lines.append(raw)
        path = write_shard(str(tmp_path / "in" / name), lines)
        inputs.append(path)
        expected_bad += [(path, shard, off, reason, raw) for off, reason, raw in bad]
    out, res = build(tmp_path, [str(tmp_path / "in" / "*")], chunk_bytes=3000, max_bad_fraction=1.0)
    ledger = check_cache(out, inputs, 3000)  # all good documents present, token for token
    dead = read_dead_letters(out)
    got = []
    for d in dead:
        raw = base64.b64decode(d["line_base64"]) if "line_base64" in d else d["line"].encode("utf-8")
        got.append((d["file"], d["shard"], d["offset"], d["reason"], raw))
    assert sorted(got) == sorted(expected_bad)
    assert {r for _, r in BAD_LINES} <= {d["reason"] for d in dead}
    assert any("line_base64" in d for d in dead)
    # counted in the ledger, per reason and per chunk, and in Beam metrics
    want = {}
    for *_, reason, _ in expected_bad:
        want[reason] = want.get(reason, 0) + 1
    assert ledger["bad_records"] == want
    assert ledger["totals"]["bad_records"] == len(expected_bad)
    assert sum(c["bad_records"] for c in ledger["chunks"]) == len(expected_bad)
    for c in ledger["chunks"]:
        if c["bad_records"]:
            assert c["dead_letters"] == f"bad/shard-{c['shard']:05d}/chunk-{c['index_in_shard']:06d}.jsonl"
            assert os.path.exists(os.path.join(out, c["dead_letters"]))
    metrics = res["result"].metrics().query(MetricsFilter().with_namespace("chunkledger"))
    counters = {m.key.metric.name: m.committed for m in metrics["counters"]}
    assert counters["bad_records"] == len(expected_bad)
    assert counters["bad_invalid_unicode"] == want["invalid_unicode"]
    assert counters["documents"] == ledger["totals"]["docs"]
    assert counters["tokens"] == ledger["totals"]["tokens"]


def test_max_bad_fraction_fails_then_rerun_with_higher_threshold_finalizes(tmp_path):
    lines, bad = mixed_lines(1, n_good=30)
    a = write_shard(str(tmp_path / "a.jsonl"), lines)
    with pytest.raises(BuildError, match="max_bad_fraction") as e:
        build(tmp_path, [a], chunk_bytes=2000, max_bad_fraction=0.01)
    assert "rerun" in str(e.value) and f"{len(bad)} of" in str(e.value)
    out = str(tmp_path / "cache")
    assert load_ledger(out)["finished"] is False
    # The job's verdict is a file in the cache; run() reports it (not the runner's exception text).
    with open(os.path.join(out, "_FAILED.json"), encoding="utf-8") as f:
        failure = json.load(f)
    reasons = collections.Counter(reason for _, reason, _ in bad)
    assert failure == {"error": "too_many_bad_records", "bad_records": len(bad), "lines": len(bad) + 30,
                       "max_bad_fraction": 0.01, "reasons": dict(reasons)}
    assert str(e.value).startswith(f"too many bad records: {len(bad)} of {len(bad) + 30} input lines")
    _, res = build(tmp_path, [a], chunk_bytes=2000, max_bad_fraction=0.5)
    assert not os.path.exists(os.path.join(out, "_FAILED.json"))
    assert res["resumed"] and res["ledger"]["finished"]
    clean, _ = build(tmp_path, [a], chunk_bytes=2000, max_bad_fraction=0.5, name="clean")
    assert tree_bytes(out) == tree_bytes(clean)
    assert len(read_dead_letters(out)) == len(bad)
    assert len(read_documents(out)) == 30


def test_pattern_matching_nothing_fails_before_any_work(tmp_path):
    a = write_shard(str(tmp_path / "a.jsonl"), [{"text": "hello"}])
    with pytest.raises(BuildError, match="nothing-here"):
        build(tmp_path, [a, str(tmp_path / "nothing-here" / "*.jsonl")])
    assert not os.path.exists(tmp_path / "cache")


def test_unreadable_input_fails_naming_the_file(tmp_path):
    a = write_shard(str(tmp_path / "a.jsonl"), [{"text": "hello"}])
    broken = tmp_path / "b.jsonl.gz"
    broken.write_bytes(b"this is not gzip data at all")
    with pytest.raises(BuildError, match="b.jsonl.gz"):
        build(tmp_path, [a, str(broken)])
    assert not os.path.exists(tmp_path / "cache")


def test_cli_prints_clear_error_and_exits_nonzero(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        build_cache.main(["--input", str(tmp_path / "none*.jsonl"), "--output", str(tmp_path / "o"),
                          "--tokenizer", "tiktoken:cl100k_base", "--runner=FnApiRunner"])
    assert e.value.code == 2
    assert "matches no file" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["big.jsonl.gz", "big.jsonl.zst"])
def test_truncated_or_corrupt_compressed_input_is_an_error_and_nothing_of_it_is_kept(tmp_path, name):
    """Found mid-stream, after some of its chunks were written: those are removed, no _DONE.json, no
    finished ledger; with the file restored, a rerun equals a clean build."""
    good = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in sample_texts(20, seed=4)])
    path = write_shard(str(tmp_path / "in" / name), [{"text": t} for t in sample_texts(1500, seed=5)])  # > 1 MiB: damage found after chunks were written
    intact = open(path, "rb").read()
    damaged = {"cut": intact[: len(intact) * 9 // 10]}
    flipped = bytearray(intact)
    flipped[len(flipped) * 9 // 10] ^= 0x55
    if name.endswith(".gz"):
        damaged["flipped"] = bytes(flipped)  # zstd without its optional checksum cannot see a flipped bit
    for how, data in damaged.items():
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(BuildError) as e:
            build(tmp_path, [str(tmp_path / "in" / "*")], chunk_bytes=65536)
        msg = str(e.value)
        assert msg.startswith(f"input file {path} is damaged: ") and "uncompressed bytes" in msg, (how, msg)
        out = str(tmp_path / "cache")
        assert load_ledger(out)["finished"] is False
        assert not os.path.exists(os.path.join(out, fmt.shard_done_path(1)))
        assert not os.path.exists(os.path.join(out, fmt.shard_dir(1))) or not os.listdir(
            os.path.join(out, fmt.shard_dir(1))), how
    with open(path, "wb") as f:
        f.write(intact)
    build(tmp_path, [str(tmp_path / "in" / "*")], chunk_bytes=65536)
    clean, _ = build(tmp_path, [str(tmp_path / "in" / "*")], chunk_bytes=65536, name="clean")
    assert tree_bytes(str(tmp_path / "cache")) == tree_bytes(clean)
    check_cache(clean, [good, path], 65536)


def test_input_without_documents_is_an_error_unless_allow_empty(tmp_path):
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": "hello"}])
    empty = tmp_path / "in" / "b.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(BuildError, match=f"yield no document: {empty} \\(0 bytes"):
        build(tmp_path, [str(tmp_path / "in" / "*")])
    assert not os.path.exists(tmp_path / "cache")  # found before any work
    empty.unlink()
    bad = write_shard(str(tmp_path / "in" / "c.jsonl.gz"), [b"not json", b"", b'{"text": ""}'])
    with pytest.raises(BuildError, match=f"yield no document: {bad} \\(\\d+ bytes, 3 bad lines\\)"):
        build(tmp_path, [str(tmp_path / "in" / "*")], max_bad_fraction=1.0)
    _, res = build(tmp_path, [str(tmp_path / "in" / "*")], max_bad_fraction=1.0, allow_empty=True)
    assert res["ledger"]["finished"] and res["ledger"]["totals"]["docs"] == 1
    assert os.path.getsize(a) > 0


def test_unknown_options_and_stray_arguments_exit_2_naming_them(tmp_path, capsys):
    a = write_shard(str(tmp_path / "g" / "a.jsonl"), [{"text": "hello"}])
    b = write_shard(str(tmp_path / "g" / "b.jsonl"), [{"text": "world"}])
    base = ["--output", str(tmp_path / "o"), "--tokenizer", "tiktoken:cl100k_base", "--runner=FnApiRunner"]
    cases = {("--input", a, b): f"unexpected argument(s) {b}: --input takes one pattern",
             ("--input", a, "--chunk_size", "1MiB"): "unknown option --chunk_size; did you mean --chunk_bytes?",
             ("--input", a, "--max_bad", "0.5"): "unknown option --max_bad; did you mean --max_bad_fraction?",
             ("--input", a, "--compression_level", "99"): "--compression_level 99 is not a zstd level"}
    for args, want in cases.items():
        with pytest.raises(SystemExit) as e:
            build_cache.main([*args, *base])
        assert e.value.code == 2
        assert want in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")
