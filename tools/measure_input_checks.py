"""What identifying inputs by content costs: hashing the lines while building, and a rerun's checks.

    python -m tools.measure_input_checks [--mb 20] [--runner FnApiRunner]

1. In one process, on the same lines: the builder's per-line sha256 (``pipelines.inputs.lines.SpanHasher``)
   against tokenizing them (the builder's encoder), as MB/s and as a share of the tokenizing time.
2. A whole build of a generated corpus (one plain shard and one zstd shard), then a rerun of the same
   command on the finished cache (it checks every chunk's files and input span, tokenizes nothing), as
   wall times of the two commands in fresh processes and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))


def corpus(d: str, mb: float) -> list[str]:
    import zstandard

    from build_helpers import sample_texts

    texts = sample_texts(2000, seed=1, min_words=50, max_words=800)
    out = []
    for name in ("a.jsonl", "b.jsonl.zst"):
        lines, size, i = [], 0, 0
        while size < mb * 1e6 / 2:
            line = (json.dumps({"text": texts[i % len(texts)], "id": i}) + "\n").encode()
            lines.append(line)
            size += len(line)
            i += 1
        body = b"".join(lines)
        path = os.path.join(d, name)
        with open(path, "wb") as f:
            f.write(zstandard.ZstdCompressor(level=3).compress(body) if name.endswith(".zst") else body)
        out.append(path)
    return out


def in_process(path: str) -> dict:
    from pipelines.chunking.records import parse_line
    from pipelines.inputs.lines import SpanHasher
    from pipelines.tokenize.fast_tokenizer import load_cached
    from pipelines.tokenize.tokenizer import resolve

    data = open(path, "rb").read()
    lines = data.split(b"\n")
    t0 = time.perf_counter()
    h, off = SpanHasher(), 0
    for ln in lines:
        h.add(off, ln)
        off += len(ln) + 1
    h.finish(len(data))
    hash_s = time.perf_counter() - t0
    enc = load_cached(resolve("tiktoken:cl100k_base"))
    texts = [t for t, _, _ in (parse_line(ln, "text") for ln in lines if ln) if t]
    t0 = time.perf_counter()
    for i in range(0, len(texts), 256):
        enc.encode_many(texts[i:i + 256])
    tok_s = time.perf_counter() - t0
    mb = len(data) / 1e6
    return {"MB": mb, "sha256 MB/s": mb / hash_s, "tokenize MB/s": mb / tok_s, "hash/tokenize": hash_s / tok_s}


def timed(args: list[str]) -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "pipelines.build_cache", *args], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=20.0, help="uncompressed corpus size (default 20)")
    ap.add_argument("--runner", default="FnApiRunner")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        paths = corpus(d, args.mb)
        print(json.dumps(in_process(paths[0]), indent=1))
        argv = ["--input", os.path.join(d, "*"), "--output", os.path.join(d, "cache"), "--tokenizer",
                "tiktoken:cl100k_base", "--chunk_bytes", "4MiB", f"--runner={args.runner}"]
        build_s = timed(argv)
        verify_s = timed(argv)
        print(json.dumps({"build s": build_s, "verifying rerun s": verify_s, "rerun/build": verify_s / build_s},
                         indent=1))


if __name__ == "__main__":
    main()
