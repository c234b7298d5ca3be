"""CPU cost of best-fit packing one chunk (``reader.order.packing``), and its padding against concatenation.

    python -m benchmarks.packing_cost [--docs 20000] [--median 600] [--sigma 1.0] [--seq_len 2048 8192]

Document lengths are log-normal (median ``--median`` tokens, log-space sigma ``--sigma``), one chunk of
``--docs`` documents, seeded. For each L it prints the median CPU microseconds per piece (all pieces,
full ones included) of ``best_fit_rows`` and ``count_best_fit_rows``, and the padding and cut figures of
best fit and of concatenation (``concat_rows``) on the same lengths.
"""

from __future__ import annotations

import argparse
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--median", type=float, default=600)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--seq_len", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
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
