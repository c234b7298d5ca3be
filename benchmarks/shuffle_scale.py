"""I/O of the growing-window shuffle at real sizes, simulated.

``benchmarks/shuffle_quality.py`` measures quality on a real but small cache, with sizes scaled down.
This script keeps the real sizes: seq_len 2048, R* = 16, batch 64, the reader's default 1 GiB memory
budget, and a synthetic 4.3 B-token cache. The cache's chunks and row groups are the pipeline
defaults (64 MiB chunks of about 16 M tokens, 128 Ki-token row groups), the same with 1 Mi-token row
groups (the default before), or small chunks (8 MiB chunks, 128 Ki-token row groups).

It replays one maximum window (2^20 examples, about 2 B tokens) after the growth phase, through the
same LRU model as ``shuffle_quality.simulate_io``. There are two ways to read. ``rg`` reads row groups
by byte range, as ``reader.storage.store`` does. ``chunk`` fetches whole chunk files (the reader before
byte-range reads; still what it does for sidecars without a row-group index). Each host serves
the rows ``k ≡ r (mod R)`` of every batch. The figures are bytes read divided by what the unshuffled
order reads over the same batches.

    python -m benchmarks.shuffle_scale            # about 1-2 minutes
    python -m benchmarks.shuffle_scale --quick    # smaller window, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from benchmarks import shuffle_quality as sq
from reader.order import shuffle

SEQ_LEN, R_STAR, BATCH, BUDGET = 2048, 16, 64, 1 << 30
CACHES = {  # name: (chunk tokens, row-group tokens)
    "pipeline_defaults": (16 << 20, 128 << 10),  # 64 MiB chunks, 128 Ki-token row groups (the default)
    "rg_1mi": (16 << 20, 1 << 20),  # 64 MiB chunks, 1 Mi-token row groups (the default before)
    "small_chunks": (2 << 20, 128 << 10),
}


def configs(rg_tokens: int, max_window: int) -> dict[str, shuffle.ShuffleConfig]:
    return {
        "default": shuffle.ShuffleConfig(seed=1, max_window=max_window, lanes=R_STAR),
        "for_reader": shuffle.ShuffleConfig.for_reader(1, seq_len=SEQ_LEN, ideal_readers=R_STAR, batch_size=BATCH,
                                                     row_group_tokens=rg_tokens, max_window=max_window),
    }


HOSTS = (1, 4)


def run(quick: bool = False, log=print) -> dict:
    max_window = 1 << 16 if quick else 1 << 20
    out: dict = {"seq_len": SEQ_LEN, "ideal_readers": R_STAR, "batch_size": BATCH, "memory_budget_bytes": BUDGET,
                 "max_window": max_window}
    t0 = time.time()
    for cname, (chunk_tokens, rg_tokens) in CACHES.items():
        cfgs = configs(rg_tokens, max_window)
        starts, top = cfgs["default"].window_table
        first = int(starts[-1]) * R_STAR  # first example of the first maximum window
        first -= first % BATCH
        t = np.arange(first, first + max_window, dtype=np.int64)
        perms = {"none": t, **{k: shuffle.shuffle_example_indices(t, c) for k, c in cfgs.items()}}
        span = int(max(v.max() for v in perms.values())) + 1
        lay = sq.synthetic_layout(shards=8, tokens=int(span * SEQ_LEN * 1.02), chunk_tokens=chunk_tokens,
                                  rg_tokens=rg_tokens)
        ex = sq.compute_examples(lay, span, SEQ_LEN, R_STAR)
        for k, c in cfgs.items():
            out[f"{cname}_{k}_block_size"] = c.block_size
            out[f"{cname}_{k}_mix_size"] = c.mix_size
            out[f"{cname}_{k}_mix_decoded_mib"] = c.mix_size * SEQ_LEN * shuffle.DECODED_BYTES_PER_TOKEN >> 20
        for model, whole in (("rg", False), ("chunk", True)):
            for hosts in HOSTS:
                base = None
                for name, perm in perms.items():
                    v = sq.simulate_io(ex, lay, perm, seq_len=SEQ_LEN, budget=BUDGET, whole_chunks=whole,
                                       hosts=hosts)
                    base = v if name == "none" else base
                    if name != "none":
                        out[f"{cname}_{name}_io_{model}_r{hosts}_amp"] = v / base
                log(f"shuffle_scale: {cname} {model} R={hosts} ({time.time() - t0:.0f}s)")
    out["seconds"] = round(time.time() - t0, 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 65,536-example window instead of 2^20")
    a = ap.parse_args(argv)
    res = run(quick=a.quick, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(res, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
