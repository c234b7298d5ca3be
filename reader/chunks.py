"""Chunk data: fetch only the needed row groups by byte range, verify each, decode it, keep it in an LRU.

A chunk is opened from three small pieces: its sidecar (verified against the finished ledger's
``sidecar_checksum``; during a build the sidecar is what the writer published atomically after the
Parquet file), the Parquet footer byte range named by the sidecar (verified against its sha256, then
parsed for the column-chunk offsets) and the sidecar's ``row_group_index``. A row group is then one
``fs.cat_file(path, start, end)`` of its byte range, whose sha256 is compared with the sidecar BEFORE
anything is decoded: a truncated or corrupted chunk raises :class:`ChunkError` naming the file and the
row group, and no wrong token is ever returned. Decoded row groups are flat ``int32`` token arrays plus
document starts (4 bytes per token); they, and the small per-chunk metadata, count against
``memory_budget_bytes`` (fetched bytes are not kept). Concurrent requests for the same item (the
prefetch threads and the caller) share one load. A sidecar written before sidecars carried the
row-group index makes the store fetch that chunk whole and check the whole-file checksum instead.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import io
import itertools
import json
import os
import sys
import threading
import weakref
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import format as fmt
from .cache import Cache


def int_values(column, dtype=np.int32) -> np.ndarray:
    """A non-null integer Arrow (chunked) array as numpy, without ``to_numpy`` (which imports pandas)."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if arr.null_count:
        raise ValueError("unexpected nulls")
    width = np.dtype(dtype).itemsize
    if arr.type.bit_width != 8 * width:
        raise ValueError(f"expected {dtype}, got {arr.type}")
    if len(arr) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * width)


class ChunkError(fmt.FormatError):
    """A chunk file is missing, truncated, corrupted, or does not match its ledger entry."""


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

    @property
    def num_row_groups(self) -> int:
        return len(self.rg_checksums)

    @property
    def nbytes(self) -> int:
        return (len(self.footer[1]) + 100 * self.num_row_groups + 512
                + (len(self.data) if self.data is not None else 0))

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
class WholeChunk:
    """A chunk file fetched whole and verified against the ledger (``validate`` and old sidecars)."""

    index: int
    path: str
    data: bytes
    rg_token_starts: np.ndarray
    rg_doc_starts: np.ndarray
    doc_lengths: np.ndarray
    doc_starts: np.ndarray
    file_meta: Any = None


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """A decoded row group, laid out for vectorized window gathers.

    ``padded[1:]`` are the row group's tokens (its documents concatenated) and ``padded[0] == 0``, so that
    ``padded[t]`` is the token before token ``t`` (the previous-token input of flat-tokens packing) with no
    special case at the row group start. Positions within documents are not stored (4 bytes per token
    decoded, not 8): readers derive them from ``doc_starts`` for the windows they serve
    (:meth:`positions_range`).
    """

    padded: np.ndarray  # int32 [n+1]
    doc_starts: np.ndarray  # int64 [docs+1], token offsets relative to the row group start
    buf: np.ndarray | None = None  # the store's reusable buffer that ``padded`` is a view of, if any

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
        return (self.buf if self.buf is not None else self.padded).nbytes + self.doc_starts.nbytes


def _error(cache: Cache, rel: str, what: str) -> ChunkError:
    return ChunkError(
        f"{cache.display(rel)}: {what}. The file does not match the ledger; no tokens were returned from "
        "it. Rerun the build command that made this cache (it rewrites missing chunks; delete a damaged "
        "chunk and its .json sidecar first), or run `python -m reader validate` to list every problem."
    )


