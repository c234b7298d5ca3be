"""Read-time packing of one chunk's documents into rows of ``seq_len`` tokens (pure numpy, no reader state).

``best_fit_rows`` never cuts a document shorter than L: each document is split only into full L-token
pieces plus one remainder, full pieces are rows by themselves, and the remainders are placed by best-fit
decreasing (Ding et al. 2024, "Fewer Truncations Improve Language Modeling"), at most ``continuations``
continuation pieces (long documents' tails) per row, first in it, and at most ``max_segments`` pieces in
all (one and no cap by default: the rule of caches before format version 4). ``concat_rows`` describes
plain concatenation cut into windows of L in the same form, and ``packing_figures`` measures either.
The exact rule is in docs/FORMAT.md ("Best-fit packing"); ``count_best_fit_rows`` is the row count alone.

A chunk is packed per *window*, a run of consecutive whole row groups of about ``window_tokens`` tokens
(:func:`window_bounds`): its rows are window 0's best-fit rows, then window 1's, ...
(:func:`best_fit_chunk_rows`). A reader then decodes one window, not the whole chunk, before a stream's
next row, and can drop a window's row groups once the stream is past its rows.

Rows are a CSR description (:class:`PackedRows`): row i holds pieces ``row_ptr[i]:row_ptr[i+1]``, piece
k being tokens ``[start[k], start[k] + length[k])`` of document ``doc[k]`` of the chunk.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max
# The default window target (ReadOptions.best_fit_window_tokens): padding at L = 2048 stays within 2% on the
# bench corpus and a reader holds 16 MiB decoded per stream (docs/BENCHMARKS.md)
WINDOW_TOKENS = 4 << 20


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


def _best_fit(rem: np.ndarray, cont: np.ndarray, seq_len: int, continuations: int | None = 1,
              max_segments: int | None = None) -> tuple[np.ndarray, int]:
    """Best-fit decreasing of the remainder pieces ``rem`` (each in 1..L-1, in document order; ``cont``:
    the piece continues its document, i.e. starts past token 0): the row of each piece (rows numbered in
    creation order), and the number of rows. A row holds at most ``continuations`` continuation pieces
    and at most ``max_segments`` pieces (None: no cap).

    Open rows are kept in two sets, rows that may still take a continuation piece (set 0: any piece may
    go there) and rows that hold ``continuations`` of them (set 1: only pieces that start their
    document); a row with ``max_segments`` pieces is closed (in neither). In each set, rows live in
    per-capacity min-heaps of row numbers: the rule takes the smallest capacity that fits, then the
    oldest row in it. A FIFO per capacity would not do, as rows do not reach a capacity in creation
    order: with L = 10 and pieces 7 5 4 2 1, row 0 takes 7, row 1 takes 5 then 4 (capacity 1), row 0 then
    takes 2 (capacity 1), and the 1 must go to row 0.

    The capacities that have rows are bits of a two-level bitmap of Python ints per set (words of about
    sqrt(L) bits and a summary of non-empty words), so "smallest capacity >= p" is a shift and a
    lowest-set-bit per level, on ints of a few machine words at any practical L; the sort and the heaps
    make the whole O(n log n). Pieces longer than L/2 come first and each opens a row (every row then
    holds a longer piece, so has less room than they need): those rows are made at once.
    """
    n = len(rem)
    C = n + 1 if continuations is None else int(continuations)
    M = n + 1 if max_segments is None else int(max_segments)
    order = np.argsort(-rem, kind="stable")  # length descending; stable keeps document order on ties
    sizes, conts = rem[order], cont[order]
    big = int(np.searchsorted(-sizes, -(seq_len // 2), side="left"))  # pieces > L/2 (sizes descend)
    shift = max(6, (int(seq_len).bit_length() + 1) // 2)
    low = (1 << shift) - 1
    words = ([0] * ((seq_len >> shift) + 1), [0] * ((seq_len >> shift) + 1))
    summary = [0, 0]
    heaps: tuple[list, list] = ([None] * seq_len, [None] * seq_len)  # per set: capacity -> heap of rows
    # the big pieces' rows: row i has capacity L - size, in set 1 if its piece is all the continuation
    # pieces it may hold; rows of one (set, capacity) in ascending order, a valid heap (none if a row
    # holds one piece only)
    key = (conts[:big] >= C).astype(np.int64) * seq_len + (seq_len - sizes[:big])
    by = np.argsort(key, kind="stable")
    cuts = np.flatnonzero(np.diff(key[by])) + 1
    bounds = [0, *cuts.tolist(), big]
    # (slices of one list: np.split makes an array per group, a third of this function's time)
    members, group_keys = by.tolist(), key[by][bounds[:-1]].tolist() if big and M > 1 else []
    for a, b, kc in zip(bounds[:-1], bounds[1:], group_keys):
        k, c = divmod(kc, seq_len)
        heaps[k][c] = members[a:b]
        words[k][c >> shift] |= 1 << (c & low)
        summary[k] |= 1 << (c >> shift)
    # per-row counts, kept only for a cap that needs them (C = 1 is the move to set 1 alone)
    ncont = conts[:big].astype(np.int64).tolist() + [0] * (n - big) if C > 1 and C <= n else None
    npieces = [1] * big + [0] * (n - big) if M <= n else None
    words0, words1 = words
    heaps0, heaps1 = heaps
    rest = []
    rows = big
    heappush, heappop = heapq.heappush, heapq.heappop
    for p, is_cont in zip(sizes[big:].tolist(), conts[big:].tolist()):
        # c: the smallest capacity >= p of set 0 (0: none), then of set 1 for a document start
        w = p >> shift
        m = words0[w] >> (p & low)
        if m:
            c = p + (m & -m).bit_length() - 1
        else:
            sm = summary[0] >> (w + 1)
            if sm:
                w += (sm & -sm).bit_length()
                m = words0[w]
                c = (w << shift) + (m & -m).bit_length() - 1
            else:
                c = 0
        k = 0
        if not is_cont:  # set 1 is open to it too: the smaller capacity, then the older row
            w = p >> shift
            m = words1[w] >> (p & low)
            if m:
                c1 = p + (m & -m).bit_length() - 1
            else:
                sm = summary[1] >> (w + 1)
                if sm:
                    w += (sm & -sm).bit_length()
                    m = words1[w]
                    c1 = (w << shift) + (m & -m).bit_length() - 1
                else:
                    c1 = 0
            if c1 and (not c or c1 < c or (c1 == c and heaps1[c1][0] < heaps0[c][0])):
                c, k = c1, 1
        if c:
            h = heaps[k][c]
            row = heappop(h)
            if not h:  # capacity c of set k has no row left: clear its bit
                w = c >> shift
                words[k][w] ^= 1 << (c & low)
                if not words[k][w]:
                    summary[k] ^= 1 << w
            c -= p
        else:
            row = rows
            rows += 1
            c = seq_len - p
        rest.append(row)
        if is_cont and C <= n:
            if ncont is None:
                k = 1
            else:
                ncont[row] += 1
                k = int(ncont[row] >= C)
        if npieces is not None:
            npieces[row] += 1
            if npieces[row] >= M:  # closed: no piece joins it any more
                c = 0
        if c:
            h = heaps[k][c]
            if h:
                heappush(h, row)
            else:
                heaps[k][c] = [row]
                w = c >> shift
                words[k][w] |= 1 << (c & low)
                summary[k] |= 1 << w
    row_of = np.empty(n, np.int64)
    row_of[order[:big]] = np.arange(big)
    row_of[order[big:]] = rest
    return row_of, rows


def _caps(continuations, max_segments) -> None:
    for name, v in (("continuations", continuations), ("max_segments", max_segments)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise ValueError(f"{name} must be None or an integer >= 1, got {v!r}")


def count_best_fit_rows(lengths, seq_len: int, *, continuations: int | None = 1,
                        max_segments: int | None = None) -> int:
    """Rows ``best_fit_rows`` gives, without building them. It still runs the placement (the count is not
    known otherwise), so it saves only the final layout: 10-30% of the time (benchmarks/packing_cost.py)."""
    n = _check(lengths, seq_len)
    _caps(continuations, max_segments)
    rem = n % seq_len
    has = rem > 0
    return int((n // seq_len).sum()) + _best_fit(rem[has], n[has] > seq_len, seq_len, continuations, max_segments)[1]


def best_fit_rows(lengths, seq_len: int, *, continuations: int | None = 1,
                  max_segments: int | None = None) -> PackedRows:
    """Pack one chunk's documents (token counts ``lengths``, in file order) into rows of ``seq_len``.

    A document of n tokens gives ``n // L`` full pieces (each a row of its own) and a remainder of
    ``n % L`` tokens if non-zero, a *continuation* piece when the document is longer than L; remainders
    are placed by best-fit decreasing, at most ``continuations`` continuation pieces (None: any number)
    and at most ``max_segments`` pieces (None: any number) per row; rows are ordered by their earliest
    piece in (document, start) order, and pieces within a row are its continuation pieces, then the others,
    each in document order. See docs/FORMAT.md ("Best-fit packing") for the rule.
    """
    n = _check(lengths, seq_len)
    _caps(continuations, max_segments)
    L = int(seq_len)
    full = n // L
    rem = n % L
    # Every piece in document order: per document its full pieces, then its remainder.
    per_doc = full + (rem > 0)
    total = int(per_doc.sum())
    doc = np.repeat(np.arange(len(n), dtype=np.int32), per_doc)
    first = np.cumsum(per_doc) - per_doc  # index of each document's first piece
    k = np.arange(total, dtype=np.int64) - np.repeat(first, per_doc)  # piece number within its document
    start = k * L
    length = np.minimum(n[doc] - start, L).astype(np.int32)
    is_rem = length < L
    has = rem > 0
    rem_rows, _ = _best_fit(rem[has], n[has] > L, L, continuations, max_segments)
    # Row of each piece, as the index of its earliest piece (rows' earliest pieces are distinct): a full
    # piece is its own, a remainder's row has the smallest piece index among its members.
    piece = np.arange(total, dtype=np.int64)
    rem_piece = piece[is_rem]
    rem_row = rem_rows
    _, first_member = np.unique(rem_row, return_index=True)  # rem_piece ascends: first seen = smallest
    row_key = piece.copy()
    row_key[is_rem] = rem_piece[first_member][rem_row]
    order = np.lexsort((piece, start == 0, row_key))  # by row, its continuation pieces first, then the others
    row_ptr = np.append(np.flatnonzero(np.diff(row_key[order], prepend=-1)), total).astype(np.int64)
    return PackedRows(row_ptr, doc[order], start[order], length[order])


def window_bounds(row_group_tokens, window_tokens: int) -> np.ndarray:
    """A chunk's packing windows from its row groups' token counts: window i is row groups
    ``bounds[i]:bounds[i+1]`` (int64, non-empty windows only; no row group: no window).

    With T the chunk's tokens and W = ``window_tokens``, the row groups are cut into n = max(1, round(T/W))
    runs (halves round up), run i ending at the first row-group end at or after (i+1)·T/n tokens; runs
    that end where the previous one does are empty and left out (they hold no document). Computed on
    Python integers, so (i+1)·T never overflows."""
    if isinstance(window_tokens, bool) or not isinstance(window_tokens, (int, np.integer)) or window_tokens < 1:
        raise ValueError(f"window_tokens must be an integer >= 1, got {window_tokens!r}")
    tokens = np.asarray(row_group_tokens, dtype=np.int64).tolist()
    G, T, W = len(tokens), sum(tokens), int(window_tokens)
    if not G:
        return np.zeros(1, np.int64)
    n = max(1, (2 * T + W) // (2 * W))
    bounds, done, end = [0], 0, 0
    for g, t in enumerate(tokens[:-1]):
        end += t
        # runs 0 .. ended-1 end at or before this row group's end: (i+1)·T <= end·n
        ended = min(n - 1, end * n // T) if T else 0
        if ended > done:
            bounds.append(g + 1)
            done = ended
    bounds.append(G)
    return np.asarray(bounds, dtype=np.int64)


def window_docs(lengths, row_group_docs, window_tokens: int) -> np.ndarray:
    """Document bounds of a chunk's packing windows (:func:`window_bounds`): window i holds documents
    ``docs[i]:docs[i+1]``. ``row_group_docs``: the chunk's documents per row group, in order."""
    n = _check(lengths, 1)
    per = np.asarray(row_group_docs, dtype=np.int64)
    if per.ndim != 1 or (per.size and per.min() < 0) or int(per.sum()) != n.size:
        raise ValueError(f"row_group_docs must be >= 0 per row group and add up to the {n.size} documents, "
                         f"got {per.size} row groups holding {int(per.sum())}")
    doc_bounds = np.concatenate([[0], np.cumsum(per)])
    tok = np.concatenate([[0], np.cumsum(n)])
    return doc_bounds[window_bounds(np.diff(tok[doc_bounds]), window_tokens)]


