"""Chunk data: fetch, verify, decode only the needed row groups, and keep it in a bounded LRU.

A chunk file is fetched whole with fsspec (one request), its length and sha256 checksum are compared
with the ledger (a truncated or corrupted file raises :class:`ChunkError` naming it), and its bytes stay
in the LRU so that row groups can be decoded one at a time, using the ``ROW_GROUP_TOKENS_KEY``
metadata to know which row groups a token range needs. Decoded row groups are flat ``int32`` token
arrays plus document start offsets. Everything cached counts against ``memory_budget_bytes``;
concurrent requests for the same item (the prefetch thread and the caller) share one load.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import json
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
    """A verified chunk file: its bytes, row-group layout and document lengths (one chunk, not the cache)."""

    index: int  # global chunk index
    path: str  # relative path
    data: bytes
    rg_token_starts: np.ndarray  # int64 [G+1]: token offset of each row group inside the chunk
    rg_doc_starts: np.ndarray  # int64 [G+1]: document offset of each row group
    doc_lengths: np.ndarray  # int64 [docs]
    doc_starts: np.ndarray  # int64 [docs+1]: token offset of each document inside the chunk
    file_meta: Any = None  # pyarrow FileMetaData of the chunk

    @property
    def nbytes(self) -> int:
        return len(self.data) + 8 * (self.rg_token_starts.size * 2 + self.doc_lengths.size * 2 + 1)

    @property
    def rg_token_starts_list(self) -> list[int]:
        got = self.__dict__.get("_rg_list")
        if got is None:
            got = self.rg_token_starts.tolist()
            object.__setattr__(self, "_rg_list", got)
        return got


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """A decoded row group, laid out for vectorized window gathers.

    ``padded[1:]`` are the row group's tokens (its documents concatenated) and ``padded[0] == 0``, so that
    ``padded[t]`` is the token before token ``t`` (the previous-token input of flat-tokens packing) with no
    special case at the row group start; ``positions[t]`` is token ``t``'s position in its document.
    """

    padded: np.ndarray  # int32 [n+1]
    positions: np.ndarray  # int32 [n]
    doc_starts: np.ndarray  # int64 [docs+1], token offsets relative to the row group start

    @property
    def tokens(self) -> np.ndarray:
        return self.padded[1:]

    @property
    def nbytes(self) -> int:
        return self.padded.nbytes + self.positions.nbytes + self.doc_starts.nbytes


def _error(cache: Cache, rel: str, what: str) -> ChunkError:
    return ChunkError(
        f"{cache.display(rel)}: {what}. The file does not match the ledger; no tokens were returned from "
        "it. Rerun the build command that made this cache (it rewrites missing chunks; delete a damaged "
        "chunk and its .json sidecar first), or run `python -m reader validate` to list every problem."
    )


def parse_chunk(cache: Cache, index: int, data: bytes, entry: dict[str, Any] | None = None) -> ChunkMeta:
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
    return ChunkMeta(index, rel, data, rg_token_starts, rg_doc_starts, lengths, doc_starts, pf.metadata)


class ChunkStore:
    """Verified chunk bytes and decoded row groups, in an LRU bounded by ``memory_budget_bytes``."""

    def __init__(self, cache: Cache, *, memory_budget_bytes: int = 1 << 30, threads: int = 2):
        self.cache = cache
        self.budget = int(memory_budget_bytes)
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[Any, tuple[Any, int]] = collections.OrderedDict()
        self._inflight: dict[Any, cf.Future] = {}
        self._used = 0
        self.opened: set[int] = set()  # global indices of chunks whose bytes were fetched
        self.fetches = 0  # chunk files fetched (a refetch after eviction counts again)
        self.bytes_fetched = 0
        self.decodes = 0  # row groups decoded
        self.fast_decode = True  # PLAIN token pages: decompress and take the values (see fast_token_values)
        self._pool = cf.ThreadPoolExecutor(max(1, threads), thread_name_prefix="chunkledger-prefetch")
        # a store dropped without close() still stops its threads
        self._closer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)

    def close(self) -> None:
        self._closer()

    # -- LRU ------------------------------------------------------------------------------------------
    def _get(self, key: Any, load: Callable[[], tuple[Any, int]]) -> Any:
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
            return fut.result()
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
                _, (_, n) = self._lru.popitem(last=False)
                self._used -= n
        fut.set_result(value)
        return value

    @property
    def used_bytes(self) -> int:
        return self._used

    # -- loading ----------------------------------------------------------------------------------------
    def meta(self, index: int) -> ChunkMeta:
        """The verified chunk ``index`` (fetched whole on first use)."""
        return self._get(("chunk", index), lambda: self._load_meta(index))

    def _load_meta(self, index: int):
        rel = self.cache.table.paths[index]
        try:
            data = self.cache.fs.cat_file(self.cache.path(rel))
        except FileNotFoundError:
            raise _error(self.cache, rel, "missing") from None
        with self._lock:
            self.opened.add(index)
            self.fetches += 1
            self.bytes_fetched += len(data)
        m = parse_chunk(self.cache, index, data)
        return m, m.nbytes

    def row_group(self, index: int, group: int) -> RowGroup:
        return self._get(("rg", index, group), lambda: self._load_row_group(index, group))

    def _load_row_group(self, index: int, group: int):
        m = self.meta(index)
        lo, hi = m.rg_doc_starts[group], m.rg_doc_starts[group + 1]
        starts = m.doc_starts[lo:hi + 1] - m.doc_starts[lo]
        expect = int(starts[-1])
        padded = None
        if self.fast_decode:
            padded = fast_token_values(m.data, m.file_meta.row_group(group).column(0), expect, lead=1)
        if padded is None:
            try:
                pf = pq.ParquetFile(pa.BufferReader(m.data))
                col = pf.read_row_group(group, columns=[fmt.TOKEN_COLUMN]).column(0)
                tokens = int_values(col.combine_chunks().flatten())
            except Exception as e:
                raise _error(self.cache, m.path, f"row group {group} cannot be decoded ({e})") from e
            if tokens.size != expect:
                raise _error(self.cache, m.path, f"row group {group} holds {tokens.size} tokens, num_tokens "
                                                 f"says {expect}")
            padded = np.empty(tokens.size + 1, np.int32)
            padded[0] = 0
            padded[1:] = tokens
        tokens = padded[1:]
        positions = np.arange(tokens.size, dtype=np.int32)
        positions -= np.repeat(starts[:-1].astype(np.int32), np.diff(starts))
        with self._lock:
            self.decodes += 1
        rg = RowGroup(padded, positions, starts)
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
            poss.append(rg.positions[a:b])
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
# The file's sha256 was verified against the ledger before this runs, and the decoded count is checked.

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


def fast_token_values(data: bytes, col_meta, expect: int, lead: int = 0) -> np.ndarray | None:
    """The int32 values of one token column chunk (after ``lead`` zeros), or None if it is not PLAIN data
    pages this function can read."""
    try:
        if not str(col_meta.path_in_schema).startswith(fmt.TOKEN_COLUMN + "."):
            return None
        if col_meta.has_dictionary_page or col_meta.physical_type != "INT32":
            return None
        codec_name = str(col_meta.compression).upper()
        if codec_name not in _CODECS:
            return None
        codec = _CODECS[codec_name]
        start = col_meta.data_page_offset
        end = start + col_meta.total_compressed_size
        view = memoryview(data)
        out = np.empty(expect + lead, np.int32)
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
                for _ in range(2):  # repetition levels, then definition levels: <int32 length><bytes>
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