def parse_chunk(cache: Cache, index: int, data: bytes, entry: dict[str, Any] | None = None) -> WholeChunk:
    """Verify ``data`` (the bytes of global chunk ``index``) against the ledger and read its layout."""
    t = cache.table
    rel = t.paths[index]
    want_bytes = int(t.nbytes[index])
    if len(data) != want_bytes:
        kind = "truncated" if len(data) < want_bytes else "longer than recorded"
        raise _error(cache, rel, f"{kind}: {len(data)} bytes, the ledger says {want_bytes}")
    got = fmt.checksum(data)
    if got != t.checksums[index]:
        raise _error(cache, rel, f"checksum mismatch: file has {got}, the ledger says {t.checksums[index]}")
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        kv = pf.metadata.metadata or {}
        rg_tokens = json.loads(kv[fmt.ROW_GROUP_TOKENS_KEY])
        lengths = int_values(pf.read(columns=[fmt.LENGTH_COLUMN], use_threads=False).column(0)).astype(np.int64)
        rg_rows = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
    except KeyError:
        raise _error(cache, rel, f"no {fmt.ROW_GROUP_TOKENS_KEY.decode()} key in the Parquet metadata") from None
    except Exception as e:  # pyarrow raises several types for damaged files
        raise _error(cache, rel, f"not a readable Parquet chunk ({e})") from e
    if len(rg_tokens) != len(rg_rows):
        raise _error(cache, rel, f"{len(rg_rows)} row groups but {len(rg_tokens)} row-group token counts")
    if lengths.size != int(t.docs[index]) or int(lengths.sum()) != int(t.tokens[index]):
        raise _error(cache, rel, f"{lengths.size} documents / {int(lengths.sum())} tokens, the ledger says "
                                 f"{int(t.docs[index])} / {int(t.tokens[index])}")
    rg_doc_starts = np.concatenate([[0], np.cumsum(rg_rows, dtype=np.int64)])
    doc_starts = np.concatenate([[0], np.cumsum(lengths)])
    rg_token_starts = np.concatenate([[0], np.cumsum(np.asarray(rg_tokens, dtype=np.int64))])
    if not np.array_equal(doc_starts[rg_doc_starts], rg_token_starts):
        raise _error(cache, rel, "row-group token counts disagree with the num_tokens column")
    return WholeChunk(index, rel, data, rg_token_starts, rg_doc_starts, lengths, doc_starts, pf.metadata)


