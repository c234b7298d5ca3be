"""The batch schema: every key, dtype and shape of a batch, per layout, defined once.

The reader allocates its batches from here, reader workers size their shared memory from here, and
loaders (``reader.jax``, a PyTorch loader) name and type their fields from here. A batch of ``rows``
rows and ``seq_len`` = L tokens per row holds, in this key order:

* ``layout="arrays"``: the five ``[rows, L]`` token fields of :data:`TOKEN_FIELDS`, then the row
  fields;
* ``layout="flat"`` (packed only): one ``uint32 [rows, L+1]`` array ``tokens`` in seqax's
  flat-tokens encoding and two per-row ints (:data:`FLAT_FIELDS`, decoded by :func:`expand_flat`),
  then, for a cache with loss masks (or a mixture with one), ``loss_mask`` ``bool [rows, L]``, then,
  for best-fit rows that may hold several continuation pieces (``ReadOptions.best_fit_continuations``),
  the ``[rows, K]`` fields of :data:`CONTINUATION_FIELDS` (K: that many minus one), then the row fields;
* with ``ReadOptions(varlen=True)``, in either layout before the row fields, the varlen fields of
  :data:`VARLEN_FIELDS`: ``cu_seqlens`` ``int32 [rows, S + 1]`` (S = ``max_segments``) and ``max_seqlen``
  ``int32 [rows]``;
* the per-row fields of :data:`ROW_FIELDS`: ``example_ids``, ``epochs``, ``valid``, ``components``.

Varlen fields are per row, not per host-batch, so they shard with the rows and stay the same for any
number of readers; docs/FORMAT.md ("Reading order") defines them exactly, docs/READING.md (``varlen``) says
how a kernel takes them.

``components`` tells which cache of a mixture (:mod:`reader.mixture.mixture`) a row comes from; a single cache
is a mixture of one, so its rows say 0 (and padding rows -1, in both).

``loss_mask`` has one definition, :func:`loss_mask`: a real target token (not padding) and, in a cache
with loss masks (supervised records), a loss token of its document. A plain cache's documents are loss
tokens throughout.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from reader.options import LAYOUTS


@dataclasses.dataclass(frozen=True)
class Field:
    """One array of a batch.

    Attributes:
      name: its key in the batch dict.
      dtype: numpy dtype.
      columns: ``None`` for one value per row (shape ``[rows]``); an int: the row width as ``L + columns``
        (0: ``[rows, L]``; 1: ``[rows, L+1]``); a str: a width of the read's, ``"continuations"`` (the
        flat layout's continuation slots K) or ``"segments"`` (``max_segments + 1``).
      doc: what it holds.
    """

    name: str
    dtype: np.dtype
    columns: int | str | None
    doc: str

    def shape(self, rows: int, seq_len: int, continuations: int = 0, segments: int | None = None
              ) -> tuple[int, ...]:
        if self.columns is None:
            return (rows,)
        if self.columns == "continuations":
            return (rows, continuations)
        if self.columns == "segments":
            return (rows, (segments or 0) + 1)
        return (rows, seq_len + self.columns)


def _f(name, dtype, columns, doc) -> Field:
    return Field(name, np.dtype(dtype), columns, doc)


TOKEN_ARRAYS = (
    _f("inputs", np.int32, 0, "the previous token of the same document, 0 at a document start"),
    _f("targets", np.int32, 0, "the row's tokens"),
    _f("segment_ids", np.int32, 0, "1, 2, ... per document piece in the row; 0 at padding"),
    _f("positions", np.int32, 0, "position of each token in its document"),
    _f("loss_mask", np.bool_, 0, "True on real tokens that are loss tokens (every token of a plain cache), "
                                 "False on padding"),
)
FLAT_ARRAYS = (
    _f("tokens", np.uint32, 1, "columns 1..L: 2 * token + 1 where a document starts, else 2 * token; "
                               "column 0: 2 * the previous token of the same document, 0 at a start"),
    _f("first_positions", np.int32, None, "position in its document of the row's first token"),
    _f("num_tokens", np.int32, None, "real tokens in the row (L except at the end of an eval pass)"),
)
CONTINUATION_ARRAYS = (  # continuation pieces past column 0 of a flat row, in column order; unused: L, 0, 0
    _f("continuation_columns", np.int32, "continuations", "the piece's first column (L: no piece)"),
    _f("continuation_positions", np.int32, "continuations", "the position of that token in its document"),
    _f("continuation_inputs", np.int32, "continuations", "the token before it in its document (its input)"),
)
VARLEN_ARRAYS = (
    _f("cu_seqlens", np.int32, "segments", "0, then each piece's end column; past the row's pieces, its "
                                           "real tokens again"),
    _f("max_seqlen", np.int32, None, "the row's longest piece (0: no tokens)"),
)
ROW_ARRAYS = (
    _f("example_ids", np.int64, None, "global example index served in the row (-1: padding)"),
    _f("epochs", np.int64, None, "epoch of the row's first token (-1: padding)"),
    _f("valid", np.bool_, None, "False for the padding rows at the end of an eval pass"),
    _f("components", np.int32, None, "the row's component in a mixture (its index in the mixture file); "
                                     "0 for a single cache; -1: padding"),
)

TOKEN_FIELDS = tuple(f.name for f in TOKEN_ARRAYS)
FLAT_FIELDS = tuple(f.name for f in FLAT_ARRAYS)
CONTINUATION_FIELDS = tuple(f.name for f in CONTINUATION_ARRAYS)
VARLEN_FIELDS = tuple(f.name for f in VARLEN_ARRAYS)
ROW_FIELDS = tuple(f.name for f in ROW_ARRAYS)
BATCH_KEYS = TOKEN_FIELDS + ROW_FIELDS  # layout="arrays"
FLAT_KEYS = FLAT_FIELDS + ROW_FIELDS  # layout="flat"
FIELDS = {f.name: f for f in TOKEN_ARRAYS + FLAT_ARRAYS + CONTINUATION_ARRAYS + VARLEN_ARRAYS + ROW_ARRAYS}


MASK_FIELD = FIELDS["loss_mask"]  # the flat layout's per-token mask, for a cache with loss masks


def fields(layout: str, masked: bool = False, continuations: int = 0, segments: int | None = None
           ) -> tuple[Field, ...]:
    """The fields of a batch in ``layout``, in key order; ``masked``: of a cache (or a mixture with a
    component) with loss masks (the flat layout then has ``loss_mask`` too); ``continuations``: the flat
    layout's continuation slots (0: none); ``segments``: ``max_segments`` of a varlen read (None: none)."""
    varlen = VARLEN_ARRAYS if segments is not None else ()
    if layout == "arrays":
        return TOKEN_ARRAYS + varlen + ROW_ARRAYS
    if layout == "flat":
        return (FLAT_ARRAYS + (MASK_FIELD,) * bool(masked) + CONTINUATION_ARRAYS * bool(continuations) + varlen
                + ROW_ARRAYS)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def batch_spec(layout: str, seq_len: int, rows: int, masked: bool = False, continuations: int = 0,
               segments: int | None = None) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """``(key, dtype, shape)`` of every array of a batch of ``rows`` rows, in key order."""
    return [(f.name, f.dtype, f.shape(rows, seq_len, continuations, segments))
            for f in fields(layout, masked, continuations, segments)]


