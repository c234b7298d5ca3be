"""CPU cost of best-fit packing one chunk (``reader.order.packing``), and its padding against concatenation;
with ``--cache``, best fit's figures on a built cache.

    python -m benchmarks.packing_cost [--docs 20000] [--median 600] [--sigma 1.0] [--seq_len 2048 8192]
    python -m benchmarks.packing_cost --cache DIR [--seq_len 256 2048 8192] [--rates_seq_len 2048 8192]
        [--split 8] [--rounds 2] [--window_tokens N] [--continuations 4] [--eval_fraction 0.25]
        [--train_fraction 1.0] [--no_rates] [--quick]

Document lengths are log-normal (median ``--median`` tokens, log-space sigma ``--sigma``), one chunk of
``--docs`` documents, seeded. For each L it prints the median CPU microseconds per piece (all pieces,
full ones included) of ``best_fit_rows`` and ``count_best_fit_rows``, and the padding and cut figures of
best fit and of concatenation (``concat_rows``) on the same lengths.

``--cache``: for each L, the padding and cut figures (:func:`cache_figures`) of best fit (each chunk
packed per window of ``--window_tokens``, default ``ReadOptions.best_fit_window_tokens``, with at most
``--continuations`` continuation pieces per row, default that of a cache of format version 4; also with
one, the rule of older caches, and plain best-fit decreasing with no cap, on the same windows' pieces),
of concatenation (the documents in global chunk order) and of unpacked reading, on the cache's chunks and
on chunks ``--split`` times smaller (each chunk's documents cut into ``--split`` consecutive runs of
about equal tokens, in row groups as the build cuts them: what a build with a ``--split`` times smaller
``--chunk_bytes`` writes, give or take where the cuts fall); the same padding figures on synthetic long
documents (:func:`long_documents`); and, for each L of ``--rates_seq_len``, the reader's real tokens per
second with best fit against concatenation (:func:`read_rates`, wall and per CPU-second), in training
over ``--train_fraction`` of the cache's tokens (with reader workers, and in one process) and in an eval
pass over ``--eval_fraction`` of it (one process). Prints one ``BENCH_RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from reader.options import CONTINUATIONS
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


def cache_row_groups(cache) -> list[np.ndarray]:
    """Every chunk's documents per row group (its Parquet footer), in global chunk order."""
    import pyarrow.parquet as pq

    from reader.storage.cache import Cache

    c = cache if isinstance(cache, Cache) else Cache(str(cache))
    out = []
    for rel in c.table.paths:
        with c.fs.open(c.path(rel), "rb") as f:
            meta = pq.ParquetFile(f).metadata
            out.append(np.asarray([meta.row_group(g).num_rows for g in range(meta.num_row_groups)], np.int64))
    return out


def row_groups_of(lengths: np.ndarray, row_group_tokens: int) -> np.ndarray:
    """Documents per row group as the build cuts them: a row group closes once it holds at least
    ``row_group_tokens`` tokens (the last one holds the rest)."""
    out, k, acc = [], 0, 0
    for n in np.asarray(lengths).tolist():
        k += 1
        acc += n
        if acc >= row_group_tokens:
            out.append(k)
            k = acc = 0
    if k:
        out.append(k)
    return np.asarray(out, np.int64)


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


