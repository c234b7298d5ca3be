"""Read-time packing of one chunk's documents into rows of ``seq_len`` tokens (pure numpy, no reader state).

``best_fit_rows`` never cuts a document shorter than L: each document is split only into full L-token
pieces plus one remainder, full pieces are rows by themselves, and the remainders are placed by best-fit
decreasing (Ding et al. 2024, "Fewer Truncations Improve Language Modeling"). ``concat_rows`` describes
plain concatenation cut into windows of L in the same form, and ``packing_figures`` measures either.
The exact rule is in docs/FORMAT.md ("Best-fit packing"); ``count_best_fit_rows`` is the row count alone.

Rows are a CSR description (:class:`PackedRows`): row i holds pieces ``row_ptr[i]:row_ptr[i+1]``, piece
k being tokens ``[start[k], start[k] + length[k])`` of document ``doc[k]`` of the chunk.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max


class PackedRows(NamedTuple):
    """Rows as CSR. ``doc`` and ``length`` are int32 (documents per chunk and L stay below 2**31, and a
    cached packing is smaller); ``row_ptr`` and ``start`` are int64 (a document may exceed 2**31 tokens)."""

    row_ptr: np.ndarray  # int64, rows + 1 entries, row_ptr[0] == 0
    doc: np.ndarray  # int32, document index in the chunk, per piece in row order
    start: np.ndarray  # int64, first token of the piece within its document
    length: np.ndarray  # int32, tokens in the piece, 1..L

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1


class PackingFigures(NamedTuple):
    rows: int
    tokens: int
    documents: int  # documents with at least one token
    padding_fraction: float  # padding tokens / (rows * L)
    cut_document_fraction: float  # documents with a piece starting past their first token / documents
    cut_token_fraction: float  # tokens in pieces that start past their document's first token / tokens


def _check(lengths, seq_len: int) -> np.ndarray:
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or not 1 <= seq_len <= _INT32_MAX:
        raise ValueError(f"seq_len must be an integer in [1, {_INT32_MAX}], got {seq_len!r}")
    arr = np.asarray(lengths)
    if arr.ndim != 1 or not (arr.dtype.kind in "iu" or arr.size == 0):
        raise ValueError(f"document lengths must be a 1-D integer array, got dtype {arr.dtype} shape {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise ValueError(f"document lengths must be >= 0, got {int(arr.min())} at index {int(arr.argmin())}")
    if arr.size > _INT32_MAX:
        raise ValueError(f"{arr.size} documents in one chunk: at most {_INT32_MAX} can be packed")
    return arr


def _best_fit(rem: np.ndarray, seq_len: int) -> tuple[list[int], int]:
    """Best-fit decreasing of the remainder pieces ``rem`` (each in 1..L-1, in document order): the row of
    each piece (rows numbered in creation order), and the number of rows.

    Open rows live in per-capacity min-heaps of row numbers: the rule takes the smallest capacity that fits,
    then the oldest row in it. A FIFO per capacity would not do, as rows do not reach a capacity in creation
    order: with L = 10 and pieces 7 5 4 2 1, row 0 takes 7, row 1 takes 5 then 4 (capacity 1), row 0 then
    takes 2 (capacity 1), and the 1 must go to row 0.

    The capacities that have rows are bits of a two-level bitmap of Python ints (words of about sqrt(L)
    bits and a summary of non-empty words), so "smallest capacity >= p" is a shift and a lowest-set-bit
    per level, on ints of a few machine words at any practical L; the sort and the heaps make the whole
    O(n log n).
    """
    order = np.argsort(-rem, kind="stable")  # length descending; stable keeps document order on ties
    shift = max(6, (int(seq_len).bit_length() + 1) // 2)
    low = (1 << shift) - 1
    words = [0] * ((seq_len >> shift) + 1)
    summary = 0
    heaps: list = [None] * seq_len  # capacity -> heap of row numbers; capacities are 1..L-1
    row_of = [0] * len(rem)
    rows = 0
    heappush, heappop = heapq.heappush, heapq.heappop
    for i, p in zip(order.tolist(), rem[order].tolist()):
        w = p >> shift
        m = words[w] >> (p & low)
        if m:
            c = p + (m & -m).bit_length() - 1
        else:
            s = summary >> (w + 1)
            if s:
                w += (s & -s).bit_length()
                m = words[w]
                c = (w << shift) + (m & -m).bit_length() - 1
            else:
                c = 0
        if c:
            h = heaps[c]
            row = heappop(h)
            if not h:  # capacity c has no row left: clear its bit
                w = c >> shift
                words[w] ^= 1 << (c & low)
                if not words[w]:
                    summary ^= 1 << w
            c -= p
        else:
            row = rows
            rows += 1
            c = seq_len - p
        row_of[i] = row
        if c:
            h = heaps[c]
            if h:
                heappush(h, row)
            else:
                heaps[c] = [row]
                w = c >> shift
                words[w] |= 1 << (c & low)
                summary |= 1 << w
    return row_of, rows


def count_best_fit_rows(lengths, seq_len: int) -> int:
    """Rows ``best_fit_rows`` gives, without building them. It still runs the placement (the count is not
    known otherwise), so it saves only the final layout: 10-30% of the time (benchmarks/packing_cost.py)."""
    n = _check(lengths, seq_len)
    rem = n % seq_len
    return int((n // seq_len).sum()) + _best_fit(rem[rem > 0], seq_len)[1]


def best_fit_rows(lengths, seq_len: int) -> PackedRows:
    """Pack one chunk's documents (token counts ``lengths``, in file order) into rows of ``seq_len``.

    A document of n tokens gives ``n // L`` full pieces (each a row of its own) and a remainder of
    ``n % L`` tokens if non-zero; remainders are placed by best-fit decreasing; rows are ordered by
    their first piece and pieces within a row by (document, start). See docs/FORMAT.md for the rule.
    """
    n = _check(lengths, seq_len)
    L = int(seq_len)
    full = n // L
    rem = n % L
    # Every piece in document order (the order that lays out rows): per document its full pieces, then
    # its remainder.
    per_doc = full + (rem > 0)
    total = int(per_doc.sum())
    doc = np.repeat(np.arange(len(n), dtype=np.int32), per_doc)
    first = np.cumsum(per_doc) - per_doc  # index of each document's first piece
    k = np.arange(total, dtype=np.int64) - np.repeat(first, per_doc)  # piece number within its document
    start = k * L
    length = np.minimum(n[doc] - start, L).astype(np.int32)
    is_rem = length < L
    rem_rows, _ = _best_fit(rem[rem > 0], L)
    # Row of each piece, as the index of its first piece (rows' first pieces are distinct): a full piece
    # is its own first piece, a remainder's row starts at the smallest piece index among its members.
    piece = np.arange(total, dtype=np.int64)
    rem_piece = piece[is_rem]
    rem_row = np.asarray(rem_rows, dtype=np.int64)
    _, first_member = np.unique(rem_row, return_index=True)  # rem_piece ascends: first seen = smallest
    row_key = piece.copy()
    row_key[is_rem] = rem_piece[first_member][rem_row]
    order = np.argsort(row_key, kind="stable")  # by (row's first piece, piece)
    row_ptr = np.append(np.flatnonzero(np.diff(row_key[order], prepend=-1)), total).astype(np.int64)
    return PackedRows(row_ptr, doc[order], start[order], length[order])


def concat_rows(lengths, seq_len: int) -> PackedRows:
    """The documents concatenated in order and cut every L tokens (``packed`` reading of one list of
    documents), as :class:`PackedRows`; the last row may be short (padded)."""
    n = _check(lengths, seq_len)
    L = int(seq_len)
    ends = np.cumsum(n)
    total = int(ends[-1]) if len(n) else 0
    # Pieces are the stretches between consecutive document and window boundaries.
    cuts = np.unique(np.concatenate([[0], ends, np.arange(L, total, L, dtype=np.int64)]))
    a, b = cuts[:-1], cuts[1:]
    # The document holding token a: the first document ending after a (zero-length documents never do).
    doc = np.searchsorted(ends, a, side="right")
    start = a - (ends[doc] - n[doc])
    row = a // L
    row_ptr = np.searchsorted(row, np.arange(-(-total // L) + 1), side="left").astype(np.int64)
    return PackedRows(row_ptr, doc.astype(np.int32), start.astype(np.int64), (b - a).astype(np.int32))


def packing_figures(rows: PackedRows, lengths, seq_len: int) -> PackingFigures:
    """Padding and cut figures of a packing of the documents ``lengths`` into rows of ``seq_len``.

    ``cut_document_fraction``: documents (with tokens) of which some row holds a piece starting after the
    document's first token, i.e. a row that sees the document without its beginning; ``cut_token_fraction``:
    the tokens in such pieces. Both are 0 when there are no tokens, as is ``padding_fraction`` with no rows.
    """
    n = _check(lengths, seq_len)
    tokens = int(n.sum())
    documents = int((n > 0).sum())
    capacity = rows.num_rows * int(seq_len)
    late = rows.start > 0
    cut_docs = len(np.unique(rows.doc[late]))
    cut_tokens = int(rows.length[late].sum(dtype=np.int64))
    return PackingFigures(
        rows=rows.num_rows,
        tokens=tokens,
        documents=documents,
        padding_fraction=(capacity - tokens) / capacity if capacity else 0.0,
        cut_document_fraction=cut_docs / documents if documents else 0.0,
        cut_token_fraction=cut_tokens / tokens if tokens else 0.0,
    )
