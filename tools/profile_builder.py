"""Measure the builder's hot path in one process: a chunk built from a jsonl file vs the raw tokenizer.

    python -m tools.profile_builder --input FILE.jsonl [--tokenizer tiktoken:cl100k_base]
        [--tokenizer_backend auto|fast|reference] [--profile]

Prints tokens/s of (a) the encoder alone on the already-parsed texts (``encode_many`` on batches of
``ENCODE_BATCH_DOCS``) and (b) ``ChunkBuilder`` reading, parsing, tokenizing and writing the same file as
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

from pipelines.inputs.lines import RangeLines
from pipelines.chunking.chunk_writer import ENCODE_BATCH_DOCS, ChunkBuilder
from pipelines.options import DEFAULT_COMPRESSION, DEFAULT_COMPRESSION_LEVEL, DEFAULT_ROW_GROUP_TOKENS, TOKEN_ENCODING
from pipelines.tokenize.fast_tokenizer import load_encoder
from pipelines.tokenize.tokenizer import resolve


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="an uncompressed jsonl file")
    ap.add_argument("--tokenizer", default="tiktoken:cl100k_base")
    ap.add_argument("--text_key", default="text")
    ap.add_argument("--tokenizer_backend", default="auto", choices=["auto", "fast", "reference"])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    spec = resolve(args.tokenizer).with_backend(args.tokenizer_backend)
    enc = load_encoder(spec)
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
    n = sum(len(a) for i in range(0, len(texts), ENCODE_BATCH_DOCS)
            for a in enc.encode_many(texts[i:i + ENCODE_BATCH_DOCS]))
    raw_s = time.perf_counter() - t0
    config = {"text_key": args.text_key, "append_eos": False, "row_group_tokens": DEFAULT_ROW_GROUP_TOKENS,
              "compression": DEFAULT_COMPRESSION, "compression_level": DEFAULT_COMPRESSION_LEVEL,
              "token_encoding": TOKEN_ENCODING}
    size = os.path.getsize(args.input)

    def build(root: str):
        b = ChunkBuilder(root=root, input_path=args.input, shard=0, index=0, lo=0, encoder=enc, config=config,
                         eos_id=spec.eos_id)
        for off, raw in RangeLines(args.input, 0, size):
            b.add(off, raw)
        return b.finish(size, size)

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        sidecar = build(d)[0]
        build_s = time.perf_counter() - t0
        print(f"{len(texts)} documents, {n} tokens, tokenizer backend {enc.backend}")
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
