"""How each batch layout writes rows: the kernels the assembler's one walk calls.

The walk (:mod:`reader.batch.assemble`) decides what goes in every row; a writer puts it there in its
layout's arrays (:mod:`reader.batch.schema`):

* :meth:`copy_concat_windows`: runs of windows that lie inside one decoded row group, for the whole batch
  (one copy per run), then :meth:`mark_documents`: the document starts inside them, for the
  whole batch at once;
* :meth:`write_row`: any other row, from its tokens (after the previous token) and their positions;
* :meth:`write_packed`: best-fit rows, from their pieces, for the whole read at once (one copy per
  piece, then the documents marked for the whole read, as :meth:`mark_documents` does);
* :meth:`pad`: rows past the end of an eval pass.

Rows may be written with scratch values first (a run's copy, or a whole-array shift, covers rows the
walk writes afterwards): the walk writes crossing and piecewise rows after the windows, and padding last.

A writer made with ``masked=True`` (a cache, or a mixture with a component, with loss masks) copies each
token's loss flag beside it from the decoded row groups' ``loss`` (:class:`reader.storage.chunk.RowGroup`;
a row group without one, of a plain component, is loss throughout): ``loss_mask`` is the flag on real
tokens (:func:`reader.batch.schema.loss_mask`), in either layout. ``continuations`` (flat layout): the
slots for best-fit continuation pieces past column 0; ``segments``: a varlen read's ``max_segments``
(its fields are written by the assembler, for either layout).
"""

from __future__ import annotations

import numpy as np

from reader.batch.schema import TOKEN_FIELDS, empty_batch

PIECE_BLOCK_ELEMENTS = 1 << 16  # rows x seq_len of unpacked rows written at once (512 KiB per int64 temporary)

_AR32: list = [np.zeros(0, np.int32)]


def _arange32(n: int) -> np.ndarray:
    """``np.arange(n, dtype=int32)``, cached (a batch needs one of batch x seq_len entries)."""
    a = _AR32[0]
    if a.size < n:
        a = _AR32[0] = np.arange(n, dtype=np.int32)
    return a[:n]


_CONST: dict[tuple, np.ndarray] = {}


def _const(value, n: int, dtype) -> np.ndarray:
    """A read-only array of ``n`` times ``value``, cached (padding, the flags of plain row groups)."""
    key = (value, n, dtype)
    a = _CONST.get(key)
    if a is None:
        a = np.full(n, value, dtype)
        a.setflags(write=False)
        _CONST[key] = a
    return a


def _copy_loss(lm, runs, groups, L: int) -> None:
    """``loss_mask`` of runs of windows (see :meth:`ArraysWriter.copy_concat_windows`): their tokens' loss flags."""
    for c, g, a, rows, k in runs:
        lo = groups[(c, g)].loss
        if lo is None:
            lm[rows] = True
        elif k == 1:
            lm[rows] = lo[a + 1:a + 1 + L]
        else:
            lm[rows] = lo[a + 1:a + 1 + k * L].reshape(k, L)


def segments(nrows: int, L: int, rows, totals, pieces_row, flat_start, first):
    """The segments of packed rows made of pieces, over a ``[nrows, L]`` array seen flat: each piece (a
    segment numbered from 1 in its row, starting at flat offset ``flat_start`` and position ``first``),
    then each row's padding (segment 0; rows without pieces are all padding). Returns ``(starts - first
    positions, numbers, lengths)`` in offset order, for ``np.repeat``."""
    total = np.zeros(nrows, np.int64)
    total[rows] = totals
    pad_rows = np.flatnonzero(total < L)
    head = np.flatnonzero(np.diff(pieces_row, prepend=-1))  # each row's first piece (rows ascend)
    in_row = np.arange(pieces_row.size) - np.repeat(head, np.diff(np.append(head, pieces_row.size)))
    starts = np.concatenate([flat_start, pad_rows * L + total[pad_rows]])
    base = starts - np.concatenate([first, np.zeros(pad_rows.size, np.int64)])
    num = np.concatenate([in_row + 1, np.zeros(pad_rows.size, np.int64)])
    o = np.argsort(starts, kind="stable")
    return base[o], num[o], np.diff(np.append(starts[o], nrows * L))


