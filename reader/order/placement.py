"""Example placement: which tokens an unpacked example or a best-fit row holds, as offsets in its chunk. Pure
arithmetic on what the storage layer supplies: a chunk's document lengths and starts (decoded by the store),
its row groups' token counts, and the counts of :mod:`reader.storage.index` (examples per chunk, best-fit rows
per packing window). :class:`reader.batch.examples.ExampleOrder` fetches them and keeps recent answers.

An unpacked example is one piece of a document (:mod:`reader.order.pieces`). A best-fit row is located
through its window: the window's rows are packed (:mod:`reader.order.packing`) from the documents of the
window's row groups alone, so a read decodes one window, not the whole chunk.

Where the documents disagree with the counts (an index file changed, or counted from other chunks),
:class:`Disagrees` says what each makes; the caller names the chunk and the index file.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from reader.order.packing import best_fit_rows, window_bounds
from reader.order.pieces import pieces_per_doc


class Disagrees(ValueError):
    """A chunk's documents or row groups do not make the counts given for it."""


# -- unpacked examples ------------------------------------------------------------------------------------


def pieces_cum(lengths: np.ndarray, seq_len: int, examples: int | None = None) -> np.ndarray:
    """Cumulative unpacked examples over a chunk's documents of ``lengths`` (as the read sees them), which
    must add up to ``examples`` (the index's count; None: not checked)."""
    cum = np.concatenate([[0], np.cumsum(pieces_per_doc(lengths, seq_len))])
    if examples is not None and int(cum[-1]) != int(examples):  # the counts came from an index file
        raise Disagrees(f"its documents make {int(cum[-1])} unpacked examples of {seq_len} tokens, "
                        f"the index says {int(examples)}")
    return cum


def locate(cum: np.ndarray, doc_lengths: np.ndarray, doc_starts: np.ndarray, offsets: np.ndarray, seq_len: int):
    """Unpacked examples ``offsets`` of a chunk whose documents are ``doc_lengths`` long from ``doc_starts``
    (``cum``: :func:`pieces_cum`): arrays ``(token offset in the chunk, position in its document of the first
    token, tokens)``."""
    doc = np.searchsorted(cum, offsets, side="right") - 1
    start = (offsets - cum[doc]) * seq_len
    length = np.minimum(doc_lengths[doc] - start, seq_len)
    return doc_starts[doc] + start, start, length


# -- best-fit rows ----------------------------------------------------------------------------------------


