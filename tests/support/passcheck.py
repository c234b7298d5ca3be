"""What a pass must be (docs/FORMAT.md, "Passes"), checked by content on any cache or mixture read: the first
``E`` examples of a training read are the rows of the eval pass at the same options, each as often as the
eval pass serves it (caches hold duplicate documents), and no batch holds a row more often than the eval
pass does. A mixture: the same for each component, over its own examples ``k < E_c``."""

from __future__ import annotations

import collections

import numpy as np

from reader import ReadOptions, Reader

CONTENT = ("targets", "inputs", "positions", "segment_ids", "loss_mask")


def row_keys(batch: dict) -> list[bytes]:
    """Each valid row's content."""
    keep = np.flatnonzero(batch["valid"])
    return [b"".join(batch[k][i].tobytes() for k in CONTENT) for i in keep.tolist()]


_EVAL: dict = {}


def eval_rows(path: str, opts: ReadOptions) -> list[bytes]:
    """The rows of the eval pass of the cache ``path`` at ``opts``' seq_len and packing (kept per cache)."""
    ev = ReadOptions(seq_len=opts.seq_len, batch_size=64, eval_mode=True, packed=opts.packed, packing=opts.packing,
                     best_fit_window_tokens=opts.best_fit_window_tokens, drop_long=opts.drop_long)
    key = (path, ev)
    got = _EVAL.get(key)
    if got is None:
        with Reader(path, ev) as r:
            got = _EVAL[key] = [row for _, batch in r.iter_batches() for row in row_keys(batch)]
    return got


def _over(rows: list[bytes], want: collections.Counter) -> int:
    """Rows of ``rows`` (one batch) held more often than ``want`` holds them."""
    return sum(1 for x, k in collections.Counter(rows).items() if k > want[x])


def pass_problems(path: str, opts: ReadOptions) -> list[str]:
    """What is wrong with the first pass of a read of the cache ``path`` with ``opts`` (empty: nothing)."""
    with Reader(path, opts) as r:
        E = r.examples_per_pass
        batches = [row_keys(batch) for _, batch in r.iter_batches(0, -(-E // opts.batch_size))]
    want = collections.Counter(eval_rows(path, opts)[:E])  # (concat: the eval pass's whole rows)
    got = collections.Counter([row for rows in batches for row in rows][:E])
    problems = []
    extra = sum((got - want).values())
    if extra:
        problems.append(f"{extra} of the {E} rows of the pass are served more often than the eval pass serves them")
    for b, rows in enumerate(batches[:E // opts.batch_size]):  # the batches wholly inside the pass
        if _over(rows, want):
            problems.append(f"batch {b} holds {_over(rows, want)} rows more often than the eval pass does")
            break
    return problems


def mixture_problems(path: str, opts: ReadOptions) -> list[str]:
    """:func:`pass_problems` of each component of the mixture file ``path``: its examples ``k < E_c``, read
    until every component has served all of them."""
    B = opts.batch_size
    with Reader(path, opts) as r:
        per_pass = np.asarray(r.examples_per_pass)
        caches = [c.url for c in r.cache.caches]
        steps = 1
        # lane l's items of a component are its examples l, l + R*, ...: all k < E_c drawn
        while (r.order.index.lane_counts(steps * B) * opts.effective_ideal_readers + np.arange(opts.effective_ideal_readers)[:, None]
               < per_pass[None, :]).any():
            steps *= 2
        want = [collections.Counter(eval_rows(url, opts)[:E]) for url, E in zip(caches, per_pass.tolist())]
        rows: list[list[bytes]] = [[] for _ in caches]
        problems = []
        for b, batch in r.iter_batches(0, steps):
            comp, k = r.order.assign(b * B + np.arange(B))
            in_batch: list[list[bytes]] = [[] for _ in caches]
            for row, c, kk in zip(row_keys(batch), comp.tolist(), k.tolist()):
                if kk < per_pass[c]:
                    rows[c].append(row)
                    in_batch[c].append(row)
            problems += [f"batch {b} holds {_over(x, want[c])} rows of component {c} more often than its eval pass "
                         "does" for c, x in enumerate(in_batch) if _over(x, want[c])]
    for c, got in enumerate(rows):
        if collections.Counter(got) != want[c]:
            problems.append(f"component {c}: its first pass is not its eval pass's rows")
    return problems