def cache_figures(chunks: list[np.ndarray], seq_len: int, groups: list[np.ndarray],
                  window_tokens: int = packing.WINDOW_TOKENS, continuations: int | None = 1) -> dict:
    """Padding and cut figures (:func:`reader.order.packing.packing_figures`' meanings) of the documents of
    ``chunks`` (lengths per chunk, global order; ``groups``: their documents per row group) read with each
    packing at ``seq_len``:

    * ``best_fit_*``: each chunk packed per window of ``window_tokens`` (``best_fit_chunk_rows``), at most
      ``continuations`` continuation pieces per row, as ``packing="best_fit"`` reads it;
    * ``best_fit_one_continuation_padding``, ``plain_bfd_padding``: the same windows packed with one
      continuation piece per row (the rule of caches older than format version 4) and with no cap (plain
      best-fit decreasing of the same pieces); ``best_fit_padding_over_plain_bfd``: best fit's padding less
      plain BFD's;
    * ``concat_*``: the documents in global chunk order concatenated and cut every L tokens (a stream of
      the order; ``R*`` streams cut at other places, in the same proportions);
    * ``unpacked_*``: a document of n tokens in ``ceil(n/L)`` rows, each padded.

    Also ``best_fit_short_documents_cut``: documents of at most L tokens of which some row holds a piece
    not starting at their first token (the packing's promise: 0), ``best_fit_rows`` and
    ``best_fit_windows``."""
    L = int(seq_len)
    out: dict = {}
    rows = tokens = docs = cut_docs = cut_tokens = short_cut = windows = 0
    other = {"one_continuation": 0, "plain_bfd": 0}  # rows of the other rules
    for n, g in zip(chunks, groups):
        r = packing.best_fit_chunk_rows(n, g, L, window_tokens, continuations=continuations)
        other["one_continuation"] += int(packing.count_best_fit_windows(n, g, L, window_tokens).sum())
        other["plain_bfd"] += int(packing.count_best_fit_windows(n, g, L, window_tokens, continuations=None).sum())
        windows += packing.window_docs(n, g, window_tokens).size - 1
        late = r.start > 0
        rows += r.num_rows
        tokens += int(n.sum())
        docs += int((n > 0).sum())
        cut = np.unique(r.doc[late])
        cut_docs += cut.size
        cut_tokens += int(r.length[late].sum(dtype=np.int64))
        short_cut += int((n[cut] <= L).sum())
    out.update(best_fit_rows=rows, best_fit_short_documents_cut=short_cut, best_fit_windows=windows)
    cap = rows * L
    out["best_fit_padding"] = (cap - tokens) / cap if cap else 0.0
    out["best_fit_one_continuation_padding"] = 1 - tokens / (other["one_continuation"] * L) if cap else 0.0
    out["plain_bfd_padding"] = 1 - tokens / (other["plain_bfd"] * L) if cap else 0.0
    out["best_fit_padding_over_plain_bfd"] = out["best_fit_padding"] - out["plain_bfd_padding"]
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


def _cpu_s() -> float:
    """CPU seconds of this process and its children (reader workers), user + system: the live ones, and
    those that exited and were waited for."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:4])  # user, system, children_user, children_system
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:  # (exited meanwhile)
            pass
    return total


def read_rates(cache: str, seq_len: int, batches: int, rounds: int, *, eval_mode: bool, workers: int,
               window_tokens: int = packing.WINDOW_TOKENS, continuations: int | None = None) -> dict:
    """Real tokens (``num_tokens``) per second read from ``cache`` with ``packing="best_fit"`` and with
    ``"concat"``, ``batches`` batches from opening the reader, runs alternating (A B A B ...: a machine
    that slows down slows both); batch 64, flat layout, default budget. Per packing: the best and the
    median wall rate of the rounds, and the best rate per CPU-second (this process and its reader
    workers, sampled before the reader closes), and best fit's ratios to concat of each (best fit with at
    most ``continuations`` continuation pieces per row; None: the cache's default); ``*_paired``: the
    median over the rounds of best fit's rate over that of the concat run just before it (a busy machine
    slows neighbouring runs alike); ``*_first_batch_s``: the median wall seconds from opening the reader to
    the first batch.

    ``eval_mode``: one pass in global chunk order (one stream): both read the same chunks, every row group
    decoded once, so the ratio is the cost of the packing per token. Else the reader benchmark's
    configuration, R* = 16, with ``workers`` reader workers (0: one process): a best-fit read decodes a
    stream's window (``window_tokens``) when it enters it, so the first batch waits for R* windows."""
    from benchmarks.reader_bench import B
    from reader import Reader, ReadOptions

    base = ReadOptions(seq_len=seq_len, batch_size=B, layout="flat", eval_mode=eval_mode, num_workers=workers)
    wall: dict = {"concat": [], "best_fit": []}
    cpu: dict = {"concat": [], "best_fit": []}
    first: dict = {"concat": [], "best_fit": []}
    for _ in range(rounds):
        for name in wall:
            extra = {"best_fit_window_tokens": window_tokens, "best_fit_continuations": continuations} \
                if name == "best_fit" else {}
            c0, t = _cpu_s(), time.perf_counter()
            real = 0
            with Reader(cache, dataclasses.replace(base, packing=name, **extra)) as r:
                for _, x in r.iter_batches(0, batches):
                    if not real:
                        first[name].append(time.perf_counter() - t)
                    real += int(x["num_tokens"].sum())
                c1 = _cpu_s()
            wall[name].append(real / (time.perf_counter() - t))
            cpu[name].append(real / max(1e-9, c1 - c0))
    best = {k: max(v) for k, v in wall.items()}
    med = {k: statistics.median(v) for k, v in wall.items()}
    per_cpu = {k: max(v) for k, v in cpu.items()}

    def paired(x: dict) -> float:  # median over the rounds of best fit / the concat run just before it
        return statistics.median(b / a for a, b in zip(x["concat"], x["best_fit"]))

    return {"concat_real_tokens_per_s": best["concat"], "best_fit_real_tokens_per_s": best["best_fit"],
            "best_fit_vs_concat": best["best_fit"] / best["concat"],
            "best_fit_vs_concat_median": med["best_fit"] / med["concat"],
            "best_fit_vs_concat_paired": paired(wall),
            "concat_real_tokens_per_cpu_s": per_cpu["concat"], "best_fit_real_tokens_per_cpu_s": per_cpu["best_fit"],
            "best_fit_vs_concat_per_cpu": per_cpu["best_fit"] / per_cpu["concat"],
            "best_fit_vs_concat_per_cpu_paired": paired(cpu),
            "concat_first_batch_s": statistics.median(first["concat"]),
            "best_fit_first_batch_s": statistics.median(first["best_fit"])}


