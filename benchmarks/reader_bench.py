"""Reader figures against a numpy-memmap baseline, on one built cache, in one process.

    python -m benchmarks.reader_bench --cache DIR --work DIR [--batches N] [--pass_rule spans|streams]

- Sequential packed batches (seq_len 2048, batch 64, one reader, local cache, warm page cache) from
  ``Reader.iter_batches`` with ``num_workers=2`` (``reader_*``; two worker processes assemble into shared
  memory) and in one process (``reader_*_1p``), steady state (first batch to last; opening and worker
  start-up reported apart), in the flat-tokens layout (``layout="flat"``, what JaxLoader uses; the
  five-array layout is reported as ``reader_arrays_*``) against slicing the very same windows out of a memmap of a flat uint32 token
  file. Under the pass rule ``"streams"`` the flat file is written from the cache in *stream-major* layout
  (stream ``s``'s tokens, following ``loop(all_chunks)[s::R*]``, one after the other), so the baseline's
  window of example ``(s, j)`` is one contiguous slice; under ``"spans"`` (the default of a version 4
  cache) it is the cache's tokens in global order and the window of eval row ``x`` is the slice at
  ``x * L``. Its offsets are precomputed (as Megatron's sample index is).
  The first batches of both are compared token for token, so both serve the same windows.
- The same with the growing-window shuffle at its default settings and memory budget; the memmap
  baseline uses the same permutation (precomputed).
- Reader peak RSS (sampled) against its configured memory budget, measured before the memmap exists.
- Seek: time from opening the cache to the first batch at step 10**6 against the same at step 0.
- Opening a synthetic ledger of 100k chunks.
- Reader tokens/s against the memory budget (shuffled), for a plot.

Prints one ``BENCH_RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq

from benchmarks.common import emit_result, log
from reader import Reader, ReadOptions
from reader.storage.cache import Cache
from reader.format import spec as fmt
from reader.order import passes
from reader.order import shuffle
from reader.order import streams

L = 2048
B = 64
WORKERS = 2  # reader worker processes (ReadOptions.num_workers) of the headline figures


class RssSampler:
    """Peak RSS of this process, sampled every ``interval_s`` on a thread."""

    def __init__(self, interval_s: float = 0.02, children: bool = False):
        self.p = psutil.Process()
        self.children = children
        self.peak = self.rss()
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        n = self.p.memory_info().rss
        if self.children:  # plus the worker processes
            for c in self.p.children(recursive=True):
                try:
                    n += c.memory_info().rss
                except psutil.Error:
                    pass
        return n

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval_s)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.rss())


def warm(cache: Path) -> int:
    n = 0
    for p in sorted(cache.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    n += len(chunk)
    return n


def targets_of(batch: dict) -> np.ndarray:
    """A batch's targets, from either layout (flat: ``tokens[:, 1:] >> 1``)."""
    if "targets" in batch:
        return batch["targets"].copy()
    return (batch["tokens"][:, 1:] >> 1).astype(np.int32)


def read_reader(cache: Path, opts: ReadOptions, batches: int, max_s: float | None = None):
    """Iterate ``batches`` batches from a fresh reader. Returns ``(from_open_s, steady_s, first, done)``:
    seconds from opening the reader to the last batch; seconds from the first batch to the last (the
    steady state: opening and worker start-up excluded); the first two batches' targets; batches read
    (fewer if ``max_s`` ran out first)."""
    t = time.perf_counter()
    r = Reader(str(cache), opts)
    first = []
    sink = 0
    done = 0
    t_first = None
    for b, batch in r.iter_batches(0, batches):
        if b < 2:
            first.append(targets_of(batch))
        sink += int(batch["targets"][0, 0] if "targets" in batch else batch["tokens"][0, 1])  # touch it
        done += 1
        if t_first is None:
            t_first = time.perf_counter()
        if max_s is not None and time.perf_counter() - t > max_s:
            break
    end = time.perf_counter()
    r.close()
    return end - t, end - t_first, first, done


# --------------------------------------------------------------------------------------------------
# The memmap baseline


