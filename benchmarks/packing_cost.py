"""CPU cost of best-fit packing one chunk (``reader.order.packing``), and its padding against concatenation;
with ``--cache``, best fit's figures on a built cache.

    python -m benchmarks.packing_cost [--docs 20000] [--median 600] [--sigma 1.0] [--seq_len 2048 8192]
    python -m benchmarks.packing_cost --cache DIR [--seq_len 2048 8192] [--split 8] [--rounds 2]
        [--eval_fraction 0.25] [--train_fraction 0.5] [--quick]

Document lengths are log-normal (median ``--median`` tokens, log-space sigma ``--sigma``), one chunk of
``--docs`` documents, seeded. For each L it prints the median CPU microseconds per piece (all pieces,
full ones included) of ``best_fit_rows`` and ``count_best_fit_rows``, and the padding and cut figures of
best fit and of concatenation (``concat_rows``) on the same lengths.

``--cache``: for each L, the padding and cut figures (:func:`cache_figures`) of best fit (each chunk
packed alone), of concatenation (the documents in global chunk order) and of unpacked reading, on the
cache's chunks and on chunks ``--split`` times smaller (each chunk's documents cut into ``--split``
consecutive runs of about equal tokens: what a build with a ``--split`` times smaller ``--chunk_bytes``
writes, give or take where the cuts fall); and the reader's real tokens per second with best fit against
concatenation (:func:`read_rates`), in training over ``--train_fraction`` of the cache's tokens (reader
workers; by default one pass) and in an eval pass over ``--eval_fraction`` of it (one process). Prints
one ``BENCH_RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from reader.order import packing


def _cpu_us(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e6


def cache_lengths(cache) -> list[np.ndarray]:
    """Every chunk's document lengths (its ``num_tokens`` column), in global chunk order."""
    from reader.storage.cache import Cache
    from reader.storage.validate import chunk_doc_lengths

    c = cache if isinstance(cache, Cache) else Cache(str(cache))
    return [chunk_doc_lengths(c, i) for i in range(len(c.table))]


def split_chunks(chunks: list[np.ndarray], parts: int) -> list[np.ndarray]:
    """Each chunk's documents cut into ``parts`` consecutive runs of about equal tokens (a smaller chunk
    size); a run never splits a document, so a chunk of fewer documents gives fewer runs."""
    out = []
    for n in chunks:
        if not n.size:
            continue
        ends = np.cumsum(n)
        cuts = np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, side="left") + 1
        out += [x for x in np.split(n, np.unique(cuts)) if x.size]
    return out


