"""The best-fit packing rule (docs/FORMAT.md, "Best-fit packing") as plainly as possible, for tests: an
O(n^2) reference of ``reader.order.packing.best_fit_rows``, and of a chunk's windows."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction


def reference_best_fit(lengths, L, continuations=1, max_segments=None):
    """Rows of the documents ``lengths`` packed into rows of ``L``, each holding at most ``continuations``
    continuation pieces and ``max_segments`` pieces (None: no cap): a list of rows, each a list of
    ``(doc, start, length)`` in the row's order."""
    full_rows = []
    others = []
    for d, n in enumerate(lengths):
        for s in range(0, n - n % L, L):
            full_rows.append([(d, s, L)])
        if n % L:
            others.append((d, n - n % L, n % L))
    others.sort(key=lambda piece: (-piece[2], piece[0]))
    rows = []  # in creation order: [remaining capacity, pieces]
    for piece in others:
        size = piece[2]
        cont = piece[1] > 0
        # rows it may go to: rows below max_segments pieces; for a continuation piece, also below
        # `continuations` continuation pieces
        allowed = [i for i, row in enumerate(rows)
                   if (max_segments is None or len(row[1]) < max_segments)
                   and not (cont and continuations is not None
                            and sum(s > 0 for _, s, _ in row[1]) >= continuations)]
        chosen = None
        for i in allowed:
            row = rows[i]
            if row[0] >= size and (chosen is None or row[0] < rows[chosen][0]):
                chosen = i
        # The same choice stated as the rule: smallest remaining capacity that fits, then first created.
        fitting = [(rows[i][0], i) for i in allowed if rows[i][0] >= size]
        assert chosen == (min(fitting)[1] if fitting else None)
        if chosen is None:
            rows.append([L, []])
            chosen = len(rows) - 1
        rows[chosen][0] -= size
        rows[chosen][1].append(piece)
    # within a row: the continuation pieces first, then the others, each in document order
    out = full_rows + [sorted(row[1], key=lambda p: (p[1] == 0, p)) for row in rows]
    out.sort(key=lambda row: min(p[:2] for p in row))
    return out


def reference_windows(row_group_tokens, W):
    """The packing windows of a chunk with these row groups (docs/FORMAT.md): row-group bounds, literally
    as the rule says it, in exact fractions; empty runs left out."""
    T = sum(row_group_tokens)
    n = max(1, math.floor(Fraction(T, W) + Fraction(1, 2)))
    ends = list(itertools.accumulate(row_group_tokens))
    bounds = [0]
    for i in range(n):
        target = Fraction((i + 1) * T, n)
        end = next(g + 1 for g, e in enumerate(ends) if e >= target) if i < n - 1 else len(ends)
        if end > bounds[-1]:
            bounds.append(end)
    return bounds if ends else [0]


def reference_chunk_best_fit(lengths, row_group_docs, L, W, continuations=1, max_segments=None):
    """A chunk's rows: each window's ``reference_best_fit`` rows, window after window, documents numbered
    in the chunk."""
    doc_bounds = [0, *itertools.accumulate(row_group_docs)]
    rg_tokens = [sum(lengths[a:b]) for a, b in zip(doc_bounds, doc_bounds[1:])]
    wb = reference_windows(rg_tokens, W)
    out = []
    for g0, g1 in zip(wb, wb[1:]):
        a, b = doc_bounds[g0], doc_bounds[g1]
        out += [[(d + a, s, m) for d, s, m in row] for row in reference_best_fit(lengths[a:b], L, continuations, max_segments)]
    return out
