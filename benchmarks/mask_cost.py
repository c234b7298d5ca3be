"""What loss masks cost a read: the same documents written twice, without and with ``loss_spans``, read alike.

    python -m benchmarks.mask_cost --work DIR [--tokens N] [--rounds R] [--quick]

``make bench`` runs it with the defaults (96 Mi tokens, 3 rounds).

One set of generated chat-like documents (log-normal lengths, median 600 tokens; 1 to 4 loss runs each,
about half the tokens) is written twice with the builder's chunk writer (``reader.format.chunk_file``,
zstd 3, row groups of 128 Ki tokens, chunks of 1 Mi tokens): ``plain`` (``record_format`` text) and
``masked`` (``record_format`` chat, one more column). Each is then read the same way, runs alternating,
best of ``--rounds``, real tokens per second from opening the reader to the last batch:

- ``decode``: every row group of every chunk through the chunk store (fetch, sha256, decode; with masks,
  the spans and the per-token flags too), one thread;
- ``train``: the reader benchmark's headline read (``benchmarks/reader_bench.py``: flat layout, batch
  64, seq_len 2048, R* = 16, two reader workers), about one pass;
- ``train_1p``: the same in one process (no workers);
- ``best_fit_1p``: best-fit rows, one process.

Each is measured per second and per CPU-second (of the reading thread for ``decode``; of the process and
its reader workers for the reads): on a shared machine the second moves least with other work. The
ratios ``masked / plain`` are the figures (target >= 0.9). Prints one ``BENCH_RESULT`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import time

import numpy as np

from reader.format import chunk_file
from reader.format import sidecar
from reader.format import spec as fmt
from reader.storage import files, finish

ROW_GROUP_TOKENS = 128 << 10
CHUNK_TOKENS = 1 << 20


def documents(tokens: int, seed: int = 0) -> tuple[list[np.ndarray], list[list[int]]]:
    """Chat-like documents of about ``tokens`` tokens in all, and each one's loss spans."""
    rng = np.random.default_rng(seed)
    docs, spans, total = [], [], 0
    while total < tokens:
        n = int(max(8, rng.lognormal(np.log(600), 0.8)))
        docs.append(rng.integers(1, 100_000, size=n, dtype=np.int32))
        cuts = np.sort(rng.choice(np.arange(1, n), size=2 * int(rng.integers(1, 5)), replace=False))
        cuts[-1] = n  # the last turn (an answer) runs to the end, EOS included
        spans.append(cuts.tolist())
        total += n
    return docs, spans


def write_cache(root: str, docs: list[np.ndarray], spans: list[list[int]] | None,
                fields: dict[str, list] | None = None) -> None:
    """A finished cache of ``docs`` (one shard, chunks of about ``CHUNK_TOKENS``), with ``spans`` a masked one;
    ``fields``: kept fields (name -> one string per document)."""
    config = {"text_key": "text", "append_eos": True, "chunk_bytes": CHUNK_TOKENS, "row_group_tokens": ROW_GROUP_TOKENS,
              "compression": "zstd", "compression_level": 3, "token_encoding": "PLAIN"}
    if spans is not None:
        config["record_format"] = "chat"
    if fields:
        config["keep_fields"] = list(fields)
    lengths = np.asarray([len(d) for d in docs], np.int64)
    ends = np.cumsum(lengths)
    chunk_of = (ends - lengths) // CHUNK_TOKENS
    sidecars = []
    for k in range(int(chunk_of[-1]) + 1):
        idx = np.flatnonzero(chunk_of == k)
        out = chunk_file.ChunkParquet(config)
        lo = int(idx[0]) if idx.size else 0
        for hi in chunk_file_groups(lengths, idx):
            part = slice(lo, hi)
            out.write(chunk_file.flat_row_group_table(
                np.concatenate(docs[part]), lengths[part].astype(np.int32), 0, (ends - lengths)[part] * 4,
                loss_spans=None if spans is None else spans[part],
                fields=None if not fields else {n: v[part] for n, v in fields.items()}), int(lengths[part].sum()))
            lo = hi
        data, rg_index, footer = out.finish()
        side = sidecar.make_sidecar(shard=0, index_in_shard=k, byte_range=[k * CHUNK_TOKENS, (k + 1) * CHUNK_TOKENS],
                                       data=data, row_group_index=rg_index, footer=footer, docs=out.docs,
                                       tokens=out.tokens, loss_tokens=out.loss_tokens if out.masked else None)
        os.makedirs(os.path.join(root, fmt.shard_dir(0)), exist_ok=True)
        with open(os.path.join(root, side["path"]), "wb") as f:
            f.write(data)
        with open(os.path.join(root, fmt.sidecar_path(0, k)), "wb") as f:
            f.write(sidecar.sidecar_bytes(side))
        sidecars.append(side)
    n = len(sidecars)
    plan = {"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "finished": False, "config": config,
            "tokenizer": {"spec": "synthetic", "kind": "synthetic", "name": "synthetic", "vocab_size": 100_000,
                          "eos_id": 0, "hash": "synthetic"},
            "inputs": [{"shard": 0, "path": "/synthetic/shard-00000.jsonl", "size": n * CHUNK_TOKENS,
                        "compression": "none", "chunks": n}]}
    inputs = [dict(inp, uncompressed_bytes=inp["size"]) for inp in plan["inputs"]]
    finish.finish_cache(files.local(), root, plan, inputs, (sidecar.ledger_entry(s) for s in sidecars))