def cache_figures(chunks: list[np.ndarray], seq_len: int) -> dict:
    """Padding and cut figures (:func:`reader.order.packing.packing_figures`' meanings) of the documents of
    ``chunks`` (lengths per chunk, global order) read with each packing at ``seq_len``:

    * ``best_fit_*``: each chunk packed alone (``best_fit_rows``), as ``packing="best_fit"`` reads it;
    * ``concat_*``: the documents in global chunk order concatenated and cut every L tokens (a stream of
      the order; ``R*`` streams cut at other places, in the same proportions);
    * ``unpacked_*``: a document of n tokens in ``ceil(n/L)`` rows, each padded.

    Also ``best_fit_short_documents_cut``: documents of at most L tokens of which some row holds a piece
    not starting at their first token (the packing's promise: 0), and ``best_fit_rows``."""
    L = int(seq_len)
    out: dict = {}
    rows = tokens = docs = cut_docs = cut_tokens = short_cut = 0
    for n in chunks:
        r = packing.best_fit_rows(n, L)
        late = r.start > 0
        rows += r.num_rows
        tokens += int(n.sum())
        docs += int((n > 0).sum())
        cut = np.unique(r.doc[late])
        cut_docs += cut.size
        cut_tokens += int(r.length[late].sum(dtype=np.int64))
        short_cut += int((n[cut] <= L).sum())
    out.update(best_fit_rows=rows, best_fit_short_documents_cut=short_cut)
    cap = rows * L
    out["best_fit_padding"] = (cap - tokens) / cap if cap else 0.0
    out["best_fit_cut_documents"] = cut_docs / docs if docs else 0.0
    out["best_fit_cut_tokens"] = cut_tokens / tokens if tokens else 0.0
    every = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    cc = packing.packing_figures(packing.concat_rows(every, L), every, L)
    out.update(concat_padding=cc.padding_fraction, concat_cut_documents=cc.cut_document_fraction,
               concat_cut_tokens=cc.cut_token_fraction)
    pieces = int((-(-every // L)).sum())
    out["unpacked_padding"] = (pieces * L - tokens) / (pieces * L) if pieces else 0.0
    out["unpacked_cut_documents"] = int((every > L).sum()) / docs if docs else 0.0
    out["unpacked_cut_tokens"] = int(np.maximum(every - L, 0).sum()) / tokens if tokens else 0.0
    return out


def read_rates(cache: str, seq_len: int, batches: int, rounds: int, *, eval_mode: bool) -> dict:
    """Real tokens (``num_tokens``) per second read from ``cache`` with ``packing="best_fit"`` and with
    ``"concat"``, ``batches`` batches from opening the reader, runs alternating, best of ``rounds`` each;
    batch 64, flat layout, default budget.

    ``eval_mode``: one pass in global chunk order, in one process (``num_workers=0``): both read the same
    chunks, every row group decoded once (best fit's last chunk whole), so the ratio is the cost of the
    packing per token. Else the reader benchmark's headline configuration (R* = 16, its reader workers):
    a best-fit read decodes each stream's whole chunk when it enters it (the chunk's first rows take
    documents from all of it), so the first batch waits for R* whole chunks and the run's last chunks
    are decoded whole; timing from the opening keeps that in."""
    from benchmarks.reader_bench import B, WORKERS
    from reader import Reader, ReadOptions

    base = ReadOptions(seq_len=seq_len, batch_size=B, layout="flat", eval_mode=eval_mode,
                       num_workers=0 if eval_mode else WORKERS)
    best = {"concat": 0.0, "best_fit": 0.0}
    for _ in range(rounds):
        for name in best:
            t = time.perf_counter()
            real = 0
            with Reader(cache, dataclasses.replace(base, packing=name)) as r:
                for _, x in r.iter_batches(0, batches):
                    real += int(x["num_tokens"].sum())
            best[name] = max(best[name], real / (time.perf_counter() - t))
    return {"concat_real_tokens_per_s": best["concat"], "best_fit_real_tokens_per_s": best["best_fit"],
            "best_fit_vs_concat": best["best_fit"] / best["concat"]}


def cache_main(a) -> None:
    from reader.storage.cache import Cache

    from benchmarks.common import emit_result, log
    from benchmarks.reader_bench import B

    cache = Cache(str(a.cache))
    chunks = cache_lengths(cache)
    small = split_chunks(chunks, a.split)
    tokens = int(cache.table.tokens.sum())
    res: dict = {"packing_chunks": len(chunks), "packing_small_chunks": len(small), "packing_split": a.split,
                 "packing_tokens_per_chunk": tokens / max(1, len(chunks))}
    for L in a.seq_len:
        res.update({f"{k}_L{L}": v for k, v in cache_figures(chunks, L).items()})
        # (concatenation and unpacked reading do not depend on the chunks)
        res.update({f"{k}_L{L}_small": v for k, v in cache_figures(small, L).items() if k.startswith("best_fit")})
        for tag, eval_mode, frac in (("", False, a.train_fraction), ("_eval", True, a.eval_fraction)):
            batches = 4 if a.quick else max(1, int(tokens * frac) // (B * L))
            res.update({f"{k}{tag}_L{L}": v for k, v in read_rates(str(a.cache), L, batches, a.rounds,
                                                                   eval_mode=eval_mode).items()})
            res[f"packing_read_batches{tag}_L{L}"] = batches
        log(f"best fit, L={L}: padding {res[f'best_fit_padding_L{L}']:.2%} ({res[f'best_fit_padding_L{L}_small']:.2%} "
            f"with {a.split}x smaller chunks), cut documents {res[f'best_fit_cut_documents_L{L}']:.2%} "
            f"(concat {res[f'concat_cut_documents_L{L}']:.2%}), reads at {res[f'best_fit_vs_concat_L{L}']:.2f} of "
            f"concat (training, workers), {res[f'best_fit_vs_concat_eval_L{L}']:.2f} (an eval pass, one process)")
    emit_result(res)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--median", type=float, default=600)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--seq_len", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7; 2 with --cache)")
    ap.add_argument("--cache", help="a built cache: best fit's figures on it (see the module docstring)")
    ap.add_argument("--split", type=int, default=8, help="with --cache: the smaller chunks, this many per chunk")
    ap.add_argument("--eval_fraction", type=float, default=0.25,
                    help="with --cache: share of the cache's tokens an eval-pass rate reads")
    ap.add_argument("--train_fraction", type=float, default=1.0,
                    help="with --cache: share of the cache's tokens a training rate reads")
    ap.add_argument("--quick", action="store_true", help="with --cache: read 4 batches per rate")
    a = ap.parse_args(argv)
    if a.cache:
        a.rounds = a.rounds or 2
        return cache_main(a)
    a.rounds = a.rounds or 7
    rng = np.random.default_rng(0)
    lengths = np.maximum(rng.lognormal(np.log(a.median), a.sigma, a.docs), 1).astype(np.int64)
    print(f"{a.docs} documents, {int(lengths.sum())} tokens, log-normal median {a.median:g} sigma {a.sigma:g}")
    for L in a.seq_len:
        pieces = int((-(-lengths // L)).sum())
        remainders = int((lengths % L > 0).sum())
        pack = _cpu_us(lambda: packing.best_fit_rows(lengths, L), a.rounds)
        count = _cpu_us(lambda: packing.count_best_fit_rows(lengths, L), a.rounds)
        bf = packing.packing_figures(packing.best_fit_rows(lengths, L), lengths, L)
        cc = packing.packing_figures(packing.concat_rows(lengths, L), lengths, L)
        print(f"L={L}: {pieces} pieces ({remainders} placed by best fit), {bf.rows} rows")
        print(f"  best_fit_rows       {pack / 1e3:8.1f} ms  {pack / pieces:5.2f} us/piece")
        print(f"  count_best_fit_rows {count / 1e3:8.1f} ms  {count / pieces:5.2f} us/piece")
        for name, f in (("best fit", bf), ("concat", cc)):
            print(f"  {name:8s} rows {f.rows:6d}  padding {f.padding_fraction:6.2%}  "
                  f"cut documents {f.cut_document_fraction:6.2%}  cut tokens {f.cut_token_fraction:6.2%}")


if __name__ == "__main__":
    main()
