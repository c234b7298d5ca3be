"""One chunk: its verified layout (:class:`ChunkMeta`, opened from the sidecar and the Parquet footer)
and its decoded row groups (:class:`RowGroup`), as the store keeps them.

Opening a chunk reads two small pieces: its sidecar (verified against the finished ledger's
``sidecar_checksum``; during a build the sidecar is what the writer published atomically after the
Parquet file) and the Parquet footer byte range it names (verified against its sha256, then parsed for
the column-chunk offsets and cross-checked with the sidecar's ``row_group_index``). A sidecar written
before sidecars carried the row-group index makes the chunk be fetched whole and checked whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from reader.format import spec as fmt
from reader.format.sidecar import Disagreement, Layout, row_group_index, size_mismatch
from reader.storage.cache import Cache
from reader.storage.validate import chunk_error, parse_chunk


@dataclasses.dataclass(frozen=True)
class ChunkMeta:
    """One chunk's verified layout: row-group byte ranges, checksums, counts and Parquet footer metadata."""

    index: int  # global chunk index
    path: str  # relative path
    rg_ranges: np.ndarray  # int64 [G, 2]: (offset, length) of each row group in the file
    rg_checksums: list  # sha256 of each row group's bytes
    rg_token_starts: np.ndarray  # int64 [G+1]: token offset of each row group inside the chunk
    rg_doc_starts: np.ndarray  # int64 [G+1]: document offset of each row group
    file_meta: Any  # pyarrow FileMetaData (parsed from the verified footer)
    footer: tuple  # (offset, bytes) of the footer
    nbytes_file: int
    data: bytes | None = None  # whole file: only for chunks whose sidecar has no row-group index
    # a view's reads (reader.storage.views.viewed_meta): the offsets above count kept documents; ``keep`` says
    # which stored documents are kept, ``stored`` holds the stored (rg_token_starts, rg_doc_starts)
    keep: np.ndarray | None = None
    stored: tuple | None = None

    @property
    def num_row_groups(self) -> int:
        return len(self.rg_checksums)

    @property
    def nbytes(self) -> int:
        return (len(self.footer[1]) + 100 * self.num_row_groups + 512
                + (len(self.data) if self.data is not None else 0) + (self.keep.size * 9 if self.keep is not None else 0))

    @property
    def rg_token_starts_list(self) -> list[int]:
        got = self.__dict__.get("_rg_list")
        if got is None:
            got = self.rg_token_starts.tolist()
            object.__setattr__(self, "_rg_list", got)
        return got


@dataclasses.dataclass(frozen=True)
class DocIndex:
    """Document lengths of a whole chunk (from its decoded row groups; unpacked reads need them)."""

    doc_lengths: np.ndarray  # int64 [docs]
    doc_starts: np.ndarray  # int64 [docs+1]: token offset of each document inside the chunk

    @property
    def nbytes(self) -> int:
        return self.doc_lengths.nbytes + self.doc_starts.nbytes


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """A decoded row group, laid out for vectorized window gathers.

    ``padded[1:]`` are the row group's tokens (its documents concatenated) and ``padded[0] == 0``, so that
    ``padded[t]`` is the token before token ``t`` (the previous-token input of flat-tokens packing) with no
    special case at the row group start. Positions within documents are not stored (4 bytes per token
    decoded, not 8): readers derive them from ``doc_starts`` for the windows they serve
    (:meth:`positions_range`). A masked cache's row group also has ``loss``, laid out like ``padded``
    (``loss[1 + t]``: token ``t`` is a loss token; 1 byte per token).
    """

    padded: np.ndarray  # int32 [n+1]
    doc_starts: np.ndarray  # int64 [docs+1], token offsets relative to the row group start
    loss: np.ndarray | None = None  # bool [n+1], loss[0] == False; None: a cache without loss masks

    @property
    def tokens(self) -> np.ndarray:
        return self.padded[1:]

    @property
    def positions(self) -> np.ndarray:
        """int32 [n]: each token's position within its document (computed on demand, not kept)."""
        return self.positions_range(0, self.padded.size - 1)

    def positions_range(self, lo: int, hi: int) -> np.ndarray:
        """int32 [hi - lo]: positions within their documents of tokens ``[lo, hi)``."""
        ds = self.doc_starts
        k0 = int(np.searchsorted(ds, lo, side="right")) - 1
        k1 = int(np.searchsorted(ds, hi, side="left"))
        bounds = np.concatenate([[lo], ds[k0 + 1:k1], [hi]])
        base = np.concatenate([[ds[k0]], ds[k0 + 1:k1]]) - lo
        return (np.arange(hi - lo, dtype=np.int64) - np.repeat(base, np.diff(bounds))).astype(np.int32)

    @property
    def nbytes(self) -> int:
        return self.padded.nbytes + self.doc_starts.nbytes + (self.loss.nbytes if self.loss is not None else 0)


def open_chunk(cache: Cache, index: int, fetch: Callable[..., bytes], tally: Callable[..., None]):
    """Chunk ``index``'s verified :class:`ChunkMeta` and its size in memory, from its sidecar and footer.

    ``fetch(rel, start=None, end=None)`` returns a file's bytes (a range of them); ``tally(index, nbytes,
    data=...)`` counts each fetch (see ``ChunkStore``). The sidecar is read with ``cache.cat``.
    """
    steps = open_chunk_steps(cache, index, tally)
    want = next(steps)
    while True:
        try:
            got = cache.cat(want[1]) if want[0] == SIDECAR else fetch(*want[1:])
        except Exception as e:  # noqa: BLE001 - the steps decide what a failed read means
            want = steps.throw(e)
        else:
            try:
                want = steps.send(got)
            except StopIteration as done:
                return done.value


