"""Measure the builder's hot path in one process: a chunk built from a jsonl file vs the raw tokenizer.

    python -m tools.profile_builder --input FILE.jsonl [--tokenizer tiktoken:cl100k_base] [--profile]

Prints tokens/s of (a) the tokenizer alone on the already-parsed texts (tiktoken ``encode_ordinary``,
HF ``encode_batch``) and (b) ``ChunkBuilder`` reading, parsing, tokenizing and writing the same file as
one chunk, and their ratio. ``--profile`` adds the top functions of (b) by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import tempfile
import time

from pipelines import fsutil
from pipelines.chunk_writer import ChunkBuilder
from pipelines.options import DEFAULT_COMPRESSION, DEFAULT_COMPRESSION_LEVEL, DEFAULT_ROW_GROUP_TOKENS, TOKEN_ENCODING
from pipelines.tokenizer import HFEncoder, TiktokenEncoder, resolve


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="an uncompressed jsonl file")
    ap.add_argument("--tokenizer", default="tiktoken:cl100k_base")
    ap.add_argument("--text_key", default="text")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    spec = resolve(args.tokenizer)
    enc = spec.load()
    texts = []
    with open(args.input, "rb") as f:
        for line in f:
            try:
                t = json.loads(line).get(args.text_key)
            except (ValueError, AttributeError):
                continue
            if isinstance(t, str) and t:
                texts.append(t)
    t0 = time.perf_counter()
    if isinstance(enc, TiktokenEncoder):
        n = sum(len(enc.enc.encode_ordinary(t)) for t in texts)
    elif isinstance(enc, HFEncoder):
        n = sum(len(e.ids) for i in range(0, len(texts), 1024)
                for e in enc.tok.encode_batch(texts[i:i + 1024], add_special_tokens=False))
    else:  # pragma: no cover
        raise SystemExit("unknown encoder")
    raw_s = time.perf_counter() - t0
    config = {"text_key": args.text_key, "append_eos": False, "row_group_tokens": DEFAULT_ROW_GROUP_TOKENS,
              "compression": DEFAULT_COMPRESSION, "compression_level": DEFAULT_COMPRESSION_LEVEL,
              "token_encoding": TOKEN_ENCODING}
    size = os.path.getsize(args.input)

    def build(root: str):
        b = ChunkBuilder(root=root, input_path=args.input, shard=0, index=0, lo=0, encoder=enc, config=config,
                         eos_id=spec.eos_id)
        for off, raw in fsutil.iter_range_lines(args.input, 0, size):
            b.add(off, raw)
        return b.finish(size, size)

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        sidecar = build(d)[0]
        build_s = time.perf_counter() - t0
        print(f"{len(texts)} documents, {n} tokens")
        print(f"raw tokenizer      {n / raw_s / 1e6:6.2f} M tokens/s")
        print(f"ChunkBuilder       {sidecar['tokens'] / build_s / 1e6:6.2f} M tokens/s "
              f"(read + parse + tokenize + Parquet {sidecar['bytes'] / max(sidecar['tokens'], 1):.2f} bytes/token)")
        print(f"builder / raw      {raw_s / build_s:6.3f}")
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(build, d)
            pstats.Stats(prof).sort_stats("tottime").print_stats(10)


if __name__ == "__main__":
    main()
