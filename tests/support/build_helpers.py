"""Helpers for the builder's tests: small corpora, independent cache readers, tree hashes.

The cache reading here uses pyarrow directly (not ``reader/``), so builder tests check the files
against the format spec independently of the reader library.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from typing import Any, Sequence

import pyarrow.parquet as pq

from reader.format import spec as fmt

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE_DIR = os.path.join(REPO, "pipelines", "sample_corpus")
FNAPI = ["--runner=FnApiRunner"]
DIRECT_MP2 = ["--runner=DirectRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=2"]


def write_shard(path: str, lines: Sequence[bytes | str | dict], compression: str | None = None) -> str:
    """Write one jsonl shard; dict lines are JSON-encoded, str/bytes written as given (plus newline)."""
    body = b"".join(
        (json.dumps(x, ensure_ascii=False).encode() if isinstance(x, dict) else
         x.encode() if isinstance(x, str) else x) + b"\n"
        for x in lines
    )
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if compression == "gzip" or path.endswith(".gz"):
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
            gz.write(body)
    elif compression == "zstd" or path.endswith(".zst"):
        import zstandard

        with open(path, "wb") as f:
            f.write(zstandard.ZstdCompressor(level=3).compress(body))
    else:
        with open(path, "wb") as f:
            f.write(body)
    return path


def sample_texts(n: int, seed: int = 0, min_words: int = 5, max_words: int = 400) -> list[str]:
    """Deterministic English-like texts of varied length (from the committed sample corpus's words)."""
    import random

    here = os.path.join(SAMPLE_DIR, "part-00.jsonl")
    with open(here, encoding="utf-8") as f:
        words = " ".join(json.loads(line)["text"] for line in f).split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(min_words, max_words)
        start = rng.randrange(0, max(1, len(words) - k))
        text = " ".join(words[start:start + k])
        if rng.random() < 0.3:
            text = text.replace(". ", ".\n\n")
        out.append(text)
    return out


def tree_bytes(root: str) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


def tree_digest(root: str) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in tree_bytes(root).items()}


def load_ledger(root: str) -> dict[str, Any]:
    with open(os.path.join(root, fmt.LEDGER_NAME), encoding="utf-8") as f:
        return json.load(f)


def read_chunk(root: str, rel: str) -> dict[str, list]:
    t = pq.read_table(os.path.join(root, rel))
    return {name: t.column(name).to_pylist() for name in t.column_names}


def read_documents(root: str) -> list[dict[str, Any]]:
    """All documents in global order: ``{"tokens", "shard", "offset"}`` (straight from the Parquet files)."""
    ledger = load_ledger(root)
    docs = []
    for c in ledger["chunks"]:
        cols = read_chunk(root, c["path"])
        for toks, n, s, off in zip(cols[fmt.TOKEN_COLUMN], cols[fmt.LENGTH_COLUMN], cols[fmt.SHARD_COLUMN],
                                   cols[fmt.OFFSET_COLUMN]):
            docs.append({"tokens": toks, "num_tokens": n, "shard": s, "offset": off})
    return docs


def read_dead_letters(root: str) -> list[dict[str, Any]]:
    out = []
    bad = os.path.join(root, fmt.BAD_DIR)
    for d, _, files in sorted(os.walk(bad)):
        for name in sorted(files):
            with open(os.path.join(d, name), encoding="utf-8") as f:
                out.extend(json.loads(line) for line in f if line.strip())
    return out


def train_tiny_tokenizer(path: str, texts: Sequence[str] | None = None, vocab_size: int = 400) -> str:
    """Train a small byte-level BPE tokenizer offline with ``tokenizers`` and save it as ``path`` (json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts or sample_texts(200, seed=7)), trainer=trainer)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tok.save(path)
    return path


def small_plan(tmp_path, chunk_bytes: int = 1500):
    """Two shards (plain with one bad line, gzip) of 24 texts under ``tmp_path/in``, planned as the launcher
    would: ``(plan, tokenizer, texts, (plain_path, gzip_path))``."""
    from pipelines.launcher import match_inputs
    from pipelines.options import build_arg_parser, chunk_config
    from pipelines.plan import make_plan
    from pipelines.tokenize.tokenizer import resolve

    texts = sample_texts(24, seed=11)
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in texts[:12]] + [b"oops"])
    b = write_shard(str(tmp_path / "in" / "b.jsonl.gz"), [{"text": t} for t in texts[12:]])
    args = build_arg_parser().parse_args(["--input", "x", "--output", "y", "--tokenizer", "tiktoken:cl100k_base",
                                          "--chunk_bytes", str(chunk_bytes), "--max_bad_fraction", "1"])
    tok = resolve("tiktoken:cl100k_base")
    plan = make_plan(tok.identity(), chunk_config(args), match_inputs([str(tmp_path / "in" / "*")]))
    return plan, tok, texts, (a, b)
