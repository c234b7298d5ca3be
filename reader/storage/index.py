"""Examples counted per chunk: unpacked examples (one document piece each: a document of ``n`` tokens
gives ``ceil(n/L)``) and best-fit rows (:mod:`reader.order.packing`, each chunk packed per window of
whole row groups).

How many such examples a chunk yields depends on ``seq_len``, and the ledger only has token and
document counts; so the first reader of a packing and ``seq_len`` reads the ``num_tokens`` column of every
chunk (and, for best fit, its row groups' document counts from the Parquet footer) and stores one
integer per chunk (best fit: also one per window) in ``ROOT/index/`` (with a fingerprint of the chunk
checksums) for later readers. Concatenated packed reading needs none of this.

Where an example lies in its chunk is :mod:`reader.order.placement`'s, from these counts.

``drop_long`` (``ReadOptions.drop_long``): documents longer than ``seq_len`` count as empty, so they
yield no example (windows stay those of the stored row groups); those counts live in an index file
whose name ends in ``-drop_long``, with the number of documents and tokens dropped per chunk.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import warnings
from typing import Any, Mapping

import numpy as np
import pyarrow.parquet as pq

from reader.format import spec as fmt
from reader.format import blocks
from reader.format import table as chunk_table
from reader.storage import files, remote
from reader.storage.cache import Cache
from reader.storage.pages import int_values
from reader.format.sidecar import arrow_message, size_mismatch
from reader.storage.validate import ChunkError
from reader.order.packing import WINDOW_TOKENS, count_best_fit_rows, window_docs
from reader.order.pieces import unpacked_examples_per_chunk

INDEX_DIR = "index"
INDEXED_PACKINGS = ("unpacked", "best_fit")  # the packings counted per chunk


_INDEX_FILE = re.compile(r"(unpacked|best_fit)-L(\d+)(?:-W(\d+))?(?:-C(\d+))?(?:-S(\d+))?(-drop_long)?(?:-V([0-9a-f]{16}))?\.(?:json|bin)")


def check_index_files(cache: Cache, views: Mapping[str, tuple[Any, Any]] | None = None) -> list[str]:
    """Problems of the reader's index files in ``ROOT/index/`` (``validate``): each file made for this cache
    is counted again from the chunks and must say the same (a file made for other chunks, or unreadable, is
    ignored by readers, who count again, and here). ``views``: ``{key: (view, cache as it sees it)}`` whose
    index files are checked too (:func:`reader.storage.views.check_view_files`)."""
    if not cache.complete:
        return []
    problems, views = [], views or {}
    for e in cache.storage.list(cache.path(INDEX_DIR)):
        name = e.path.rstrip("/").rsplit("/", 1)[-1]
        m = _INDEX_FILE.fullmatch(name)
        if m is None:
            continue
        packing, seq_len, window, cont, segs, drop, key = m.groups()
        if key is not None and key not in views:
            continue
        view, seen = views[key] if key is not None else (None, cache)
        table = seen.table  # (a view's: its kept counts)
        caps = {"continuations": int(cont or 1), "max_segments": int(segs) if segs else None} \
            if packing == "best_fit" else {}

        def index() -> ExampleIndex:
            return ExampleIndex(seen, int(seq_len), packing, index_cache=False, drop_long=bool(drop),
                                window_tokens=int(window) if window else WINDOW_TOKENS, view=view, **caps)

        said = index()
        rel = said.index_file
        if rel != f"{INDEX_DIR}/{name}":  # not a name this cache's readers use
            continue
        try:
            cache.storage.read(cache.path(rel), limit=said.file_limit(table))
        except files.UnsafeFile as err:
            problems.append(f"{cache.display(rel)}: not an index file ({err.what}); delete it (readers make it again)")
            continue
        if not said._load(table, said._fingerprint(table)):
            continue
        fresh = index()
        counts = fresh.counts(table)
        differ = [k for k, a, b in (("counts", said._examples, counts), ("windows", said._wrows, fresh._wrows),
                                    ("dropped", said._drop, fresh._drop))
                  if not np.array_equal(a, b) and (k != "windows" or packing == "best_fit")
                  and (k != "dropped" or fresh.drop_long)]
        if differ:
            bad = np.flatnonzero(said._examples != counts)
            where = (f" (chunk {bad[0]}: the file says {said._examples[bad[0]]}, its documents make {counts[bad[0]]})"
                     if bad.size else "")
            problems.append(f"{cache.display(rel)}: its {', '.join(differ)} differ from what the chunks make{where}: "
                            "the file was changed after it was written; delete it (readers make it again)")
    return problems


def chunk_columns(cache: Cache, table: fmt.ChunkTable, c: int, extra=(), metadata=None) -> tuple[list[int], np.ndarray, list]:
    """Chunk ``c``'s row groups' document counts, its ``num_tokens`` column (checked against ``table``) and the
    columns ``extra`` (pyarrow arrays; the children of a struct named ``struct.child`` come as one struct
    column), read from the Parquet file without its tokens. ``metadata``: its footer, parsed (a store's
    verified one), not read again."""
    rel = table.paths[c]
    try:
        with cache.storage.open(cache.path(rel)) as f:
            size = f.size if getattr(f, "size", None) is not None else cache.storage.size(cache.path(rel))
            if int(size) != int(table.nbytes[c]):
                raise ChunkError(f"{cache.display(rel)}: {size_mismatch(int(size), int(table.nbytes[c]))}. "
                                 "Rerun the build (delete this chunk and its .json sidecar first) or run "
                                 "`python -m reader validate`.")
            pf = pq.ParquetFile(f, metadata=metadata)
            rg_docs = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
            got = pf.read(columns=[fmt.LENGTH_COLUMN, *extra], use_threads=False)  # (callers run it on their threads)
            lengths = int_values(got.column(0))
            others = [got.column(i).combine_chunks() for i in range(1, got.num_columns)]
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
    return rg_docs, lengths, others


class ExampleIndex:
    """Examples per chunk of one packing for one ``seq_len`` (:meth:`counts`; best fit: also rows per window,
    :meth:`window_counts`).

    The counts are kept by chunk position (the known chunks are a prefix of the order that never changes: the
    cache raises if it does), as flat arrays: a million chunks cost a few arrays, not a million objects.

    Args:
      cache: the open cache.
      seq_len: L.
      packing: ``"unpacked"`` or ``"best_fit"`` (``ReadOptions.packing``).
      index_cache: load and store the counts in ``ROOT/index/`` (when the cache is finished and writable).
      window_tokens: best fit: the window target (``ReadOptions.best_fit_window_tokens``).
      drop_long: documents longer than ``seq_len`` yield no example (see the module docstring).
      continuations, max_segments: best fit: the continuation pieces and the pieces a row holds at most
        (:func:`reader.order.packing.best_fit_rows`; None: no cap).
      view: a :class:`reader.storage.views.View`: count its kept documents (``cache`` is then its
        :class:`reader.storage.views.ViewedCache`).
      threads: chunks counted at once.
    """

    def __init__(self, cache: Cache, seq_len: int, packing: str = "unpacked", *, index_cache: bool = True,
                 window_tokens: int = WINDOW_TOKENS, drop_long: bool = False, continuations: int = 1,
                 max_segments: int | None = None, view=None, threads: int = 8):
        if packing not in INDEXED_PACKINGS:
            raise ValueError(f"packing must be one of {INDEXED_PACKINGS}, got {packing!r}")
        self.cache = cache
        self.seq_len = int(seq_len)
        self.packing = packing
        self.window_tokens = int(window_tokens)
        self.index_cache = index_cache
        self.drop_long = bool(drop_long)
        self.caps = {"continuations": continuations, "max_segments": max_segments} if packing == "best_fit" else {}
        self.view = view
        self.threads = int(threads)
        self.counted = 0  # chunks the last counts() counted (not loaded)
        # chunks [0, n) counted: examples per chunk; best fit: rows per window (chunk c's windows are
        # wrows[wptr[c]:wptr[c+1]]); drop_long: (documents, tokens) dropped per chunk
        self._n = 0
        self._examples = np.zeros(0, np.int64)
        self._wptr = np.zeros(1, np.int64)
        self._wrows = np.zeros(0, np.int64)
        self._drop = np.zeros((0, 2), np.int64)

    @property
    def index_file(self) -> str:
        """``index/{packing}-L{L}[-W{W}][-C{continuations}][-S{max_segments}][-drop_long][-V{view}].json``: what the
        counts depend on besides the chunks (best fit: the window, and caps other than one continuation
        piece and no segment cap); ``.bin`` in the chunk table's block format for a cache of format version 4
        (:func:`write_index_file`), JSON for older ones."""
        name = f"{self.packing}-L{self.seq_len}"
        if self.packing == "best_fit":
            name += f"-W{self.window_tokens}"
            c, m = self.caps["continuations"], self.caps["max_segments"]
            name += f"-C{c}" * (c != 1) + f"-S{m}" * (m is not None)
        table = chunk_table.table_of(self.cache.table) is not None
        view = "" if self.view is None else f"-V{self.view.spec.key}"
        return f"{INDEX_DIR}/{name}{'-drop_long' * self.drop_long}{view}" + (".bin" if table else ".json")

    def file_limit(self, table: fmt.ChunkTable) -> int:
        """The most bytes the index file of ``table`` can hold: a count (and, with drop_long, two more) per
        chunk and, for best fit, one per window (at most one per row group: a row group's tokens or fewer
        per window of ``window_tokens``), each at most 21 characters."""
        per = 3 if self.drop_long else 1
        windows = (int(table.tokens.sum()) // max(1, self.window_tokens) + 2 * len(table)
                   if self.packing == "best_fit" else 0)
        return (1 << 16) + 24 * (per * len(table) + windows)

    def lengths(self, doc_lengths: np.ndarray) -> np.ndarray:
        """Document lengths as this read sees them: with ``drop_long``, a long document as empty."""
        return np.where(doc_lengths > self.seq_len, 0, doc_lengths) if self.drop_long else doc_lengths

    def dropped(self, table: fmt.ChunkTable) -> tuple[int, int]:
        """``(documents, tokens)`` that ``drop_long`` skips in the chunks of ``table`` (after :meth:`counts`)."""
        got = self._drop[:len(table)]
        return int(got[:, 0].sum()), int(got[:, 1].sum())

    def _set(self, examples: np.ndarray, windows: tuple[np.ndarray, np.ndarray] | None,
             dropped: np.ndarray | None) -> None:
        self._examples, self._n = examples, int(examples.size)
        if windows is not None:
            self._wptr, self._wrows = windows
        if dropped is not None:
            self._drop = dropped

    def _append(self, per: list[np.ndarray], dropped: list[tuple[int, int]]) -> None:
        """Chunks ``[n, n + len(per))`` counted: ``per`` each's examples (best fit: per window)."""
        if self.packing == "best_fit":
            sizes = np.asarray([w.size for w in per], np.int64)
            self._wptr = np.concatenate([self._wptr, self._wptr[-1] + np.cumsum(sizes)])
            self._wrows = np.concatenate([self._wrows, *per]) if per else self._wrows
        examples = np.asarray([int(w.sum()) for w in per], np.int64)
        self._examples = np.concatenate([self._examples, examples])
        self._drop = np.concatenate([self._drop, np.asarray(dropped, np.int64).reshape(-1, 2)])
        self._n += len(per)

    def _loaded(self, got: dict, table: fmt.ChunkTable) -> bool:
        """An index file's counts taken if they can be ours (shapes and ranges); False: count again. Best fit's
        ``windows``: ``(ptr, rows)``, chunk c's windows being ``rows[ptr[c]:ptr[c+1]]``."""
        counts = np.asarray(got["counts"], dtype=np.int64)
        if counts.shape != (len(table),) or ((counts < 0) | (counts > table.tokens)).any():
            return False
        dropped = None
        if self.drop_long:
            dropped = np.asarray(got["dropped"], dtype=np.int64)
            if dropped.shape != (len(table), 2) or (dropped < 0).any() or (dropped[:, 0] > table.docs).any() \
                    or (dropped[:, 1] > table.tokens).any():
                return False
        windows = None
        if self.packing == "best_fit":
            ptr, rows = (np.asarray(a, dtype=np.int64) for a in got["windows"])
            if got.get("window_tokens") != self.window_tokens or ptr.shape != (len(table) + 1,) or ptr[0] != 0 \
                    or (np.diff(ptr) < 0).any() or ptr[-1] != rows.size or (rows < 0).any():
                return False
            sums = np.concatenate([[0], np.cumsum(rows)])
            if not np.array_equal(sums[ptr[1:]] - sums[ptr[:-1]], counts):
                return False
            windows = (ptr, rows)
        self._set(counts, windows, dropped)
        return True

    def _fingerprint(self, table: fmt.ChunkTable) -> str:
        """What the counts belong to: :func:`reader.format.table.fingerprint`, or a view's (:meth:`reader.storage.views.View.fingerprint`)."""
        return chunk_table.fingerprint(table) if self.view is None else self.view.fingerprint(table)

    def _load(self, table: fmt.ChunkTable, fingerprint: str) -> bool:
        """The index file's counts, if it is there and ours (else count again)."""
        cache = self.cache
        try:
            raw = cache.storage.read(cache.path(self.index_file), limit=self.file_limit(table))
            if chunk_table.table_of(table) is not None:
                return self._load_blocks(raw, table, fingerprint)
            got = fmt.load_json(raw)
            if got.get("fingerprint") != fingerprint or got.get("seq_len") != self.seq_len:
                return False
            if self.packing == "best_fit":  # per chunk, its windows' rows
                w = [np.asarray(x, dtype=np.int64).reshape(-1) for x in got["windows"]]
                got["windows"] = (np.concatenate([[0], np.cumsum([x.size for x in w], dtype=np.int64)]),
                                  np.concatenate(w) if w else np.zeros(0, np.int64))
            return self._loaded(got, table)
        except (FileNotFoundError, ValueError, KeyError, TypeError, OverflowError, AttributeError, IndexError,
                fmt.FormatError, files.UnsafeFile):
            return False  # missing or not ours (a FIFO, a device, too large: refused unread): count again

    def _load_blocks(self, raw: bytes, table: fmt.ChunkTable, fingerprint: str) -> bool:
        head, data = blocks.read_parts(raw, self.cache.display(self.index_file))
        if (head.get("fingerprint"), head.get("seq_len"), head.get("kind")) != (fingerprint, self.seq_len, self.packing) \
                or head.get("drop_long") != self.drop_long or (self.packing == "best_fit" and (
                    head.get("window_tokens"), head.get("caps")) != (self.window_tokens, self.caps)):
            return False
        cols = data["chunks"]
        got = {"counts": cols["examples"], "window_tokens": head.get("window_tokens")}
        if self.drop_long:
            got["dropped"] = np.stack([cols["dropped_docs"], cols["dropped_tokens"]], axis=1)
        if self.packing == "best_fit":
            got["windows"] = (np.concatenate([[0], np.cumsum(cols["windows"])]), data["windows"]["rows"])
        return self._loaded(got, table)

    def counts(self, table: fmt.ChunkTable) -> np.ndarray:
        """Examples of every chunk of ``table`` (one int per chunk; see the module docstring)."""
        cache = self.cache
        if cache.complete and self.index_cache and not self._n:
            if self._load(table, self._fingerprint(table)):
                self.counted = 0
                return self._examples
        todo = range(self._n, len(table))
        self.counted = len(todo)
        if todo:
            with cf.ThreadPoolExecutor(self.threads) as pool:
                got = list(pool.map(lambda c: self._count(table, c), todo))
            self._append([g for g, _ in got], [d for _, d in got])
        counts = self._examples[:len(table)]
        if cache.complete and self.index_cache and todo:
            try:
                self._write(table)
            except files.UnsafeFile as e:  # a symlink planted in the cache: never written through
                warnings.warn(f"the reader's index file is not written: {e}", stacklevel=2)
            except Exception:  # read-only cache: keep the table in memory only
                pass
        return counts

    def _write(self, table: fmt.ChunkTable) -> None:
        """The index file of these counts (a concurrent reader sees the old or the new file)."""
        cache, n = self.cache, len(table)
        fingerprint = self._fingerprint(table)
        if chunk_table.table_of(table) is not None:
            body = write_index_file(self.packing, self.seq_len, fingerprint, self._examples[:n],
                                    window_tokens=self.window_tokens if self.packing == "best_fit" else None,
                                    windows=(self._wptr[:n + 1], self._wrows) if self.packing == "best_fit" else None,
                                    dropped=self._drop[:n] if self.drop_long else None, caps=self.caps)
        else:
            doc = {"format": f"chunkledger-{self.packing}-index", "seq_len": self.seq_len,
                   "fingerprint": fingerprint, "counts": self._examples[:n].tolist()}
            if self.packing == "best_fit":
                doc.update(window_tokens=self.window_tokens,
                           windows=[self._wrows[a:b].tolist() for a, b in zip(self._wptr[:n], self._wptr[1:n + 1])])
            if self.drop_long:  # per chunk: [documents, tokens] dropped
                doc["dropped"] = self._drop[:n].tolist()
            body = fmt.dumps(doc).encode()
        files.write(cache.storage, cache.path(self.index_file), body)

    def _count(self, table: fmt.ChunkTable, c: int) -> tuple[np.ndarray, tuple[int, int]]:
        """Chunk ``c``'s examples: ``[n]`` (unpacked), or its windows' rows (best fit); and the documents and
        tokens ``drop_long`` drops from it."""
        if int(table.docs[c]) == 0:
            return np.zeros(1 if self.packing == "unpacked" else 0, np.int64), (0, 0)
        if self.view is not None:  # the kept documents (``table`` holds the view's counts)
            rg_docs, lengths = self.view.chunk(c).kept()
            rg_docs = rg_docs.tolist()
        else:
            rg_docs, lengths, _ = chunk_columns(self.cache, table, c)
        # windows follow the stored row groups; drop_long empties long documents inside them
        bounds = window_docs(lengths, rg_docs, self.window_tokens).tolist() if self.packing == "best_fit" else None
        dropped = (0, 0)
        if self.drop_long:
            long = lengths > self.seq_len
            dropped = (int(long.sum()), int(lengths[long].sum()))
            lengths = self.lengths(lengths)
        if bounds is not None:
            return np.asarray([count_best_fit_rows(lengths[a:b], self.seq_len, **self.caps)
                               for a, b in zip(bounds[:-1], bounds[1:])], np.int64), dropped
        return np.asarray([unpacked_examples_per_chunk(lengths, self.seq_len)], np.int64), dropped

    def examples_of(self, c: int) -> int | None:
        """Chunk ``c``'s examples as counted (None: not counted)."""
        return int(self._examples[c]) if c < self._n else None

    def window_counts(self, c: int) -> np.ndarray:
        """Best fit: the rows of each of chunk ``c``'s windows, as counted."""
        if c >= self._n:  # (counts() runs before any read, for every known chunk)
            raise RuntimeError(f"chunk {c} was not counted")
        return self._wrows[self._wptr[c]:self._wptr[c + 1]]

    def mismatch(self, c: int, what: str) -> ChunkError:
        """The error for chunk ``c``'s documents disagreeing with these counts (``what``: how)."""
        cache = self.cache
        return ChunkError(f"{cache.display(cache.table.paths[c])}: {what}. Delete "
                          f"{cache.display(self.index_file)} (it is rebuilt) or run `python -m reader validate`.")