def chunk_file_groups(lengths: np.ndarray, idx: np.ndarray) -> list[int]:
    """Row-group ends (document indices) of the chunk of documents ``idx``: a group closes once it holds
    ``ROW_GROUP_TOKENS`` tokens (the builder's rule)."""
    ends, acc = [], 0
    for i in idx.tolist():
        acc += int(lengths[i])
        if acc >= ROW_GROUP_TOKENS:
            ends.append(i + 1)
            acc = 0
    if idx.size and (not ends or ends[-1] != int(idx[-1]) + 1):
        ends.append(int(idx[-1]) + 1)
    return ends


def decode_rate(root: str, clock=time.thread_time) -> float:
    """Tokens per second through the chunk store: every row group fetched, verified and decoded, in this
    thread (its CPU time by default: other processes on the machine do not count)."""
    from reader.storage.cache import Cache
    from reader.storage.store import ChunkStore

    cache = Cache(root)
    t = clock()
    store = ChunkStore(cache, memory_budget_bytes=64 << 20, threads=1)
    for c in range(len(cache.table)):
        for g in range(store.meta(c).num_row_groups):
            store.row_group(c, g)
            store.release(c, g)
    store.close()
    return int(cache.table.tokens.sum()) / (clock() - t)


def _cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (reader workers, once closed)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def read_rate(root: str, opts, batches: int) -> tuple[float, float]:
    """Real tokens of ``batches`` batches read with ``opts``, from opening the reader to closing it: per
    second, and per CPU-second of this process and its reader workers."""
    from reader import Reader

    t, cpu = time.perf_counter(), _cpu_s()
    real = 0
    with Reader(root, opts) as r:
        for _, x in r.iter_batches(0, batches):
            real += int(x["num_tokens"].sum())
    return real / (time.perf_counter() - t), real / (_cpu_s() - cpu)


def main(argv=None) -> None:
    from benchmarks.common import emit_result
    from benchmarks.reader_bench import B, L, WORKERS
    from reader import ReadOptions

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="directory for the two caches")
    ap.add_argument("--tokens", type=int, default=96 << 20,
                    help="tokens of each cache (default 96 Mi: reader workers' start-up stays a small share)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 Mi tokens, 1 round")
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.rounds = 2 << 20, 1
    docs, spans = documents(a.tokens)
    roots = {"plain": os.path.join(a.work, "plain"), "masked": os.path.join(a.work, "masked")}
    for name, root in roots.items():
        if not os.path.exists(os.path.join(root, fmt.LEDGER_NAME)):
            write_cache(root, docs, spans if name == "masked" else None)
    tokens = sum(len(d) for d in docs)
    batches = max(1, tokens // (B * L))
    train = ReadOptions(seq_len=L, batch_size=B, layout="flat", num_workers=WORKERS)
    reads = {"decode": None, "train": train, "train_1p": dataclasses.replace(train, num_workers=0),
             "best_fit_1p": dataclasses.replace(train, num_workers=0, packing="best_fit")}
    best = {(read, name, clock): 0.0 for read in reads for name in roots for clock in ("s", "cpu_s")}
    for _ in range(a.rounds):
        for read, opts in reads.items():
            for name, root in roots.items():
                rates = (decode_rate(root, time.perf_counter), decode_rate(root)) if opts is None else \
                    read_rate(root, opts, batches)
                for clock, rate in zip(("s", "cpu_s"), rates):
                    best[(read, name, clock)] = max(best[(read, name, clock)], rate)
    res = {"mask_cost_tokens": tokens, "mask_cost_batches": batches, "mask_cost_rounds": a.rounds,
           "mask_loss_token_share": sum(sum(s[1::2]) - sum(s[0::2]) for s in spans) / tokens,
           "mask_bytes_per_token": (_size(roots["masked"]) - _size(roots["plain"])) / tokens}
    res.update(ratios(best, reads, "mask", "plain", "masked"))
    emit_result(res)


def ratios(best: dict, reads, prefix: str, base: str, other: str) -> dict:
    """The figures of paired reads: ``best[(read, way, clock)]`` (tokens per second, per CPU-second) of the ways
    ``base`` and ``other``, as ``{prefix}_{read}_{way}_tokens_per_{clock}`` and ``{prefix}_{read}[_cpu]_ratio``
    (``other / base``), each logged."""
    from benchmarks.common import log

    res = {}
    for read in reads:
        for clock in ("s", "cpu_s"):
            a, b = best[(read, base, clock)], best[(read, other, clock)]
            tag = "" if clock == "s" else "_cpu"
            res.update({f"{prefix}_{read}_{base}_tokens_per_{clock}": a, f"{prefix}_{read}_{other}_tokens_per_{clock}": b,
                        f"{prefix}_{read}{tag}_ratio": b / a})
            log(f"{read:12s} {base} {a / 1e6:8.1f} M tokens/{clock}  {other} {b / 1e6:8.1f} M tokens/{clock}  "
                f"ratio {b / a:.3f}")
    return res


def _size(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, fmt.CHUNKS_DIR))
               for f in fs if f.endswith(".parquet"))


if __name__ == "__main__":
    main()
