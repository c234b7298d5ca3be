"""Examples counted per chunk: unpacked examples (one document piece each: a document of ``n`` tokens
gives ``ceil(n/L)``) and best-fit rows (:mod:`reader.order.packing`, each chunk packed on its own).

How many such examples a chunk yields depends on ``seq_len``, and the ledger only has token and
document counts; so the first reader of a kind and ``seq_len`` reads the ``num_tokens`` column of every
chunk and stores one integer per chunk in ``ROOT/index/{kind}-L{seq_len}.json`` (with a fingerprint of
the chunk checksums) for later readers. Concatenated packed reading needs none of this.

``drop_long`` (``ReadOptions.drop_long``): documents longer than ``seq_len`` count as empty, so they
yield no example; those counts live in ``ROOT/index/{kind}-L{seq_len}-drop_long.json``, with the number
of documents and tokens dropped per chunk.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import threading

import numpy as np
import pyarrow.parquet as pq

from reader.format import spec as fmt
from reader.storage import atomic, remote
from reader.storage.cache import Cache
from reader.storage.chunk import DocIndex
from reader.storage.pages import int_values
from reader.storage.validate import ChunkError, arrow_message, size_mismatch
from reader.order.packing import best_fit_rows, count_best_fit_rows
from reader.order.pieces import pieces_per_doc, unpacked_examples_per_chunk

INDEX_DIR = "index"
KINDS = ("unpacked", "best_fit")
_CUM_CACHE = 256  # chunks whose cumulative piece counts are kept
_ROWS_CACHE_BYTES = 64 << 20  # best-fit packings of recent chunks kept (about 30 bytes per piece)


class ChunkRows:
    """One chunk's best-fit rows, laid out for locating: row ``i`` holds pieces ``ptr[i]:ptr[i+1]``, piece
    ``k`` being ``length[k]`` tokens from token ``token[k]`` of the chunk, the first at position ``first[k]``
    of its document, written from column ``column[k]`` of the row."""

    __slots__ = ("ptr", "token", "first", "length", "column", "nbytes", "rows")

    def __init__(self, lengths: np.ndarray, doc_starts: np.ndarray, seq_len: int):
        rows = best_fit_rows(lengths, seq_len)
        self.ptr = rows.row_ptr
        self.rows = rows.num_rows
        self.token = doc_starts[rows.doc] + rows.start
        self.first = rows.start
        self.length = rows.length
        end = np.cumsum(rows.length, dtype=np.int64)
        row_of = np.repeat(np.arange(rows.num_rows), np.diff(rows.row_ptr))
        self.column = (end - rows.length - np.concatenate([[0], end])[rows.row_ptr[:-1]][row_of]).astype(np.int32)
        self.nbytes = sum(a.nbytes for a in (self.ptr, self.token, self.first, self.length, self.column))


class ExampleIndex:
    """Examples per chunk of one kind for one ``seq_len`` (:meth:`counts`), and where an example lies in
    its chunk (:meth:`locate` for unpacked examples, :meth:`rows` for best-fit rows).

    Args:
      cache: the open cache.
      seq_len: L.
      kind: ``"unpacked"`` or ``"best_fit"``.
      index_cache: load and store the counts in ``ROOT/index/`` (when the cache is finished and writable).
      drop_long: documents longer than ``seq_len`` yield no example (see the module docstring).
    """

    def __init__(self, cache: Cache, seq_len: int, kind: str = "unpacked", *, index_cache: bool = True,
                 drop_long: bool = False):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.cache = cache
        self.seq_len = int(seq_len)
        self.kind = kind
        self.index_cache = index_cache
        self.drop_long = bool(drop_long)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}  # chunk checksum -> examples
        self._dropped: dict[str, tuple[int, int]] = {}  # chunk checksum -> (documents, tokens) dropped
        self._cum: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._rows: collections.OrderedDict[int, ChunkRows] = collections.OrderedDict()
        self._rows_bytes = 0

    @property
    def index_file(self) -> str:
        return f"{INDEX_DIR}/{self.kind}-L{self.seq_len}{'-drop_long' * self.drop_long}.json"

    def lengths(self, doc_lengths: np.ndarray) -> np.ndarray:
        """Document lengths as this read sees them: with ``drop_long``, a long document as empty."""
        return np.where(doc_lengths > self.seq_len, 0, doc_lengths) if self.drop_long else doc_lengths

    def dropped(self, table: fmt.ChunkTable) -> tuple[int, int]:
        """``(documents, tokens)`` that ``drop_long`` skips in the chunks of ``table`` (after :meth:`counts`)."""
        got = [self._dropped.get(h, (0, 0)) for h in table.checksums]
        return sum(d for d, _ in got), sum(t for _, t in got)

    def counts(self, table: fmt.ChunkTable) -> np.ndarray:
        """Examples of every chunk of ``table`` (one int per chunk; see the module docstring)."""
        cache = self.cache
        fingerprint = hashlib.sha256("\n".join(table.checksums).encode()).hexdigest()
        rel = self.index_file
        if cache.complete and self.index_cache and not self._counts:
            try:
                got = fmt.load_json(cache.fs.cat_file(cache.path(rel)))
                if (got.get("fingerprint") == fingerprint and got.get("seq_len") == self.seq_len
                        and len(got.get("counts", ())) == len(table)):
                    counts = np.asarray(got["counts"], dtype=np.int64)
                    dropped = got["dropped"] if self.drop_long else None
                    if not ((counts < 0) | (counts > table.tokens)).any():  # (else not ours: count again)
                        if dropped is not None:
                            self._dropped.update(zip(table.checksums, map(tuple, dropped)))
                        return counts
            except (FileNotFoundError, ValueError, KeyError, TypeError, OverflowError):
                pass  # missing or not ours: count again
        todo = [c for c in range(len(table)) if table.checksums[c] not in self._counts]
        if todo:
            with cf.ThreadPoolExecutor(8) as pool:
                for c, n in zip(todo, pool.map(lambda c: self._count(table, c), todo)):
                    self._counts[table.checksums[c]] = n
        counts = np.asarray([self._counts[h] for h in table.checksums], dtype=np.int64)
        if cache.complete and self.index_cache and todo:
            entry = {"format": f"chunkledger-{self.kind}-index", "seq_len": self.seq_len,
                     "fingerprint": fingerprint, "counts": counts.tolist()}
            if self.drop_long:  # per chunk: [documents, tokens] dropped
                entry["dropped"] = [list(self._dropped.get(h, (0, 0))) for h in table.checksums]
            body = fmt.dumps(entry).encode()
            try:
                atomic.write(cache.fs, cache.path(rel), body)  # a concurrent reader sees the old or the new file
            except Exception:  # read-only cache: keep the table in memory only
                pass
        return counts

    def _count(self, table: fmt.ChunkTable, c: int) -> int:
        cache, rel = self.cache, table.paths[c]
        if int(table.docs[c]) == 0:
            return 0
        try:
            with cache.fs.open(cache.path(rel), "rb") as f:
                size = f.size if getattr(f, "size", None) is not None else cache.fs.size(cache.path(rel))
                if int(size) != int(table.nbytes[c]):
                    raise ChunkError(f"{cache.display(rel)}: {size_mismatch(int(size), int(table.nbytes[c]))}. "
                                     "Rerun the build (delete this chunk and its .json sidecar first) or run "
                                     "`python -m reader validate`.")
                lengths = int_values(pq.read_table(f, columns=[fmt.LENGTH_COLUMN]).column(0))
        except FileNotFoundError:
            raise ChunkError(f"{cache.display(rel)}: missing (listed in the ledger)") from None
        except ChunkError:
            raise
        except Exception as e:
            if remote.is_storage_error(e):
                raise remote.storage_error(cache.display(rel), e, anonymous=cache.anonymous) from e
            raise ChunkError(f"{cache.display(rel)}: cannot read its num_tokens column ({arrow_message(e)}); run "
                             "`python -m reader validate`") from e
        if lengths.size != int(table.docs[c]) or int(lengths.sum()) != int(table.tokens[c]):
            raise ChunkError(f"{cache.display(rel)}: {lengths.size} documents / {int(lengths.sum())} "
                             f"tokens, the ledger says {int(table.docs[c])} / {int(table.tokens[c])}")
        if self.drop_long:
            long = lengths > self.seq_len
            self._dropped[table.checksums[c]] = (int(long.sum()), int(lengths[long].sum()))
            lengths = self.lengths(lengths)
        if self.kind == "best_fit":
            return count_best_fit_rows(lengths, self.seq_len)
        return unpacked_examples_per_chunk(lengths, self.seq_len)

    def _pieces_cum(self, c: int, docs: DocIndex) -> np.ndarray:
        """Cumulative unpacked examples over chunk ``c``'s documents (a few recent chunks are kept)."""
        with self._lock:
            got = self._cum.get(c)
            if got is not None:
                self._cum.move_to_end(c)
                return got
        cum = np.concatenate([[0], np.cumsum(pieces_per_doc(self.lengths(docs.doc_lengths), self.seq_len))])
        with self._lock:
            self._cum[c] = cum
            while len(self._cum) > _CUM_CACHE:
                self._cum.popitem(last=False)
        return cum

    def locate(self, c: int, docs: DocIndex, offsets: np.ndarray):
        """Unpacked examples ``offsets`` of chunk ``c`` (whose documents are ``docs``): arrays ``(token offset in
        the chunk, position in its document of the first token, tokens)``."""
        cum = self._pieces_cum(c, docs)
        doc = np.searchsorted(cum, offsets, side="right") - 1
        start = (offsets - cum[doc]) * self.seq_len
        length = np.minimum(docs.doc_lengths[doc] - start, self.seq_len)
        return docs.doc_starts[doc] + start, start, length

    def chunk_rows(self, c: int, docs: DocIndex) -> ChunkRows:
        """Chunk ``c``'s best-fit rows (the packings of recent chunks are kept)."""
        with self._lock:
            got = self._rows.get(c)
            if got is not None:
                self._rows.move_to_end(c)
                return got
        got = ChunkRows(self.lengths(docs.doc_lengths), docs.doc_starts, self.seq_len)
        with self._lock:
            if c not in self._rows:
                self._rows[c] = got
                self._rows_bytes += got.nbytes
            while self._rows_bytes > _ROWS_CACHE_BYTES and len(self._rows) > 1:
                self._rows_bytes -= self._rows.popitem(last=False)[1].nbytes
        return got

    def rows(self, c: int, docs: DocIndex, offsets: np.ndarray):
        """Best-fit rows ``offsets`` of chunk ``c`` (whose documents are ``docs``): ``(pieces per row, token
        offset in the chunk, position in its document of the first token, tokens, column in the row)``,
        the last four per piece, row after row."""
        got = self.chunk_rows(c, docs)
        lo, hi = got.ptr[offsets], got.ptr[offsets + 1]
        n = hi - lo
        k = np.arange(int(n.sum()), dtype=np.int64) + np.repeat(lo - (np.cumsum(n) - n), n)
        return n, got.token[k], got.first[k], got.length[k], got.column[k]