def empty_batch(layout: str, seq_len: int, rows: int, *, masked: bool = False, continuations: int = 0,
                segments: int | None = None) -> dict[str, np.ndarray]:
    """Uninitialized arrays of a batch (:func:`batch_spec`)."""
    return {k: np.empty(shape, d) for k, d, shape in batch_spec(layout, seq_len, rows, masked, continuations, segments)}


def loss_mask(real, stored=None):
    """The ``loss_mask`` rule, for numpy, jax.numpy and torch arrays alike: ``real`` (bool ``[B, L]``, a
    real target token) and, when the batch carries one (a cache with loss masks), the ``stored``
    per-token mask (the token is a loss token of its document)."""
    return real if stored is None else real & stored


def continuations(t, columns, positions, inputs, int32):
    """The continuation pieces past column 0 of flat rows, for :func:`expand_flat` in numpy, jax.numpy or
    torch alike (``int32``: that library's dtype). ``t``: the columns ``[1, L]``; ``columns``, ``positions``,
    ``inputs``: the ``continuation_*`` fields ``[B, K]`` (K is a few: ``[B, L, K]`` comparisons find them).
    Returns ``(at, input, first)``: where such a piece starts (bool ``[B, L]``; a segment starts there), its
    first input there (0 elsewhere), and a function of each token's segment start column ``last`` ``[B, L]``
    giving its segment's first position when that segment is such a piece (0 otherwise: a document start)."""
    hit = t[:, :, None] == columns[:, None, :]
    return (hit.any(2), (hit * inputs[:, None, :]).sum(2, dtype=int32),
            lambda last: ((last[:, :, None] == columns[:, None, :]) * positions[:, None, :]).sum(2, dtype=int32))


