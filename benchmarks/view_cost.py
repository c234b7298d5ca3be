"""What a view costs a read: one cache read whole and through a view that keeps about 80% of its documents.

    python -m benchmarks.view_cost --work DIR [--tokens N] [--rounds R] [--keep 0.8] [--quick]

``make bench`` runs it with the defaults (96 Mi tokens, 3 rounds).

The documents of ``benchmarks/mask_cost.py`` (log-normal lengths, median 600 tokens), written once with the
builder's chunk writer and a kept field ``language_score`` (uniform in [0, 1), as text, as FineWeb's); the view
is ``language_score >= 1 - keep``. Each read runs both ways, alternating, best of ``--rounds``, real tokens per
second from opening the reader to the last batch (the view's index file made beforehand, as a first read
leaves it):

- ``train``: the reader benchmark's headline read (flat layout, batch 64, seq_len 2048, R* = 16, two reader
  workers), about one pass of the view;
- ``train_1p``: the same in one process;
- ``best_fit_1p``: best-fit rows, one process.

The ratios ``view / whole`` of real tokens per second (and per CPU-second) are the figures (target >= 0.8: the
reader decodes whole row groups, so a view of 80% of the documents cannot be cheaper per token kept than
that). ``view_first_open_s``: opening the view the first time (its masks read and counted). Prints one
``BENCH_RESULT`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

from benchmarks.mask_cost import documents, ratios, read_rate, write_cache
from reader.format import spec as fmt


def main(argv=None) -> None:
    from benchmarks.common import emit_result
    from benchmarks.reader_bench import B, L, WORKERS
    from reader import Reader, ReadOptions

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="directory for the cache")
    ap.add_argument("--tokens", type=int, default=96 << 20, help="tokens of the cache (default 96 Mi)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", type=float, default=0.8, help="share of documents the view keeps")
    ap.add_argument("--quick", action="store_true", help="4 Mi tokens, 1 round")
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.rounds = 4 << 20, 1
    root = os.path.join(a.work, f"cache-{a.tokens}")
    docs, _ = documents(a.tokens)
    scores = np.random.default_rng(1).random(len(docs))
    if not os.path.exists(os.path.join(root, fmt.LEDGER_NAME)):
        write_cache(root, docs, None, {"language_score": [f"{s:.4f}" for s in scores]})
    threshold = round(1 - a.keep, 4)
    view = f"language_score >= {threshold}"
    kept = scores >= threshold
    lengths = np.asarray([len(d) for d in docs])
    train = ReadOptions(seq_len=L, batch_size=B, layout="flat", num_workers=WORKERS)
    reads = {"train": train, "train_1p": dataclasses.replace(train, num_workers=0),
             "best_fit_1p": dataclasses.replace(train, num_workers=0, packing="best_fit")}
    t = time.perf_counter()
    with Reader(root, dataclasses.replace(train, view=view, num_workers=0)) as r:  # (the view's index file)
        r.batch(0)
    first_open = time.perf_counter() - t
    batches = max(1, int(lengths[kept].sum()) // (B * L))
    best = {(read, way, clock): 0.0 for read in reads for way in ("whole", "view") for clock in ("s", "cpu_s")}
    for _ in range(a.rounds):
        for read, opts in reads.items():
            for way in ("whole", "view"):
                rates = read_rate(root, dataclasses.replace(opts, view=view if way == "view" else None), batches)
                for clock, rate in zip(("s", "cpu_s"), rates):
                    best[(read, way, clock)] = max(best[(read, way, clock)], rate)
    res = {"view_cost_tokens": int(lengths.sum()), "view_cost_batches": batches, "view_cost_rounds": a.rounds,
           "view_kept_docs_share": float(kept.mean()), "view_kept_tokens_share": float(lengths[kept].sum() / lengths.sum()),
           "view_first_open_s": first_open}
    res.update(ratios(best, reads, "view", "whole", "view"))
    emit_result(res)


if __name__ == "__main__":
    main()