class ArraysWriter:
    """``layout="arrays"``: inputs, targets, segment_ids, positions, loss_mask as ``[rows, L]`` arrays."""

    layout = "arrays"
    strided = False  # writes through flat views of whole arrays: rows must be contiguous

    def __init__(self, seq_len: int, masked: bool = False, continuations: int = 0, segments: int | None = None):
        self.L = seq_len
        self.masked = masked
        self.segments = segments

    def new(self, n: int) -> dict[str, np.ndarray]:
        return empty_batch(self.layout, self.L, n, segments=self.segments)

    def reset(self, out: dict[str, np.ndarray]) -> None:
        """Every token array is written whole by the walk."""

    def copy_concat_windows(self, out, runs, groups) -> None:
        """Targets and inputs of each run ``(chunk, row group, offset, rows, k)``: ``k`` consecutive windows
        of one row group into rows ``rows`` (:func:`reader.batch.assemble.window_runs`), as one copy."""
        L = self.L
        tg, ip = out["targets"], out["inputs"]
        for c, g, a, rows, k in runs:
            rg = groups[(c, g)]
            if k == 1:
                tg[rows] = rg.padded[a + 1:a + 1 + L]
                ip[rows] = rg.padded[a:a + L]
            else:
                tg[rows] = rg.padded[a + 1:a + 1 + k * L].reshape(k, L)
                ip[rows] = rg.padded[a:a + k * L].reshape(k, L)
        if self.masked:
            _copy_loss(out["loss_mask"], runs, groups, L)

    def mark_documents(self, out, rows, first, owner, offset) -> None:
        """positions, segment_ids, loss_mask and the zero inputs at document starts of the copied windows
        (see :func:`reader.batch.assemble.doc_starts_in_windows` for the arguments): a few hundred segments
        for the whole batch, not one pass per token."""
        L = self.L
        nrows = out["targets"].shape[0]
        # segments, as flat offsets into the [rows, L] outputs: each window's first piece (at column 0,
        # position `first`), then one per document start inside it. Runs continue over rows that are
        # not windows; those are written afterwards (crossing windows) or zeroed (padding).
        flat = np.concatenate([rows * L, rows[owner] * L + offset])
        pos0 = np.concatenate([first, np.zeros(owner.size, np.int64)])
        o = np.argsort(flat, kind="stable")
        flat, pos0 = flat[o], pos0[o]
        starts_doc = flat[pos0 == 0]  # tokens that start a document: input 0
        if flat[0] != 0:  # rows before the first window: scratch, overwritten later
            flat, pos0 = np.concatenate([[0], flat]), np.concatenate([[0], pos0])
        size = nrows * L
        lengths = np.diff(np.append(flat, size))
        sidx = np.arange(flat.size)
        row_first = np.maximum.accumulate(np.where(flat % L == 0, sidx, 0))
        segnum = (sidx - row_first + 1).astype(np.int32)
        np.subtract(_arange32(size), np.repeat((flat - pos0).astype(np.int32), lengths),
                    out=out["positions"].reshape(-1))
        np.copyto(out["segment_ids"].reshape(-1), np.repeat(segnum, lengths))
        out["inputs"].reshape(-1)[starts_doc] = 0
        if not self.masked:  # (masked: copy_concat_windows copied the flags)
            out["loss_mask"][:] = True

    def write_row(self, out, r: int, seq: np.ndarray, pos: np.ndarray, loss: np.ndarray | None = None) -> None:
        """Row ``r`` from ``seq`` (the token before the row's first, then its ``m <= L`` tokens) and the
        tokens' positions in their documents (and their loss flags; None: all loss tokens); columns past
        ``m`` are padding."""
        m = pos.size
        out["targets"][r, :m] = seq[1:]
        inputs = out["inputs"][r, :m]
        inputs[:] = seq[:m]
        flag = pos == 0
        inputs[flag] = 0
        out["positions"][r, :m] = pos
        if m:
            flag[0] = True
        np.cumsum(flag, dtype=np.int32, out=out["segment_ids"][r, :m])
        out["loss_mask"][r, :m] = True if loss is None else loss
        if m < self.L:
            for k in TOKEN_FIELDS:
                out[k][r, m:] = 0

    def write_pieces(self, out, dst: np.ndarray, padded: np.ndarray, local: np.ndarray, first: np.ndarray,
                     length: np.ndarray, loss: np.ndarray | None = None) -> None:
        """Unpacked rows ``dst``: ``length`` tokens of one decoded row group (``padded``, and its ``loss``
        flags if any) from token ``local``, whose first token is at position ``first`` of its document;
        then padding."""
        ar = np.arange(self.L, dtype=np.int64)
        # a block of rows at a time, so the [rows, L] temporaries stay in the CPU cache when a slab of
        # batches puts hundreds of rows in one row group (measured by benchmarks/unpacked_blocks.py)
        step = max(1, PIECE_BLOCK_ELEMENTS // self.L)
        for i in range(0, len(dst), step):
            d, lo, fi, le = dst[i:i + step], local[i:i + step], first[i:i + step], length[i:i + step]
            real = ar[None, :] < le[:, None]
            gi = np.where(real, lo[:, None] + ar[None, :], -1)  # -1 -> padded[0] == 0
            pos = np.where(real, fi[:, None] + ar[None, :], 0)
            out["targets"][d] = padded[gi + 1]
            out["inputs"][d] = np.where(pos > 0, padded[np.maximum(gi, 0)], 0)
            out["positions"][d] = pos
            out["segment_ids"][d] = real
            out["loss_mask"][d] = real if loss is None else loss[gi + 1]  # (loss[0] is False)

    def write_packed(self, out, rows, totals, pieces_row, columns, local, first, lengths, group, padded,
                     losses=None) -> None:
        """Packed rows made of pieces (best-fit rows), for the whole read: rows ``rows`` hold ``totals``
        tokens; piece ``k`` writes ``lengths[k]`` tokens of decoded row group ``padded[group[k]]`` from
        token ``local[k]`` into row ``pieces_row[k]`` from column ``columns[k]``, its first token at
        position ``first[k]`` of its document. Pieces come row after row, in column order, filling each
        row from column 0; a piece at position 0 starts a document. Rows without pieces are padding.
        ``losses``: each row group's loss flags (a masked writer), parallel to ``padded``.

        The rows' contents are listed piece by piece (views of the row groups, zeros for padding) and
        written by one ``np.concatenate`` per array: pieces are long (about L/2 at L = 2048 on real
        text) and a read's pieces lie in hundreds of row groups, so per-token index arrays (or one
        gather per row group) cost several times more."""
        L = self.L
        nrows = out["targets"].shape[0]
        z, no, yes = _const(0, L, np.int32), _const(False, L, bool), _const(True, L, bool)
        tparts, iparts = [], []  # the two arrays' contents, row after row, for one concatenate each
        mparts = [] if self.masked else None  # the loss flags' (a plain row group's: True throughout)
        r0, used = -1, L
        for r, g, a, m, f in zip(pieces_row.tolist(), group.tolist(), local.tolist(), lengths.tolist(),
                                 first.tolist()):
            if r != r0:  # a new row: pad the last one, and rows without pieces
                tparts += [z[:L - used]] + [z] * (r - r0 - 1)
                iparts += [z[:L - used]] + [z] * (r - r0 - 1)
                if mparts is not None:
                    mparts += [no[:L - used]] + [no] * (r - r0 - 1)
                r0, used = r, 0
            p = padded[g]
            tparts.append(p[a + 1:a + 1 + m])
            if f:
                iparts.append(p[a:a + m])
            else:  # a document's first token has no input
                iparts += [z[:1], p[a + 1:a + m]]
            if mparts is not None:
                lo = losses[g]
                mparts.append(yes[:m] if lo is None else lo[a + 1:a + 1 + m])
            used += m
        tparts += [z[:L - used]] + [z] * (nrows - r0 - 1)
        iparts += [z[:L - used]] + [z] * (nrows - r0 - 1)
        np.concatenate(tparts, out=out["targets"].reshape(-1))
        np.concatenate(iparts, out=out["inputs"].reshape(-1))
        dst0 = pieces_row * L + columns
        base, num, seg_len = segments(nrows, L, rows, totals, pieces_row, dst0, first)
        mask = out["loss_mask"].reshape(-1)
        real = np.repeat(num > 0, seg_len)
        if mparts is not None:
            mparts += [no[:L - used]] + [no] * (nrows - r0 - 1)
            np.concatenate(mparts, out=mask)
        else:
            np.copyto(mask, real)
        np.copyto(out["segment_ids"].reshape(-1), np.repeat(num.astype(np.int32), seg_len))
        pos = out["positions"].reshape(-1)
        np.subtract(_arange32(nrows * L), np.repeat(base.astype(np.int32), seg_len), out=pos)
        pos *= real

    def pad(self, out, rows: np.ndarray) -> None:
        for k in TOKEN_FIELDS:
            out[k][rows] = 0


class FlatWriter:
    """``layout="flat"``: ``tokens`` uint32 ``[rows, L+1]`` (flat-tokens) plus first_positions, num_tokens."""

    layout = "flat"
    strided = True  # indexes [row, column] only: rows may be strided (a reader worker's rows of a slot)

    def __init__(self, seq_len: int, masked: bool = False, continuations: int = 0, segments: int | None = None):
        self.L = seq_len
        self.masked = masked  # a loss_mask array beside the tokens
        self.continuations = continuations  # slots for continuation pieces past column 0 (best fit)
        self.segments = segments

    def new(self, n: int) -> dict[str, np.ndarray]:
        return empty_batch(self.layout, self.L, n, masked=self.masked, continuations=self.continuations,
                           segments=self.segments)

    def _no_continuations(self, out, rows) -> None:
        if self.continuations:
            out["continuation_columns"][rows] = self.L
            out["continuation_positions"][rows] = 0
            out["continuation_inputs"][rows] = 0

    def reset(self, out: dict[str, np.ndarray]) -> None:
        out["first_positions"][:] = 0
        out["num_tokens"][:] = self.L
        self._no_continuations(out, slice(None))

    def copy_concat_windows(self, out, runs, groups) -> None:
        """``tokens[r] = 2 * padded[a : a+L+1]`` (the previous token, then the window) for each run; the
        tokens are copied as they are, then doubled for the whole batch in one pass."""
        L = self.L
        W = out["tokens"].view(np.int32)  # 2*token as int32 bits: the same bytes as the uint32 value
        for c, g, a, rows, k in runs:
            p = groups[(c, g)].padded
            if k == 1:
                W[rows] = p[a:a + L + 1]
            else:  # k windows: their tokens in one pass, their previous tokens in another
                W[rows, 1:] = p[a + 1:a + 1 + k * L].reshape(k, L)
                W[rows, 0] = p[a:a + k * L:L]
        W <<= 1  # (rows that are not windows hold scratch values here; the walk writes them afterwards)
        if self.masked:
            _copy_loss(out["loss_mask"], runs, groups, L)

    def mark_documents(self, out, rows, first, owner, offset) -> None:
        """Start bits and first positions of the copied windows, for the whole batch at once."""
        out["first_positions"][rows] = first
        tok = out["tokens"]  # [row, column] indexing: rows may be strided
        tok[rows[owner], 1 + offset] += np.uint32(1)
        at_start = rows[first == 0]  # windows that begin a document: start bit, and no previous token
        tok[at_start, 1] += np.uint32(1)
        tok[at_start, 0] = 0

    def write_row(self, out, r: int, seq: np.ndarray, pos: np.ndarray, loss: np.ndarray | None = None) -> None:
        """Row ``r`` from ``seq`` (the token before the row's first, then its ``m <= L`` tokens) and the
        tokens' positions in their documents (and loss flags, see :meth:`ArraysWriter.write_row`);
        columns past ``m`` are padding."""
        m = pos.size
        if self.masked:
            out["loss_mask"][r, :m] = True if loss is None else loss
            out["loss_mask"][r, m:] = False
        row = out["tokens"][r].view(np.int32)
        np.left_shift(seq, 1, out=row[:m + 1])
        if m < self.L:
            row[m + 1:] = 0
        out["num_tokens"][r] = m
        starts = np.flatnonzero(pos == 0)
        tok = out["tokens"][r]
        tok[1 + starts] += np.uint32(1)
        out["first_positions"][r] = pos[0] if m else 0
        if m and pos[0] == 0:
            tok[0] = 0

    def write_pieces(self, *args) -> None:
        raise ValueError("layout='flat' holds packed windows only; unpacked examples use layout='arrays'")

    def write_packed(self, out, rows, totals, pieces_row, columns, local, first, lengths, group, padded,
                     losses=None) -> None:
        """Best-fit rows, for the whole read: see :meth:`ArraysWriter.write_packed`. Column 0 is the token
        before a row's first piece (0 when it starts a document), each piece's tokens follow from column
        ``1 + columns[k]``, and a piece at position 0 sets its first token's start bit; a piece past the
        row's first that continues a document goes in the row's next ``continuation_*`` slot."""
        L1 = self.L + 1
        tok = out["tokens"]
        direct = tok.flags.c_contiguous
        W = tok.view(np.int32) if direct else np.empty(tok.shape, np.int32)
        z, no, yes = _const(0, L1, np.int32), _const(False, L1 - 1, bool), _const(True, L1 - 1, bool)
        parts = []  # the tokens array's content, row after row, for one concatenate
        mparts = [] if self.masked else None  # the loss flags' (L per row: no column 0)
        append = parts.append
        r0, used = -1, L1
        for r, g, a, m in zip(pieces_row.tolist(), group.tolist(), local.tolist(), lengths.tolist()):
            if r != r0:  # a new row: pad the last one and rows without pieces; the first piece comes with
                # the token before it in column 0 (zeroed below where the piece starts a document)
                if used < L1:
                    append(z[:L1 - used])
                    if mparts is not None:
                        mparts.append(no[:L1 - used])
                if r - r0 > 1:
                    parts += [z] * (r - r0 - 1)
                    if mparts is not None:
                        mparts += [no] * (r - r0 - 1)
                append(padded[g][a:a + 1 + m])
                r0, used = r, 1 + m
            else:
                append(padded[g][a + 1:a + 1 + m])
                used += m
            if mparts is not None:
                lo = losses[g]
                mparts.append(yes[:m] if lo is None else lo[a + 1:a + 1 + m])
        if used < L1:
            append(z[:L1 - used])
        parts += [z] * (tok.shape[0] - r0 - 1)
        flat = W.reshape(-1)
        np.concatenate(parts, out=flat)
        head = np.flatnonzero(np.diff(pieces_row, prepend=-1))  # each row's first piece
        head_first = first[head]
        flat[pieces_row[head][head_first == 0] * L1] = 0  # column 0 of rows that start with a document
        flat <<= 1
        dst0 = pieces_row * L1 + 1 + columns
        flat[dst0[first == 0]] += 1
        if not direct:  # strided rows (a reader worker's rows of a slot): written apart, copied once
            np.copyto(tok, W.view(np.uint32))
        out["first_positions"][rows] = head_first
        out["num_tokens"][rows] = totals
        later = np.ones(first.size, bool)
        later[head] = False
        late = np.flatnonzero(later & (first > 0))
        if late.size:  # continuation pieces past column 0, in the slots of their rows in column order
            r = pieces_row[late]
            slot = np.arange(late.size) - np.searchsorted(r, r)
            if int(slot.max()) >= self.continuations:
                raise ValueError(f"a best-fit row holds {int(slot.max()) + 2} continuation pieces; this flat "
                                 f"layout has room for {self.continuations + 1}")
            out["continuation_columns"][r, slot] = columns[late]
            out["continuation_positions"][r, slot] = first[late]
            out["continuation_inputs"][r, slot] = [padded[g][a] for g, a in zip(group[late].tolist(),
                                                                                local[late].tolist())]
        if mparts is not None:
            lm = out["loss_mask"]
            mparts += [no[:L1 - used]] + [no] * (tok.shape[0] - r0 - 1)
            if lm.flags.c_contiguous:
                np.concatenate(mparts, out=lm.reshape(-1))
            else:
                np.copyto(lm, np.concatenate(mparts).reshape(lm.shape))

    def pad(self, out, rows: np.ndarray) -> None:
        out["tokens"][rows] = 0
        out["num_tokens"][rows] = 0
        out["first_positions"][rows] = 0
        self._no_continuations(out, rows)
        if self.masked:
            out["loss_mask"][rows] = False


def writer(layout: str, seq_len: int, masked: bool = False, continuations: int = 0, segments: int | None = None):
    """The writer of ``layout`` (``masked``: with the loss flags of a cache with loss masks; ``continuations``,
    ``segments``: see the module docstring)."""
    return {"arrays": ArraysWriter, "flat": FlatWriter}[layout](seq_len, masked, continuations, segments)
