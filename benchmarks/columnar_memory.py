"""Peak memory of reading a Parquet input chunk by chunk: bounded by the row group, not by the file.

    python -m benchmarks.columnar_memory                       # 200 MB and 2 GB files of 64 MB row groups
    python -m benchmarks.columnar_memory --sizes_mb 20,200 --row_group_mb 4   # smaller
    python -m benchmarks.columnar_memory --build --save benchmarks/columnar_memory.json   # and whole builds

Writes each file (uncompressed text, so the file is as large as its text; one document of a few KB per row)
under ``--work``, then reads every chunk of it (``--chunk_bytes`` = one row group) in a fresh process
through :class:`pipelines.inputs.columnar.ChunkReader`, turning every text into a Python string as the
builder does, and reports that process's peak RSS (``ru_maxrss``), its RSS after the imports, and the peak of pyarrow's
memory pool. With ``--build``, it also builds a cache of each file (``python -m pipelines.build_cache``, one
worker, tiktoken, a chunk per row group) and reports the largest process's peak RSS (the worker's: sampled
every 0.25 s). The claim it checks: the peak of the largest file is within 1.25x of the smallest one's.
``--save`` writes the figures as JSON; docs/BENCHMARKS.md shows the saved ones (benchmarks/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MB = 1 << 20

_CHILD = r"""
import json, resource, sys, time
import pyarrow as pa
from pipelines.inputs.columnar import PARQUET, ChunkReader, plan
path, chunk_bytes = sys.argv[1], int(sys.argv[2])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
base = rss()
t0 = time.time()
layout = plan(path, PARQUET, text_key="text", chunk_bytes=chunk_bytes)
rows = chars = 0
for k in range(len(layout.chunks)):
    for rec in ChunkReader(layout, k, text_key="text"):
        rows += 1
        chars += len(rec.text)
print(json.dumps({"rows": rows, "chars": chars, "chunks": len(layout.chunks), "seconds": time.time() - t0,
                  "base_rss": base, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "arrow_pool_peak": pa.default_memory_pool().max_memory()}))
"""


def make_parquet(path: Path, size_bytes: int, row_group_bytes: int, doc_bytes: int = 4096, seed: int = 0) -> Path:
    """A Parquet file of about ``size_bytes`` of text in row groups of about ``row_group_bytes`` (no codec),
    written one row group at a time (the writer never holds the file)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlucmfwypvbgkqjxz     ", dtype=np.uint8)
    rows = max(1, row_group_bytes // doc_bytes)
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    written, first = 0, 0
    with pq.ParquetWriter(str(path), schema, compression="none", write_statistics=False) as w:
        while written < size_bytes:
            rows = min(rows, -(-(size_bytes - written) // doc_bytes))  # the last row group: what is left
            chars = letters[rng.integers(0, len(letters), rows * doc_bytes, dtype=np.uint8)]
            offsets = pa.array(np.arange(0, rows * doc_bytes + 1, doc_bytes, dtype=np.int32))
            text = pa.StringArray.from_buffers(rows, offsets.buffers()[1], pa.py_buffer(chars.tobytes()))
            w.write_table(pa.table({"id": pa.array(np.arange(first, first + rows)), "text": text}, schema=schema),
                          row_group_size=rows)
            written += rows * doc_bytes
            first += rows
    return path


def measure(path: Path, chunk_bytes: int) -> dict:
    """Read every chunk of ``path`` in a fresh process; its peak RSS and pyarrow pool peak (bytes)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(chunk_bytes)], capture_output=True,
                         text=True, cwd=REPO, env=env, timeout=3600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes_mb", default="200,2000", help="file sizes in MB of text, smallest first")
    p.add_argument("--row_group_mb", type=int, default=64)
    p.add_argument("--work", default=str(REPO / "benchmarks" / "work" / "columnar_memory"))
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument("--build", action="store_true", help="also build a cache of each file (1 worker)")
    p.add_argument("--save", type=Path, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rg = args.row_group_mb * MB
    results = []
    for size_mb in (int(s) for s in args.sizes_mb.split(",")):
        path = work / f"text-{size_mb}mb-rg{args.row_group_mb}mb.parquet"
        t0 = time.time()
        if not path.exists():
            make_parquet(path, size_mb * MB, rg)
        made = time.time() - t0
        r = measure(path, rg)
        r.update(file_mb=round(path.stat().st_size / MB, 1), row_group_mb=args.row_group_mb, make_s=round(made, 1))
        results.append(r)
        print(f"{r['file_mb']:>8} MB file, {r['chunks']} chunks, {r['rows']} rows: peak RSS "
              f"{r['peak_rss'] / MB:.0f} MB (after imports {r['base_rss'] / MB:.0f} MB), pyarrow pool peak "
              f"{r['arrow_pool_peak'] / MB:.0f} MB, read in {r['seconds']:.1f} s", flush=True)
        if args.build:
            from benchmarks import pipeline_bench

            b = pipeline_bench.build([str(path)], work / "cache", "tiktoken:cl100k_base", workers=1,
                                     extra=["--chunk_bytes", str(rg)])
            r.update(build_peak_rss_worker_mb=round(b["peak_rss_proc_mb"], 1),
                     build_peak_rss_tree_mb=round(b["peak_rss_tree_mb"], 1), build_tokens=b["tokens"],
                     build_wall_s=round(b["wall_s"], 1))
            print(f"{'':>8}    build: {b['tokens']} tokens, largest process's peak RSS "
                  f"{b['peak_rss_proc_mb']:.0f} MB (tree {b['peak_rss_tree_mb']:.0f} MB)", flush=True)
        if not args.keep:
            path.unlink()
    out = {"columnar_peak_rss_ratio": results[-1]["peak_rss"] / results[0]["peak_rss"], "files": results}
    print(f"peak RSS, largest / smallest file: {out['columnar_peak_rss_ratio']:.3f} (claim: <= 1.25)")
    if args.build:
        out["columnar_build_peak_rss_ratio"] = (results[-1]["build_peak_rss_worker_mb"]
                                                / results[0]["build_peak_rss_worker_mb"])
        print(f"a build's largest process, largest / smallest file: {out['columnar_build_peak_rss_ratio']:.3f}")
    print(json.dumps(out))
    if args.save:
        args.save.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0 if max(v for k, v in out.items() if k.endswith("ratio")) <= 1.25 else 1


if __name__ == "__main__":
    sys.exit(main())
