"""Kept fields (reader/storage/fields.py, Cache.fields, ``inspect --by``): read for any document range,
counted per value, and invisible to the batches."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from cachegen import DEFAULT_TOKENIZER, ledger_chunks
from reader import ReadOptions, Reader
from reader.cli.main import main
from reader.format import spec as fmt
from reader.format.chunk_file import ChunkParquet, row_group_table
from reader.format.sidecar import make_sidecar, sidecar_bytes
from reader.storage import fields
from reader.storage.cache import Cache

KEEP = ("source", "meta.lang")


def corpus(num_chunks: int = 4, docs_per_chunk: int = 7, seed: int = 0):
    rng = np.random.default_rng(seed)
    chunks = []
    for c in range(num_chunks):
        docs = []
        for d in range(docs_per_chunk):
            i = c * docs_per_chunk + d
            docs.append((rng.integers(1, 1000, rng.integers(1, 30)).astype(np.int32),
                         {"source": ("web", "books", None)[i % 3], "meta.lang": str(i)}))
        chunks.append(docs)
    return chunks


def write_cache(root: str, chunks, keep=KEEP) -> None:
    """One shard; row groups of 3 documents; the kept fields only if ``keep``."""
    config = {"text_key": "text", "append_eos": False, "chunk_bytes": 1000, "row_group_tokens": 50,
              "compression": "zstd", "compression_level": 3, "token_encoding": "PLAIN"}
    if keep:
        config["keep_fields"] = list(keep)
    sidecars = []
    for k, docs in enumerate(chunks):
        w = ChunkParquet(config)
        for lo in range(0, len(docs), 3):
            part = docs[lo:lo + 3]
            kept = {n: [f[n] for _, f in part] for n in keep} if keep else None
            w.write(row_group_table([a for a, _ in part], 0, list(range(lo, lo + len(part))), None, fields=kept),
                    sum(len(a) for a, _ in part))
        data, index, footer = w.finish()
        os.makedirs(os.path.join(root, fmt.shard_dir(0)), exist_ok=True)
        with open(os.path.join(root, fmt.chunk_path(0, k)), "wb") as f:
            f.write(data)
        sidecars.append(make_sidecar(shard=0, index_in_shard=k, byte_range=[k * 1000, k * 1000 + 1000], data=data,
                                     row_group_index=index, footer=footer, docs=w.docs, tokens=w.tokens))
        with open(os.path.join(root, fmt.sidecar_path(0, k)), "wb") as f:
            f.write(sidecar_bytes(sidecars[-1]))
    entries, bad = ledger_chunks(sidecars)
    ledger = {"format": fmt.FORMAT_NAME, "format_version": 3, "finished": True,  # kept fields came with 3
              "tokenizer": DEFAULT_TOKENIZER, "config": config, "chunks": entries, "bad_records": bad,
              "inputs": [{"shard": 0, "path": "/x.jsonl", "size": 1000 * len(chunks), "compression": "none",
                          "chunks": len(chunks)}],
              "totals": {"docs": sum(e["docs"] for e in entries), "tokens": sum(e["tokens"] for e in entries)}}
    with open(os.path.join(root, fmt.LEDGER_NAME), "w") as f:
        f.write(fmt.dumps_ledger(ledger))


@pytest.fixture()
def cache_dir(tmp_path):
    chunks = corpus()
    write_cache(str(tmp_path / "kept"), chunks)
    write_cache(str(tmp_path / "plain"), chunks, keep=())
    return tmp_path, [f for docs in chunks for _, f in docs]


def test_fields_for_any_document_range(cache_dir):
    tmp, want = cache_dir
    cache = Cache(str(tmp / "kept"))
    assert fields.kept_fields(cache) == KEEP
    n = len(want)
    for start, stop in [(0, n), (0, 0), (5, 6), (6, 8), (3, 17), (n - 1, n), (7, 21)]:
        got = cache.fields(start, stop)
        assert got == {k: [f[k] for f in want[start:stop]] for k in KEEP}, (start, stop)
    assert cache.fields(2, 9, ["meta.lang"]) == {"meta.lang": [str(i) for i in range(2, 9)]}
    with pytest.raises(IndexError):
        cache.fields(0, n + 1)


def test_unknown_fields_are_refused_naming_those_kept(cache_dir):
    tmp, _ = cache_dir
    with pytest.raises(fields.NoSuchField, match="keeps no field 'url'; the fields it keeps: source, meta.lang"):
        Cache(str(tmp / "kept")).fields(0, 1, ["url"])
    with pytest.raises(fields.NoSuchField, match="the fields it keeps: none"):
        Cache(str(tmp / "plain")).fields(0, 1, ["source"])


def test_tally_and_inspect_by(cache_dir, capsys):
    tmp, want = cache_dir
    cache = Cache(str(tmp / "kept"))
    lengths = [len(a) for docs in corpus() for a, _ in docs]
    expect = {}
    for f, n in zip(want, lengths):
        d, t = expect.get(f["source"], (0, 0))
        expect[f["source"]] = (d + 1, t + n)
    got = fields.tally(cache, "source")
    assert got == expect and list(got.values()) == sorted(expect.values(), key=lambda x: -x[1])
    assert main(["inspect", str(tmp / "kept"), "--by", "source", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {r["value"]: (r["documents"], r["tokens"]) for r in info["by"]["source"]} == expect
    assert main(["inspect", str(tmp / "kept"), "--by", "source"]) == 0
    text = capsys.readouterr().out
    assert "by source" in text and f"{'(none)':<9}  {expect[None][0]:>14,}  {expect[None][1]:>18,}" in text
    assert main(["validate", str(tmp / "kept")]) == 0  # the extra column is part of a valid chunk
    capsys.readouterr()
    assert main(["inspect", str(tmp / "plain"), "--by", "source"]) != 0
    assert "keeps no field 'source'" in capsys.readouterr().err


@pytest.mark.parametrize("packed", [True, False])
def test_batches_do_not_change(cache_dir, packed):
    tmp, _ = cache_dir
    opts = ReadOptions(seq_len=16, batch_size=4, ideal_readers=2, packed=packed, shuffle_seed=3)
    out = []
    for name in ("kept", "plain"):
        with Reader(str(tmp / name), opts, num_readers=1, reader_index=0) as r:
            out.append([b for _, b in r.iter_batches(start=0, count=6)])
    for a, b in zip(*out):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