def long_documents(tokens: int, row_group_tokens: int, chunk_tokens: int = 64 << 20, seed: int = 0):
    """Synthetic long documents: lengths log-uniform in [200, 5000] tokens (the length of generated web
    pages, papers' sections or documentation pages), ``tokens`` in all, in chunks of about
    ``chunk_tokens`` cut into row groups as the build cuts them. Returns (chunks, documents per row group)."""
    rng = np.random.default_rng(seed)
    n = np.exp(rng.uniform(np.log(200), np.log(5000), tokens // 1000 + 1)).astype(np.int64)
    n = n[:int(np.searchsorted(np.cumsum(n), tokens)) + 1]
    chunks = split_chunks([n], max(1, -(-tokens // chunk_tokens)))
    return chunks, [row_groups_of(c, row_group_tokens) for c in chunks]


def cache_main(a) -> None:
    from reader.storage.cache import Cache

    from benchmarks.common import emit_result, log
    from benchmarks.reader_bench import B, WORKERS

    cache = Cache(str(a.cache))
    chunks = cache_lengths(cache)
    groups = cache_row_groups(cache)
    rgt = int(cache.ledger.config.get("row_group_tokens") or (1 << 20))
    small = split_chunks(chunks, a.split)
    small_groups = [row_groups_of(n, rgt) for n in small]
    tokens = int(cache.table.tokens.sum())
    long_chunks, long_groups = long_documents(min(tokens, 64 << 20), rgt)
    res: dict = {"packing_chunks": len(chunks), "packing_small_chunks": len(small), "packing_split": a.split,
                 "packing_tokens_per_chunk": tokens / max(1, len(chunks)), "packing_window_tokens": a.window_tokens,
                 "packing_continuations": a.continuations, "long_docs_tokens": int(sum(int(c.sum()) for c in long_chunks))}
    for L in a.seq_len:
        res.update({f"{k}_L{L}": v for k, v in cache_figures(chunks, L, groups, a.window_tokens,
                                                             a.continuations).items()})
        # (concatenation and unpacked reading do not depend on the chunks)
        res.update({f"{k}_L{L}_small": v for k, v in cache_figures(small, L, small_groups, a.window_tokens,
                                                                   a.continuations).items()
                    if k.startswith("best_fit")})
        res.update({f"long_docs_{k}_L{L}": v for k, v in cache_figures(long_chunks, L, long_groups, a.window_tokens,
                                                                       a.continuations).items()
                    if k in ("best_fit_padding", "best_fit_one_continuation_padding", "plain_bfd_padding",
                             "best_fit_padding_over_plain_bfd")})
        line = (f"best fit, L={L}: padding {res[f'best_fit_padding_L{L}']:.2%} ({res[f'best_fit_padding_L{L}_small']:.2%} "
                f"with {a.split}x smaller chunks; one continuation per row {res[f'best_fit_one_continuation_padding_L{L}']:.2%}, "
                f"plain BFD {res[f'plain_bfd_padding_L{L}']:.2%}; long documents {res[f'long_docs_best_fit_padding_L{L}']:.2%}, "
                f"plain BFD {res[f'long_docs_plain_bfd_padding_L{L}']:.2%}), cut documents "
                f"{res[f'best_fit_cut_documents_L{L}']:.2%} (concat {res[f'concat_cut_documents_L{L}']:.2%}), "
                f"{res[f'best_fit_windows_L{L}']} windows")
        if not a.no_rates and L in a.rates_seq_len:
            for tag, eval_mode, frac, workers in (("", False, a.train_fraction, WORKERS),
                                                  ("_1p", False, a.train_fraction, 0),
                                                  ("_eval", True, a.eval_fraction, 0)):
                batches = 4 if a.quick else max(1, int(tokens * frac) // (B * L))
                got = read_rates(str(a.cache), L, batches, a.rounds, eval_mode=eval_mode, workers=workers,
                                 window_tokens=a.window_tokens, continuations=a.continuations)
                res.update({f"{k}{tag}_L{L}": v for k, v in got.items()})
                res[f"packing_read_batches{tag}_L{L}"] = batches
            line += "; reads at " + ", ".join(
                f"{res[f'best_fit_vs_concat{t}_L{L}']:.2f} wall / {res[f'best_fit_vs_concat_per_cpu{t}_L{L}']:.2f} "
                f"per CPU-s of concat, paired median {res[f'best_fit_vs_concat_paired{t}_L{L}']:.2f} / "
                f"{res[f'best_fit_vs_concat_per_cpu_paired{t}_L{L}']:.2f}, first batch after "
                f"{res[f'best_fit_first_batch_s{t}_L{L}']:.2f} s (concat {res[f'concat_first_batch_s{t}_L{L}']:.2f}) "
                f"({what})"
                for t, what in (("", f"training, {WORKERS} workers"), ("_1p", "training, one process"),
                                ("_eval", "an eval pass, one process")))
        log(line)
    emit_result(res)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--median", type=float, default=600)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--seq_len", type=int, nargs="+", default=None,
                    help="default 2048 8192; with --cache 256 2048 8192 (rates: --rates_seq_len)")
    ap.add_argument("--rates_seq_len", type=int, nargs="+", default=[2048, 8192],
                    help="with --cache: the L of the read rates (each must be in --seq_len)")
    ap.add_argument("--continuations", type=int, default=CONTINUATIONS,
                    help=f"with --cache: best fit's continuation pieces per row (default {CONTINUATIONS}, a "
                         "cache of format version 4's; ReadOptions.best_fit_continuations)")
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7; 2 with --cache)")
    ap.add_argument("--cache", help="a built cache: best fit's figures on it (see the module docstring)")
    ap.add_argument("--split", type=int, default=8, help="with --cache: the smaller chunks, this many per chunk")
    ap.add_argument("--eval_fraction", type=float, default=0.25,
                    help="with --cache: share of the cache's tokens an eval-pass rate reads")
    ap.add_argument("--train_fraction", type=float, default=1.0,
                    help="with --cache: share of the cache's tokens a training rate reads")
    ap.add_argument("--quick", action="store_true", help="with --cache: read 4 batches per rate")
    ap.add_argument("--no_rates", action="store_true", help="with --cache: the padding and cut figures only")
    ap.add_argument("--window_tokens", type=int, default=packing.WINDOW_TOKENS,
                    help="with --cache: best fit's window target (ReadOptions.best_fit_window_tokens)")
    a = ap.parse_args(argv)
    if a.cache:
        a.rounds = a.rounds or 2
        a.seq_len = a.seq_len or [256, 2048, 8192]
        return cache_main(a)
    a.rounds = a.rounds or 7
    a.seq_len = a.seq_len or [2048, 8192]
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
