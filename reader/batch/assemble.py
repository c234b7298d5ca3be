"""The batch assembler: gathers the tokens a :class:`reader.batch.examples.Placement` names into a batch.

One walk serves both layouts; the layout's writer (:mod:`reader.batch.layouts`) does the writing. Packed
rows fall in three kinds, sorted in one pass over the rows:

* windows inside one decoded row group (almost every row): gathered for the whole batch at once, one
  copy per run of consecutive windows of a row group, and the documents inside them from the
  row groups' document starts (a few vectorized calls per batch, whatever its size);
* windows over two row groups of one chunk (the second begins with a document): row by row;
* anything else (over chunks, over more row groups, or the short last window of an eval pass): row
  by row, from the placement's pieces.

Unpacked rows are gathered per row group of each chunk. Best-fit rows (several pieces of one chunk
each, every piece inside one row group) are written for the whole read at once by the layout's
``write_packed``. A varlen read's ``cu_seqlens`` and ``max_seqlen`` (:mod:`reader.batch.schema`) come from
the placement's pieces alone, for either layout (best-fit and unpacked rows: concat reads cannot keep to
``max_segments``).
"""

from __future__ import annotations

import bisect
from typing import Callable

import numpy as np

from reader.batch.layouts import writer
from reader.options import ReadOptions
from reader.batch.examples import Placement
from reader.storage.store import ChunkStore

SLAB_BATCHES = 16  # a slab: consecutive batches assembled in one pass (iter_batches, reader workers); its
# per-pass costs (locating, sorting windows, one call per run and per component of a mixture) are paid
# once per slab, so a mixture of C components gains most (about C times the per-pass calls of one cache)


def window_runs(arr: np.ndarray, L: int) -> list:
    """Runs of the windows ``arr`` (int64 ``[n, 4]`` rows ``(chunk, row group, offset, row)``, sorted,
    each inside one row group): ``(chunk, row group, offset, rows, k)`` for ``k`` consecutive windows of
    one row group (a stream's windows of the batch, or of one mixture component's rows of it), each one
    copy: ``rows`` is the output row when ``k == 1``, a slice when the rows are equally spaced (a
    stream's rows of a batch), else an index array (a mixture component's rows are where its block
    arrangement put them). Found with a few array operations, whatever the number of windows."""
    n = arr.shape[0]
    c, g, a, r = arr.T
    brk = np.flatnonzero((c[1:] != c[:-1]) | (g[1:] != g[:-1]) | (a[1:] != a[:-1] + L)) + 1
    lo = np.concatenate([[0], brk])
    hi = np.concatenate([brk, [n]])
    d = np.diff(r)
    # a run's rows are equally spaced when no step inside it differs from the one before it
    change = np.concatenate([[0, 0], np.cumsum(d[1:] != d[:-1])])  # change[k]: steps k' <= k-1 unlike k'-1
    k = hi - lo
    spaced = (k > 1) & (change[np.maximum(hi - 1, lo)] == change[np.minimum(lo + 1, n - 1)])
    step = np.where(k > 1, np.append(d, 0)[lo], 0)
    out = []
    for (c0, g0, a0, r0), i, kk, sp, st, rl in zip(arr[lo].tolist(), lo.tolist(), k.tolist(), spaced.tolist(),
                                                  step.tolist(), r[hi - 1].tolist()):
        if kk == 1:
            out.append((c0, g0, a0, r0, 1))
        elif sp and st > 0:
            out.append((c0, g0, a0, slice(r0, rl + 1, st), kk))
        else:
            out.append((c0, g0, a0, r[i:i + kk], kk))
    return out


