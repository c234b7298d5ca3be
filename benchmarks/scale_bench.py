"""Internet scale, by simulation: caches and plans of 10^5, 10^6 and 10^7 chunks in 25,000 shards (a 15T-token
corpus at 64 MiB chunks makes about 10^6), opened, read and finalized as a real job would.

    make bench-scale    # = python -m benchmarks.scale_bench -> benchmarks/scale.json, docs/BENCHMARKS.md "Scale"

Every cache is written by the project's own writer code: the table by ``reader.format.table.TableWriter``, the
finished ledger by ``reader.storage.finish.finished_ledger``; its rows are synthetic counts like real 64 MiB chunks'
(8,000 to 24,000 documents, 700 to 1,300 tokens each), and chunk files and sidecars exist only for the chunks a
measured read touches (one real chunk, written by ``reader.format.chunk_file``, hard-linked under each of their
paths; the table records its bytes and checksums there). A valid cache of 10^7 chunks would need 2 * 10^7 files,
more than this disk's inodes. The 10^6 cache stays at ``benchmarks/work/scale-1e6/`` for any reader to open
(``python -m reader inspect benchmarks/work/scale-1e6 --max_chunks 2`` samples its first and last chunks).

Figures (``benchmarks/scale.json``):

- ``open_*``: a fresh process opens the cache as host 3 of 64 (``Reader(...)`` then its stream index), default
  read options; seconds, the process's peak RSS (``VmHWM``: the interpreter and its imports included), and the
  bytes it read while opening (``/proc/self/io`` rchar: the ledger and the table's pieces).
- ``first_batch_s_r4096_1e6``: then, in a fresh process, host 4095 of 4096 reads its row of batch 0 (packed
  concat, L = 2048, B = 4096, R* = 4096): seconds from the open done to the batch.
- ``finalize_rss_mb_1e6``: the build's finalize (``FinalizeLedgerFn`` on the FnApiRunner, in-process: the one
  process of the run) over the entries of a 10^6-unit plan in 25,000 shards, written as workers write them
  (kept in ``benchmarks/work/scale-finalize-1e6/`` for the next run); the process's peak RSS and seconds.
- ``pipeline_mb_1e6``: the serialized job graph (``Pipeline.to_runner_api()``) of that plan, both ways of dealing
  units (ranges of shards, and the local runner's worker slots); the larger.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, log

SHARDS = 25_000
CHUNK_BYTES = 64 << 20
SIZES = {"1e5": 100_000, "1e6": 1_000_000, "1e7": 10_000_000}
# the chunks a measured read touches: chunk 4095 (the index files' cost), the chunks a "streams" read of host
# 4095 of 4096 starts with (stream 4095: chunk 4095, then 4095 + 4096, ...), the first and last chunks
# (`inspect --max_chunks 2` reads them: see the module doc); and those a "spans" read starts with
# (:func:`spans_touched`)
TOUCHED = (3, 4095, 4095 + 4096, 0, -1)
# the first batch measured (packed concat; the pass rule: the cache's default, "spans" for version 4)
FIRST_BATCH = {"seq_len": 2048, "batch_size": 4096, "ideal_readers": 4096}
TARGETS = {"open_s_1e6": (1.0, "<="), "open_rss_mb_1e6": (300, "<="), "open_fetched_mb_1e6": (64, "<="),
           "open_s_1e7": (10.0, "<="), "open_rss_mb_1e7": (2000, "<="), "finalize_rss_mb_1e6": (1000, "<="),
           "pipeline_mb_1e6": (5.0, "<="), "first_batch_s_r4096_1e6": (2.0, "<=")}
OUT = REPO / "benchmarks" / "scale.json"


def plan_parts():
    """The tokenizer identity and chunking config of a default build (cl100k_base, 64 MiB chunks)."""
    from pipelines.options import build_arg_parser, chunk_config
    from pipelines.tokenize.tokenizer import resolve

    args = build_arg_parser().parse_args(["--input", "x", "--output", "y", "--tokenizer", "tiktoken:cl100k_base"])
    return resolve("tiktoken:cl100k_base"), chunk_config(args)


def synthetic_plan(n: int, tok, config):
    """A ``BuildPlan`` of ``n`` chunks over 25,000 uncompressed JSON Lines shards of whole 64 MiB chunks."""
    from pipelines.plan import BuildPlan, InputFile

    per = np.full(SHARDS, n // SHARDS, np.int64)
    per[:n % SHARDS] += 1
    inputs = tuple(InputFile(shard=s, path=f"/corpus/fineweb/shard-{s:05d}.jsonl", size=int(per[s]) * CHUNK_BYTES,
                             compression="none", chunks=int(per[s])) for s in range(SHARDS))
    return BuildPlan(tokenizer=tok.identity(), config=config, inputs=inputs)


def real_chunk(config) -> tuple[bytes, int, int]:
    """One real chunk of ``config`` (written by the builder's writer) of a 64 MiB input's size: 120 row groups
    of about 128 Ki tokens, 15 M tokens in 15,000 documents. ``(bytes, docs, tokens)``."""
    from reader.format import chunk_file

    rng = np.random.default_rng(0)
    out = chunk_file.ChunkParquet(config.to_json())
    docs = tokens = 0
    for _ in range(120):
        lengths = rng.integers(200, 1900, size=125).astype(np.int32)
        values = rng.integers(0, 100_000, size=int(lengths.sum())).astype(np.int32)
        out.write(chunk_file.flat_row_group_table(values, lengths, 0, np.arange(lengths.size) * 1000), int(values.size))
        docs, tokens = docs + lengths.size, tokens + int(values.size)
    data, _, _ = out.finish()
    return data, docs, tokens


def spans_touched(docs: np.ndarray, tokens: np.ndarray, real_docs: int, real_tokens: int) -> list[int]:
    """The chunks a measured read touches (:data:`TOUCHED`, and the rows host 4095 of 4096 reads first under
    the "spans" rule, the default of a version 4 cache: the first row of span 4095, near the end of the data),
    their ``docs`` and ``tokens`` set to the real chunk's in place (which moves the rows: repeated until no new
    chunk is touched)."""
    from reader.order.passes import Spans

    n = len(docs)
    touched = {c % n for c in TOUCHED}
    while True:
        for c in touched:
            docs[c], tokens[c] = real_docs, real_tokens
        ends = np.cumsum(tokens)
        rows = int(ends[-1]) // FIRST_BATCH["seq_len"]  # E: the eval pass's whole rows of L tokens
        start = Spans(rows, FIRST_BATCH["ideal_readers"]).span_start(FIRST_BATCH["ideal_readers"] - 1)
        # (a row either side: the eval pass's last row and a row's shifted targets are not modelled here)
        lo, hi = (start - 1) * FIRST_BATCH["seq_len"], (start + 2) * FIRST_BATCH["seq_len"] + 1
        need = set(range(int(np.searchsorted(ends, lo, "right")), int(np.searchsorted(ends, hi - 1, "right")) + 1))
        if need <= touched:
            return sorted(touched)
        touched |= need


def write_cache(root: Path, n: int, tok, config) -> dict:
    """The finished cache of :func:`synthetic_plan`'s ``n`` chunks at ``root`` (see the module doc)."""
    from pipelines import status
    from reader.format import blocks, table as chunk_table
    from reader.format import spec as fmt
    from reader.format.sidecar import ledger_entry, make_sidecar, row_group_index, sidecar_bytes
    from reader.storage import finish
    from reader.order.streams import round_robin_order

    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    plan = synthetic_plan(n, tok, config)
    raw_plan = plan.ledger()
    inputs = [dict(i.to_json(), uncompressed_bytes=i.size) for i in plan.inputs]
    order = round_robin_order([i["chunks"] for i in inputs])
    data, real_docs, real_tokens = real_chunk(config)
    rg_index, footer = row_group_index(data)
    rng = np.random.default_rng(1)
    docs = rng.integers(8_000, 24_000, n)
    tokens = docs * rng.integers(700, 1300, n)
    touched = spans_touched(docs, tokens, real_docs, real_tokens)
    real = root / "real-chunk.parquet"
    real.write_bytes(data)
    entries = {}
    for c in touched:
        s, k = map(int, order[c])
        (root / fmt.shard_dir(s)).mkdir(parents=True, exist_ok=True)
        os.link(real, root / fmt.chunk_path(s, k))
        sidecar = make_sidecar(shard=s, index_in_shard=k, byte_range=[k * CHUNK_BYTES, (k + 1) * CHUNK_BYTES],
                               data=data, row_group_index=rg_index, footer=footer, docs=real_docs, tokens=real_tokens)
        (root / fmt.sidecar_path(s, k)).write_bytes(sidecar_bytes(sidecar))
        entries[c] = ledger_entry(sidecar)
    real.unlink()
    sums = finish.Sums(shards=SHARDS)
    tmp = root / ".tmp-table.bin"
    t0 = time.perf_counter()
    with open(tmp, "wb") as f:
        w = chunk_table.TableWriter(f, n, masked=False)
        for lo in range(0, n, chunk_table.BLOCK_ROWS):
            m = min(chunk_table.BLOCK_ROWS, n - lo)
            d, t = docs[lo:lo + m], tokens[lo:lo + m]
            cols = {"docs": d, "tokens": t, "bytes": t * 13 // 10, "bad_records": np.zeros(m, np.int64),
                    "checksum": rng.integers(0, 256, (m, 32), dtype=np.uint8),
                    "sidecar_checksum": rng.integers(0, 256, (m, 32), dtype=np.uint8)}
            for c, e in entries.items():
                if lo <= c < lo + m:
                    cols["bytes"][c - lo] = e["bytes"]
                    for key in ("checksum", "sidecar_checksum"):
                        cols[key][c - lo] = blocks.digests_of([e[key]])[0]
            w.add(cols)
            sums.docs += int(cols["docs"].sum())
            sums.tokens += int(cols["tokens"].sum())
            sums.bytes += int(cols["bytes"].sum())
    desc = w.finish()
    os.replace(tmp, root / desc["path"])
    ledger = finish.finished_ledger(raw_plan, inputs, sums, table=desc)
    status.write_ledger(str(root), ledger)
    return {"write_s": time.perf_counter() - t0, "ledger_mb": (root / fmt.LEDGER_NAME).stat().st_size / 1e6,
            "table_mb": desc["bytes"] / 1e6}


