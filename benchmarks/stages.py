"""Where a build worker's CPU goes, per stage, on the benchmark corpus (one process, no profiler).

    python -m benchmarks.stages --corpus DIR [--shards 1] [--repeats 2]

Each stage of the builder's per-document path runs alone over the same input, with the builder's own code,
and its CPU-seconds are timed (best of ``--repeats``): reading the lines and hashing them (the input
checksum), parsing the JSON lines (``parse_line``), encoding (the fast backend's ``encode_many`` in batches
of 256, what the limit runs), and writing Parquet (``row_group_table`` + the chunk's ``ParquetWriter`` +
row-group index and checksums). Then the whole ``ChunkBuilder`` (everything, as a worker runs it, one chunk
per ``--chunk_bytes`` of input). Against them, the parse-and-encode limit's path on one core: GigaToken's
``encode_files`` reading, parsing and encoding the same files (cl100k without special tokens: our tokens),
writing nothing. The encoders are made anew before each timing (cold: both cache the pieces they have
encoded). Prints one ``BENCH_RESULT`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import emit_result


def _cpu(fn) -> float:
    c = time.process_time()
    fn()
    return time.process_time() - c


def measure(corpus: Path, shards: int = 1, repeats: int = 2) -> dict:
    from gigatoken import JsonlFileSource

    from benchmarks.megatron_peer import load_gigatoken
    from pipelines.inputs.lines import RangeLines, SpanHasher
    from pipelines.chunking.chunk_writer import ENCODE_BATCH_DOCS, ChunkBuilder
    from pipelines.chunking.records import parse_line
    from pipelines.tokenize.fast_tokenizer import load_encoder
    from pipelines.options import (DEFAULT_CHUNK_BYTES, DEFAULT_COMPRESSION, DEFAULT_COMPRESSION_LEVEL,
                                   DEFAULT_ROW_GROUP_TOKENS, TOKEN_ENCODING)
    from pipelines.tokenize.tokenizer import resolve
    from reader.format import spec as fmt
    from reader.format.chunk_file import ChunkParquet, row_group_table

    manifest = json.loads((corpus / "manifest.json").read_text())
    files = [str(corpus / f) for f in manifest["files"][:shards]]
    spec = resolve("tiktoken:cl100k_base").with_backend("fast")
    enc = load_encoder(spec)
    config = {"text_key": "text", "append_eos": False, "row_group_tokens": DEFAULT_ROW_GROUP_TOKENS,
              "compression": DEFAULT_COMPRESSION, "compression_level": DEFAULT_COMPRESSION_LEVEL,
              "token_encoding": TOKEN_ENCODING}
    lines, texts, offsets = [], [], []
    for path in files:
        for off, raw in RangeLines(path, 0, os.path.getsize(path)):
            lines.append(raw)
            offsets.append(off)
    for raw in lines:
        text, _, _ = parse_line(raw, "text")
        if text is not None:
            texts.append(text)
    arrays = [a for i in range(0, len(texts), ENCODE_BATCH_DOCS) for a in enc.encode_many(texts[i:i + ENCODE_BATCH_DOCS])]
    tokens = sum(len(a) for a in arrays)
    input_bytes = sum(os.path.getsize(p) for p in files)

    def read_and_hash():
        for path in files:
            hasher = SpanHasher()
            rl = RangeLines(path, 0, os.path.getsize(path))
            for off, raw in rl:
                hasher.add(off, raw)
            hasher.finish(rl.end)

    def parse():
        for raw in lines:
            parse_line(raw, "text")

    def encode(enc):
        for i in range(0, len(texts), ENCODE_BATCH_DOCS):
            enc.encode_many(texts[i:i + ENCODE_BATCH_DOCS])

    def parquet():
        limit, per_chunk = int(config["row_group_tokens"]), DEFAULT_CHUNK_BYTES // 4  # ~4 bytes of text per token
        writer, in_chunk, rg, rg_offs, n = ChunkParquet(config), 0, [], [], 0
        for a, off in zip(arrays, offsets):
            rg.append(a)
            rg_offs.append(off)
            n += len(a)
            if n >= limit:
                writer.write(row_group_table(rg, 0, rg_offs, None), n)
                in_chunk += n
                rg, rg_offs, n = [], [], 0
                if in_chunk >= per_chunk:
                    data, _, _ = writer.finish()
                    fmt.checksum(data)
                    writer, in_chunk = ChunkParquet(config), 0
        if rg:
            writer.write(row_group_table(rg, 0, rg_offs, None), n)
        data, _, _ = writer.finish()
        fmt.checksum(data)

    def whole(enc):
        with tempfile.TemporaryDirectory() as d:
            for shard, path in enumerate(files):
                size = os.path.getsize(path)
                for k, lo in enumerate(range(0, size, DEFAULT_CHUNK_BYTES)):
                    hi = min(lo + DEFAULT_CHUNK_BYTES, size)
                    b = ChunkBuilder(root=d, input_path=path, shard=shard, index=k, lo=lo, encoder=enc,
                                     config=config, eos_id=spec.eos_id)
                    rl = RangeLines(path, lo, hi)
                    for off, raw in rl:
                        b.add(off, raw)
                    b.finish(hi, rl.end)

    def parse_encode_limit(tok):
        tok.encode_files(JsonlFileSource(files, field="text"), parallel=False)

    def cold(fn, make) -> float:
        """The best of the repeats, each with an encoder made anew (outside the timing)."""
        times = []
        for _ in range(repeats):
            fresh = make()
            times.append(_cpu(lambda: fn(fresh)))
        return min(times)

    best = {k: min(_cpu(fn) for _ in range(repeats)) for k, fn in
            (("read_hash", read_and_hash), ("parse", parse), ("parquet", parquet))}
    best["encode"] = cold(encode, lambda: load_encoder(spec))
    best["whole"] = cold(whole, lambda: load_encoder(spec))
    best["parse_encode_limit"] = cold(parse_encode_limit, lambda: load_gigatoken(specials=False))
    out = {"stage_tokens": tokens, "stage_input_mb": input_bytes / 1e6, "stage_docs": len(texts)}
    for k, v in best.items():
        out[f"stage_{k}_cpu_s"] = v
        out[f"stage_{k}_tokens_per_cpu_s"] = tokens / v
    parts = sum(best[k] for k in ("read_hash", "parse", "encode", "parquet"))
    for k in ("read_hash", "parse", "encode", "parquet"):
        out[f"stage_{k}_share"] = best[k] / best["whole"]
    out["stage_other_share"] = max(0.0, 1 - parts / best["whole"])
    out["stage_encode_vs_whole"] = best["encode"] / best["whole"]  # the most a worker can reach of the limit
    # the same bound for a worker that wrote nothing (read, hash, parse, encode), and one that only parsed
    # and encoded texts already in memory: what no change to writing (the cache's bytes) could beat
    out["stage_ceiling_without_writing"] = best["encode"] / (best["read_hash"] + best["parse"] + best["encode"])
    out["stage_ceiling_parse_encode"] = best["encode"] / (best["parse"] + best["encode"])
    # against the parse-and-encode limit's path: the share of a worker's CPU it would need for the same work,
    # and the CPU-seconds per MB of jsonl a worker spends beyond it (the room left)
    out["stage_whole_vs_parse_encode_limit"] = best["parse_encode_limit"] / best["whole"]
    out["stage_beyond_limit_cpu_s_per_mb"] = (best["whole"] - best["parse_encode_limit"]) / (input_bytes / 1e6)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    emit_result(measure(a.corpus, a.shards, a.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