def expand_flat(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The ``layout="arrays"`` batch of a ``layout="flat"`` one: equal, array for array, to what the same
    reader returns with ``layout="arrays"``.

    ``tokens[:, 1:]`` are the window's tokens as ``2 * token + start`` (``start`` = 1 where a document
    begins); ``tokens[:, 0]`` is ``2 * previous token`` of the same document, or 0 when the window begins
    a document. ``first_positions`` is the first token's position in its document; ``num_tokens`` the
    real tokens of the row (``L`` except at the end of an eval pass and in padding rows).
    ``loss_mask`` (a cache with loss masks): which tokens are loss tokens; :func:`loss_mask` combines it
    with the real tokens. ``continuation_columns``, ``continuation_positions``, ``continuation_inputs``
    (best-fit rows of several continuation pieces): each piece past column 0 that continues a document
    (no start bit) begins a segment at that column, at that position, with that input; unused slots say
    column L. ``reader.jax.expand_flat`` and ``reader.torch.expand_flat`` are the same function in
    jax.numpy and torch.
    """
    tok = np.asarray(batch["tokens"], dtype=np.uint32)
    L = tok.shape[1] - 1
    start = (tok[:, 1:] & 1).astype(bool)
    t = np.arange(L, dtype=np.int32)
    real = t[None, :] < np.asarray(batch["num_tokens"])[:, None]
    targets = (tok[:, 1:] >> 1).astype(np.int32)
    inputs = (tok[:, :-1] >> 1).astype(np.int32)
    inputs[start] = 0
    # continuation pieces past column 0: a segment starts there, at their position, after their input
    none = np.zeros((tok.shape[0], 0), np.int32)
    cont, cont_inputs, seg_first = continuations(t[None, :], *(np.asarray(batch.get(f"continuation_{k}", none))
                                                               for k in ("columns", "positions", "inputs")), np.int32)
    inputs = np.where(cont, cont_inputs, inputs)
    boundary = start | cont
    segment_ids = np.cumsum(boundary, axis=1, dtype=np.int32)
    segment_ids += (~boundary[:, :1]).astype(np.int32)
    last = np.maximum.accumulate(np.where(boundary, t[None, :], -1), axis=1)
    first = np.asarray(batch["first_positions"], dtype=np.int32)[:, None]
    positions = np.where(last >= 0, t[None, :] - last + seg_first(last), first + t[None, :]).astype(np.int32)
    stored = np.asarray(batch["loss_mask"], dtype=bool) if "loss_mask" in batch else None
    out = {"inputs": inputs, "targets": targets, "segment_ids": segment_ids, "positions": positions,
           "loss_mask": loss_mask(real, stored)}
    for k in ("inputs", "targets", "segment_ids", "positions"):
        out[k][~real] = 0
    for k in VARLEN_FIELDS + ROW_FIELDS:
        if k in batch:
            out[k] = np.asarray(batch[k]).copy()
    return out
