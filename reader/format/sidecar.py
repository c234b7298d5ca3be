"""A chunk's sidecar: its keys, how it is made, what the ledger takes from it, and the one check that a chunk's
files agree with it.

The sidecar ``chunk-KKKKKK.json`` (deterministic JSON, :func:`sidecar_bytes`; docs/FORMAT.md) is the chunk's
ledger entry without ``doc_offset``/``token_offset``/``sidecar_checksum``, plus the keys that let a reader
fetch row groups by byte range and verify each one before decoding it (:func:`row_group_index`):

* ``row_group_index``: ``[[offset, length, docs, tokens, "sha256:<hex>"], ...]``, one entry per Parquet
  row group: the byte range covering all its column chunks (contiguous, in order, starting at 4), its
  document and token counts, and the sha256 of those bytes;
* ``footer``: ``[offset, length, "sha256:<hex>"]``: the bytes from the end of the last row group to EOF
  (thrift FileMetaData + 4-byte length + ``PAR1``).

The finished ledger's chunk entry (:func:`ledger_entry`) is the sidecar minus :data:`SIDECAR_ONLY_KEYS` (the
ledger stays small) plus ``doc_offset``, ``token_offset`` and ``sidecar_checksum`` (sha256 of the sidecar
file's bytes), so that ledger -> sidecar -> footer and row groups is a chain of checksums.

"The files agree with the sidecar" is checked here (:class:`Layout`), at three depths: **open** (a reader
verifies the footer alone), **rerun** (the builder keeps a chunk an earlier run left: the whole file, its
loss tokens and dead letters) and **validate** (the whole file, then every row group decoded, in
``reader/storage/validate.py``). A :class:`Disagreement` says which file is at fault: the sidecar or the chunk.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reader.format import spec as fmt
from reader.format.checks import MAX_COUNT, is_int, load_json

# Every key a sidecar of this version holds; a sidecar missing one was written by older code. Besides them,
# ``row_range`` (columnar inputs only) and ``loss_tokens`` (caches with loss masks only).
SIDECAR_KEYS = ("path", "shard", "index_in_shard", "byte_range", "input_span", "input_checksum", "docs", "tokens",
                "bytes", "checksum", "row_groups", "row_group_index", "footer", "bad_records", "bad_reasons",
                "dead_letters", "dead_letters_checksum")
# Sidecar keys that the ledger does not copy (the ledger's sidecar_checksum covers them).
SIDECAR_ONLY_KEYS = ("row_group_index", "footer", "input_span", "input_checksum", "dead_letters_checksum")
# Ledger chunk-entry keys that the sidecar does not carry.
LEDGER_ONLY_KEYS = ("doc_offset", "token_offset", "sidecar_checksum")


def make_sidecar(*, shard: int, index_in_shard: int, byte_range: Sequence[int] | None, data: bytes,
                 row_group_index: list, footer: list, docs: int, tokens: int,
                 bad_reasons: Mapping[str, int] | None = None, dead_letters: str | None = None,
                 dead_letters_checksum: str | None = None, input_span: Sequence[int] | None = None,
                 input_checksum: str | None = None, row_range: Sequence[int] | None = None,
                 loss_tokens: int | None = None) -> dict[str, Any]:
    """The sidecar of a chunk: write it with :func:`sidecar_bytes` after the Parquet file.

    Args:
      shard, index_in_shard: the chunk's place (its path follows from them).
      byte_range: ``[lo, hi)`` of the uncompressed input shard the chunk covers (None for a columnar input).
      data: the chunk file's bytes (size and checksum).
      row_group_index, footer: from :func:`row_group_index` (``ChunkParquet.finish``).
      docs, tokens: counts in the chunk.
      bad_reasons: reason -> count of the dead-lettered lines of the range.
      dead_letters, dead_letters_checksum: relative path and checksum of the dead-letter file, if any.
      input_span, input_checksum: ``[start, end)`` of the input bytes the chunk was built from (its lines)
        and their checksum, which a rerun compares with the input to find chunks whose input changed
        (None for imported caches, which are not rebuilt from an input).
      row_range: ``[r0, r1)``, the rows of a columnar input the chunk covers (a ``row_range`` key; none
        for other inputs, whose sidecars stay as they were).
      loss_tokens: a masked cache's loss tokens in the chunk (``ChunkParquet.loss_tokens``); None for a
        plain cache (no key).
    """
    bad = dict(sorted((bad_reasons or {}).items()))
    extra = {} if row_range is None else {"row_range": [int(row_range[0]), int(row_range[1])]}
    if loss_tokens is not None:
        extra["loss_tokens"] = int(loss_tokens)
    return {
        "path": fmt.chunk_path(shard, index_in_shard),
        "shard": shard,
        "index_in_shard": index_in_shard,
        "byte_range": None if byte_range is None else [int(byte_range[0]), int(byte_range[1])],
        "docs": int(docs),
        "tokens": int(tokens),
        "bytes": len(data),
        "checksum": fmt.checksum(data),
        "row_groups": len(row_group_index),
        "row_group_index": row_group_index,
        "footer": footer,
        "bad_records": sum(bad.values()),
        "bad_reasons": bad,
        "dead_letters": dead_letters,
        "dead_letters_checksum": dead_letters_checksum,
        "input_span": None if input_span is None else [int(input_span[0]), int(input_span[1])],
        "input_checksum": input_checksum,
        **extra,
    }


def sidecar_bytes(sidecar: Mapping[str, Any]) -> bytes:
    """The bytes of a sidecar file (deterministic JSON)."""
    return fmt.dumps(sidecar).encode()


def ledger_entry(sidecar: Mapping[str, Any]) -> dict[str, Any]:
    """A finished ledger's chunk entry from its sidecar, before ``doc_offset``/``token_offset`` are added:
    the sidecar minus ``SIDECAR_ONLY_KEYS``, plus ``sidecar_checksum``."""
    entry = {k: v for k, v in sidecar.items() if k not in SIDECAR_ONLY_KEYS}
    entry["sidecar_checksum"] = fmt.checksum(sidecar_bytes(sidecar))
    return entry


def entry_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """What a sidecar and its ledger entry both hold (they must agree on it)."""
    return {k: v for k, v in d.items() if k not in SIDECAR_ONLY_KEYS and k not in LEDGER_ONLY_KEYS}


# --------------------------------------------------------------------------------------------------
# Row-group byte ranges (the keys "row_group_index" and "footer")


def _column_span(col) -> tuple[int, int]:
    """``(first byte, end)`` of a column chunk (its dictionary page, if any, comes first)."""
    start = col.data_page_offset
    if col.has_dictionary_page:
        d = col.dictionary_page_offset
        if d is not None and d < start:
            start = d
    return start, start + col.total_compressed_size


def row_group_ranges(meta) -> list[tuple[int, int]]:
    """``(offset, length)`` of each row group of a Parquet ``FileMetaData``: the span of its column chunks.
    (Every chunk is opened through this: each column's metadata is read once.)"""
    out = []
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        spans = [_column_span(rg.column(c)) for c in range(rg.num_columns)]
        lo = min(a for a, _ in spans)
        out.append((lo, max(b for _, b in spans) - lo))
    return out


def row_group_index(data: bytes | memoryview) -> tuple[list[list[Any]], list[Any]]:
    """``(row_group_index, footer)`` sidecar values of a chunk file's bytes (see the module docstring).

    Raises ``FormatError`` if the row groups are not contiguous and in order from byte 4 (what every
    chunkledger writer produces), or the ``ROW_GROUP_TOKENS_KEY`` metadata is missing or inconsistent.
    """
    view = memoryview(data)
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    kv = meta.metadata or {}
    if fmt.ROW_GROUP_TOKENS_KEY not in kv:
        raise fmt.FormatError(f"no {fmt.ROW_GROUP_TOKENS_KEY.decode()} key in the Parquet metadata")
    tokens = load_json(kv[fmt.ROW_GROUP_TOKENS_KEY])
    ranges = row_group_ranges(meta)
    if len(tokens) != len(ranges):
        raise fmt.FormatError(f"{len(ranges)} row groups but {len(tokens)} row-group token counts")
    index, pos = [], 4
    for g, (off, length) in enumerate(ranges):
        if off != pos:
            raise fmt.FormatError(f"row group {g} starts at byte {off}, expected {pos} (row groups must be "
                                  "contiguous and in order)")
        index.append([off, length, int(meta.row_group(g).num_rows), int(tokens[g]),
                      fmt.checksum(view[off:off + length])])
        pos = off + length
    footer = [pos, len(view) - pos, fmt.checksum(view[pos:])]
    return index, footer


# --------------------------------------------------------------------------------------------------
# The files agree with the sidecar


class Disagreement(ValueError):
    """A chunk's files disagree with its sidecar; ``sidecar`` is True when the sidecar is the damaged one,
    False when the chunk file is."""

    def __init__(self, what: str, sidecar: bool):
        super().__init__(what)
        self.sidecar = sidecar


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a sidecar says of its chunk file's bytes (the keys ``row_group_index`` and ``footer``), checked."""

    size: int  # the file's size
    index: list  # the sidecar's row_group_index
    ranges: np.ndarray  # int64 [G, 2]: (offset, length) of each row group
    docs: np.ndarray  # int64 [G]
    tokens: np.ndarray  # int64 [G]
    checksums: list  # sha256 of each row group's bytes
    footer: list  # [offset, length, sha256]

    @staticmethod
    def of(side: Mapping[str, Any], size: int, docs: int, tokens: int) -> "Layout | None":
        """The layout a sidecar gives a file of ``size`` bytes, ``docs`` documents and ``tokens`` tokens (the
        chunk's record: its ledger entry, or the sidecar's own counts); None for a sidecar written before
        sidecars had one. Its numbers must be in range, its row groups contiguous from byte 4, the footer
        must end the file, and the counts must add up to the record's."""
        if "row_group_index" not in side or "footer" not in side:
            return None
        if not all(is_int(v, 0, MAX_COUNT) for v in (size, docs, tokens)):
            raise Disagreement("malformed bytes, docs or tokens", sidecar=True)
        try:
            index, footer = side["row_group_index"], side["footer"]
            f_off, f_len = footer[0], footer[1]
            ranges = np.asarray([[int(e[0]), int(e[1])] for e in index], dtype=np.int64).reshape(-1, 2)
            rg_docs = np.asarray([int(e[2]) for e in index], dtype=np.int64)
            rg_tokens = np.asarray([int(e[3]) for e in index], dtype=np.int64)
            sums = [str(e[4]) for e in index]
            if not (is_int(f_off, 0, size) and is_int(f_len, 0, size)) or bool(
                    (ranges < 0).any() | (ranges > size).any() | (rg_docs < 0).any() | (rg_tokens < 0).any()
                    | (rg_docs > MAX_COUNT).any() | (rg_tokens > MAX_COUNT).any()):
                raise ValueError(f"numbers outside the {size}-byte file or the counts a chunk can hold")
            footer = [f_off, f_len, str(footer[2])]
        except (TypeError, ValueError, IndexError, KeyError, OverflowError) as e:
            raise Disagreement(f"malformed row_group_index/footer ({e})", sidecar=True) from None
        ends = np.concatenate([[4], ranges[:, 0] + ranges[:, 1]])
        if (not np.array_equal(ranges[:, 0], ends[:-1]) or int(ends[-1]) != f_off or f_off + f_len != size
                or int(rg_docs.sum()) != int(docs) or int(rg_tokens.sum()) != int(tokens)
                or side.get("row_groups", len(sums)) != len(sums)):
            raise Disagreement("row_group_index/footer inconsistent with the chunk's size, documents or tokens",
                               sidecar=True)
        return Layout(size, index, ranges, rg_docs, rg_tokens, sums, footer)

    def footer_meta(self, footer: bytes | memoryview):
        """The Parquet ``FileMetaData`` of the footer's bytes, checked against the sidecar: its sha256, and the
        row groups, their byte ranges, documents and tokens it lists."""
        off, _, want = self.footer
        if fmt.checksum(footer) != want:
            raise Disagreement(f"footer checksum mismatch (bytes [{off}, {self.size}))", sidecar=False)
        try:
            fm = pq.read_metadata(pa.BufferReader(footer))
            kv_tokens = load_json((fm.metadata or {})[fmt.ROW_GROUP_TOKENS_KEY])
            ok = (fm.num_row_groups == len(self.checksums) and kv_tokens == self.tokens.tolist()
                  and [fm.row_group(g).num_rows for g in range(fm.num_row_groups)] == self.docs.tolist()
                  and [list(r) for r in row_group_ranges(fm)] == self.ranges.tolist())
        except Exception as e:  # noqa: BLE001 - damaged metadata
            raise Disagreement(f"unreadable Parquet footer ({arrow_message(e)})", sidecar=False) from e
        if not ok:
            raise Disagreement("the Parquet footer disagrees with the sidecar's row_group_index", sidecar=False)
        return fm

    def check_file(self, data: bytes, want_checksum: str | None):
        """The whole file's bytes against the record (size and sha256 ``want_checksum``: where they differ,
        which row group or the footer; None: the caller has checked them) and against the sidecar (each row
        group's sha256, the footer as :meth:`footer_meta`). Returns the footer's ``FileMetaData``."""
        wrong = None if want_checksum is None else file_mismatch(data, self.size, want_checksum, self.index,
                                                                 self.footer)
        if wrong:
            raise Disagreement(wrong, sidecar=False)
        view = memoryview(data)
        try:  # the bytes are the recorded ones: any difference left is the sidecar's
            if any(fmt.checksum(view[a:a + n]) != s for (a, n), s in zip(self.ranges.tolist(), self.checksums)):
                raise Disagreement("row group checksums", sidecar=True)
            return self.footer_meta(view[self.footer[0]:])
        except Disagreement:
            raise Disagreement("its row_group_index/footer do not match the chunk file", sidecar=True) from None


def arrow_message(e: BaseException) -> str:
    """pyarrow's message without its placeholder for in-memory sources (``'<Buffer>'``), which names no
    file: callers put the file's name in front."""
    msg = str(e).replace("Could not open Parquet input source '<Buffer>': ", "")
    return msg.replace(" '<Buffer>'", "").strip() or type(e).__name__


def size_mismatch(size: int, want_bytes: int) -> str | None:
    """What a file of ``size`` bytes is, when ``want_bytes`` were recorded (None if they agree)."""
    if size < want_bytes:
        return f"truncated at {size:,} of {want_bytes:,} bytes"
    if size > want_bytes:
        return f"longer than recorded: {size:,} bytes, {want_bytes:,} recorded (appended to or replaced)"
    return None


def file_mismatch(data: bytes, want_bytes: int, want_checksum: str, index: list | None = None,
                  footer: list | None = None) -> str | None:
    """What is wrong with a chunk file's bytes, precisely, or None if size and sha256 match.

    Args:
      data: the file's bytes.
      want_bytes, want_checksum: its recorded size and sha256.
      index, footer: the sidecar's ``row_group_index`` and ``footer`` (trusted), to say which row group
        or whether the footer holds the damage; None to report only the whole-file mismatch.
    """
    n = len(data)
    if n != want_bytes:
        return size_mismatch(n, want_bytes)
    got = fmt.checksum(data)
    if got == want_checksum:
        return None
    where = []
    try:
        view = memoryview(data)
        for g, e in enumerate(index or []):
            off, length, want = int(e[0]), int(e[1]), str(e[4])
            if fmt.checksum(view[off:off + length]) != want:
                where.append(f"row group {g} of {len(index)} (bytes [{off:,}, {off + length:,}))")
        if footer:
            off = int(footer[0])
            if fmt.checksum(view[off:]) != str(footer[2]):
                where.append(f"the Parquet footer (bytes [{off:,}, {n:,}))")
        if index and int(index[0][0]) > 0 and bytes(view[:4]) != b"PAR1":
            where.append("the leading PAR1 magic (bytes [0, 4))")
    except (TypeError, ValueError, IndexError):
        where = []
    if where:
        return f"checksum mismatch in {' and '.join(where)}: the bytes there changed (bit flip or overwrite)"
    return f"checksum mismatch: the file's sha256 is {got}, the recorded one is {want_checksum}"


def loss_tokens(column) -> int:
    """The loss tokens of a ``loss_spans`` column (an Arrow list array, chunked or not): the lengths of its
    spans summed. A sidecar's ``loss_tokens`` is counted this way only."""
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    v = col.flatten().to_numpy().astype(np.int64)
    return int(v[1::2].sum() - v[0::2].sum())


def file_loss_tokens(data: bytes) -> int | None:
    """The loss tokens of a chunk file's ``loss_spans`` column, None without a readable one."""
    try:
        return loss_tokens(pq.read_table(pa.BufferReader(data), columns=[fmt.LOSS_COLUMN]).column(0))
    except (KeyError, ValueError, OSError, pa.ArrowException):
        return None


def dead_letters_problem(side: Mapping[str, Any], read: Callable[[str], bytes | None]) -> str | None:
    """What is wrong with a chunk's dead letters against its sidecar (the file's path, sha256 and line
    count), or None; ``read(rel)`` is a file's bytes, None if missing."""
    rel, bad = side.get("dead_letters"), side.get("bad_records")
    if rel is None:
        return None if bad == 0 and side.get("dead_letters_checksum") is None else \
            f"the sidecar counts {bad} bad records but names no dead-letter file"
    data = read(rel) if rel == fmt.dead_letter_path(side["shard"], side["index_in_shard"]) else None
    if data is None:
        return "dead-letter file missing"
    if fmt.checksum(data) != side.get("dead_letters_checksum"):
        return (f"dead-letter file changed: its sha256 is {fmt.checksum(data)}, the sidecar's dead_letters_checksum "
                f"{side.get('dead_letters_checksum')}")
    lines = data.count(b"\n")
    if lines != bad:
        return f"dead-letter file of {lines} lines, the sidecar counts {bad} bad records"
    return None