SIDECAR = "sidecar"  # what open_chunk_steps asks for: (SIDECAR, rel), or (RANGE, rel, start, end) / (RANGE, rel)
RANGE = "range"


def open_chunk_steps(cache: Cache, index: int, tally: Callable[..., None]):
    """:func:`open_chunk` as a generator that does no I/O itself: it yields what it needs read, ``(SIDECAR,
    rel)`` (a whole sidecar; a missing one is thrown in as ``FileNotFoundError``) or ``(RANGE, rel, start,
    end)`` (bytes of a chunk file, as ``fetch`` reads them; ``(RANGE, rel)``: the whole file), is sent the
    bytes (or thrown the read's error), and returns ``(ChunkMeta, size in memory)``. A blocking caller
    (:func:`open_chunk`) and an asynchronous one (``ChunkStore``, many chunks opened at once) drive it."""
    t = cache.table
    rel = t.paths[index]
    side_rel = fmt.sidecar_path(int(t.shard[index]), int(t.index_in_shard[index]))
    # the checksums before the first request: a version 4 table fetches a block of them when first asked,
    # blocking I/O that must not run on the event loop the asynchronous caller's later steps run on
    want, checksum = (t.sidecar_checksums[index] if t.sidecar_checksums is not None else None), t.checksums[index]
    try:
        raw = yield SIDECAR, side_rel
    except FileNotFoundError:
        raise chunk_error(cache, side_rel, "sidecar missing") from None
    tally(index, len(raw), data=False)
    if want is not None and fmt.checksum(raw) != want:
        raise chunk_error(cache, side_rel, f"sidecar checksum mismatch: file has {fmt.checksum(raw)}, the ledger "
                          f"says {want}")
    try:
        side = fmt.load_json(raw)
    except ValueError as e:
        raise chunk_error(cache, side_rel, f"sidecar is not valid JSON ({e})") from None
    if not isinstance(side, dict):
        raise chunk_error(cache, side_rel, "sidecar is not a JSON object")
    for key, got, exp in (("path", side.get("path"), rel), ("checksum", side.get("checksum"), checksum),
                          ("bytes", side.get("bytes"), int(t.nbytes[index])),
                          ("docs", side.get("docs"), int(t.docs[index])),
                          ("tokens", side.get("tokens"), int(t.tokens[index]))):
        if got != exp:
            raise chunk_error(cache, side_rel, f"sidecar {key} is {got!r}, {fmt.LEDGER_NAME} says {exp!r} (one of the "
                              "two was changed after the build; `python -m reader validate` tells which)")
    size = int(t.nbytes[index])
    try:
        lay = Layout.of(side, size, int(t.docs[index]), int(t.tokens[index]))
    except Disagreement as e:
        raise chunk_error(cache, side_rel if e.sidecar else rel, str(e)) from None
    if lay is None:
        return (yield from _open_whole(cache, index, tally))
    f_off, f_len, _ = lay.footer
    # one byte past the recorded end: a file longer than recorded shows up here, at no extra request
    footer = yield RANGE, rel, f_off, f_off + f_len + 1
    tally(index, len(footer), data=None)
    if len(footer) != f_len:
        raise chunk_error(cache, rel, _size_problem(cache, rel, size, f_off, f_len, len(footer)))
    try:
        fm = lay.footer_meta(footer)
    except Disagreement as e:
        raise chunk_error(cache, side_rel if e.sidecar else rel, str(e)) from None
    m = ChunkMeta(index, rel, lay.ranges, lay.checksums, np.concatenate([[0], np.cumsum(lay.tokens)]),
                  np.concatenate([[0], np.cumsum(lay.docs)]), fm, (f_off, footer), size)
    return m, m.nbytes


def _size_problem(cache: Cache, rel: str, size: int, f_off: int, f_len: int, got: int) -> str:
    """A short or long read of the footer: the file's real size (one more request, on this error path only)."""
    try:
        actual = cache.storage.size(cache.path(rel))
    except Exception:  # noqa: BLE001 - the size is a detail of the message
        actual = f_off + got if 0 < got < f_len else None
    if actual is not None and actual != size:
        return size_mismatch(actual, size)
    kind = "truncated" if got < f_len else "longer than recorded"
    return f"{kind}: the footer at bytes [{f_off}, {f_off + f_len}) of a {size}-byte file read {got} bytes"


def _open_whole(cache: Cache, index: int, tally):
    """A chunk whose sidecar predates the row-group index: fetch it whole, verify, index it here."""
    rel = cache.table.paths[index]
    data = yield RANGE, rel
    tally(index, len(data), data=True)
    w = parse_chunk(cache, index, data)
    rg_index, footer = row_group_index(data)
    rg_ranges = np.asarray([e[:2] for e in rg_index], dtype=np.int64).reshape(-1, 2)
    m = ChunkMeta(index, rel, rg_ranges, [e[4] for e in rg_index], w.rg_token_starts, w.rg_doc_starts,
                  w.file_meta, (footer[0], data[footer[0]:]), len(data), data)
    return m, m.nbytes
