"""reader.torch against the plain reader, in one run: tokens/s and CPU per batch of TokenBatches through
torch DataLoaders, next to ``Reader.iter_batches`` on the same cache and options.

    python -m benchmarks.torch_loader --cache DIR                # any cache (e.g. make demo's, or make bench's)
    python -m benchmarks.torch_loader --synthetic /tmp/tcache    # writes a 19 M-token synthetic cache first

Not part of ``make bench`` (yet). Rows: ``Reader.iter_batches`` (the baseline), TokenBatches with
``DataLoader(num_workers=0)``, with ``num_workers=2`` DataLoader workers (each serves every 2nd batch and
decodes its rank's row groups itself), and with ``num_workers=0`` plus ``ReadOptions(num_workers=2)``
(reader worker processes split every batch's rows by stream). CPU counts this process and its reaped
descendants (DataLoader and reader workers) during the measured batches, so it reads about the same on a
busy machine; wall rates do not.
Each configuration runs ``--rounds`` times, interleaved; the report gives medians and ratios to the
baseline measured in the same round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


def _cpu_s() -> float:
    """CPU seconds of this process and its live descendants (DataLoader and reader workers) so far."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # exited meanwhile
            pass
    return total


def write_synthetic(root: str, chunks: int = 32, tokens_per_chunk: int = 600_000) -> None:
    """Lognormal document lengths, random ids below 100k, the pipeline's 128 Ki-token row groups."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import cachegen  # the tests' cache writer (no Beam needed)

    rng = np.random.default_rng(0)
    out = []
    for _ in range(chunks):
        docs, n = [], 0
        while n < tokens_per_chunk:
            length = int(rng.lognormal(6, 1.2)) + 1
            docs.append(rng.integers(1, 100_000, length, dtype=np.int32))
            n += length
        out.append(docs)
    cachegen.write_synthetic_cache(root, out, chunks_per_shard=[chunks // 4] * 4, row_group_tokens=131072)


def measure(make, batches: int, warmup: int) -> tuple[float, float]:
    """(tokens/s wall, CPU ms per batch) over ``batches`` batches after ``warmup`` (start-up excluded)."""
    it = iter(make())
    for _ in range(warmup):
        next(it)
    t0, c0 = time.perf_counter(), _cpu_s()
    tokens = 0
    for _ in range(batches):
        x = next(it)
        tokens += int(np.prod(tuple(x["tokens"].shape)))
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    close = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)
    if close:
        close()
    del it, x
    return tokens / wall, cpu * 1e3 / batches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--cache", help="an existing cache")
    where.add_argument("--synthetic", help="write a synthetic cache here (if absent) and use it")
    ap.add_argument("--batches", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shuffle_seed", type=int, default=None)
    a = ap.parse_args(argv)
    root = a.cache or a.synthetic
    if a.synthetic and not os.path.exists(os.path.join(root, "ledger.json")):
        write_synthetic(root)

    from torch.utils.data import DataLoader

    from reader import ReadOptions, Reader
    from reader.torch import TokenBatches, as_tensors

    base = dict(seq_len=2048, batch_size=64, ideal_readers=16, layout="flat", shuffle_seed=a.shuffle_seed)
    opts, opts_rw = ReadOptions(**base), ReadOptions(**base, num_workers=2)
    configs = {
        "Reader.iter_batches (baseline)": lambda: (as_tensors(b) for _, b in Reader(root, opts).iter_batches(0)),
        "DataLoader(num_workers=0)": lambda: DataLoader(TokenBatches(root, opts), batch_size=None),
        "DataLoader(num_workers=2)": lambda: DataLoader(TokenBatches(root, opts), batch_size=None, num_workers=2),
        "DataLoader(num_workers=0), ReadOptions(num_workers=2)":
            lambda: DataLoader(TokenBatches(root, opts_rw), batch_size=None),
    }
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
    for _ in range(a.rounds):
        for name, make in configs.items():
            results[name].append(measure(make, a.batches, warmup=40))
    base_name = next(iter(configs))
    print(f"{'configuration':55s} {'M tok/s':>8s} {'CPU ms/batch':>13s} {'rate / base':>12s} {'CPU / base':>11s}")
    for name, runs in results.items():
        rate = statistics.median(r for r, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        rr = statistics.median(r / b[0] for (r, _), b in zip(runs, results[base_name]))
        cr = statistics.median(c / b[1] for (_, c), b in zip(runs, results[base_name]))
        print(f"{name:55s} {rate / 1e6:8.1f} {cpu:13.2f} {rr:12.2f} {cr:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