def example_sources(opts: ReadOptions, batches: int, shuffle_cfg) -> tuple[np.ndarray, np.ndarray]:
    ex = np.arange(batches * B, dtype=np.int64)
    src = shuffle.shuffle_example_indices(ex, shuffle_cfg) if shuffle_cfg is not None else ex
    return streams.stream_position(np.asarray(src, np.int64), opts.effective_ideal_readers)


def baseline_offsets(cache: Path, seq_opts: ReadOptions, shuf_opts: ReadOptions, batches: int,
                     flat: Path) -> tuple[np.ndarray, np.ndarray]:
    """Write the memmap baseline's flat file and return the token offsets of the sequential and the
    shuffled read's windows ([batches, B] each), for the read's pass rule: ``"streams"``, a stream-major
    file (:func:`write_flat_file`); ``"spans"``, the cache's tokens in global order, where eval row ``x``
    (what every example is, :mod:`reader.order.passes`) is the slice at ``x * L``."""
    with Reader(str(cache), shuf_opts) as r:
        rule = r.order.pass_rule
        shuffled = r.order.spans() if rule == "spans" else None
    ex = np.arange(batches * B, dtype=np.int64)
    if rule == "spans":
        plain = passes.Spans(shuffled.rows, shuffled.r)
        rows_seq, rows_shf = (sp.place(sp.sources(ex))[3] for sp in (plain, shuffled))
        write_flat_file(cache, dataclasses.replace(seq_opts, pass_rule="streams", ideal_readers=1),
                        np.asarray([(max(rows_seq.max(), rows_shf.max()) + 1) * L]), flat)
        return (rows_seq * L).reshape(batches, B), (rows_shf * L).reshape(batches, B)
    s_seq, j_seq = example_sources(seq_opts, batches, None)
    s_shf, j_shf = example_sources(shuf_opts, batches, shuf_opts.shuffle_config())
    need = np.zeros(seq_opts.effective_ideal_readers, np.int64)
    for s, j in ((s_seq, j_seq), (s_shf, j_shf)):
        np.maximum.at(need, s, (j + 1) * L)
    base = write_flat_file(cache, seq_opts, need, flat)
    return (base[s_seq] + j_seq * L).reshape(batches, B), (base[s_shf] + j_shf * L).reshape(batches, B)


def write_flat_file(cache: Path, opts: ReadOptions, need_tokens: np.ndarray, out: Path) -> np.ndarray:
    """Stream-major flat uint32 file of the first ``need_tokens[s]`` tokens of every stream (of the
    ``"streams"`` rule: ``opts.pass_rule``; with one stream, the cache's tokens in global order); returns
    the file offset (in tokens) where each stream starts."""
    r = Reader(str(cache), opts)
    idx = r.stream_index()
    table = r.cache.table
    decoded: dict[int, np.ndarray] = {}

    def chunk_tokens(c: int) -> np.ndarray:
        if c not in decoded:
            col = pq.read_table(str(cache / table.paths[c]), columns=[fmt.TOKEN_COLUMN]).column(0)
            decoded[c] = col.combine_chunks().flatten().to_numpy().astype(np.uint32)
        return decoded[c]

    base = np.zeros(len(need_tokens), np.int64)
    pos = 0
    with open(out, "wb") as f:
        for s, need in enumerate(need_tokens):
            base[s] = pos
            for _epoch, c, a, b in idx.pieces(s, 0, int(need)):
                f.write(chunk_tokens(c)[a:b].tobytes())
                pos += b - a
    r.close()
    return base


def decode_rate(cache: Path, min_s: float = 1.0) -> tuple[float, float]:
    """One core, bytes already in memory: tokens/s of decoding the token column of whole row groups
    (Parquet -> flat int32 numpy), and of that plus a sha256 of the chunk bytes (what a first read costs)."""
    import hashlib

    import pyarrow as pa

    table = Cache(str(cache)).table
    blobs = [(cache / rel).read_bytes() for rel in table.paths[: min(4, len(table))]]
    n = 0
    t = time.perf_counter()
    while True:
        for data in blobs:
            pf = pq.ParquetFile(pa.BufferReader(data))
            for g in range(pf.num_row_groups):
                col = pf.read_row_group(g, columns=[fmt.TOKEN_COLUMN]).column(0)
                n += col.combine_chunks().flatten().to_numpy().size
        dt = time.perf_counter() - t
        if dt >= min_s:
            break
    dec = n / dt
    t = time.perf_counter()
    for data in blobs:
        hashlib.sha256(data).digest()
    hash_s = time.perf_counter() - t
    tokens = int(table.tokens[: len(blobs)].sum())
    return dec, tokens / (tokens / dec + hash_s)


