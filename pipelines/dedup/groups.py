"""Which documents duplicate which: exact groups, LSH candidate pairs and the near-duplicate rule. Pure numpy
on arrays of global document indices (a document's index in the cache's global order), no I/O.

Every function here returns the same answer whatever the order of its inputs (they are sorted first), so
the marks do not depend on how a runner splits or orders the work.
"""

from __future__ import annotations

import numpy as np

WINDOW = 8  # LSH candidates: each member of a bucket is paired with the members up to this far before it ...
FIRST = 8  # ... and with the bucket's first members (so that a bucket's keeper is always a candidate)


def exact_marks(hi: np.ndarray, lo: np.ndarray, ntok: np.ndarray, doc: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(doc, keeper, ntok)`` of every document that repeats an earlier one: the documents whose 128-bit hash
    (``hi``, ``lo``) and token count are equal form a group, whose first document (the smallest index)
    is its keeper; each other member is marked with it."""
    if not len(doc):
        return doc, doc, ntok
    order = np.lexsort((doc, ntok, lo, hi))
    hi, lo, ntok, doc = hi[order], lo[order], ntok[order], doc[order]
    start = np.ones(len(doc), bool)
    start[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1]) | (ntok[1:] != ntok[:-1])
    keeper = doc[np.maximum.accumulate(np.where(start, np.arange(len(doc)), 0))]
    return doc[~start], keeper[~start], ntok[~start]


def candidate_pairs(keys: np.ndarray, doc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)``, ``a < b``, deduplicated: the candidate pairs of LSH buckets (documents with equal band
    ``keys``). In a bucket sorted by document, member ``p`` is paired with members ``p - WINDOW .. p - 1``
    and with the bucket's first ``FIRST`` members: all pairs of a bucket of up to ``WINDOW + 1`` members,
    and at most ``WINDOW + FIRST`` per member of a larger one (a template shared by thousands of pages)."""
    if not len(doc):
        return doc, doc
    order = np.lexsort((doc, keys))
    keys, doc = keys[order], doc[order]
    pos = np.arange(len(doc))
    start = np.ones(len(doc), bool)
    start[1:] = keys[1:] != keys[:-1]
    first = np.maximum.accumulate(np.where(start, pos, 0))  # each member's bucket start
    a, b = [], []
    for d in range(1, WINDOW + 1):
        ok = pos - d >= first
        a.append(doc[pos[ok] - d])
        b.append(doc[ok])
    for f in range(FIRST):
        ok = first + f < pos - WINDOW
        a.append(doc[first[ok] + f])
        b.append(doc[ok])
    return unique_pairs(np.concatenate(a), np.concatenate(b))


def unique_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct pairs ``(a, b)`` with ``a != b``, each as (smaller, larger), sorted."""
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    keep = lo != hi
    if not keep.any():
        return lo[:0], hi[:0]
    pairs = np.unique(np.stack([lo[keep], hi[keep]], axis=1), axis=0)
    return pairs[:, 0], pairs[:, 1]


def greedy_marks(a: np.ndarray, b: np.ndarray, jac: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(doc, keeper, jaccard)`` from the verified edges ``(a, b, jac)`` (``a < b``): the documents are
    visited in the global order; a document with an edge to an earlier document that is kept is marked
    with the kept one of the highest Jaccard estimate (ties: the earliest), otherwise it is kept.

    So every marked document is similar to its keeper itself (no chains), and no two kept documents share
    an edge. What it gives up against connected components: a document similar only to documents that are
    themselves marked is kept, where components would remove it with their whole chain.
    """
    if not len(a):
        return a, a, jac
    order = np.lexsort((a, -jac, b))
    a, b, jac = a[order].tolist(), b[order].tolist(), jac[order]
    marked: dict[int, int] = {}
    best: dict[int, int] = {}  # document -> position of its chosen edge
    for i, (x, y) in enumerate(zip(a, b)):
        if y not in marked and x not in marked:
            marked[y] = x
            best[y] = i
    docs = np.fromiter(marked.keys(), np.int64, len(marked))
    keepers = np.fromiter(marked.values(), np.int64, len(marked))
    jj = jac[np.fromiter(best.values(), np.int64, len(best))]
    o = np.argsort(docs)
    return docs[o], keepers[o], jj[o]