def best_fit_chunk_rows(lengths, row_group_docs, seq_len: int, window_tokens: int, **caps) -> PackedRows:
    """A chunk's best-fit rows: each window's (:func:`window_docs`) ``best_fit_rows`` (``caps``: its
    ``continuations`` and ``max_segments``), in window order, documents numbered in the chunk."""
    bounds = window_docs(lengths, row_group_docs, window_tokens)
    n = np.asarray(lengths, dtype=np.int64)
    parts = [best_fit_rows(n[a:b], seq_len, **caps) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
    if not parts:
        return best_fit_rows(n, seq_len, **caps)
    ptr_base = np.cumsum([0] + [len(p.doc) for p in parts[:-1]])
    row_ptr = np.concatenate([[0]] + [p.row_ptr[1:] + o for p, o in zip(parts, ptr_base)])
    doc = np.concatenate([p.doc + np.int32(a) for p, a in zip(parts, bounds[:-1].tolist())])
    return PackedRows(row_ptr.astype(np.int64), doc.astype(np.int32), np.concatenate([p.start for p in parts]),
                      np.concatenate([p.length for p in parts]))


def count_best_fit_windows(lengths, row_group_docs, seq_len: int, window_tokens: int, **caps) -> np.ndarray:
    """Rows of each window of :func:`best_fit_chunk_rows` (int64, one per window), without building them."""
    bounds = window_docs(lengths, row_group_docs, window_tokens)
    n = np.asarray(lengths, dtype=np.int64)
    return np.asarray([count_best_fit_rows(n[a:b], seq_len, **caps) for a, b in zip(bounds[:-1].tolist(),
                                                                                      bounds[1:].tolist())], np.int64)


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
