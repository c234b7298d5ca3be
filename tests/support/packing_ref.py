"""The best-fit packing rule (docs/FORMAT.md, "Best-fit packing") as plainly as possible, for tests: an
O(n^2) reference of ``reader.order.packing.best_fit_rows``."""

from __future__ import annotations


def reference_best_fit(lengths, L):
    """Rows of the documents ``lengths`` packed into rows of ``L``: a list of rows, each a list of
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
        # rows it may go to: any row if it starts its document, else rows without a continuation piece
        allowed = [i for i, row in enumerate(rows) if not (cont and any(s > 0 for _, s, _ in row[1]))]
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
    # within a row: the continuation piece first, then document order
    out = full_rows + [sorted(row[1], key=lambda p: (p[1] == 0, p)) for row in rows]
    out.sort(key=lambda row: min(p[:2] for p in row))
    return out
