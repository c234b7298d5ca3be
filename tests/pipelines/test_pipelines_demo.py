"""`make demo`: builds the sample corpus, decodes documents back, and is rerunnable."""

from __future__ import annotations

import glob
import gzip
import json
import os

from build_helpers import load_ledger, read_documents, tree_bytes
from pipelines import demo


def test_sample_corpus_is_small_varied_and_has_a_gzip_shard():
    files = sorted(glob.glob(os.path.join(demo.SAMPLE_DIR, "*")))
    assert len(files) >= 3 and sum(f.endswith(".jsonl.gz") for f in files) == 1
    assert sum(os.path.getsize(f) for f in files) < 1 << 20
    texts = []
    for f in files:
        data = gzip.open(f).read() if f.endswith(".gz") else open(f, "rb").read()
        texts += [json.loads(line)["text"] for line in data.splitlines()]
    assert len(texts) > 200 and len(set(texts)) == len(texts)
    assert sum(len(t) for t in texts) > 200_000


def test_demo_builds_decodes_and_reruns(tmp_path, capsys):
    out = str(tmp_path / "demo-cache")
    assert demo.main(["--output", out]) == 0
    first = capsys.readouterr().out
    assert "all decoded documents match" in first and "OK" in first and "MISMATCH" not in first
    ledger = load_ledger(out)
    assert ledger["finished"] and ledger["tokenizer"]["spec"] == "tiktoken:cl100k_base"
    assert len(read_documents(out)) == ledger["totals"]["docs"] > 200
    before = tree_bytes(out)
    assert demo.main(["--output", out]) == 0
    assert "already complete" in capsys.readouterr().out
    assert tree_bytes(out) == before