def doc_starts_in_windows(arr: np.ndarray, groups: dict, L: int):
    """Document structure of windows that lie inside one decoded row group each.

    ``arr``: int64 ``[n, 4]`` rows ``(chunk, row group, offset, row)``, one per window, sorted; ``groups``:
    ``{(chunk, row group): RowGroup}``.
    Returns ``(rows, first, owner, offset)``: each window's output row and the position of its first
    token in its document; and every document start strictly inside a window, as window index
    ``owner[k]`` and column ``offset[k]``. One vectorized pass for the whole batch: the row groups'
    document starts side by side in one sorted array (key = row group number * 2**40 + token offset).
    """
    shift = np.int64(1) << 40
    keys = list(groups)
    u = np.searchsorted(np.asarray([c * (1 << 24) + g for c, g in keys], np.int64),
                        arr[:, 0] * (1 << 24) + arr[:, 1])
    dss = [groups[kk].doc_starts for kk in keys]
    ds = np.concatenate(dss)  # a new array: shifted in place
    ds += np.repeat(np.arange(len(dss), dtype=np.int64) * shift, [d.size for d in dss])
    key = u * shift + arr[:, 2]
    lo = np.searchsorted(ds, key, side="right") - 1  # the document holding each window's first token
    hi = np.searchsorted(ds, key + L, side="left")  # ds[lo+1:hi]: document starts inside the window
    cnt = hi - lo - 1
    tot = int(cnt.sum())
    owner = np.repeat(np.arange(arr.shape[0]), cnt)
    inner = np.arange(tot, dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(lo + 1, cnt)
    return arr[:, 3], key - ds[lo], owner, ds[inner] - key[owner]


class Assembler:
    """Writes placements into batches of one layout.

    Args:
      store: the chunk store the tokens come from.
      options: the :class:`reader.ReadOptions` (seq_len, packed, layout).
      on_windows: called after each packed read with what it copied, as ``(chunk, row group, ...)``
        tuples: the runs of windows inside one row group (sorted) and the windows over two row groups;
        the release policy's hook.
      masked: the cache (or a component of the mixture) has loss masks: rows carry their tokens' loss
        flags (:mod:`reader.batch.layouts`).
      continuations: the flat layout's slots for best-fit continuation pieces past column 0
        (``ReadOptions.continuation_slots``).
    """

    def __init__(self, store: ChunkStore, options: ReadOptions,
                 on_windows: Callable[[list, list], None] | None = None, masked: bool = False,
                 continuations: int = 0):
        self.store = store
        self.L = options.seq_len
        self.packed = options.packed
        self.masked = masked
        self.segments = options.varlen_segments
        self.writer = writer(options.layout, options.seq_len, masked, continuations, self.segments)
        self.on_windows = on_windows
        self._rg_starts: dict[int, list[int]] = {}  # chunk -> its row groups' first tokens (kept across reads)

    def assemble(self, pl: Placement, into: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The batch of ``pl``'s rows. ``into``: arrays to write it into (any row strides; reader workers
        pass their rows of a shared-memory slot), returned."""
        w = self.writer
        if into is not None and not w.strided:
            got = self.assemble(pl)
            for k, v in got.items():
                np.copyto(into[k], v, casting="no")
            return into
        n = pl.examples.size
        out = w.new(n) if into is None else into
        w.reset(out)
        out["example_ids"][:] = pl.examples
        out["epochs"][:] = -1
        out["epochs"][pl.rows] = pl.epochs
        out["valid"][:] = pl.valid
        out["components"][:] = 0 if pl.components is None else pl.components
        if pl.rows.size:
            if pl.pieces is not None:
                self._best_fit(pl, out)
            elif self.packed:
                self._packed(pl, out)
            else:
                self._unpacked(pl, out)
        if pl.rows.size < n:  # last: the walk may write scratch values there
            pad = np.flatnonzero(~pl.valid)
            w.pad(out, pad)
            out["components"][pad] = -1
        if self.segments is not None:
            self._varlen(pl, out)
        return out

    def _varlen(self, pl: Placement, out) -> None:
        """``cu_seqlens`` and ``max_seqlen`` of every row (reader.batch.schema): each valid row's pieces'
        ends, then its real tokens repeated; zeros for padding rows."""
        M = self.segments
        if pl.pieces is not None:
            counts, lengths = np.diff(pl.pieces.ptr), pl.pieces.lengths.astype(np.int64)
        else:  # unpacked: one piece per row
            counts, lengths = np.ones(pl.rows.size, np.int64), pl.lengths.astype(np.int64)
        if counts.size and int(counts.max()) > M:
            raise ValueError(f"a row of {int(counts.max())} pieces in a read of max_segments={M}")
        cu = np.zeros((pl.examples.size, M + 1), np.int64)
        top = np.zeros(pl.examples.size, np.int64)
        if lengths.size:
            head = np.cumsum(counts) - counts
            ends = np.cumsum(lengths)
            within = ends - np.repeat(ends[head] - lengths[head], counts)  # each piece's end in its row
            cu[np.repeat(pl.rows, counts), np.arange(lengths.size) - np.repeat(head, counts) + 1] = within
            np.maximum.accumulate(cu, axis=1, out=cu)
            top[pl.rows] = np.maximum.reduceat(lengths, head)
        out["cu_seqlens"][:] = cu
        out["max_seqlen"][:] = top

    def _packed(self, pl: Placement, out) -> None:
        L, w, store = self.L, self.writer, self.store
        # sort the rows into windows inside one row group (recs: (chunk, group, offset in group, row)),
        # over two row groups of one chunk (cross: (chunk, group, offset, tokens in the first, row)) and
        # the rest (slow: row numbers k); plain Python over the rows is cheaper than numpy per chunk here
        recs, cross, slow, runs = [], [], [], []
        rg_starts = self._rg_starts
        if len(rg_starts) > 4096:
            rg_starts.clear()
        for k, (c, o, m, r) in enumerate(zip(pl.chunks.tolist(), pl.starts.tolist(), pl.lengths.tolist(),
                                             pl.rows.tolist())):
            if m < L:
                slow.append(k)
                continue
            starts = rg_starts.get(c)
            if starts is None:
                starts = rg_starts[c] = store.meta(c).rg_token_starts_list
            g = bisect.bisect_right(starts, o) - 1
            e = o + L
            if e > starts[g + 1]:
                if g + 2 < len(starts) and e <= starts[g + 2]:
                    cross.append((c, g, o - starts[g], starts[g + 1] - o, r))
                else:
                    slow.append(k)
                continue
            recs.append((c, g, o - starts[g], r))
        if recs:
            recs.sort()
            arr = np.asarray(recs, dtype=np.int64)
            runs = window_runs(arr, L)
            groups = store.row_groups([(c, g) for c, g, *_ in runs])  # (sorted: recs are)
            w.copy_concat_windows(out, runs, groups)
            w.mark_documents(out, *doc_starts_in_windows(arr, groups, L))
        for c, g, a, la, r in cross:  # documents never span row groups: one starts at the boundary
            rg1, rg2 = store.row_group(c, g), store.row_group(c, g + 1)
            seq = np.concatenate([rg1.padded[a:a + la + 1], rg2.padded[1:1 + L - la]])
            pos = np.concatenate([rg1.positions_range(a, a + la), rg2.positions_range(0, L - la)])
            loss = None if rg1.loss is None else np.concatenate([rg1.loss[a + 1:a + 1 + la], rg2.loss[1:1 + L - la]])
            w.write_row(out, r, seq, pos, loss)
        for k in slow:
            pieces = pl.spill.get(k)
            if pieces is None:  # inside one chunk, over more than two row groups
                c, o = int(pl.chunks[k]), int(pl.starts[k])
                pieces = [(int(pl.epochs[k]), c, o, o + L)]
            w.write_row(out, int(pl.rows[k]), *self._gather(pieces))
        if self.on_windows is not None:
            self.on_windows(runs, cross)

    def _gather(self, pieces) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(seq, positions, loss flags)`` of a row made of ``pieces`` ``(epoch, chunk, lo, hi)`` (all of
        one cache): ``seq`` is the token before the first (0 at a document start), then the tokens; the
        flags are None without loss masks."""
        toks, poss, losses = [], [], []
        prev = 0
        for _, chunk, a, b in pieces:
            t, p = self.store.tokens(chunk, a, b)
            if not toks and p.size and p[0] > 0:
                prev = int(self.store.tokens(chunk, a - 1, a)[0][0])
            toks.append(t)
            poss.append(p)
            if self.masked:
                losses.append(self.store.loss_flags(chunk, a, b))
        loss = None if not losses or losses[0] is None else np.concatenate(losses)
        m = sum(t.size for t in toks)
        seq = np.empty(m + 1, np.int32)
        seq[0] = prev
        if m:
            np.concatenate(toks, out=seq[1:])
            return seq, np.concatenate(poss) if len(poss) > 1 else poss[0], loss
        return seq, np.zeros(0, np.int32), loss

    def _best_fit(self, pl: Placement, out) -> None:
        """Rows made of pieces of one chunk each (:class:`reader.order.placement.RowPieces`): every piece
        lies in one document, hence in one row group."""
        store, pc = self.store, pl.pieces
        counts = np.diff(pc.ptr)
        # each piece's row group, in one search: the read's chunks' row-group starts one after the other,
        # chunk i's raised by i << 40 (more tokens than a chunk holds); per-chunk numpy calls would cost
        # more than the few pieces of each chunk
        cs, rank = np.unique(pl.chunks, return_inverse=True)
        starts = [store.meta(c).rg_token_starts for c in cs.tolist()]
        first = np.cumsum([0] + [s.size for s in starts[:-1]])
        every = np.concatenate([s + (i << 40) for i, s in enumerate(starts)])
        rank = np.repeat(rank.reshape(-1), counts)
        key = (rank << 40) + pc.starts
        at = np.searchsorted(every, key, side="right") - 1
        group, local = at - first[rank], key - every[at]
        chunk = cs[rank]
        ukeys, inv = np.unique((chunk << 32) | group, return_inverse=True)  # (row groups per chunk < 2**32)
        keys = [(k >> 32, k & 0xFFFFFFFF) for k in ukeys.tolist()]
        groups = store.row_groups(keys)  # (sorted, as the mixture's store expects)
        self.writer.write_packed(out, pl.rows, pl.lengths, np.repeat(pl.rows, counts), pc.columns, local,
                                 pc.first_positions, pc.lengths, inv.reshape(-1),
                                 [groups[k].padded for k in keys], [groups[k].loss for k in keys])
        if self.on_windows is not None:  # rows of a chunk never go back before their earliest piece
            self.on_windows(keys, [])

    def _unpacked(self, pl: Placement, out) -> None:
        w, store = self.writer, self.store
        for c in np.unique(pl.chunks).tolist():
            mc = np.flatnonzero(pl.chunks == c)
            rg_starts = store.meta(c).rg_token_starts
            tokoff = pl.starts[mc]
            group = np.searchsorted(rg_starts, tokoff, side="right") - 1
            for g in np.unique(group).tolist():
                mg = mc[group == g]
                rg = store.row_group(c, g)
                w.write_pieces(out, pl.rows[mg], rg.padded, pl.starts[mg] - rg_starts[g],
                               pl.first_positions[mg], pl.lengths[mg], rg.loss)
