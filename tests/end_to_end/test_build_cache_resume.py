"""Crash and resume: a build SIGKILLed at many points, rerun, equals a clean build byte for byte.

Also: rerunning into an existing cache with another tokenizer, chunking configuration or input refuses.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from build_helpers import load_ledger, sample_texts, train_tiny_tokenizer, tree_bytes, write_shard
from pipelines.build_cache import BuildError
from build_helpers import build, check_cache
from build_helpers import mixed_lines

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHUNK = 4000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume_in")
    paths = []
    for shard, name in enumerate(["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]):
        lines, _ = mixed_lines(shard + 10, n_good=45 - 10 * shard)
        paths.append(write_shard(str(d / name), lines))
    return d, paths


@pytest.fixture(scope="module")
def clean(corpus, tmp_path_factory):
    d, paths = corpus
    out, _ = build(tmp_path_factory.mktemp("clean"), [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    check_cache(out, paths, CHUNK)
    return out, tree_bytes(out)


def argv(inputs_glob: str, out: str) -> list[str]:
    return ["--input", inputs_glob, "--output", out, "--tokenizer", "tiktoken:cl100k_base",
            "--chunk_bytes", str(CHUNK), "--max_bad_fraction", "1.0", "--runner=FnApiRunner"]


def run_killed(args: list[str], kill_at: str) -> subprocess.CompletedProcess:
    """The command-line build in a subprocess, SIGKILLed at ``kill_at`` (see tests/support/kill_at.py)."""
    return subprocess.run([sys.executable, os.path.join(REPO, "tests", "support", "kill_at.py"), kill_at, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_kill_points_then_rerun_is_byte_identical(corpus, clean, tmp_path):
    d, _ = corpus
    clean_out, clean_files = clean
    # The clean build writes every file once, plus the plan ledger: that many atomic writes.
    total_writes = len(clean_files) + 1
    points = ["1:after_rename", "2:before_rename", "5:after_rename", f"{total_writes // 2}:before_rename",
              f"{total_writes - 3}:after_rename", f"{total_writes}:before_rename"]
    for i, point in enumerate(points):
        out = str(tmp_path / f"c{i}")
        proc = run_killed(argv(str(d / "*"), out), point)
        assert proc.returncode == -signal.SIGKILL, (point, proc.stdout, proc.stderr[-2000:])
        assert load_ledger(out)["finished"] is False
        if point.endswith("before_rename"):
            assert glob.glob(os.path.join(out, "**", ".tmp-*"), recursive=True), point
        _, res = build(tmp_path, [str(d / "*")], name=f"c{i}", chunk_bytes=CHUNK, max_bad_fraction=1.0)
        assert res["resumed"]
        assert tree_bytes(out) == clean_files, f"resume after kill at {point} differs from a clean build"


@pytest.mark.slow
def test_external_sigkill_mid_build_then_rerun_is_byte_identical(tmp_path):
    """A real SIGKILL from outside once some chunks exist (multi-process runner: kill the whole group)."""
    texts = sample_texts(1200, seed=3, min_words=100, max_words=600)
    half = len(texts) // 2
    paths = [write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in texts[:half]]),
             write_shard(str(tmp_path / "in" / "b.jsonl.gz"), [{"text": t} for t in texts[half:]])]
    args = ["--input", str(tmp_path / "in" / "*"), "--output", str(tmp_path / "killed"),
            "--tokenizer", "tiktoken:cl100k_base", "--chunk_bytes", "40000", "--runner=DirectRunner",
            "--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.build_cache", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if len(glob.glob(str(tmp_path / "killed" / "chunks" / "*" / "*.json"))) >= 4:
                break
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the build finished before it could be killed"
    assert load_ledger(str(tmp_path / "killed"))["finished"] is False
    time.sleep(0.5)  # let killed worker processes' file handles close
    _, res = build(tmp_path, [str(tmp_path / "in" / "*")], name="killed", chunk_bytes=40000)
    assert res["resumed"]
    clean, _ = build(tmp_path, [str(tmp_path / "in" / "*")], name="clean", chunk_bytes=40000)
    check_cache(clean, paths, 40000)
    assert tree_bytes(str(tmp_path / "killed")) == tree_bytes(clean)


def test_resume_skips_complete_chunks_and_rebuilds_damaged_ones(corpus, clean, tmp_path):
    d, _ = corpus
    clean_out, clean_files = clean
    out, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    ledger = load_ledger(out)
    # Unfinish the cache, damage one chunk of the plain shard and one of the gzip shard, remove a sidecar.
    plan = json.loads(open(os.path.join(out, "ledger.json")).read())
    plan.update(finished=False, chunks=[], totals={}, bad_records={})
    from reader.format.spec import dumps_ledger

    for inp in plan["inputs"]:
        if inp["compression"] != "none":
            inp["chunks"] = None
        inp.pop("uncompressed_bytes")
    open(os.path.join(out, "ledger.json"), "w").write(dumps_ledger(plan))
    victims = [c for c in ledger["chunks"] if c["index_in_shard"] == 1][:2]
    for c in victims:
        with open(os.path.join(out, c["path"]), "r+b") as f:
            f.seek(10)
            f.write(b"\x00\x01\x02")
    os.remove(os.path.join(out, ledger["chunks"][0]["path"].replace(".parquet", ".json")))
    # a sidecar as older code wrote it (no row-group index): its chunk counts as incomplete and is rebuilt
    old = next(c for c in ledger["chunks"] if c["index_in_shard"] == 2)
    side = os.path.join(out, old["path"].replace(".parquet", ".json"))
    stripped = {k: v for k, v in json.load(open(side)).items() if k not in ("row_group_index", "footer")}
    open(side, "w").write(dumps_ledger(stripped))
    _, res = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    from apache_beam.metrics.metric import MetricsFilter

    counters = {m.key.metric.name: m.committed
                for m in res["result"].metrics().query(MetricsFilter().with_namespace("chunkledger"))["counters"]}
    # the gzip shard is streamed again but only its damaged chunk is re-tokenized
    assert counters["chunks_written"] == 4
    assert counters["chunks_skipped"] == len(ledger["chunks"]) - 4
    assert tree_bytes(out) == clean_files


def test_rerun_with_other_config_or_tokenizer_or_inputs_refuses(corpus, tmp_path):
    d, paths = corpus
    out, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    before = tree_bytes(out)
    with pytest.raises(BuildError, match=f"config.chunk_bytes: {CHUNK} in the cache, {CHUNK * 2} now"):
        build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK * 2, max_bad_fraction=1.0)
    with pytest.raises(BuildError, match="config.append_eos"):
        build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, append_eos=True)
    with pytest.raises(BuildError, match="config.text_key: 'text' in the cache, 'id' now"):
        build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, text_key="id")  # a key every record has
    tok = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    with pytest.raises(BuildError, match="different tokenizer"):
        build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, tokenizer=tok)
    with pytest.raises(BuildError, match=f"other input files \\(no longer matched: {paths[1]}, {paths[2]}\\)"):
        build(tmp_path, [paths[0]], chunk_bytes=CHUNK)
    assert tree_bytes(out) == before
