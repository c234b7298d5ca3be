"""Digests of a cache's global batches under a grid of read options, to check that two trees serve the
same batches (a refactor must not change them).

Run the script with each tree's code first on the path, then compare::

    PYTHONPATH=/old/tree python tools/same_batches.py CACHE old.json
    PYTHONPATH=$PWD      python tools/same_batches.py CACHE new.json
    python tools/same_batches.py --compare old.json new.json

The grid: concat, best fit and unpacked; in order and shuffled; the arrays and flat layouts; an eval
pass; one reader host and host 1 of 2; batches 0, 1, 5 and 37 (seq_len 64, batch 8, R* = 4: made for
small test caches). It only uses options every tree since format version 2 knows.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys

BATCHES = (0, 1, 5, 37)


def grid():
    for packing, shuffle, layout, eval_mode, readers in itertools.product(
            ("concat", "best_fit", "unpacked"), (None, 3), ("arrays", "flat"), (False, True), ((1, 0), (2, 1))):
        if (packing == "unpacked" and layout == "flat") or (eval_mode and shuffle is not None):
            continue  # not a read: flat rows are packed, an eval pass is in order
        kw = dict(seq_len=64, batch_size=8, ideal_readers=4, layout=layout, eval_mode=eval_mode)
        if shuffle is not None:
            kw["shuffle_seed"] = shuffle
        if packing == "unpacked":
            kw["packed"] = False  # the spelling every tree knows
        else:
            kw["packing"] = packing
        yield kw, readers


def digests(cache: str) -> dict:
    import numpy as np

    from reader import Reader, ReadOptions

    out = {}
    for kw, (num_readers, index) in grid():
        key = json.dumps(dict(kw, readers=[num_readers, index]), sort_keys=True)
        try:
            with Reader(cache, ReadOptions(**kw), num_readers=num_readers, reader_index=index) as r:
                got = {}
                for b in BATCHES:
                    try:
                        x = r.batch(b)
                    except Exception as e:  # past an eval pass's end: the same error on both trees
                        got[b] = type(e).__name__
                        continue
                    got[b] = {k: f"{hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()[:16]} {v.shape}"
                              for k, v in sorted(x.items())}
            out[key] = got
        except Exception as e:
            out[key] = f"{type(e).__name__}: {e}"[:300]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # (one metavar: argparse's help cannot show a tuple for a positional)
    ap.add_argument("paths", nargs=2, metavar="PATH", help="CACHE OUT.json, or with --compare A.json B.json")
    ap.add_argument("--compare", action="store_true", help="compare two digest files A and B")
    a = ap.parse_args(argv)
    if a.compare:
        x, y = (json.load(open(p)) for p in a.paths)
        differ = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
        for k in differ:
            print("differs:", k)
        print(f"{len(x)} option sets, {len(differ)} differ")
        return 1 if differ else 0
    res = digests(a.paths[0])
    with open(a.paths[1], "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    print(f"{len(res)} option sets -> {a.paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