class _RangeFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only some verified ranges are held, for pyarrow's
    reader (the fallback decoder); reading anywhere else is an error, never zeros."""

    def __init__(self, size: int, pieces: list[tuple[int, bytes]]):
        super().__init__()
        self._size, self._pieces, self._pos = size, pieces, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else (self._pos + offset if whence == 1 else self._size + offset)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self._size - self._pos
        for off, buf in self._pieces:
            if off <= self._pos and self._pos + n <= off + len(buf):
                out = buf[self._pos - off:self._pos - off + n]
                self._pos += n
                return bytes(out)
        raise OSError(f"read of bytes [{self._pos}, {self._pos + n}) outside the verified ranges")

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


_MAX_OPEN_FILES = 64
_MAX_RETIRED = 64  # row groups kept for their buffers after leaving the cache, even with the cache full
_RETIRED_SCAN = 16  # retired buffers of a size looked at per decode (those still referred to are skipped)
_BUFFER_STEP = 16384  # decode buffers are sized in steps of 64 KiB, so similar row groups share them


def _shutdown(pool: cf.ThreadPoolExecutor, files: dict, lock: threading.Lock) -> None:
    pool.shutdown(wait=False, cancel_futures=True)
    with lock:
        for f in files.values():
            f.close()
        files.clear()


class ChunkStore:
    """Verified, decoded row groups (and per-chunk layouts) in an LRU bounded by ``memory_budget_bytes``."""

    def __init__(self, cache: Cache, *, memory_budget_bytes: int = 1 << 30, threads: int = 2):
        self.cache = cache
        self.budget = int(memory_budget_bytes)
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[Any, tuple[Any, int]] = collections.OrderedDict()
        self._inflight: dict[Any, cf.Future] = {}
        self._used = 0
        self.opened: set[int] = set()  # global indices of chunks whose metadata or data were fetched
        self.fetches = 0  # row-group byte ranges (or whole legacy files) fetched; again after eviction
        self.meta_fetches = 0  # chunks opened (sidecar + footer); again after eviction
        self.bytes_fetched = 0  # every byte fetched: sidecars, footers, row groups
        self.decodes = 0  # row groups decoded
        self.fast_decode = True  # PLAIN pages: decompress and take the values (see fast_token_values)
        # Decoded row groups that left the cache (evicted, or released by a read that has passed them:
        # sequential reads row group by row group, shuffled reads mixing group by mixing group): their
        # buffers are reused for new decodes once nothing refers to them any more, so a
        # long read writes into memory that is already mapped instead of faulting in fresh pages.
        # By buffer size (entries), oldest first. Up to _MAX_RETIRED are kept whatever the cache holds, more
        # while the cache and they together stay within the budget (a read that releases what it has
        # passed, e.g. a shuffled read at the end of a mixing group, keeps the cache well below it).
        self._retired: dict[int, collections.OrderedDict[int, RowGroup]] = {}
        self._retired_count = 0
        self._retired_bytes = 0
        self.fresh_buffers = 0  # decode buffers allocated (the rest were reused)
        self._pool = cf.ThreadPoolExecutor(max(1, threads), thread_name_prefix="chunkledger-prefetch")
        # Local caches: byte ranges are os.pread() calls on descriptors kept open (fsspec opens the file
        # for every range, which costs as much as reading a row group). Other filesystems use fsspec.
        self._files: collections.OrderedDict[str, io.FileIO] = collections.OrderedDict()
        self._local = cache.is_local
        # a store dropped without close() still stops its threads and closes its files
        self._closer = weakref.finalize(self, _shutdown, self._pool, self._files, self._lock)

    def close(self) -> None:
        self._closer()

    # -- LRU ------------------------------------------------------------------------------------------
    def _get(self, key: Any, load: Callable[[], tuple[Any, int]], wait: bool = True) -> Any:
        """The cached value of ``key``, else ``load()`` it (once, whoever asks meanwhile waits for it);
        ``wait=False``: return None instead of waiting for a load another thread runs."""
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                return hit[0]
            fut = self._inflight.get(key)
            owner = fut is None
            if owner:
                fut = cf.Future()
                self._inflight[key] = fut
        if not owner:
            return fut.result() if wait else None
        try:
            value, nbytes = load()
        except BaseException as e:
            with self._lock:
                del self._inflight[key]
            fut.set_exception(e)
            raise
        with self._lock:
            del self._inflight[key]
            self._lru[key] = (value, nbytes)
            self._used += nbytes
            while self._used > self.budget and len(self._lru) > 1:
                _, (old, n) = self._lru.popitem(last=False)
                self._used -= n
                self._retire(old)
            self._trim_retired()
        fut.set_result(value)
        return value

    @property
    def used_bytes(self) -> int:
        return self._used

    def _retire(self, value: Any) -> None:
        """Keep an evicted or released row group's buffer for reuse (lock held; see _trim_retired)."""
        if isinstance(value, RowGroup) and value.buf is not None:
            self._retired.setdefault(value.buf.size, collections.OrderedDict())[id(value)] = value
            self._retired_count += 1
            self._retired_bytes += value.buf.nbytes

    def _trim_retired(self) -> None:
        """Forget retired buffers (oldest of the most common size first) beyond _MAX_RETIRED while the cache
        and they together exceed the budget (lock held)."""
        while self._retired_count > _MAX_RETIRED and self._used + self._retired_bytes > self.budget:
            size = max(self._retired, key=lambda k: len(self._retired[k]))
            bucket = self._retired[size]
            bucket.popitem(last=False)
            if not bucket:
                del self._retired[size]
            self._retired_count -= 1
            self._retired_bytes -= size * 4

    @property
    def retired_buffers(self) -> int:
        """Buffers of row groups that left the cache, kept for new decodes."""
        return self._retired_count

    def release(self, index: int, group: int) -> None:
        """Drop row group ``group`` of chunk ``index`` from the cache now (the read is past it); its buffer
        is reused once nothing refers to it. Only a cache decision: a later read decodes it again."""
        self.release_range(index, group, group + 1)

    def release_range(self, index: int, lo: int, hi: int) -> int:
        """:meth:`release` row groups ``lo .. hi-1`` of chunk ``index`` (those in the cache); returns how
        many were there."""
        got = 0
        with self._lock:
            for group in range(lo, hi):
                hit = self._lru.pop(("rg", index, group), None)
                if hit is not None:
                    self._used -= hit[1]
                    self._retire(hit[0])
                    got += 1
            self._trim_retired()
        return got

    def cached_meta(self, index: int) -> ChunkMeta | None:
        """Chunk ``index``'s layout if it is in the cache now (never fetches)."""
        with self._lock:
            hit = self._lru.get(("chunk", index))
        return None if hit is None else hit[0]

    def _buffer(self, n: int) -> np.ndarray:
        """An int32 buffer of at least ``n`` entries: a retired row group's, when no array, view or
        object refers to it any more (CPython reference counts: the row group, its ``padded`` view and
        the buffer are referenced only from here), else a new one."""
        size = -(-n // _BUFFER_STEP) * _BUFFER_STEP  # buffers are multiples of the step: n <= size <= n + step
        with self._lock:
            for want in (size, size + _BUFFER_STEP) if size == n else (size,):
                bucket = self._retired.get(want)
                if not bucket:
                    continue
                for key in list(itertools.islice(bucket, _RETIRED_SCAN)):  # oldest first
                    rg = bucket[key]
                    buf = rg.buf
                    # refs: rg -> the bucket, `rg`, getrefcount's argument; padded -> rg and the argument;
                    # buf -> rg, padded's base, `buf`, the argument. Anything more is a live user.
                    if sys.getrefcount(rg) == 3 and sys.getrefcount(rg.padded) == 2 and sys.getrefcount(buf) == 4:
                        del bucket[key]
                        if not bucket:
                            del self._retired[want]
                        self._retired_count -= 1
                        self._retired_bytes -= buf.nbytes
                        return buf
                    bucket.move_to_end(key)  # still in use: look at the others first next time
            self.fresh_buffers += 1
        return np.empty(size, np.int32)

    def _count(self, index: int, nbytes: int, *, data: bool | None) -> None:
        """Tally a fetch: ``data`` True for chunk data, False for opening a chunk, None for its footer."""
        with self._lock:
            self.opened.add(index)
            self.bytes_fetched += nbytes
            if data:
                self.fetches += 1
            elif data is not None:
                self.meta_fetches += 1

    def _cat(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            if start is None:
                return self.cache.fs.cat_file(self.cache.path(rel))
            if self._local:
                return self._pread(rel, start, end)
            return self.cache.fs.cat_file(self.cache.path(rel), start=start, end=end)
        except FileNotFoundError:
            raise _error(self.cache, rel, "missing") from None

    def _pread(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a local file (fewer at its end), through a kept-open file. An evicted
        file is only dropped from the table; it closes when the last thread reading it lets go, so a
        descriptor is never closed (and its number reused) under a concurrent read."""
        with self._lock:
            f = self._files.get(rel)
            if f is not None:
                self._files.move_to_end(rel)
        if f is None:
            f = open(self.cache.path(rel), "rb", buffering=0)
            with self._lock:
                f = self._files.setdefault(rel, f)
                while len(self._files) > _MAX_OPEN_FILES:
                    self._files.popitem(last=False)
        return os.pread(f.fileno(), max(0, end - start), start)

    # -- loading ----------------------------------------------------------------------------------------
    def meta(self, index: int) -> ChunkMeta:
        """Chunk ``index``'s verified layout (sidecar + footer, fetched on first use)."""
        return self._get(("chunk", index), lambda: self._load_meta(index))

    def _load_meta(self, index: int):
        t, cache = self.cache.table, self.cache
        rel = t.paths[index]
        side_rel = fmt.sidecar_path(int(t.shard[index]), int(t.index_in_shard[index]))
        try:
            raw = cache.fs.cat_file(cache.path(side_rel))
        except FileNotFoundError:
            raise _error(cache, side_rel, "sidecar missing") from None
        self._count(index, len(raw), data=False)
        want = t.sidecar_checksums[index] if t.sidecar_checksums is not None else None
        if want is not None and fmt.checksum(raw) != want:
            raise _error(cache, side_rel, f"sidecar checksum mismatch: file has {fmt.checksum(raw)}, the ledger "
                                          f"says {want}")
        try:
            side = json.loads(raw)
        except ValueError as e:
            raise _error(cache, side_rel, f"sidecar is not valid JSON ({e})") from None
        for key, got, exp in (("path", side.get("path"), rel), ("checksum", side.get("checksum"), t.checksums[index]),
                              ("bytes", side.get("bytes"), int(t.nbytes[index])),
                              ("docs", side.get("docs"), int(t.docs[index])),
                              ("tokens", side.get("tokens"), int(t.tokens[index]))):
            if got != exp:
                raise _error(cache, side_rel, f"sidecar {key} is {got!r}, the ledger says {exp!r}")
        if "row_group_index" not in side or "footer" not in side:
            return self._load_whole(index)
        size = int(t.nbytes[index])
        try:
            index_rows = side["row_group_index"]
            f_off, f_len, f_sum = side["footer"]
            rg_ranges = np.asarray([[int(e[0]), int(e[1])] for e in index_rows], dtype=np.int64).reshape(-1, 2)
            rg_docs = np.asarray([int(e[2]) for e in index_rows], dtype=np.int64)
            rg_tokens = np.asarray([int(e[3]) for e in index_rows], dtype=np.int64)
            rg_sums = [str(e[4]) for e in index_rows]
        except (TypeError, ValueError, IndexError, KeyError) as e:
            raise _error(cache, side_rel, f"malformed row_group_index/footer ({e!r})") from None
        ends = np.concatenate([[4], rg_ranges[:, 0] + rg_ranges[:, 1]])
        if (not np.array_equal(rg_ranges[:, 0], ends[:-1]) or int(ends[-1]) != f_off or f_off + f_len != size
                or int(rg_docs.sum()) != int(t.docs[index]) or int(rg_tokens.sum()) != int(t.tokens[index])):
            raise _error(cache, side_rel, "row_group_index/footer inconsistent with the chunk's size, documents "
                                          "or tokens")
        # one byte past the recorded end: a file longer than recorded shows up here, at no extra request
        footer = self._cat(rel, f_off, f_off + f_len + 1)
        self._count(index, len(footer), data=None)
        if len(footer) != f_len:
            kind = "truncated" if len(footer) < f_len else "longer than recorded"
            raise _error(cache, rel, f"{kind}: the footer at bytes [{f_off}, {f_off + f_len}) of a {size}-byte "
                                     f"file read {len(footer)} bytes")
        if fmt.checksum(footer) != f_sum:
            raise _error(cache, rel, f"footer checksum mismatch (bytes [{f_off}, {size}))")
        try:
            fm = pq.read_metadata(pa.BufferReader(footer))
            kv = fm.metadata or {}
            kv_tokens = json.loads(kv[fmt.ROW_GROUP_TOKENS_KEY])
            ok = (fm.num_row_groups == len(rg_sums) and kv_tokens == rg_tokens.tolist()
                  and [fm.row_group(g).num_rows for g in range(fm.num_row_groups)] == rg_docs.tolist()
                  and [list(r) for r in fmt.row_group_ranges(fm)] == rg_ranges.tolist())
        except Exception as e:  # noqa: BLE001 - damaged metadata
            raise _error(cache, rel, f"unreadable Parquet footer ({e})") from e
        if not ok:
            raise _error(cache, rel, "the Parquet footer disagrees with the sidecar's row_group_index")
        m = ChunkMeta(index, rel, rg_ranges, rg_sums, np.concatenate([[0], np.cumsum(rg_tokens)]),
                      np.concatenate([[0], np.cumsum(rg_docs)]), fm, (f_off, footer), size)
        return m, m.nbytes

    def _load_whole(self, index: int):
        """A chunk whose sidecar predates the row-group index: fetch it whole, verify, index it here."""
        rel = self.cache.table.paths[index]
        data = self._cat(rel)
        self._count(index, len(data), data=True)
        w = parse_chunk(self.cache, index, data)
        rg_index, footer = fmt.row_group_index(data)
        rg_ranges = np.asarray([e[:2] for e in rg_index], dtype=np.int64).reshape(-1, 2)
        m = ChunkMeta(index, rel, rg_ranges, [e[4] for e in rg_index], w.rg_token_starts, w.rg_doc_starts,
                      w.file_meta, (footer[0], data[footer[0]:]), len(data), data)
        return m, m.nbytes

    def doc_index(self, index: int) -> DocIndex:
        """Every document length of chunk ``index`` (decodes each of its row groups; unpacked reads)."""
        return self._get(("docs", index), lambda: self._load_doc_index(index))

    def _load_doc_index(self, index: int):
        m = self.meta(index)
        parts = [np.diff(self.row_group(index, g).doc_starts) for g in range(m.num_row_groups)]
        lengths = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        d = DocIndex(lengths, np.concatenate([[0], np.cumsum(lengths)]))
        return d, d.nbytes

    def row_group(self, index: int, group: int) -> RowGroup:
        return self._get(("rg", index, group), lambda: self._load_row_group(index, group))

    def warm_row_groups(self, index: int, groups) -> None:
        """Prefetch: load row groups ``groups`` of chunk ``index``, skipping those cached (they count as
        used) and those another thread is loading (so the prefetch threads decode different row groups)."""
        todo = []
        with self._lock:
            lru, inflight = self._lru, self._inflight
            for group in groups:
                key = ("rg", index, group)
                if key in lru:
                    lru.move_to_end(key)
                elif key not in inflight:
                    todo.append(group)
        for group in todo:
            self._get(("rg", index, group), lambda: self._load_row_group(index, group), wait=False)

    def row_groups(self, keys) -> dict[tuple[int, int], RowGroup]:
        """``{(chunk, group): row_group(chunk, group)}`` for ``keys`` (in their order, duplicates once):
        the cached ones under one lock, the rest through :meth:`row_group`."""
        out: dict[tuple[int, int], Any] = dict.fromkeys(keys)
        miss = []
        with self._lock:
            lru = self._lru
            for key in out:
                k = ("rg", *key)
                hit = lru.get(k)
                if hit is None:
                    miss.append(key)
                else:
                    lru.move_to_end(k)
                    out[key] = hit[0]
        for c, g in miss:
            out[(c, g)] = self.row_group(c, g)
        return out

    def _fetch_row_group(self, m: ChunkMeta, group: int) -> bytes:
        off, length = (int(x) for x in m.rg_ranges[group])
        if m.data is not None:
            buf = m.data[off:off + length]  # verified with the whole file
        else:
            buf = self._cat(m.path, off, off + length)
            self._count(m.index, len(buf), data=True)
        if len(buf) != length:
            raise _error(self.cache, m.path, f"truncated: row group {group} at bytes [{off}, {off + length}) read "
                                             f"{len(buf)} bytes")
        if fmt.checksum(buf) != m.rg_checksums[group]:
            raise _error(self.cache, m.path, f"checksum mismatch in row group {group} (bytes [{off}, "
                                             f"{off + length}))")
        return buf

    def _load_row_group(self, index: int, group: int):
        m = self.meta(index)
        buf = self._fetch_row_group(m, group)  # verified before any decoding
        base = int(m.rg_ranges[group, 0])
        docs = int(m.rg_doc_starts[group + 1] - m.rg_doc_starts[group])
        expect = int(m.rg_token_starts[group + 1] - m.rg_token_starts[group])
        rgm = m.file_meta.row_group(group)
        padded = lengths = None
        out = None
        if self.fast_decode:
            lengths = fast_plain_values(buf, rgm.column(1), docs, base=base, column=fmt.LENGTH_COLUMN, levels=0)
            if lengths is not None:
                out = self._buffer(expect + 1)
                padded = fast_plain_values(buf, rgm.column(0), expect, lead=1, base=base, out=out)
                if padded is None:
                    out = None
        if padded is None or lengths is None:
            try:
                f = _RangeFile(m.nbytes_file, [(base, buf), m.footer])
                pf = pq.ParquetFile(pa.PythonFile(f, mode="r"), metadata=m.file_meta)
                tab = pf.read_row_group(group, columns=[fmt.TOKEN_COLUMN, fmt.LENGTH_COLUMN], use_threads=False)
                tokens = int_values(tab.column(0).combine_chunks().flatten())
                lengths = int_values(tab.column(1))
            except Exception as e:
                raise _error(self.cache, m.path, f"row group {group} cannot be decoded ({e})") from e
            padded = np.empty(tokens.size + 1, np.int32)
            padded[0] = 0
            padded[1:] = tokens
        if padded.size - 1 != expect or lengths.size != docs or int(lengths.sum(dtype=np.int64)) != expect:
            raise _error(self.cache, m.path, f"row group {group} holds {padded.size - 1} tokens in {lengths.size} "
                                             f"documents, the sidecar says {expect} in {docs}")
        starts = np.zeros(docs + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        with self._lock:
            self.decodes += 1
        rg = RowGroup(padded, starts, out)
        return rg, rg.nbytes

    def prefetch(self, fn: Callable[[], Any]) -> cf.Future:
        """Run ``fn`` (which touches the store) on the background pool."""
        return self._pool.submit(fn)

    def submit(self, fn: Callable[..., Any], *args) -> cf.Future:
        return self._pool.submit(fn, *args)

    # -- token ranges -------------------------------------------------------------------------------------
    def tokens(self, index: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[lo, hi)`` of chunk ``index`` and each token's position within its document."""
        m = self.meta(index)
        g0 = int(np.searchsorted(m.rg_token_starts, lo, side="right")) - 1
        g1 = int(np.searchsorted(m.rg_token_starts, hi - 1, side="right")) - 1 if hi > lo else g0
        toks, poss = [], []
        for g in range(g0, g1 + 1):
            base = int(m.rg_token_starts[g])
            a, b = max(lo, base) - base, min(hi, int(m.rg_token_starts[g + 1])) - base
            if b <= a:
                continue
            rg = self.row_group(index, g)
            toks.append(rg.padded[a + 1:b + 1])
            poss.append(rg.positions_range(a, b))
        if len(toks) == 1:
            return toks[0], poss[0]
        if not toks:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        return np.concatenate(toks), np.concatenate(poss)


def validate_chunk(cache: Cache, index: int, *, decode: bool = True) -> list[str]:
    """Problems with global chunk ``index`` (empty list if it is sound): file, checksum, layout, sidecar."""
    t = cache.table
    rel = t.paths[index]
    problems = []
    data = None
    try:
        try:
            data = cache.fs.cat_file(cache.path(rel))
        except FileNotFoundError:
            raise _error(cache, rel, "missing") from None
        m = parse_chunk(cache, index, data)
        if decode:
            pf = pq.ParquetFile(pa.BufferReader(m.data))
            for g in range(pf.metadata.num_row_groups):
                col = pf.read_row_group(g, columns=[fmt.TOKEN_COLUMN]).column(0)
                n = len(col.combine_chunks().flatten())
                want = int(m.rg_token_starts[g + 1] - m.rg_token_starts[g])
                if n != want:
                    raise _error(cache, rel, f"row group {g} decodes to {n} tokens, metadata says {want}")
    except fmt.FormatError as e:
        problems.append(str(e).split(". The file does not match")[0])
    except Exception as e:  # noqa: BLE001 - report, never crash the validator
        problems.append(f"{cache.display(rel)}: {e!r}")
    shard, k = int(t.shard[index]), int(t.index_in_shard[index])
    side = fmt.sidecar_path(shard, k)
    try:
        raw = cache.fs.cat_file(cache.path(side))
        entry = json.loads(raw)
        if cache.complete:
            want = dict(cache.ledger.raw["chunks"][index])
            want_sum = want.pop("sidecar_checksum", None)
            want.pop("doc_offset", None)
            want.pop("token_offset", None)
            got = {key: v for key, v in entry.items() if key not in fmt.SIDECAR_ONLY_KEYS}
            if got != want:
                diff = sorted(key for key in set(got) | set(want) if got.get(key) != want.get(key))
                problems.append(f"{cache.display(side)}: sidecar differs from the ledger entry in {diff}")
            elif want_sum is not None and fmt.checksum(raw) != want_sum:
                problems.append(f"{cache.display(side)}: sidecar checksum {fmt.checksum(raw)}, the ledger says "
                                f"{want_sum}")
        if data is not None:
            try:
                index_want, footer_want = fmt.row_group_index(data)
                if [entry.get("row_group_index"), entry.get("footer")] != [index_want, footer_want]:
                    problems.append(f"{cache.display(side)}: row_group_index/footer do not match the chunk file "
                                    "(or are missing: sidecar written by an older chunkledger; rebuild)")
            except fmt.FormatError:
                pass  # the chunk itself was reported above
    except FileNotFoundError:
        problems.append(f"{cache.display(side)}: sidecar missing")
    except ValueError as e:
        problems.append(f"{cache.display(side)}: not valid JSON ({e})")
    return problems


# --------------------------------------------------------------------------------------------------
# Fast path for the token column: PLAIN-encoded int32 data pages are decompressed with pyarrow's codec
# and the values taken as they are. Documents are delimited by the num_tokens column, so the list
# structure (repetition/definition levels) is skipped instead of being reassembled. Anything else
# (dictionary pages, other encodings or codecs) returns None and the caller uses pyarrow's reader.
# The bytes were verified against their sha256 (row group range, or whole file) before this runs, and the
# decoded counts are checked.

_CODECS = {"ZSTD": "zstd", "SNAPPY": "snappy", "GZIP": "gzip", "BROTLI": "brotli", "UNCOMPRESSED": None}


class _Thrift:
    """Minimal Thrift compact-protocol reader for Parquet page headers."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf, pos: int):
        self.buf, self.pos = buf, pos

    def varint(self) -> int:
        shift = result = 0
        buf = self.buf
        while True:
            b = buf[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def struct(self) -> dict:
        """Read a struct: {field id: value}; nested structs become dicts, other containers are skipped."""
        out, last = {}, 0
        while True:
            head = self.buf[self.pos]
            self.pos += 1
            if head == 0:
                return out
            ftype = head & 0x0F
            delta = head >> 4
            fid = last + delta if delta else self.zigzag()
            last = fid
            out[fid] = self.value(ftype)

    def value(self, ftype: int):
        if ftype == 1:
            return True
        if ftype == 2:
            return False
        if ftype == 3:
            self.pos += 1
            return self.buf[self.pos - 1]
        if ftype in (4, 5, 6):
            return self.zigzag()
        if ftype == 7:
            self.pos += 8
            return None
        if ftype == 8:
            n = self.varint()
            self.pos += n
            return None
        if ftype in (9, 10):
            head = self.buf[self.pos]
            self.pos += 1
            n, et = head >> 4, head & 0x0F
            if n == 15:
                n = self.varint()
            for _ in range(n):
                self.value(et if et != 1 else 1)
            return None
        if ftype == 11:
            n = self.varint()
            if n:
                kv = self.buf[self.pos]
                self.pos += 1
                for _ in range(n):
                    self.value(kv >> 4)
                    self.value(kv & 0x0F)
            return None
        if ftype == 12:
            return self.struct()
        raise ValueError(f"unknown thrift type {ftype}")


def fast_token_values(data, col_meta, expect: int, lead: int = 0, base: int = 0) -> np.ndarray | None:
    """The int32 values of one token column chunk (after ``lead`` zeros), or None if it is not PLAIN data
    pages this function can read. ``data`` holds the file's bytes from offset ``base`` on."""
    return fast_plain_values(data, col_meta, expect, lead=lead, base=base)


def fast_plain_values(data, col_meta, expect: int, *, lead: int = 0, base: int = 0,
                      column: str = fmt.TOKEN_COLUMN, levels: int = 2, out: np.ndarray | None = None
                      ) -> np.ndarray | None:
    """The int32 values of one PLAIN column chunk of ``column`` (after ``lead`` zeros), or None.

    ``data`` holds the file's bytes from offset ``base`` on (a row group's verified byte range, or the
    whole file with ``base=0``). ``levels``: level blocks in front of v1 page values (2 for the
    ``list<int32>`` token column: repetition and definition; 0 for a required top-level column).
    """
    try:
        path = str(col_meta.path_in_schema)
        if not (path == column or path.startswith(column + ".")):
            return None
        if col_meta.has_dictionary_page or col_meta.physical_type != "INT32":
            return None
        codec_name = str(col_meta.compression).upper()
        if codec_name not in _CODECS:
            return None
        codec = _CODECS[codec_name]
        start = col_meta.data_page_offset - base
        end = start + col_meta.total_compressed_size
        if start < 0 or end > len(data):
            return None
        view = memoryview(data)
        out = np.empty(expect + lead, np.int32) if out is None else out[:expect + lead]
        out[:lead] = 0
        got = 0
        pos = start
        while pos < end:
            t = _Thrift(data, pos)
            h = t.struct()
            pos = t.pos
            ptype, usize, csize = h.get(1), h.get(2), h.get(3)
            body = view[pos:pos + csize]
            pos += csize
            if ptype == 0:  # DATA_PAGE (v1): levels and values compressed together
                dph = h.get(5) or {}
                if dph.get(2, 0) != 0:  # encoding must be PLAIN
                    return None
                raw = pa.decompress(body, decompressed_size=usize, codec=codec) if codec else pa.py_buffer(body)
                raw = memoryview(raw)
                p = 0
                for _ in range(levels):  # repetition levels, then definition levels: <int32 length><bytes>
                    n = int.from_bytes(raw[p:p + 4], "little")
                    p += 4 + n
                values = raw[p:]
            elif ptype == 3:  # DATA_PAGE_V2: levels uncompressed in front of the (maybe compressed) values
                dph = h.get(8) or {}
                if dph.get(4, 0) != 0:
                    return None
                lv = dph.get(5, 0) + dph.get(6, 0)
                comp = dph.get(7, True)
                rest = body[lv:]
                if codec and comp:
                    values = memoryview(pa.decompress(rest, decompressed_size=usize - lv, codec=codec))
                else:
                    values = rest
            elif ptype == 2:
                return None  # dictionary page: not PLAIN
            else:
                continue  # index pages carry no values
            if len(values) % 4:
                return None
            n = len(values) // 4
            if got + n > expect:
                return None
            out[lead + got:lead + got + n] = np.frombuffer(values, dtype="<i4")
            got += n
        return out if got == expect else None
    except (ValueError, IndexError, KeyError, TypeError, OSError, pa.ArrowException):
        return None
