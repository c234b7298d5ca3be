"""fastokens against GigaToken as the builder's fast backend, per tokenizer kind: which one ``auto`` picks.

    python -m benchmarks.tokenizer_backends --corpus DIR [--mb 64] [--rounds 3] [--work DIR] [--emit]

The corpus's first ``--mb`` MB of jsonl lines (shard order; use the distinct corpus,
benchmarks/distinct_corpus.py) in one file. Each run reads it, parses every line with orjson and encodes the
texts in batches of 256 with one backend's encoder as a build worker runs it (``FastEncoder`` /
``GigaTokenEncoder.encode_many``, guards included, verification aside), on one thread: the whole encode path
of a worker, in MB of jsonl per CPU-second of this process. Cold: a fresh encoder for every run (both
libraries cache the pieces they have seen), made outside the timing (its CPU-seconds are reported apart).

Paired and alternating: each round runs both backends, in turns (fastokens first in odd rounds, GigaToken
first in even ones), so the machine's drift hits both; the figure is each round's ratio, and its median.
Kinds: ``tiktoken:cl100k_base``, and cl100k as a ``tokenizer.json`` (benchmarks/hf_tokenizer.py, written
offline). Both backends' tokens are compared document by document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

BATCH = 256
BACKENDS = ("fast", "gigatoken")


def _specs(work: Path) -> dict:
    from benchmarks import hf_tokenizer
    from pipelines.tokenize import tokenizer as tk

    return {"tiktoken": tk.resolve("tiktoken:cl100k_base"),
            "huggingface": tk.resolve(str(hf_tokenizer.convert_added_specials(work)))}


def _run(encoder, path: Path) -> list:
    import orjson

    with open(path, "rb") as f:
        texts = [orjson.loads(line)["text"] for line in f]
    out: list = []
    for i in range(0, len(texts), BATCH):
        out.extend(encoder.encode_many(texts[i:i + BATCH]))
    return out


def measure(corpus: Path, mb: float, rounds: int, work: Path) -> dict:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")
    import numpy as np

    from benchmarks.encoders_cold import prefix_file
    from pipelines.tokenize import fast_tokenizer as ft

    path = prefix_file(Path(corpus), mb, Path(work))
    size = path.stat().st_size / 1e6
    warm = prefix_file(Path(corpus), 0.05, Path(work), f"backends-{Path(corpus).name}-warm-up.jsonl")
    res: dict = {"corpus": Path(corpus).name, "jsonl_mb": size, "rounds": rounds, "kinds": {}}
    for kind, spec in _specs(Path(work)).items():
        tokenizer_json = spec.tokenizer_json() if kind == "huggingface" else ""
        reference = spec.load_reference(tokenizer_json)
        for b in BACKENDS:  # lazy imports and the heap, once
            _run(ft.make_encoder(b, spec, reference, tokenizer_json), warm)
        cpu: dict = {b: [] for b in BACKENDS}
        load: dict = {b: [] for b in BACKENDS}
        last: dict = {}
        for r in range(rounds):
            for b in (BACKENDS if r % 2 == 0 else BACKENDS[::-1]):
                c = time.process_time()
                enc = ft.make_encoder(b, spec, reference, tokenizer_json)
                load[b].append(time.process_time() - c)
                c = time.process_time()
                last[b] = _run(enc, path)
                cpu[b].append(time.process_time() - c)
                del enc
        a, g = last["fast"], last["gigatoken"]
        same = sum(1 for x, y in zip(a, g) if np.array_equal(x, y))
        ratios = [cpu["fast"][i] / cpu["gigatoken"][i] for i in range(rounds)]  # gigatoken's speed / fastokens'
        row = {b: {"mb_per_cpu_s": [size / c for c in cpu[b]], "median_mb_per_cpu_s": size / statistics.median(cpu[b]),
                   "load_cpu_s": statistics.median(load[b])} for b in BACKENDS}
        row.update({"gigatoken_over_fast": ratios, "median_gigatoken_over_fast": statistics.median(ratios),
                    "docs": len(a), "same_docs": same})
        res["kinds"][kind] = row
        print(f"{kind}: fastokens {row['fast']['median_mb_per_cpu_s']:.1f}, gigatoken "
              f"{row['gigatoken']['median_mb_per_cpu_s']:.1f} MB of jsonl per CPU-second (medians of {rounds}); "
              f"gigatoken / fastokens by round {', '.join(f'{x:.2f}' for x in ratios)}; loads "
              f"{row['fast']['load_cpu_s']:.2f} / {row['gigatoken']['load_cpu_s']:.2f} CPU-s; same tokens on "
              f"{same} of {len(a)} documents", file=sys.stderr)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, type=Path)
    ap.add_argument("--mb", type=float, default=64.0, help="MB of jsonl from the corpus's start (default 64)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("benchmarks/work"))
    ap.add_argument("--emit", action="store_true", help="print one BENCH_RESULT line")
    a = ap.parse_args(argv)
    res = measure(a.corpus, a.mb, a.rounds, a.work)
    print(json.dumps(res, indent=1))
    if a.emit:
        from benchmarks.common import emit_result

        emit_result(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