def memmap_rate(mm: np.ndarray, offsets: np.ndarray, min_s: float = 0.4, reps: int = 3) -> float:
    """Tokens/s of slicing ``offsets`` ([batches, B]) windows of L tokens into int32 batches: the best of
    ``reps`` timings of at least ``min_s`` each (the machine is shared; a baseline caught by a neighbour
    would flatter the reader)."""
    return max(_memmap_rate(mm, offsets, min_s) for _ in range(reps))


def _memmap_rate(mm: np.ndarray, offsets: np.ndarray, min_s: float) -> float:
    batches = offsets.shape[0]
    out = np.empty((B, L), np.int32)
    done = 0
    t = time.perf_counter()
    while True:
        for b in range(batches):
            row = offsets[b]
            out = np.empty((B, L), np.int32)  # a fresh batch, as a loader hands out
            for k in range(B):
                o = row[k]
                out[k] = mm[o:o + L]
        done += batches
        dt = time.perf_counter() - t
        if dt >= min_s:
            return done * B * L / dt


# --------------------------------------------------------------------------------------------------
# Synthetic ledger of many chunks


def synthetic_ledger(root: Path, chunks: int, template: dict, shards: int = 100) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / fmt.LEDGER_NAME
    if path.exists():
        return root
    per = [chunks // shards + (1 if i < chunks % shards else 0) for i in range(shards)]
    rr = streams.round_robin_order(np.asarray(per))
    entries = []
    doc_off = tok_off = 0
    rng = np.random.default_rng(0)
    docs = rng.integers(1000, 20000, size=chunks)
    toks = docs * rng.integers(600, 1400, size=chunks)
    for k, (s, i) in enumerate(rr.tolist()):
        e = {
            "path": fmt.chunk_path(s, i),
            "shard": s,
            "index_in_shard": i,
            "byte_range": [i * (64 << 20), (i + 1) * (64 << 20)],
            "docs": int(docs[k]),
            "tokens": int(toks[k]),
            "doc_offset": doc_off,
            "token_offset": tok_off,
            "bytes": int(toks[k]) * 13 // 10,
            "checksum": "sha256:" + f"{k:064x}",
            "bad_records": 0,
        }
        doc_off += int(docs[k])
        tok_off += int(toks[k])
        entries.append(e)
    ledger = {k: v for k, v in template.items() if k != "table"}
    ledger["format_version"] = 3  # a chunk list (version 4's table: benchmarks/scale_bench.py)
    ledger["inputs"] = [
        {"shard": s, "path": f"/data/shard-{s:05d}.jsonl", "size": per[s] * (64 << 20), "compression": "none",
         "chunks": per[s]} for s in range(shards)
    ]
    ledger["chunks"] = entries
    ledger["finished"] = True
    ledger["totals"] = {"docs": doc_off, "tokens": tok_off, "chunks": chunks,
                        "bytes": sum(e["bytes"] for e in entries), "input_bytes": chunks * (64 << 20),
                        "bad_records": 0}
    ledger["bad_records"] = {}
    path.write_text(fmt.dumps_ledger(ledger))
    return root


def time_open(root: Path, opts: ReadOptions) -> float:
    t = time.perf_counter()
    r = Reader(str(root), opts)
    r.stream_index()
    dt = time.perf_counter() - t
    r.close()
    return dt


def time_seek(cache: Path, opts: ReadOptions, step: int) -> float:
    t = time.perf_counter()
    r = Reader(str(cache), opts)
    r.batch(step)
    dt = time.perf_counter() - t
    r.close()
    return dt


# --------------------------------------------------------------------------------------------------


def run(cache: Path, work: Path, batches: int, rounds: int, budgets: list[float], seek_reps: int,
        budget_max_s: float = 20.0, pass_rule: str | None = None) -> dict:
    res: dict = {}
    # The headline layout is "flat" (seqax's flat-tokens: one uint32 [B, L+1] array and two ints per
    # row, what JaxLoader ships to devices); the five-array layout is measured too ("arrays").
    # pass_rule: None, the cache's default (ReadOptions.pass_rule)
    seq_opts = ReadOptions(seq_len=L, batch_size=B, packing="concat", layout="flat", pass_rule=pass_rule)
    shuf_opts = ReadOptions(seq_len=L, batch_size=B, packing="concat", shuffle_seed=0, layout="flat", pass_rule=pass_rule)
    W = WORKERS
    # name -> options; the headline figures (reader_*) use W worker processes, *_1p one process
    configs = {
        "reader": dataclasses.replace(seq_opts, num_workers=W),
        "reader_shuffled": dataclasses.replace(shuf_opts, num_workers=W),
        "reader_1p": seq_opts,
        "reader_shuffled_1p": shuf_opts,
        "reader_arrays": dataclasses.replace(seq_opts, layout="arrays", num_workers=W),
        "reader_arrays_shuffled": dataclasses.replace(shuf_opts, layout="arrays", num_workers=W),
        "reader_arrays_1p": dataclasses.replace(seq_opts, layout="arrays"),
        "reader_arrays_shuffled_1p": dataclasses.replace(shuf_opts, layout="arrays"),
    }
    with Reader(str(cache), seq_opts) as r:
        res["reader_pass_rule"] = r.order.pass_rule
    res["reader_layout"] = seq_opts.layout
    res["reader_num_workers"] = W
    cfg = shuf_opts.shuffle_config()
    res["reader_ideal_readers"] = seq_opts.ideal_readers
    res["reader_memory_budget_mb"] = seq_opts.memory_budget_bytes / 1e6
    res["reader_batches"] = batches
    res["reader_shuffle_config"] = repr(cfg)
    cache_bytes = warm(cache)
    gc.collect()
    rss_base = psutil.Process().memory_info().rss
    res["reader_rss_before_mb"] = rss_base / 1e6

    # -- reader runs first (RSS before any memmap pages exist) --------------------------------------
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}  # (from open, steady) seconds
    firsts: dict[str, list] = {}

    def one(name: str) -> None:
        total, steady, first, _ = read_reader(cache, configs[name], batches)
        runs[name].append((total, steady))
        firsts.setdefault(name, first)

    with RssSampler() as rss:  # one process: its RSS against its budget
        one("reader_1p")
        one("reader_shuffled_1p")
    res["reader_peak_rss_mb"] = rss.peak / 1e6
    res["reader_rss_growth_mb"] = (rss.peak - rss_base) / 1e6
    with RssSampler(children=True) as rss_w:  # the reader and its workers together
        one("reader")
        one("reader_shuffled")
    res["reader_workers_peak_rss_mb"] = rss_w.peak / 1e6
    for name in configs:
        if not runs[name]:
            one(name)
    log(f"reader: seq {batches * B * L / runs['reader'][0][1] / 1e6:.1f} M tok/s ({W} workers), "
        f"{batches * B * L / runs['reader_1p'][0][1] / 1e6:.1f} (one process); shuffled "
        f"{batches * B * L / runs['reader_shuffled'][0][1] / 1e6:.1f}; peak RSS {rss.peak / 1e6:.0f} MB")
    seq_first, shuf_first = firsts["reader"], firsts["reader_shuffled"]
    for name, first in firsts.items():  # every configuration serves the same batches
        ref = firsts["reader_shuffled" if "shuffled" in name else "reader"]
        if not all(np.array_equal(a, b) for a, b in zip(first, ref)):
            raise AssertionError(f"{name}: its first batches differ from the {W}-worker reader's")

    # -- memmap baseline ------------------------------------------------------------------------------
    flat = work / "memmap-tokens.u32"
    off_seq, off_shf = baseline_offsets(cache, seq_opts, shuf_opts, batches, flat)
    res["memmap_file_mb"] = flat.stat().st_size / 1e6
    mm = np.memmap(flat, dtype=np.uint32, mode="r")
    _ = int(np.asarray(mm[:: 1024]).sum())  # touch
    with open(flat, "rb") as f:  # warm the page cache
        while f.read(1 << 24):
            pass
    # Same windows: the reader's first batches equal the memmap's.
    for first, offs, what in ((seq_first, off_seq, "sequential"), (shuf_first, off_shf, "shuffled")):
        for b, tgt in enumerate(first):
            want = np.stack([mm[o:o + L] for o in offs[b]]).astype(np.int32)
            if not np.array_equal(tgt, want):
                raise AssertionError(f"{what} batch {b}: reader targets differ from the memmap windows")
    res["reader_memmap_same_windows"] = True

    mm_seq, mm_shf = [memmap_rate(mm, off_seq)], [memmap_rate(mm, off_shf)]
    for _ in range(rounds - 1):
        for name in configs:
            one(name)
            if name == "reader":
                mm_seq.append(memmap_rate(mm, off_seq))
            elif name == "reader_shuffled":
                mm_shf.append(memmap_rate(mm, off_shf))
    tokens_steady = (batches - 1) * B * L
    res["memmap_tokens_per_s"] = max(mm_seq)
    res["memmap_shuffled_tokens_per_s"] = max(mm_shf)
    for name in configs:
        base_rate = res["memmap_shuffled_tokens_per_s" if "shuffled" in name else "memmap_tokens_per_s"]
        res[f"{name}_tokens_per_s"] = tokens_steady / min(st for _, st in runs[name])
        res[f"{name}_vs_memmap"] = res[f"{name}_tokens_per_s"] / base_rate
        res[f"{name}_from_open_tokens_per_s"] = batches * B * L / min(t for t, _ in runs[name])
        res[f"{name}_first_batch_s"] = min(t - st for t, st in runs[name])
    del mm
    log(f"memmap: seq {res['memmap_tokens_per_s'] / 1e6:.0f} M tok/s, shuffled "
        f"{res['memmap_shuffled_tokens_per_s'] / 1e6:.0f} M tok/s")

    res["parquet_decode_tokens_per_s_1core"], res["parquet_decode_and_verify_tokens_per_s_1core"] = decode_rate(cache)
    res["parquet_decode_vs_memmap_1core"] = res["parquet_decode_tokens_per_s_1core"] / res["memmap_tokens_per_s"]
    log(f"parquet decode (1 core, in memory): {res['parquet_decode_tokens_per_s_1core'] / 1e6:.0f} M tok/s")

    # -- seek -------------------------------------------------------------------------------------------
    far, near = [], []
    for _ in range(seek_reps):
        near.append(time_seek(cache, seq_opts, 0))
        far.append(time_seek(cache, seq_opts, 10**6))
    res["seek_near_s"] = statistics.median(near)
    res["seek_far_s"] = statistics.median(far)
    res["seek_far_vs_near"] = res["seek_far_s"] / res["seek_near_s"]

    # -- ledger of 100k chunks ------------------------------------------------------------------------------
    template = json.loads((cache / fmt.LEDGER_NAME).read_text())
    root = synthetic_ledger(work / "ledger-100k", 100_000, template)
    res["ledger_100k_mb"] = (root / fmt.LEDGER_NAME).stat().st_size / 1e6
    res["ledger_open_s_100k"] = statistics.median(time_open(root, seq_opts) for _ in range(3))

    # -- tokens/s against the memory budget (shuffled) ----------------------------------------------------
    curve = []
    for mult in budgets:
        budget = int(seq_opts.memory_budget_bytes * mult)
        o = dataclasses.replace(shuf_opts, memory_budget_bytes=budget)
        dt, _, _, done = read_reader(cache, o, batches, max_s=budget_max_s)
        curve.append([budget / 1e6, done * B * L / dt])
        log(f"reader: shuffled, budget {budget / 1e6:.0f} MB: {done * B * L / dt / 1e6:.2f} M tok/s")
    res["reader_budget_curve"] = curve
    res["cache_bytes_read_for_warmup"] = cache_bytes
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seek_reps", type=int, default=3)
    ap.add_argument("--budgets", default="0.25,0.5,1,2", help="multiples of the default budget (plot)")
    ap.add_argument("--pass_rule", choices=passes.PASS_RULES, default=None,
                    help="ReadOptions.pass_rule of every read (default: the cache's, by its format version)")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    budgets = [float(x) for x in a.budgets.split(",") if x]
    emit_result(run(a.cache, a.work, a.batches, a.rounds, budgets, a.seek_reps, pass_rule=a.pass_rule))
    return 0


if __name__ == "__main__":
    sys.exit(main())
