"""CPU of writing unpacked rows (``ArraysWriter.write_pieces``) all at once against in blocks of rows.

    python -m benchmarks.unpacked_blocks [--rows 512] [--seq_len 2048] [--rounds 15]

A slab of batches can place hundreds of rows in one row group; ``write_pieces`` builds ``[rows, L]``
int64 temporaries, which fall out of the CPU cache when ``rows`` is large. This times one call over all
rows (``PIECE_BLOCK_ELEMENTS`` raised so it does not split them) against the shipped blocking, on random
tokens, and checks both write the same arrays. Prints the median CPU milliseconds of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from reader.batch import layouts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args(argv)
    L, n = a.seq_len, a.rows
    rng = np.random.default_rng(0)
    padded = rng.integers(0, 100_000, 64 * L + L + 2, dtype=np.int32)
    local = np.sort(rng.integers(0, 64 * L, n)).astype(np.int64)
    first = rng.integers(0, 3, n).astype(np.int64) * L
    length = rng.integers(1, L + 1, n).astype(np.int64)
    dst = np.arange(n)
    w = layouts.ArraysWriter(L)
    outs = {"whole": w.new(n), "blocks": w.new(n)}
    shipped = layouts.PIECE_BLOCK_ELEMENTS
    times = {k: [] for k in outs}
    for _ in range(a.rounds):
        for name, out in outs.items():
            layouts.PIECE_BLOCK_ELEMENTS = n * L if name == "whole" else shipped
            c = time.process_time()
            w.write_pieces(out, dst, padded, local, first, length)
            times[name].append(time.process_time() - c)
    layouts.PIECE_BLOCK_ELEMENTS = shipped
    bad = [k for k in layouts.TOKEN_FIELDS if not np.array_equal(outs["whole"][k], outs["blocks"][k])]
    assert not bad, f"blocking changed {bad}"
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"{n} rows x {L}: all at once {med['whole']:.1f} ms, in blocks of {max(1, shipped // L)} rows "
          f"{med['blocks']:.1f} ms (CPU, median of {a.rounds}); blocks / all = {med['blocks'] / med['whole']:.2f}")


if __name__ == "__main__":
    main()
