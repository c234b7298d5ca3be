"""The developer tools in tools/ still run from the repository root (``python -m tools.<name>``)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from build_helpers import REPO, SAMPLE_DIR
from build_helpers import build


def run_tool(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_make_sample_corpus_writes_four_shards_the_last_gzip(tmp_path):
    out = tmp_path / "corpus"
    run_tool("tools.make_sample_corpus", "--out", str(out), "--max_bytes", "20000")
    names = sorted(os.listdir(out))
    assert names == ["part-00.jsonl", "part-01.jsonl", "part-02.jsonl", "part-03.jsonl.gz"]
    docs = []
    for name in names:
        path = out / name
        data = gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()
        docs += [json.loads(line) for line in data.splitlines()]
    assert len(docs) >= 4 and all(d["text"] and d["source"] for d in docs)
    assert sum(len(json.dumps(d, ensure_ascii=False).encode()) + 1 for d in docs) <= 20000


@pytest.mark.slow
def test_profile_builder_builds_a_chunk_and_compares_with_the_tokenizer():
    out = run_tool("tools.profile_builder", "--input", os.path.join(SAMPLE_DIR, "part-00.jsonl"))
    assert "96 documents" in out and "ChunkBuilder" in out and "builder / raw" in out


@pytest.mark.slow
def test_measure_encodings_reads_a_cache(tmp_path):
    cache, _ = build(tmp_path, [os.path.join(SAMPLE_DIR, "part-01.jsonl")], chunk_bytes=40000)
    out = run_tool("tools.measure_encodings", "--cache", cache, "--only_default")
    assert "corpus: 96 documents" in out and "builder default (zstd-3 PLAIN)" in out


@pytest.mark.slow
def test_measure_input_checks_reports_both_costs():
    out = run_tool("tools.measure_input_checks", "--mb", "0.3")
    assert '"hash/tokenize"' in out and '"rerun/build"' in out