def windows(row_group_tokens: np.ndarray, window_tokens: int, per: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's windows: ``(row-group bounds, first row of each window + total)``, from its row groups'
    token counts (no decoding) and the counted rows ``per`` window."""
    bounds = window_bounds(row_group_tokens, window_tokens)
    if bounds.size - 1 != per.size:
        raise Disagrees(f"its row groups make {bounds.size - 1} packing windows of {window_tokens} tokens, "
                        f"the index lists {per.size}")
    return bounds, np.concatenate([[0], np.cumsum(per)])


class WindowRows:
    """One window's best-fit rows, laid out for locating: row ``i`` holds pieces ``ptr[i]:ptr[i+1]``, piece
    ``k`` being ``length[k]`` tokens from token ``token[k]`` of the chunk, the first at position ``first[k]``
    of its document, written from column ``column[k]`` of the row."""

    __slots__ = ("ptr", "token", "first", "length", "column", "nbytes", "rows")

    def __init__(self, lengths: np.ndarray, doc_starts: np.ndarray, seq_len: int, **caps):
        rows = best_fit_rows(lengths, seq_len, **caps)
        self.ptr = rows.row_ptr
        self.rows = rows.num_rows
        self.token = doc_starts[rows.doc] + rows.start
        self.first = rows.start
        self.length = rows.length
        end = np.cumsum(rows.length, dtype=np.int64)
        row_of = np.repeat(np.arange(rows.num_rows), np.diff(rows.row_ptr))
        self.column = (end - rows.length - np.concatenate([[0], end])[rows.row_ptr[:-1]][row_of]).astype(np.int32)
        self.nbytes = sum(a.nbytes for a in (self.ptr, self.token, self.first, self.length, self.column))


def window_rows(lengths: np.ndarray, doc_starts: np.ndarray, seq_len: int, first: np.ndarray, w: int,
                **caps) -> WindowRows:
    """Window ``w``'s best-fit rows, from its documents (``lengths`` as the read sees them, from ``doc_starts``
    in the chunk), which must be the rows counted for it (``first``: :func:`windows`)."""
    got = WindowRows(lengths, doc_starts, seq_len, **caps)
    want = int(first[w + 1] - first[w])
    if got.rows != want:  # the counts came from the num_tokens column, or an index file
        raise Disagrees(f"the documents of its packing window {w} pack into {got.rows} rows of "
                        f"{seq_len}, the index says {want}")
    return got


@dataclasses.dataclass(frozen=True)
class RowPieces:
    """The pieces of best-fit rows, as CSR over a placement's valid rows: row ``k`` holds pieces
    ``ptr[k]:ptr[k+1]``, in column order, all in the row's chunk (``Placement.chunks[k]``). A piece lies
    in one document, hence in one row group.

    Attributes:
      ptr: int64 [k+1].
      starts: int64 [p]: the piece's first token, as an offset in the chunk.
      first_positions: int64 [p]: that token's position in its document (> 0 only for a row's first piece).
      lengths, columns: [p]: the piece's tokens and the row column of its first token.
    """

    ptr: np.ndarray
    starts: np.ndarray
    first_positions: np.ndarray
    lengths: np.ndarray
    columns: np.ndarray

    @classmethod
    def empty(cls) -> RowPieces:
        z = np.zeros(0, np.int64)
        return cls(np.zeros(1, np.int64), z, z, z, z)

    @classmethod
    def scatter(cls, rows: int, parts: list[tuple[np.ndarray, RowPieces]]) -> RowPieces:
        """The pieces of ``rows`` rows from ``parts``: ``(dst, pieces)``, ``pieces``' row ``i`` being row
        ``dst[i]`` (a read's rows of each chunk, or a mixture's components' rows, put back in row order).
        (All parts at once: per-part numpy calls cost more than the few pieces each part has.)"""
        dst = np.concatenate([d for d, _ in parts]) if parts else np.zeros(0, np.int64)
        m = np.concatenate([pc.ptr[1:] - pc.ptr[:-1] for _, pc in parts]) if parts else np.zeros(0, np.int64)
        counts = np.zeros(rows, np.int64)
        counts[dst] = m
        ptr = np.concatenate([[0], np.cumsum(counts)])
        n = int(ptr[-1])
        # piece k of the parts, in part order, goes to its row's first slot plus its place in the row
        at = np.repeat(ptr[dst] - (np.cumsum(m) - m), m) + np.arange(n, dtype=np.int64)
        out = [np.empty(n, np.int64) for _ in range(4)]
        for i, o in enumerate(out):
            o[at] = np.concatenate([(pc.starts, pc.first_positions, pc.lengths, pc.columns)[i] for _, pc in parts])
        return cls(ptr, *out)


def rows(first: np.ndarray, offsets: np.ndarray, window: Callable[[int], WindowRows]) -> RowPieces:
    """Best-fit rows ``offsets`` of a chunk (``first``: :func:`windows`), cut out of the rows of the windows
    they lie in, ``window(w)`` (asked for those windows only): each row's pieces, row after row."""
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.size:  # the usual case: consecutive rows of one window (a stream's rows of a batch), slices
        o0, o1 = int(offsets[0]), int(offsets[-1])
        w = int(first.searchsorted(o0, side="right")) - 1
        if o1 - o0 + 1 == offsets.size and o1 < first[w + 1] and offsets.tolist() == list(range(o0, o1 + 1)):
            rw = window(w)
            p = rw.ptr[o0 - first[w]:o1 - first[w] + 2]
            a, b = int(p[0]), int(p[-1])
            return RowPieces(p - a, rw.token[a:b], rw.first[a:b], rw.length[a:b], rw.column[a:b])
    win = np.searchsorted(first, offsets, side="right") - 1
    n = np.zeros(offsets.size, np.int64)
    parts = []
    for w in np.unique(win).tolist():
        m = np.flatnonzero(win == w)
        rw = window(w)
        local = offsets[m] - first[w]
        parts.append((m, rw.ptr[local], rw))
        n[m] = rw.ptr[local + 1] - rw.ptr[local]
    ptr = np.concatenate([[0], np.cumsum(n)])
    out = [np.empty(int(ptr[-1]), dt) for dt in (np.int64, np.int64, np.int32, np.int32)]
    for m, lo, rw in parts:
        cnt = n[m]
        inner = np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        dst, src = np.repeat(ptr[m], cnt) + inner, np.repeat(lo, cnt) + inner
        for o, a in zip(out, (rw.token, rw.first, rw.length, rw.column)):
            o[dst] = a[src]
    return RowPieces(ptr, *out)