OPEN = r"""
import json, sys, time
import numpy as np
from reader import Reader, ReadOptions
from reader.storage.cache import Cache
from reader.format import table
def rchar():
    return int(next(l for l in open("/proc/self/io") if l.startswith("rchar")).split()[1])
def peak_rss_mb():  # this process's own peak (ru_maxrss would count the forking parent's pages)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
root, mode = sys.argv[1], sys.argv[2]
Reader  # every module of an open imported: the bytes read below are the cache's
r0, t0 = rchar(), time.perf_counter()
if mode == "open":
    r = Reader(root, ReadOptions(), num_readers=64, reader_index=3)
    r.stream_index()
    dt = time.perf_counter() - t0
    out = {"s": dt, "read_mb": (rchar() - r0) / 1e6, "chunks": len(r.cache.table)}
else:
    r = Reader(root, ReadOptions(**json.loads(sys.argv[3]), prefetch_threads=0), num_readers=4096, reader_index=4095)
    r.stream_index()
    t1 = time.perf_counter()
    b = r.batch(0)
    out = {"s": time.perf_counter() - t1, "open_s": t1 - t0, "rows": int(b["targets"].shape[0]),
           "pass_rule": r.order.pass_rule}
r.close()
out["rss_mb"] = peak_rss_mb()
print(json.dumps(out))
"""