# -- index files of a version 4 cache: the chunk table's block format ---------------------------------


def write_index_file(packing: str, seq_len: int, fingerprint: str, examples: np.ndarray, *,
                     window_tokens: int | None = None, windows: tuple[np.ndarray, np.ndarray] | None = None,
                     dropped: np.ndarray | None = None, caps: Mapping[str, Any] | None = None) -> bytes:
    """The bytes of a version 4 cache's index file (:func:`reader.format.blocks.write_parts`): a header saying what
    the counts are of (``kind``: the packing, ``seq_len``, ``window_tokens``, best fit's ``caps``, ``drop_long``, the table's
    ``fingerprint``; the file's name says all but the fingerprint: :attr:`ExampleIndex.index_file`), then
    per chunk ``examples`` (best fit also ``windows``, drop_long ``dropped_docs`` and ``dropped_tokens``), and for
    best fit the ``rows`` of every window, chunk after chunk (``windows``: ``(ptr, rows)``)."""
    i64 = blocks.INT64
    parts = {"chunks": [("examples", i64, examples)]}
    if windows is not None:
        ptr, rows = windows
        parts["chunks"].append(("windows", i64, np.diff(ptr)))
        parts["windows"] = [("rows", i64, rows[:int(ptr[-1])])]
    if dropped is not None:
        parts["chunks"] += [("dropped_docs", i64, dropped[:, 0]), ("dropped_tokens", i64, dropped[:, 1])]
    head = {"format": f"chunkledger-{packing}-index", "kind": packing, "seq_len": seq_len, "window_tokens": window_tokens,
            "caps": dict(caps) if caps else None, "drop_long": dropped is not None, "fingerprint": fingerprint}
    return blocks.write_parts(head, parts, chunk_table.BLOCK_ROWS)
