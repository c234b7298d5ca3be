"""The Reader: deterministic, sharded, seekable batches of a chunkledger cache.

Order (seed 000, issue 3): with ``R*`` streams, stream ``s`` is ``loop(all_chunks)[s::R*]`` turned into
examples; ``example[i] = stream_examples[i % R*][i // R*]``; global batch ``b`` is
``example[b*B:(b+1)*B]``; reader ``r`` of ``R`` serves its rows ``k ≡ r (mod R)``. All index math is in
:mod:`reader.order`; this module only gathers tokens.

Examples are built at read time:

* **packed**: example ``j`` of a stream is its tokens ``[j*L, (j+1)*L)`` (documents concatenated across
  chunk boundaries; nothing dropped). ``targets`` are those tokens; ``inputs[t]`` is the previous token of
  the same document, or 0 at a document start (flat-tokens, seed 001); ``segment_ids``/``positions``
  expose the documents.
* **unpacked**: one document piece per example (a document of ``n`` tokens gives ``ceil(n/L)`` pieces),
  padded with ``segment_ids == 0`` and ``loss_mask == False``.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures as cf
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import threading
import weakref
from typing import Any, Iterator

import numpy as np
import pyarrow.parquet as pq

from . import format as fmt
from . import order
from .cache import Cache, CacheNotReady
from .chunks import ChunkError, ChunkStore, RowGroup, int_values

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "example_ids", "epochs", "valid")
# layout="flat": tokens uint32 [rows, L+1]; first_positions, num_tokens int32 [rows]; and the row fields
FLAT_KEYS = ("tokens", "first_positions", "num_tokens", "example_ids", "epochs", "valid")
LAYOUTS = ("arrays", "flat")
INDEX_DIR = "index"
_GROUP = 8  # iter_batches assembles up to this many consecutive batches in one pass
# shuffled reads: batches whose source indices one cipher call computes (see Reader._perm_batches)
_PERM_BATCHES = 32


_AR32: list = [np.zeros(0, np.int32)]


def _arange32(n: int) -> np.ndarray:
    """``np.arange(n, dtype=int32)``, cached (a batch needs one of batch x seq_len entries)."""
    a = _AR32[0]
    if a.size < n:
        a = _AR32[0] = np.arange(n, dtype=np.int32)
    return a[:n]


def locate_streams(idx: order.StreamIndex, streams: np.ndarray, positions: np.ndarray):
    """``idx.locate_streams``: locate unit ``positions[k]`` of stream ``streams[k]`` for a whole batch."""
    return idx.locate_streams(streams, positions)


def _window_runs(recs, L: int):
    """Runs of ``recs`` (sorted ``(chunk, group, offset, row)`` windows inside one row group): yields
    ``(chunk, group, offset, row, k, step)`` for ``k`` consecutive windows of one row group that go to
    equally spaced rows ``row, row + step, ...`` (the usual case: a stream's rows of a batch), so each
    run is one strided copy."""
    n, i = len(recs), 0
    while i < n:
        c, g, a, r = recs[i]
        k, step = 1, 0
        if i + 1 < n:
            c2, g2, a2, r2 = recs[i + 1]
            step = r2 - r
            if c2 == c and g2 == g and a2 == a + L and step > 0:
                k = 2
                while (i + k < n and recs[i + k][0] == c and recs[i + k][1] == g
                       and recs[i + k][2] == a + k * L and recs[i + k][3] == r + k * step):
                    k += 1
        yield c, g, a, r, k, step
        i += k


def _doc_starts_in_windows(recs, groups: dict, L: int):
    """Document structure of windows that lie inside one decoded row group each.

    ``recs``: ``(chunk, group, offset, row)`` per window, sorted; ``groups``: ``{(chunk, group): RowGroup}``.
    Returns ``(rows, first, owner, offset)``: each window's output row and the position of its first
    token in its document; and every document start strictly inside a window, as window index
    ``owner[k]`` and column ``offset[k]``. One vectorized pass for the whole batch: the row groups'
    document starts side by side in one sorted array (key = group number * 2**40 + token offset).
    """
    arr = np.asarray(recs, dtype=np.int64).reshape(-1, 4)
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


def expand_flat(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The ``layout="arrays"`` batch of a ``layout="flat"`` one: equal, array for array, to what the same
    reader returns with ``layout="arrays"``.

    ``tokens[:, 1:]`` are the window's tokens as ``2 * token + start`` (seed 001's flat-tokens encoding;
    ``start`` = 1 where a document begins); ``tokens[:, 0]`` is ``2 * previous token`` of the same
    document, or 0 when the window begins a document. ``first_positions`` is the first token's position
    in its document; ``num_tokens`` the real tokens of the row (``L`` except at the end of an eval pass
    and in padding rows). ``reader.jax.expand_flat`` is the same function in jax.numpy.
    """
    tok = np.asarray(batch["tokens"], dtype=np.uint32)
    n, L = tok.shape[0], tok.shape[1] - 1
    start = (tok[:, 1:] & 1).astype(bool)
    t = np.arange(L, dtype=np.int32)
    real = t[None, :] < np.asarray(batch["num_tokens"])[:, None]
    targets = (tok[:, 1:] >> 1).astype(np.int32)
    inputs = (tok[:, :-1] >> 1).astype(np.int32)
    inputs[start] = 0
    segment_ids = np.cumsum(start, axis=1, dtype=np.int32)
    segment_ids += (~start[:, :1]).astype(np.int32)
    last = np.maximum.accumulate(np.where(start, t[None, :], -1), axis=1)
    first = np.asarray(batch["first_positions"], dtype=np.int32)[:, None]
    positions = np.where(last >= 0, t[None, :] - last, first + t[None, :]).astype(np.int32)
    out = {"inputs": inputs, "targets": targets, "segment_ids": segment_ids, "positions": positions,
           "loss_mask": real}
    for k in ("inputs", "targets", "segment_ids", "positions"):
        out[k][~real] = 0
    for k in ("example_ids", "epochs", "valid"):
        if k in batch:
            out[k] = np.asarray(batch[k]).copy()
    return out


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How to turn a cache into batches. Nothing here is baked into the cache.

    Attributes:
      seq_len: tokens per example (L).
      batch_size: examples per GLOBAL batch (B); must be a multiple of the number of readers.
      packed: True: moving windows over concatenated documents; False: one document piece per example.
      ideal_readers: R*, the number of streams. Keep it fixed for a run's lifetime (the order depends on
        it). Pick a power of two >= the largest number of reader hosts you expect (hosts R with R | R* or
        R* | R read only their own chunks). Ignored in eval mode (one stream).
      eval_mode: a single pass in global chunk order: no loop, no shuffle; the last batch is padded with
        ``valid == False`` rows and iteration ends.
      shuffle_seed: if set, ``shuffled_example[i] = example[pi(i)]`` with ``pi`` from
        ``reader.order.shuffle_example_indices`` (issue 4). Training only.
      shuffle: an ``order.ShuffleConfig`` for finer control (window sizes ...); overrides shuffle_seed.
      memory_budget_bytes: bound on cached chunk bytes + decoded row groups.
      prefetch_batches: batches assembled ahead of the consumer by ``iter_batches`` (on one thread).
      prefetch_threads: background threads that fetch, verify and decode upcoming row groups. 0: the
        assembling thread decodes what it needs when it needs it; the least CPU per batch (planning
        ahead costs about a third more), so the better choice when worker processes supply the
        parallelism on a local cache (``num_workers`` picks it for its workers then).
      index_cache: store the unpacked per-chunk example counts in ``ROOT/index/`` when writable.
      num_workers: 0 (default): batches are assembled in this process (on threads). W > 0: by W child
        processes (:mod:`reader.workers`) that each decode and assemble every W-th of this reader's rows
        into shared memory; ``iter_batches`` then returns views of that memory (the same values, bit
        for bit). Use it when one core cannot keep up (about 100 M tokens/s per core); the batch size
        must be a multiple of ``num_readers * num_workers``, and ``memory_budget_bytes`` is split
        between the workers. ``Reader.iter_batches`` and ``reader.jax.JaxLoader.iter_batches`` use the
        workers (the loader's workers each serve every W-th of the rows its process's devices hold, so W
        must divide that number of rows); ``rows``/``batch``/``examples`` and ``JaxLoader.global_batch``
        stay in-process.
      layout: ``"arrays"`` (default): the five ``[rows, L]`` arrays of BATCH_KEYS. ``"flat"`` (packed
        only): one ``uint32 [rows, L+1]`` array in seed 001's flat-tokens encoding plus two per-row
        ints (FLAT_KEYS); about 4x fewer bytes to assemble and to send to an accelerator, where
        :func:`expand_flat` (numpy) or ``reader.jax.expand_flat`` (jit) rebuilds the five arrays exactly.
    """

    seq_len: int = 2048
    batch_size: int = 64
    packed: bool = True
    ideal_readers: int = 16
    eval_mode: bool = False
    shuffle_seed: int | None = None
    shuffle: Any = None
    memory_budget_bytes: int = 1 << 30
    prefetch_batches: int = 2
    prefetch_threads: int = 2
    index_cache: bool = True
    layout: str = "arrays"
    num_workers: int = 0

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "flat" and not self.packed:
            raise ValueError("layout='flat' encodes packed windows (document starts as a bit per token); "
                             "unpacked examples use layout='arrays'")
        if self.prefetch_threads < 0:
            raise ValueError(f"prefetch_threads must be >= 0, got {self.prefetch_threads}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.ideal_readers < 1:
            raise ValueError(f"ideal_readers must be >= 1, got {self.ideal_readers}")
        if self.eval_mode and (self.shuffle_seed is not None or self.shuffle is not None):
            raise ValueError("eval_mode reads every document once in global order; it never shuffles. "
                             "Drop shuffle_seed/shuffle or eval_mode.")

    @property
    def num_streams(self) -> int:
        return 1 if self.eval_mode else self.ideal_readers

    def shuffle_config(self):
        """The shuffle config object, or None when not shuffling."""
        if self.shuffle is not None:
            return self.shuffle
        if self.shuffle_seed is None:
            return None
        cls = getattr(order, "ShuffleConfig", None)
        if cls is None or not hasattr(order, "shuffle_example_indices"):
            raise RuntimeError("shuffle_seed needs reader.order.ShuffleConfig/shuffle_example_indices "
                               "(the growing-window shuffle); this installation does not have them")
        # lanes = R*: every example stays in its stream, so hosts keep reading only their own chunks.
        names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        extra = {"lanes": self.num_streams} if "lanes" in names else {}
        return cls(seed=int(self.shuffle_seed), **extra)


class Reader:
    """Reads GLOBAL batches (or this reader's rows of them) of a cache; see the module docstring.

    Args:
      cache: cache root (local path or fsspec URL such as ``gs://b/cache``) or an open :class:`Cache`.
      options: :class:`ReadOptions`.
      num_readers, reader_index: this host is reader ``reader_index`` of ``num_readers`` (R, r).
      wait_timeout_s: while the build runs, how long to wait for a chunk that is not written yet before
        raising :class:`reader.cache.CacheNotReady`.
      poll_interval_s: how often to look for build progress while waiting.
      storage_options: passed to fsspec (e.g. ``{"token": ...}`` for gcsfs).
      _rows: private (reader worker processes): serve only these rows of every batch, a sorted subset
        of reader ``reader_index``'s rows, as :attr:`my_rows` (``batch``, ``iter_batches`` and the
        prefetch plan use them; ``num_readers``/``reader_index`` still tell its streams and lanes).
    """

    def __init__(self, cache: str | Cache, options: ReadOptions | None = None, num_readers: int = 1,
                 reader_index: int = 0, wait_timeout_s: float = 600.0, *, poll_interval_s: float = 1.0,
                 storage_options: dict | None = None, _rows=None):
        self.options = options or ReadOptions()
        self.cache = cache if isinstance(cache, Cache) else Cache(cache, storage_options=storage_options)
        self.num_readers = int(num_readers)
        self.reader_index = int(reader_index)
        self.my_rows = order.reader_rows(self.options.batch_size, self.num_readers, self.reader_index)
        if _rows is not None:
            rows = np.asarray(_rows, dtype=np.int64).reshape(-1)
            if not rows.size or (np.diff(rows) <= 0).any() or not np.isin(rows, self.my_rows).all():
                raise ValueError(f"_rows must be a non-empty, sorted subset of the rows of reader "
                                 f"{self.reader_index} of {self.num_readers}; got {rows.tolist()}")
            self.my_rows = rows
        self.wait_timeout_s = float(wait_timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self._shuffle_cfg = self.options.shuffle_config()
        self.store = ChunkStore(self.cache, memory_budget_bytes=self.options.memory_budget_bytes,
                                threads=self.options.prefetch_threads)
        self._lock = threading.Lock()
        self._index: order.StreamIndex | None = None
        self._index_key: tuple[int, bool] | None = None
        self._unpacked_counts: dict[str, int] = {}  # chunk checksum -> unpacked examples (this seq_len)
        self._piece_cum: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._perm_cache: collections.OrderedDict[Any, np.ndarray] = collections.OrderedDict()
        self._released: dict[int, int] = {}  # chunk -> row groups before this one were released
        self._pools: weakref.WeakSet = weakref.WeakSet()  # worker pools of open iter_batches (num_workers > 0)
        # shuffled packed reads: mixing groups being read (output row lo -> [hi, lanes read]) and the
        # output row the reads have reached (see _release_groups)
        self._groups: dict[int, list] = {}
        self._group_span: tuple[int, int] = (0, 0)
        self._lane_sets: dict[bytes, frozenset] = {}
        self._passed_row = 0
        self._prefetched_groups: collections.OrderedDict[int, bool] = collections.OrderedDict()
        self._prefetched_span: tuple[int, int] = (0, 0)

    def close(self) -> None:
        for pool in list(self._pools):
            pool.close()
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the stream index ---------------------------------------------------------------------------
    def stream_index(self) -> order.StreamIndex:
        """The :class:`order.StreamIndex` over the chunks known now (all chunks once the build is done)."""
        with self._lock:
            table = self.cache.table
            key = (len(table), self.cache.complete)
            if self._index is None or self._index_key != key:
                counts = table.tokens if self.options.packed else self._unpacked_table(table)
                self._index = order.StreamIndex(counts, self.options.num_streams,
                                                loop=not self.options.eval_mode,
                                                complete=self.cache.complete)
                self._index_key = key
            return self._index

    def _index_file(self) -> str:
        return f"{INDEX_DIR}/unpacked-L{self.options.seq_len}.json"

    def _unpacked_table(self, table: fmt.ChunkTable) -> np.ndarray:
        """Unpacked examples per chunk for this seq_len (one int per chunk; see README for the cost)."""
        fingerprint = hashlib.sha256("\n".join(table.checksums).encode()).hexdigest()
        rel = self._index_file()
        if self.cache.complete and self.options.index_cache and not self._unpacked_counts:
            try:
                got = json.loads(self.cache.fs.cat_file(self.cache.path(rel)))
                if (got.get("fingerprint") == fingerprint and got.get("seq_len") == self.options.seq_len
                        and len(got.get("counts", ())) == len(table)):
                    return np.asarray(got["counts"], dtype=np.int64)
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                pass
        todo = [c for c in range(len(table)) if table.checksums[c] not in self._unpacked_counts]
        if todo:
            with cf.ThreadPoolExecutor(8) as pool:
                for c, n in zip(todo, pool.map(lambda c: self._count_unpacked(table, c), todo)):
                    self._unpacked_counts[table.checksums[c]] = n
        counts = np.asarray([self._unpacked_counts[h] for h in table.checksums], dtype=np.int64)
        if self.cache.complete and self.options.index_cache and todo:
            body = fmt.dumps({"format": "chunkledger-unpacked-index", "seq_len": self.options.seq_len,
                              "fingerprint": fingerprint, "counts": counts.tolist()}).encode()
            try:
                fs, final = self.cache.fs, self.cache.path(rel)
                fs.makedirs(self.cache.path(INDEX_DIR), exist_ok=True)
                if self.cache.is_local:
                    tmp = f"{final}.tmp-{os.getpid()}-{threading.get_ident()}"
                    fs.pipe_file(tmp, body)
                    os.replace(tmp, final)  # atomic: a concurrent reader sees the old or the new file
                else:
                    fs.pipe_file(final, body)  # object stores publish whole objects atomically
            except Exception:  # read-only cache: keep the table in memory only
                pass
        return counts

    def _count_unpacked(self, table: fmt.ChunkTable, c: int) -> int:
        rel = table.paths[c]
        if int(table.docs[c]) == 0:
            return 0
        try:
            with self.cache.fs.open(self.cache.path(rel), "rb") as f:
                size = f.size if getattr(f, "size", None) is not None else self.cache.fs.size(self.cache.path(rel))
                if int(size) != int(table.nbytes[c]):
                    kind = "truncated" if size < table.nbytes[c] else "longer than recorded"
                    raise ChunkError(f"{self.cache.display(rel)}: {kind}: {size} bytes, the ledger says "
                                     f"{int(table.nbytes[c])}. Rerun the build (delete this chunk and its .json "
                                     "sidecar first) or run `python -m reader validate`.")
                lengths = int_values(pq.read_table(f, columns=[fmt.LENGTH_COLUMN]).column(0))
        except FileNotFoundError:
            raise ChunkError(f"{self.cache.display(rel)}: missing (listed in the ledger)") from None
        except ChunkError:
            raise
        except Exception as e:
            raise ChunkError(f"{self.cache.display(rel)}: cannot read its num_tokens column ({e}); run "
                             "`python -m reader validate`") from e
        if lengths.size != int(table.docs[c]) or int(lengths.sum()) != int(table.tokens[c]):
            raise ChunkError(f"{self.cache.display(rel)}: {lengths.size} documents / {int(lengths.sum())} "
                             f"tokens, the ledger says {int(table.docs[c])} / {int(table.tokens[c])}")
        return order.unpacked_examples_per_chunk(lengths, self.options.seq_len)

    # -- sizes ------------------------------------------------------------------------------------------
    @property
    def num_examples(self) -> int | None:
        """Eval mode: examples in the single pass (waits for the build to finish). Training: None."""
        if not self.options.eval_mode:
            return None
        self.cache.wait_complete(timeout_s=self.wait_timeout_s, poll_s=self.poll_interval_s,
                                 what="the size of the eval pass")
        units = int(self.stream_index().stream_length(0))
        return -(-units // self.options.seq_len) if self.options.packed else units

    @property
    def num_batches(self) -> int | None:
        """Eval mode: number of batches of the pass (last one padded). Training (looping): None."""
        n = self.num_examples
        return None if n is None else -(-n // self.options.batch_size)

    def _eval_limit(self, idx: order.StreamIndex, j: np.ndarray) -> int:
        """Eval: number of examples, or raise NotYetAvailable if ``j`` reaches past the known part."""
        units = int(idx.stream_length(0))
        L = self.options.seq_len
        if idx.complete:
            return -(-units // L) if self.options.packed else units
        known = units // L if self.options.packed else units
        if j.size and int(j.max()) >= known:
            raise order.NotYetAvailable(f"eval example {int(j.max())} is past the {known} examples written so far")
        return known

    # -- public reads ---------------------------------------------------------------------------------
    def rows(self, b: int, rows) -> dict[str, np.ndarray]:
        """Rows ``rows`` (ints in [0, B)) of GLOBAL batch ``b`` as a dict of arrays (see BATCH_KEYS)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        B = self.options.batch_size
        if b < 0:
            raise ValueError(f"batch index must be >= 0, got {b}")
        if rows.size and (rows.min() < 0 or rows.max() >= B):
            raise ValueError(f"rows must lie in [0, batch_size={B})")
        ex = int(b) * B + rows
        return self.cache.wait(lambda: self._examples(ex), timeout_s=self.wait_timeout_s,
                               poll_s=self.poll_interval_s, what=f"batch {b}")

    def batch(self, b: int) -> dict[str, np.ndarray]:
        """This reader's rows of GLOBAL batch ``b``: ``rows(b, order.reader_rows(B, R, r))``."""
        return self.rows(b, self.my_rows)

    def examples(self, ex) -> dict[str, np.ndarray]:
        """Global examples ``ex`` (indices in the possibly shuffled order)."""
        ex = np.asarray(ex, dtype=np.int64).reshape(-1)
        return self.cache.wait(lambda: self._examples(ex), timeout_s=self.wait_timeout_s,
                               poll_s=self.poll_interval_s, what="examples")

    def _batch_exists(self, b: int) -> bool:
        if not self.options.eval_mode:
            return True

        def attempt():
            idx = self.stream_index()
            first = np.asarray([b * self.options.batch_size], dtype=np.int64)
            return int(first[0]) < self._eval_limit(idx, first)

        return self.cache.wait(attempt, timeout_s=self.wait_timeout_s, poll_s=self.poll_interval_s,
                               what=f"eval batch {b}")

    def iter_batches(self, start: int = 0, count: int | None = None) -> Iterator[tuple[int, dict]]:
        """Yield ``(b, self.batch(b))`` for b = start, start+1, ... (``count`` batches, or until the end of
        the eval pass, or forever when training).

        Background work: the next ``prefetch_batches`` batches are assembled on a thread, and the row
        groups that batch ``b + lookahead`` will need are fetched, verified and decoded on
        ``prefetch_threads`` threads while batch ``b`` is served (``lookahead`` covers about one row group
        of every stream, capped by the memory budget), so decoding overlaps serving. With ``num_workers > 0``
        the batches come from worker processes instead (:class:`reader.workers.WorkerPool`): views of
        shared memory that stay valid, unchanged, for as long as they are referenced.
        """
        if self.options.num_workers > 0:
            from .workers import WorkerPool

            pool = WorkerPool(self, start, count)
            self._pools.add(pool)
            yield from pool
            return
        stop = None if count is None else start + int(count)
        ahead = max(1, self.options.prefetch_batches)
        look = self.lookahead_batches() if self.options.prefetch_threads > 0 else 0
        pending: collections.deque[tuple[int, int, cf.Future]] = collections.deque()  # (b, batches, future)
        queued = 0  # batches in `pending`
        touches: collections.deque[cf.Future] = collections.deque()
        nxt = start
        # plan `stride` batches per background task (one vectorized locate), not one task per batch
        stride = max(1, min(8, look // 2))
        planned = start + 1  # first batch not planned yet
        assembler = cf.ThreadPoolExecutor(1, thread_name_prefix="chunkledger-assemble")
        try:
            if look and (stop is None or start < stop):
                touches.extend(self._prefetch(start))  # the first batch's chunks load in parallel
            while True:
                while queued < ahead + _GROUP and (stop is None or nxt < stop) and self._batch_exists(nxt):
                    g = 1
                    while g < _GROUP and (stop is None or nxt + g < stop) and self._batch_exists(nxt + g):
                        g += 1
                    pending.append((nxt, g, assembler.submit(self._batch_group, nxt, g)))
                    queued += g
                    for _ in range(g):
                        ahead_b = nxt + look
                        if look and ahead_b >= planned and (stop is None or planned < stop):
                            while touches and touches[0].done():
                                touches.popleft()
                            count = stride if stop is None else min(stride, stop - planned)
                            if len(touches) < 64:  # plan on the pool too: keep the consumer's thread free
                                touches.append(self.store.submit(self._prefetch, planned, None, count))
                            planned += count
                        nxt += 1
                if not pending:
                    return
                b, g, fut = pending.popleft()
                queued -= g
                for i, x in enumerate(fut.result()):
                    yield b + i, x
        finally:
            for _, _, fut in pending:
                fut.cancel()
            for fut in touches:
                fut.cancel()
            assembler.shutdown(wait=False, cancel_futures=True)

    def _batch_group(self, b: int, g: int, out: dict[str, np.ndarray] | None = None) -> list[dict[str, np.ndarray]]:
        """``[self.batch(b), ..., self.batch(b + g - 1)]`` assembled in one pass (the per-call costs of
        locating and gathering are paid once for ``g`` batches); each batch is a view of its rows.
        ``out``: arrays of ``g * rows`` rows to assemble into (see :meth:`_examples`)."""
        if g == 1 and out is None:
            return [self.batch(b)]
        B, rows = self.options.batch_size, self.my_rows
        exs = [(b + i) * B + rows for i in range(g)]
        ex = np.concatenate(exs)
        # shuffled: per batch, so the cipher runs for _PERM_BATCHES batches at once (see _perm_batches)
        src = ex if self._shuffle_cfg is None else self._source_indices_batches(exs)
        out = self.cache.wait(lambda: self._examples(ex, out, src), timeout_s=self.wait_timeout_s,
                              poll_s=self.poll_interval_s, what=f"batches {b}..{b + g - 1}")
        n = rows.size
        return [{k: v[i * n:(i + 1) * n] for k, v in out.items()} for i in range(g)]

    def lookahead_batches(self) -> int:
        """How many batches ahead ``iter_batches`` decodes: about one row group per stream, within budget."""
        opts = self.options
        rg_tokens = int(self.cache.ledger.config.get("row_group_tokens") or (1 << 20))
        streams = order.streams_of_reader(opts.num_streams, self.num_readers, self.reader_index)
        local = len(streams) if streams is not None else opts.num_streams
        # tokens each stream advances per global batch, whatever R (unpacked pieces are at most seq_len)
        per_batch = max(1.0, opts.batch_size * opts.seq_len / opts.num_streams)
        want_tokens = rg_tokens
        cap_tokens = opts.memory_budget_bytes // (4 * 8 * max(1, local))  # a quarter of the budget ahead
        return int(max(1, min(4096, math.ceil(min(want_tokens, cap_tokens) / per_batch))))

    def prefetch(self, b: int, rows=None) -> list[cf.Future]:
        """Start loading, on the background threads, what rows ``rows`` (default: this reader's rows) of
        batch ``b`` need, and return at once. For loaders that call :meth:`rows` themselves; use it a
        few hundred batches ahead (:meth:`lookahead_batches`) so decoding overlaps serving."""
        return self._prefetch(b, rows)

    def _prefetch(self, b: int, rows=None, count: int = 1) -> list[cf.Future]:
        """Start loading what batches ``b .. b+count-1`` need: one background task per chunk (fetch +
        verify, then decode its needed row groups), so the chunks of a batch load in parallel; shuffled
        reads load whole mixing groups as they come into view (:attr:`_whole_group_prefetch`). Errors are
        left for the real read to report."""
        if rows is None and self._whole_group_prefetch:
            try:
                return self._prefetch_groups(b, count)
            except Exception:  # noqa: BLE001 - e.g. NotYetAvailable during a build: the real read waits
                return []
        try:
            plan = self._plan(b, rows, count)
        except Exception:  # noqa: BLE001 - e.g. NotYetAvailable during a build: the real read waits
            return []
        last_row = -1
        cfg = self._shuffle_cfg
        if cfg is not None and self.options.packed and cfg.lanes == self.options.num_streams:  # see _release_groups
            rows = self.my_rows if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
            if rows.size:
                last_row = ((b + count - 1) * self.options.batch_size + int(rows.max())) // cfg.lanes
        return [self.store.submit(self._load_chunk_part, c, offs, last_row) for c, offs in plan]

    @functools.cached_property
    def _whole_group_prefetch(self) -> bool:
        """Shuffled packed reads where this reader reads whole lanes (``R`` divides ``R* == lanes``) and a
        mixing group's row groups fit in half the memory budget: the prefetch loads each group's row
        groups once, as the group comes into view, instead of planning every batch (a batch of a group
        touches rows all over the group's blocks, and the group needs all of them within its first
        batches anyway). See :meth:`_prefetch_groups`."""
        cfg, opts = self._shuffle_cfg, self.options
        if not (cfg is not None and opts.packed and cfg.lanes == opts.num_streams
                and cfg.lanes % self.num_readers == 0
                and self.my_rows.size * self.num_readers == opts.batch_size):  # (not a worker's share of them)
            return False
        rows = cfg.block_rows * cfg.group_blocks
        lanes = cfg.lanes // self.num_readers
        rg_tokens = int(self.cache.ledger.config.get("row_group_tokens") or (1 << 20))
        # decoded bytes: the group's windows, plus a row group at each end of each block
        need = lanes * 4 * (rows * opts.seq_len + 2 * cfg.group_blocks * rg_tokens)
        return need <= opts.memory_budget_bytes // 2

    def _prefetch_groups(self, b: int, count: int) -> list[cf.Future]:
        """Load the row groups of every mixing group that batches ``b .. b+count-1`` (this reader's rows)
        reach and that is not loaded yet: one background task per chunk."""
        cfg, B = self._shuffle_cfg, self.options.batch_size
        t = (b * B + int(self.my_rows.min())) // cfg.lanes
        t_end = ((b + count - 1) * B + int(self.my_rows.max())) // cfg.lanes
        futs: list[cf.Future] = []
        while t <= t_end:
            with self._lock:
                lo, hi = self._prefetched_span
            if not lo <= t < hi:
                _, glo, ghi = order.shuffle_group_of_rows(np.asarray([t]), cfg)
                lo, hi = int(glo[0]), int(ghi[0])
                with self._lock:
                    new = lo not in self._prefetched_groups
                    if new:  # (two planning threads never both load a group)
                        self._prefetched_groups[lo] = True
                        while len(self._prefetched_groups) > 64:
                            self._prefetched_groups.popitem(last=False)
                if new:
                    try:
                        # first what the planned batches of the group need (the pool runs tasks in order),
                        # then the rest of the group
                        b0 = max(b, lo * cfg.lanes // B)
                        n = min(b + count, -(-hi * cfg.lanes // B)) - b0
                        if n > 0:
                            futs.extend(self.store.submit(self._load_chunk_part, c, offs, hi - 1)
                                        for c, offs in self._plan(b0, None, n))
                        futs.extend(self._prefetch_group(lo, hi))
                    except BaseException:  # e.g. NotYetAvailable during a build: try again next time
                        with self._lock:
                            self._prefetched_groups.pop(lo, None)
                        raise
                with self._lock:
                    self._prefetched_span = (lo, hi)
            t = hi
        return futs

    def _prefetch_group(self, lo: int, hi: int) -> list[cf.Future]:
        cfg, L = self._shuffle_cfg, self.options.seq_len
        lanes = list(range(self.reader_index % self.num_readers, cfg.lanes, self.num_readers))
        idx = self.stream_index()
        per_chunk: dict[int, list[tuple[int, int]]] = {}
        for lane, ranges in zip(lanes, order.shuffle_group_sources_of_lanes(lo, lanes, cfg)):
            for r0, r1 in ranges.tolist():
                for _, c, a, z in idx.pieces(lane, r0 * L, r1 * L):
                    per_chunk.setdefault(c, []).append((a, z))
        return [self.store.submit(self._load_chunk_ranges, c, ranges, hi - 1) for c, ranges in per_chunk.items()]

    def _load_chunk_ranges(self, c: int, ranges: list[tuple[int, int]], last_row: int) -> None:
        """Prefetch the row groups of chunk ``c`` that hold tokens ``[a, z)`` for each range."""
        if last_row < self._passed_row:  # the reads have passed the group: already served
            return
        try:
            starts = self.store.meta(c).rg_token_starts
            groups: set[int] = set()
            for a, z in ranges:
                g0 = int(np.searchsorted(starts, a, side="right")) - 1
                g1 = int(np.searchsorted(starts, z - 1, side="right")) - 1
                groups.update(range(g0, g1 + 1))
            self.store.warm_row_groups(c, sorted(groups))
        except Exception:  # noqa: BLE001 - a prefetch never fails the run; the real read reports it
            pass

    def _load_chunk_part(self, c: int, offs: np.ndarray, last_row: int = -1) -> None:
        if 0 <= last_row < self._passed_row:  # a shuffled plan the reads have overtaken: already served
            return
        try:
            meta = self.store.meta(c)
            if not self.options.packed:
                docs = self.store.doc_index(c)
                cum = self._pieces_cum(c, docs)
                doc = np.searchsorted(cum, offs, side="right") - 1
                offs = docs.doc_starts[doc] + (offs - cum[doc]) * self.options.seq_len
            groups = np.unique(np.searchsorted(meta.rg_token_starts, offs, side="right") - 1).tolist()
            done = self._released.get(c, 0)  # a plan the reads have overtaken: groups already used and released
            self.store.warm_row_groups(c, [g for g in groups if g >= done] if done else groups)
        except Exception:  # noqa: BLE001 - a prefetch never fails the run; the real read reports it
            pass

    def _plan(self, b: int, rows=None, count: int = 1) -> list[tuple[int, np.ndarray]]:
        """``(chunk, unit offsets)`` that rows ``rows`` (default: this reader's) of batch ``b`` touch, in
        chunk order. Packed: token offsets of each window's first and last token; unpacked: example offsets."""
        opts = self.options
        L = opts.seq_len
        idx = self.stream_index()
        rows = self.my_rows if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
        src = self._source_indices_batches([(b + i) * opts.batch_size + rows for i in range(count)])
        s, j = order.split_example_index(src, opts.num_streams)
        if opts.packed:
            pos = np.concatenate([j * L, j * L + L - 1])
            s = np.concatenate([s, s])
        else:
            pos = j
        if not (idx.loop and idx.complete):
            keep = pos < idx._class_totals[s]
            s, pos = s[keep], pos[keep]
        _, chunks, offs = locate_streams(idx, s, pos)
        return [(int(c), offs[chunks == c]) for c in np.unique(chunks)]

    def _source_indices_batches(self, exs: list[np.ndarray]) -> np.ndarray:
        """``_source_indices`` of several batches' examples, concatenated (see :meth:`_perm_batches`)."""
        if self._shuffle_cfg is None:
            return np.concatenate(exs)
        return np.concatenate(self._perm_batches(exs))

    def _source_indices(self, ex: np.ndarray) -> np.ndarray:
        """``pi(ex)`` with a shuffle, else ``ex``. The prefetch planner and the assembler ask for the same
        batches, so recent answers are kept (a few KB) instead of computing the cipher twice."""
        if self._shuffle_cfg is None:
            return ex
        return self._perm_batches([ex])[0]

    def _regular_batch(self, ex: np.ndarray) -> int | None:
        """``b`` if ``ex`` is this reader's rows of batch ``b`` (``b * B + my_rows``), else None."""
        rows = self.my_rows
        if ex.size != rows.size or not ex.size:
            return None
        d = ex - rows
        B = self.options.batch_size
        b0 = int(d[0])
        if b0 < 0 or b0 % B or not (d == b0).all():
            return None
        return b0 // B

    def _perm_batches(self, exs: list[np.ndarray]) -> list[np.ndarray]:
        """``pi`` of each array of ``exs``, cached. The cipher's cost is mostly per call (a few hundred
        small numpy operations whatever the size), so a miss computes every missing array at once, and
        when the last one is a regular batch ``b`` of this reader, batches ``b+1 .. b+_PERM_BATCHES-1``
        too: the assembler and the prefetch planner then find almost every batch cached."""
        keys = [(int(ex[0]), ex.size, ex.tobytes()) if ex.size else None for ex in exs]
        with self._lock:
            got = [self._perm_cache.get(k) for k in keys]
        todo = [i for i, g in enumerate(got) if g is None]
        if not todo:
            return got
        arrs = [exs[i] for i in todo]
        akeys = [keys[i] for i in todo]
        last = self._regular_batch(exs[todo[-1]])
        if last is not None:
            B = self.options.batch_size
            with self._lock:
                for b in range(last + 1, last + _PERM_BATCHES):
                    ex = b * B + self.my_rows
                    k = (int(ex[0]), ex.size, ex.tobytes())
                    if k not in self._perm_cache:
                        arrs.append(ex)
                        akeys.append(k)
        allsrc = np.asarray(order.shuffle_example_indices(np.concatenate(arrs), self._shuffle_cfg), dtype=np.int64)
        parts = np.split(allsrc, np.cumsum([a.size for a in arrs])[:-1])
        with self._lock:
            for k, src in zip(akeys, parts):
                src.setflags(write=False)
                self._perm_cache[k] = src
            while len(self._perm_cache) > 4096:
                self._perm_cache.popitem(last=False)
        for i, src in zip(todo, parts):
            got[i] = src
        return got

    # -- assembling examples ---------------------------------------------------------------------------
    def _examples(self, ex: np.ndarray, into: dict[str, np.ndarray] | None = None,
                  src: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The examples ``ex`` as a batch dict. ``into``: arrays (any row strides; the worker processes
        pass their rows of a shared-memory slot) that receive the result and are returned. ``src``:
        ``_source_indices(ex)`` if the caller has it."""
        opts = self.options
        L, n = opts.seq_len, ex.size
        idx = self.stream_index()
        if src is None:
            src = self._source_indices(ex)
        s, j = order.split_example_index(src, opts.num_streams)
        if opts.layout == "flat":  # written in place, row by row
            out = self._examples_flat(idx, ex, s, j, into)
            self._release_groups(idx, ex)
            return out
        if into is not None:
            got = self._examples(ex, src=src)
            for k, v in got.items():
                np.copyto(into[k], v, casting="no")
            return into
        # packed rows are written whole (padding rows are zeroed below), so skip zero-filling them here
        alloc = np.empty if opts.packed else np.zeros
        out = {
            "inputs": alloc((n, L), np.int32),
            "targets": alloc((n, L), np.int32),
            "segment_ids": alloc((n, L), np.int32),
            "positions": alloc((n, L), np.int32),
            "loss_mask": alloc((n, L), bool),
            "example_ids": ex.astype(np.int64, copy=True),
            "epochs": np.full(n, -1, np.int64),
            "valid": np.ones(n, bool),
        }
        sel = self._valid_rows(idx, j, out)
        if sel.size:
            if opts.packed:
                self._fill_packed(idx, s[sel], j[sel], sel, out)
            else:
                self._fill_unpacked(idx, s[sel], j[sel], sel, out)
        if opts.packed and sel.size < n:  # after filling: the fill may write scratch values there
            pad = np.flatnonzero(~out["valid"])
            for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask"):
                out[k][pad] = 0
        self._release_groups(idx, ex)
        return out

    def _fill_packed(self, idx, s, j, rows, out) -> None:
        """Packed windows. Fast path (almost every row): the window lies inside one decoded row group, so
        all such rows of a row group are gathered at once; the rest (windows that cross a row-group or
        chunk boundary, or the padded end of an eval pass) are assembled piece by piece."""
        recs, cross, slow = self._classify_windows(idx, s, j, rows, out)
        if recs:
            recs.sort()
            self._copy_windows(recs, out)  # may write scratch values into the other rows: they come next
        for c, g, a, la, r in cross:
            self._fill_cross_row(c, g, a, la, r, out)
        for k in slow:
            self._fill_packed_row(idx, int(s[k]), int(j[k]), int(rows[k]), out)
        self._release_consumed(recs, cross)

    def _release_consumed(self, recs, cross) -> None:
        """Unshuffled packed reads move forward through each chunk: once a batch's windows start in row
        group ``g`` of a chunk, its groups before ``g`` are not needed again this pass, so they leave the
        cache at once and their buffers serve the next decodes (see ``ChunkStore.release``)."""
        if self._shuffle_cfg is not None or not (recs or cross):
            return
        first: dict[int, int] = {}
        for rec in itertools.chain(recs, cross):
            c, g = rec[0], rec[1]
            if g < first.get(c, g + 1):
                first[c] = g
        todo = []
        with self._lock:
            for c, g in first.items():
                done = self._released.get(c, 0)
                if g < done:  # a new pass over this chunk (or a jump back): start again from here
                    self._released[c] = g
                elif g > done:
                    todo.extend((c, x) for x in range(done, g))
                    self._released[c] = g
            while len(self._released) > 4096:
                self._released.pop(next(iter(self._released)))
        for c, g in todo:
            self.store.release(c, g)

    def _release_groups(self, idx, ex: np.ndarray) -> None:
        """Shuffled packed reads: once the reads have passed a mixing group of the growing-window shuffle
        (``order.shuffle_group_of_rows``), the row groups that lie wholly inside its source blocks
        (``order.shuffle_group_sources``) are not needed again this pass, and after the last group of a
        window, neither are those wholly inside the window (and the one before it: the row group over their
        boundary). They leave the cache at once, so new decodes reuse their buffers (memory already
        mapped) instead of faulting in fresh pages. Row groups at block ends may serve another group: the
        LRU keeps those. Only a cache decision: a read that jumps back decodes again."""
        cfg = self._shuffle_cfg
        if cfg is None or not self.options.packed or not ex.size or cfg.lanes != self.options.num_streams:
            return  # (with lanes == R*, a lane's rows are its stream's positions)
        lanes = cfg.lanes
        rows = ex // lanes
        t_min, t_max = int(rows.min()), int(rows.max())
        by_lane = ex % lanes
        key = by_lane.tobytes()
        lane_set = self._lane_sets.get(key)
        if lane_set is None:  # (a reader's batches have one or a few lane patterns)
            lane_set = frozenset(np.unique(by_lane).tolist())
            if len(self._lane_sets) < 64:
                self._lane_sets[key] = lane_set
        with self._lock:
            lo, hi = self._group_span
            fast = lo <= t_min and t_max < hi and lo in self._groups
        if fast:
            spans = [(lo, hi)]
        else:
            _, glo, ghi = order.shuffle_group_of_rows(np.unique(rows), cfg)
            spans = sorted(set(zip(glo.tolist(), ghi.tolist())))
        finished = []
        with self._lock:
            for g_lo, g_hi in spans:
                entry = self._groups.get(g_lo)
                if entry is None:
                    entry = self._groups[g_lo] = [g_hi, set()]
                if not lane_set <= entry[1]:
                    entry[1] |= lane_set
            self._group_span = spans[-1]
            if t_min < self._passed_row:  # a jump back: groups prefetched before may have been released
                self._prefetched_groups.clear()
                self._prefetched_span = (0, 0)
            self._passed_row = t_min
            for g_lo in [g for g, (g_hi, _) in self._groups.items() if g_hi <= t_min]:
                finished.append((g_lo, *self._groups.pop(g_lo)))
            while len(self._groups) > 64:  # reads far apart (random access): stop tracking the oldest
                self._groups.pop(next(iter(self._groups)))
        for g_lo, g_hi, g_lanes in finished:
            try:
                self._release_group(idx, g_lo, g_hi, sorted(g_lanes))
            except Exception:  # noqa: BLE001 - a cache decision never fails a read
                pass

    def _release_group(self, idx, g_lo: int, g_hi: int, lanes: list[int]) -> None:
        cfg = self._shuffle_cfg
        L = self.options.seq_len
        _, w_lo, w_hi = (int(x[0]) for x in order.shuffle_window_of(np.asarray([g_lo * cfg.lanes]), cfg))
        w_lo //= cfg.lanes
        w_hi //= cfg.lanes
        sources = order.shuffle_group_sources_of_lanes(g_lo, lanes, cfg)
        ranges = {lane: rr.tolist() for lane, rr in zip(lanes, sources)}
        if g_hi >= w_hi:  # the window's last group: the whole window, and the previous one
            prev = w_lo
            if w_lo > 0:
                prev = int(order.shuffle_window_of(np.asarray([(w_lo - 1) * cfg.lanes]), cfg)[1][0]) // cfg.lanes
            for lane in lanes:
                ranges[lane].append([prev, w_hi])
        for lane, rr in ranges.items():
            s = lane % idx.r
            for r0, r1 in rr:
                self._release_stream_range(idx, s, r0 * L, r1 * L)

    def _release_stream_range(self, idx, s: int, lo: int, hi: int) -> None:
        """Release the cached row groups that lie wholly inside tokens ``[lo, hi)`` of stream ``s``."""
        for _, c, a, b in idx.pieces(s, lo, hi):
            meta = self.store.cached_meta(c)
            if meta is None:  # not in the cache: neither are its row groups, most likely
                continue
            starts = meta.rg_token_starts
            g0 = int(np.searchsorted(starts, a, side="left"))  # first row group starting at or after a
            g1 = int(np.searchsorted(starts, b, side="right")) - 1  # row groups ending at or before b
            if g1 > g0:
                self.store.release_range(c, g0, g1)

    def _classify_windows(self, idx, s, j, rows, out):
        """Locate packed windows (setting ``out["epochs"]``) and sort them into ``recs`` (inside one row
        group: ``(chunk, group, offset in group, row)``), ``cross`` (over two row groups of one chunk:
        ``(chunk, group, offset, tokens in the first group, row)``) and ``slow`` (positions ``k`` of
        the other windows: over chunks, or past the end of an eval pass)."""
        L = self.options.seq_len
        epochs, chunks, offs = locate_streams(idx, s, j * L)
        out["epochs"][rows] = epochs
        # plain Python over the (few) rows: cheaper than a dozen numpy calls per chunk
        ends = (offs + L).tolist()
        limits = idx.counts[chunks].tolist()
        recs, slow, cross = [], [], []
        rg_starts: dict[int, list[int]] = {}
        for k, (c, o, e, lim, r) in enumerate(zip(chunks.tolist(), offs.tolist(), ends, limits, rows.tolist())):
            if e > lim:
                slow.append(k)
                continue
            starts = rg_starts.get(c)
            if starts is None:
                starts = rg_starts[c] = self.store.meta(c).rg_token_starts_list
            g = bisect.bisect_right(starts, o) - 1
            if e > starts[g + 1]:
                if g + 2 < len(starts) and e <= starts[g + 2]:
                    cross.append((c, g, o - starts[g], starts[g + 1] - o, r))  # two row groups of one chunk
                else:
                    slow.append(k)
                continue
            recs.append((c, g, o - starts[g], r))
        return recs, cross, slow

    def _valid_rows(self, idx, j: np.ndarray, out) -> np.ndarray:
        """Rows that hold an example; in eval mode the rows past the end of the pass become padding
        (``valid`` False, ``example_ids`` -1). Waits (NotYetAvailable) while the end is unknown."""
        if self.options.eval_mode:
            out["valid"][...] = j < self._eval_limit(idx, j)
            out["example_ids"][~out["valid"]] = -1
        return np.flatnonzero(out["valid"])

    # -- layout="flat" ---------------------------------------------------------------------------------
    def _examples_flat(self, idx, ex: np.ndarray, s: np.ndarray, j: np.ndarray,
                       into: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Packed examples in the flat-tokens layout (see :func:`expand_flat`); into ``into`` if given
        (rows may be strided: everything below writes whole rows or indexes [row, column])."""
        L, n = self.options.seq_len, ex.size
        if into is None:
            out = {
                "tokens": np.empty((n, L + 1), np.uint32),
                "first_positions": np.zeros(n, np.int32),
                "num_tokens": np.full(n, L, np.int32),
                "example_ids": ex.astype(np.int64, copy=True),
                "epochs": np.full(n, -1, np.int64),
                "valid": np.ones(n, bool),
            }
        else:
            out = into
            out["first_positions"][:] = 0
            out["num_tokens"][:] = L
            out["example_ids"][:] = ex
            out["epochs"][:] = -1
            out["valid"][:] = True
        sel = self._valid_rows(idx, j, out)
        if sel.size:
            s, j = s[sel], j[sel]
            recs, cross, slow = self._classify_windows(idx, s, j, sel, out)
            if recs:
                recs.sort()
                self._flat_windows(recs, out)
            for c, g, a, la, r in cross:
                self._flat_cross_row(c, g, a, la, r, out)
            for k in slow:
                self._flat_packed_row(idx, int(s[k]), int(j[k]), int(sel[k]), out)
            self._release_consumed(recs, cross)
        if sel.size < n:
            pad = np.flatnonzero(~out["valid"])
            out["tokens"][pad] = 0
            out["num_tokens"][pad] = 0
            out["first_positions"][pad] = 0
        return out

    def _flat_windows(self, recs, out) -> None:
        """Windows inside one row group: ``tokens[r] = 2 * padded[a : a+L+1]`` (the previous token, then
        the window), runs of a row group's consecutive windows in one strided pass; then the start bits
        and first positions from the row groups' document starts, for the whole batch at once."""
        L = self.options.seq_len
        W = out["tokens"].view(np.int32)  # 2*token as int32 bits: the same bytes as the uint32 value
        runs = list(_window_runs(recs, L))
        groups = self.store.row_groups([(c, g) for c, g, *_ in runs])  # (sorted: recs are)
        for c, g, a, r, k, step in runs:  # the tokens as they are; doubled below, for the batch at once
            p = groups[(c, g)].padded
            if k == 1:
                W[r] = p[a:a + L + 1]
            else:  # k consecutive windows: their tokens in one pass, their previous tokens in another
                dst = W[r:r + (k - 1) * step + 1:step]
                dst[:, 1:] = p[a + 1:a + 1 + k * L].reshape(k, L)
                dst[:, 0] = p[a:a + k * L:L]
        W <<= 1  # (rows not in recs hold scratch values here; the caller writes them afterwards)
        rows, first, owner, offset = _doc_starts_in_windows(recs, groups, L)
        out["first_positions"][rows] = first
        tok = out["tokens"]  # [row, column] indexing: rows may be strided (a worker's rows of a slot)
        tok[rows[owner], 1 + offset] += np.uint32(1)
        at_start = rows[first == 0]  # windows that begin a document: start bit, and no previous token
        tok[at_start, 1] += np.uint32(1)
        tok[at_start, 0] = 0

    def _flat_cross_row(self, c: int, g: int, a: int, la: int, r: int, out) -> None:
        """A window over two row groups of one chunk (the second begins with a document)."""
        L = self.options.seq_len
        rg1, rg2 = self.store.row_group(c, g), self.store.row_group(c, g + 1)
        row = out["tokens"][r].view(np.int32)
        np.left_shift(rg1.padded[a:a + la + 1], 1, out=row[:la + 1])
        np.left_shift(rg2.padded[1:1 + L - la], 1, out=row[la + 1:])
        pos = np.concatenate([rg1.positions_range(a, a + la), rg2.positions_range(0, L - la)])
        self._flat_marks(r, pos, out)

    def _flat_packed_row(self, idx, s: int, j: int, r: int, out) -> None:
        """Any other window (over chunks, or the padded last window of an eval pass)."""
        L = self.options.seq_len
        tok, inp, pos, _ = self._stream_range(idx, s, j * L, (j + 1) * L)
        m = tok.size
        row = out["tokens"][r].view(np.int32)
        row[:] = 0
        np.left_shift(tok, 1, out=row[1:m + 1])
        if m:
            row[0] = inp[0] * 2  # the previous token of the same document (0 at a document start)
        out["num_tokens"][r] = m
        self._flat_marks(r, pos, out)

    @staticmethod
    def _flat_marks(r: int, pos: np.ndarray, out) -> None:
        """Start bits, first position and the previous-token slot of row ``r`` from its tokens' positions."""
        row = out["tokens"][r]
        starts = np.flatnonzero(pos == 0)
        row[1 + starts] += np.uint32(1)
        out["first_positions"][r] = pos[0] if pos.size else 0
        if pos.size and pos[0] == 0:
            row[0] = 0

    def _fill_cross_row(self, c: int, g: int, a: int, la: int, r: int, out) -> None:
        """A window from token ``a`` of row group ``g`` of chunk ``c`` (its last ``la`` tokens) into row
        group ``g + 1`` (documents never span row groups, so a document starts at the boundary)."""
        L = self.options.seq_len
        rg1, rg2 = self.store.row_group(c, g), self.store.row_group(c, g + 1)
        lb = L - la
        out["targets"][r, :la] = rg1.padded[a + 1:a + 1 + la]
        out["targets"][r, la:] = rg2.padded[1:1 + lb]
        out["inputs"][r, :la] = rg1.padded[a:a + la]
        out["inputs"][r, la:] = rg2.padded[:lb]
        pos = out["positions"][r]
        pos[:la] = rg1.positions_range(a, a + la)
        pos[la:] = rg2.positions_range(0, lb)
        flag = pos == 0
        out["inputs"][r][flag] = 0
        flag[0] = True
        np.cumsum(flag, dtype=np.int32, out=out["segment_ids"][r])
        out["loss_mask"][r] = True

    def _copy_windows(self, recs, out) -> None:
        """Windows that lie inside one row group. Consecutive windows of one row group that go to equally
        spaced output rows (the usual case: a stream's rows of a batch) are one strided copy of targets and
        inputs; positions, segment ids and the zero inputs at document starts come from the row groups'
        document starts for the whole batch at once (a few hundred segments, not one pass per token)."""
        L = self.options.seq_len
        tg, ip = out["targets"], out["inputs"]
        runs = list(_window_runs(recs, L))
        groups = self.store.row_groups([(c, g) for c, g, *_ in runs])  # (sorted: recs are)
        for c, g, a, r, k, step in runs:
            rg = groups[(c, g)]
            if k == 1:
                tg[r] = rg.padded[a + 1:a + 1 + L]
                ip[r] = rg.padded[a:a + L]
            else:
                dst = slice(r, r + (k - 1) * step + 1, step)
                tg[dst] = rg.padded[a + 1:a + 1 + k * L].reshape(k, L)
                ip[dst] = rg.padded[a:a + k * L].reshape(k, L)
        self._segments(recs, groups, out)

    def _segments(self, recs, groups, out) -> None:
        """positions, segment_ids, loss_mask and the zero inputs at document starts of the rows in ``recs``
        (windows inside one decoded row group each; ``recs`` sorted by row group)."""
        L = self.options.seq_len
        nrows = out["targets"].shape[0]
        rows, first, owner, offset = _doc_starts_in_windows(recs, groups, L)
        # segments, as flat offsets into the [rows, L] outputs: each window's first piece (at column 0,
        # position `first`), then one per document start inside it. Runs continue over rows that are
        # not in recs; those are written afterwards (crossing windows) or zeroed (padding).
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
        out["loss_mask"][:] = True

    def _fill_packed_row(self, idx, s: int, j: int, row: int, out) -> None:
        L = self.options.seq_len
        tok, inp, pos, _ = self._stream_range(idx, s, j * L, (j + 1) * L)
        m = tok.size
        for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask"):
            out[k][row, m:] = 0
        out["targets"][row, :m] = tok
        out["inputs"][row, :m] = inp
        out["positions"][row, :m] = pos
        flag = pos == 0
        if m:
            flag[0] = True
        out["segment_ids"][row, :m] = np.cumsum(flag, dtype=np.int32)
        out["loss_mask"][row, :m] = True

    def _stream_range(self, idx: order.StreamIndex, s: int, lo: int, hi: int):
        """Stream ``s`` tokens [lo, hi) (fewer at the end of a single pass): tokens, inputs, positions, and the
        epoch of each seq_len window's first token."""
        L = self.options.seq_len
        toks, poss, starts, epochs = [], [], [], []
        prev = 0
        got = 0
        for epoch, chunk, a, b in idx.pieces(s, lo, hi):
            t, p = self.store.tokens(chunk, a, b)
            if not toks and p.size and p[0] > 0:
                prev = int(self.store.tokens(chunk, a - 1, a)[0][0])
            toks.append(t)
            poss.append(p)
            starts.append(got)
            epochs.append(epoch)
            got += t.size
        if not toks:
            e = np.zeros(0, np.int32)
            return e, e, e, np.full(-(-(hi - lo) // L), -1, np.int64)
        tok = np.concatenate(toks) if len(toks) > 1 else toks[0]
        pos = np.concatenate(poss) if len(poss) > 1 else poss[0]
        inp = np.empty_like(tok)
        inp[1:] = tok[:-1]
        inp[0] = prev
        inp[pos == 0] = 0
        win = np.arange(0, hi - lo, L)
        which = np.searchsorted(np.asarray(starts), win, side="right") - 1
        ep = np.asarray(epochs, dtype=np.int64)[which]
        ep[win >= got] = -1
        return tok, inp, pos, ep

    def _pieces_cum(self, c: int, docs) -> np.ndarray:
        with self._lock:
            got = self._piece_cum.get(c)
            if got is not None:
                self._piece_cum.move_to_end(c)
                return got
        per = order.pieces_per_doc(docs.doc_lengths, self.options.seq_len)
        cum = np.concatenate([[0], np.cumsum(per)])
        with self._lock:
            self._piece_cum[c] = cum
            while len(self._piece_cum) > 256:
                self._piece_cum.popitem(last=False)
        return cum

    def _fill_unpacked(self, idx, s, j, rows, out) -> None:
        L = self.options.seq_len
        n = rows.size
        epochs, chunks, offs = locate_streams(idx, s, j)
        out["epochs"][rows] = epochs
        ar = np.arange(L, dtype=np.int64)
        for c in np.unique(chunks):
            mc = np.flatnonzero(chunks == c)
            meta = self.store.meta(int(c))
            docs = self.store.doc_index(int(c))
            cum = self._pieces_cum(int(c), docs)
            o = offs[mc]
            doc = np.searchsorted(cum, o, side="right") - 1
            start = (o - cum[doc]) * L
            length = np.minimum(docs.doc_lengths[doc] - start, L)
            tokoff = docs.doc_starts[doc] + start
            group = np.searchsorted(meta.rg_token_starts, tokoff, side="right") - 1
            for g in np.unique(group):
                mg = group == g
                rg = self.store.row_group(int(c), int(g))
                local = tokoff[mg] - meta.rg_token_starts[g]
                real = ar[None, :] < length[mg][:, None]
                gi = np.where(real, local[:, None] + ar[None, :], -1)  # -1 -> padded[0] == 0
                pos = np.where(real, start[mg][:, None] + ar[None, :], 0)
                tgt = rg.padded[gi + 1]
                prev = np.where(pos > 0, rg.padded[np.maximum(gi, 0)], 0)
                dst = rows[mc[mg]]
                out["targets"][dst] = tgt
                out["inputs"][dst] = prev
                out["positions"][dst] = pos
                out["segment_ids"][dst] = real
                out["loss_mask"][dst] = real


__all__ = ["ReadOptions", "Reader", "BATCH_KEYS", "CacheNotReady", "ChunkError"]