def measure(root: Path, mode: str, reps: int) -> dict:
    """The best of ``reps`` fresh processes (the machine is shared)."""
    best = None
    for _ in range(reps):
        got = subprocess.run([sys.executable, "-c", OPEN, str(root), mode, json.dumps(FIRST_BATCH)], cwd=REPO, capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)
        if got.returncode:
            raise RuntimeError(f"{mode} of {root} failed: {got.stderr[-3000:]}")
        r = json.loads(got.stdout.strip().splitlines()[-1])
        best = r if best is None or r["s"] < best["s"] else best
    return best


def index_cost(root: Path, reps: int = 10) -> dict:
    """What counting one 64 MiB chunk costs an index builder (``python -m reader index``): its footer and
    ``num_tokens`` column read (local disk, warm) and counted; milliseconds, unpacked and best fit."""
    from reader.storage.cache import Cache
    from reader.storage.index import ExampleIndex

    cache = Cache(str(root))
    out = {}
    for kind in ("unpacked", "best_fit"):
        index = ExampleIndex(cache, 2048, kind, index_cache=False)
        best = min(_timed(lambda: index._count(cache.table, TOUCHED[1])) for _ in range(reps))
        out[f"index_ms_per_chunk_{kind}"] = 1000 * best
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def pipeline_mb(tok, config, work: Path) -> dict:
    """The serialized job graph of a 10^6-unit plan (its plan ledger written first, as the launcher does)."""
    import apache_beam as beam

    from pipelines import status
    from pipelines.chunking.transforms import BuildCache

    plan = synthetic_plan(SIZES["1e6"], tok, config)
    out = work / "scale-plan-1e6"
    out.mkdir(parents=True, exist_ok=True)
    status.write_ledger(str(out), plan.ledger())
    sizes = {}
    for name, queue in (("ranges", None), ("slots", ("/tmp/claims", 2))):
        p = beam.Pipeline(runner="DirectRunner")
        _ = p | BuildCache(str(out), plan, tok, max_bad_fraction=0.1, queue=queue)
        sizes[name] = len(p.to_runner_api().SerializeToString()) / 1e6
    return {"pipeline_mb_1e6": max(sizes.values()), "pipeline_mb_1e6_by": sizes,
            "plan_ledger_mb_1e6": (out / "ledger.json").stat().st_size / 1e6}


