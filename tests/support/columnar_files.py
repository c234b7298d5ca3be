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
