"""Unpacked examples: one document piece per example (a document of ``n`` tokens gives ``ceil(n/L)``).

How many unpacked examples a chunk yields depends on ``seq_len``, and the ledger only has token and
document counts; so the first unpacked reader for a ``seq_len`` reads the ``num_tokens`` column of
every chunk and stores one integer per chunk in ``ROOT/index/unpacked-L{seq_len}.json`` (with a
fingerprint of the chunk checksums) for later readers. Packed reading needs none of this.
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
from reader.order.pieces import pieces_per_doc, unpacked_examples_per_chunk

INDEX_DIR = "index"
_CUM_CACHE = 256  # chunks whose cumulative piece counts are kept


class UnpackedIndex:
    """Unpacked examples per chunk for one ``seq_len`` (:meth:`counts`), and where an example lies in its
    chunk (:meth:`locate`).

    Args:
      cache: the open cache.
      seq_len: L.
      index_cache: load and store the counts in ``ROOT/index/`` (when the cache is finished and writable).
    """

    def __init__(self, cache: Cache, seq_len: int, *, index_cache: bool = True):
        self.cache = cache
        self.seq_len = int(seq_len)
        self.index_cache = index_cache
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}  # chunk checksum -> unpacked examples
        self._cum: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    @property
    def index_file(self) -> str:
        return f"{INDEX_DIR}/unpacked-L{self.seq_len}.json"

    def counts(self, table: fmt.ChunkTable) -> np.ndarray:
        """Unpacked examples of every chunk of ``table`` (one int per chunk; see the module docstring)."""
        cache = self.cache
        fingerprint = hashlib.sha256("\n".join(table.checksums).encode()).hexdigest()
        rel = self.index_file
        if cache.complete and self.index_cache and not self._counts:
            try:
                got = fmt.load_json(cache.fs.cat_file(cache.path(rel)))
                if (got.get("fingerprint") == fingerprint and got.get("seq_len") == self.seq_len
                        and len(got.get("counts", ())) == len(table)):
                    counts = np.asarray(got["counts"], dtype=np.int64)
                    if not ((counts < 0) | (counts > table.tokens)).any():  # (else not ours: count again)
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
            body = fmt.dumps({"format": "chunkledger-unpacked-index", "seq_len": self.seq_len,
                              "fingerprint": fingerprint, "counts": counts.tolist()}).encode()
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
        return unpacked_examples_per_chunk(lengths, self.seq_len)

    def _pieces_cum(self, c: int, docs: DocIndex) -> np.ndarray:
        """Cumulative unpacked examples over chunk ``c``'s documents (a few recent chunks are kept)."""
        with self._lock:
            got = self._cum.get(c)
            if got is not None:
                self._cum.move_to_end(c)
                return got
        cum = np.concatenate([[0], np.cumsum(pieces_per_doc(docs.doc_lengths, self.seq_len))])
        with self._lock:
            self._cum[c] = cum
            while len(self._cum) > _CUM_CACHE:
                self._cum.popitem(last=False)
        return cum

    def locate(self, c: int, docs: DocIndex, offsets: np.ndarray):
        """Examples ``offsets`` of chunk ``c`` (whose documents are ``docs``): arrays ``(token offset in
        the chunk, position in its document of the first token, tokens)``."""
        cum = self._pieces_cum(c, docs)
        doc = np.searchsorted(cum, offsets, side="right") - 1
        start = (offsets - cum[doc]) * self.seq_len
        length = np.minimum(docs.doc_lengths[doc] - start, self.seq_len)
        return docs.doc_starts[doc] + start, start, length