FINALIZE = r"""
import json, sys, time
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from pipelines.chunking.transforms import FinalizeLedgerFn
from pipelines.plan_ledger import PlanRef, plan_checksum
out, units = sys.argv[1], int(sys.argv[2])
ref = PlanRef(output=out, checksums=((None, plan_checksum(out)),))
t0 = time.perf_counter()
with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
    _ = p | beam.Create([units]) | beam.ParDo(FinalizeLedgerFn(out, ref, None, max_bad_fraction=1.0))
hwm = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
print(json.dumps({"s": time.perf_counter() - t0, "rss_mb": hwm}))
"""


def finalize_rss(tok, config, work: Path) -> dict:
    """The finalize of a 10^6-unit build over its units' entries (synthetic, written as workers write them)."""
    from pipelines import status
    from reader.format import spec as fmt, table as chunk_table

    n = SIZES["1e6"]
    plan = synthetic_plan(n, tok, config)
    out = work / "scale-finalize-1e6"
    written = out / "entries-written"  # kept between runs: a million files take minutes to write or remove here
    status.write_ledger(str(out), plan.ledger())
    rng = np.random.default_rng(2)
    t0 = time.perf_counter()
    for inp in [] if written.exists() else plan.inputs:
        d = out / fmt.shard_dir(inp.shard)
        d.mkdir(parents=True, exist_ok=True)
        for k in range(inp.chunks):
            docs = int(rng.integers(8_000, 24_000))
            tokens = docs * 1000
            e = {"path": fmt.chunk_path(inp.shard, k), "shard": inp.shard, "index_in_shard": k,
                 "byte_range": [k * CHUNK_BYTES, (k + 1) * CHUNK_BYTES], "docs": docs, "tokens": tokens,
                 "bytes": tokens * 13 // 10, "checksum": "sha256:" + os.urandom(32).hex(), "row_groups": 115,
                 "bad_records": 0, "bad_reasons": {}, "dead_letters": None,
                 "sidecar_checksum": "sha256:" + os.urandom(32).hex()}
            fd = os.open(d / f"chunk-{k:06d}{chunk_table.ENTRY_SUFFIX}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, (json.dumps(e, sort_keys=True, separators=(",", ":")) + "\n").encode())
            os.close(fd)
    written.touch()
    log(f"scale: {n:,} entries in {out} ({time.perf_counter() - t0:.0f} s)")
    got = subprocess.run([sys.executable, "-c", FINALIZE, str(out), str(n)], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)
    if got.returncode:
        raise RuntimeError(f"finalize failed: {got.stderr[-3000:]}")
    r = json.loads(got.stdout.strip().splitlines()[-1])
    ledger = json.loads((out / fmt.LEDGER_NAME).read_text())
    assert ledger["finished"] and ledger["table"]["rows"] == n
    return {"finalize_rss_mb_1e6": r["rss_mb"], "finalize_s_1e6": r["s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=REPO / "benchmarks" / "work")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--reps", type=int, default=3, help="fresh processes per open figure (the best is kept)")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: 1e7, finalize (their figures "
                                               "are kept from --out)")
    a = ap.parse_args(argv)
    skip = set(filter(None, a.skip.split(",")))
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    fig = json.loads(a.out.read_text()) if a.out.exists() else {}
    fig.pop("targets", None)
    tok, config = plan_parts()
    for key, n in SIZES.items():
        if key in skip:
            continue
        root = work / f"scale-{key}"
        info = write_cache(root, n, tok, config)
        log(f"scale: {n:,} chunks written in {info['write_s']:.1f} s (ledger {info['ledger_mb']:.2f} MB, "
            f"table {info['table_mb']:.1f} MB)")
        o = measure(root, "open", a.reps)
        fig.update({f"open_s_{key}": o["s"], f"open_rss_mb_{key}": o["rss_mb"], f"open_fetched_mb_{key}": o["read_mb"],
                    f"ledger_mb_{key}": info["ledger_mb"], f"table_mb_{key}": info["table_mb"]})
        log(f"scale: open {key}: {o['s']:.2f} s, {o['rss_mb']:.0f} MB RSS, {o['read_mb']:.1f} MB read")
        if key == "1e6":
            fig.update(index_cost(root))
            b = measure(root, "first", a.reps)
            fig["first_batch_s_r4096_1e6"] = b["s"]
            fig["first_batch_open_s_r4096_1e6"] = b["open_s"]
            log(f"scale: first batch at R* = 4096, host 4095: {b['s']:.2f} s after an open of {b['open_s']:.2f} s")
        elif key == "1e7":
            shutil.rmtree(root)
        elif key == "1e5":
            shutil.rmtree(root)
    fig.update(pipeline_mb(tok, config, work))
    log(f"scale: job graph of a 10^6-unit plan: {fig['pipeline_mb_1e6']:.3f} MB")
    if "finalize" not in skip:
        fig.update(finalize_rss(tok, config, work))
        log(f"scale: finalize of 10^6 units: {fig['finalize_rss_mb_1e6']:.0f} MB peak RSS, {fig['finalize_s_1e6']:.0f} s")
    fig["scale_bench_s"] = time.perf_counter() - t_all
    fig["targets"] = {k: list(v) for k, v in TARGETS.items()}
    fig["measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    a.out.write_text(json.dumps(fig, indent=1, sort_keys=True) + "\n")
    log(f"scale: figures in {a.out} ({fig['scale_bench_s'] / 60:.1f} min)")
    from benchmarks import report

    latest = REPO / "benchmarks" / "latest.json"
    if latest.exists() and a.out == OUT:  # the "Scale" section of docs/BENCHMARKS.md, from this file
        report.main(["--figures", str(latest)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
