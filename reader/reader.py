"""The Reader: deterministic, sharded, seekable batches of a chunkledger cache.

Order: global batch ``b`` is ``example[b*B:(b+1)*B]``; reader ``r`` of ``R`` serves its rows
``k ≡ r (mod R)``. Which row of the data ``example[i]`` is, the pass rule says (:mod:`reader.order.passes`):
``"spans"`` (format version 4 on) makes every pass of ``E`` examples a permutation of the eval pass's rows,
read as ``R*`` contiguous spans; ``"streams"`` (older caches; Levanter's round-robin streams) has stream ``s`` be
``loop(all_chunks)[s::R*]`` and ``example[i] = stream_examples[i % R*][i // R*]``.

Examples are built at read time:

* **packed**: example ``j`` of a stream (the eval pass, under ``"spans"``) is its tokens ``[j*L, (j+1)*L)``
  (documents concatenated across chunk boundaries). ``targets`` are those tokens; ``inputs[t]`` is the
  previous token of the same document, or 0 at a document start (seqax's flat-tokens format);
  ``segment_ids``/``positions`` expose the documents.
* **unpacked**: one document piece per example (a document of ``n`` tokens gives ``ceil(n/L)`` pieces),
  padded with ``segment_ids == 0`` and ``loss_mask == False``.

The Reader only wires the parts together: :class:`reader.batch.examples.ExampleOrder` says which tokens each
row holds, :class:`reader.storage.store.ChunkStore` fetches and decodes them, :class:`reader.batch.assemble.Assembler`
writes them into a batch (:mod:`reader.batch.schema`), :mod:`reader.batch.prefetch` and :mod:`reader.batch.release`
keep the store ahead of the reads, and :mod:`reader.workers.pool` runs it all in child processes.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import warnings
import weakref
from typing import Iterator

import numpy as np

from reader.batch.assemble import SLAB_BATCHES, Assembler
from reader.storage.cache import Cache
from reader.mixture.mixture_file import is_mixture_path
from reader.mixture.io import open_mixture
from reader.mixture.mixture import Mixture
from reader.options import ReadOptions
from reader.batch.examples import ExampleOrder
from reader.batch.prefetch import Prefetcher
from reader.batch.readahead import Progress, read_ahead
from reader.batch.schema import batch_spec
from reader.batch.release import ReleasePolicy
from reader.storage.store import ChunkStore
from reader.storage.views import open_view
from reader.order.passes import RepeatedRowsWarning
from reader.order.streams import StreamIndex, reader_rows
from reader.workers.pool import WorkerPool


WAIT_TIMEOUT_S = 600.0  # how long a read waits for chunks a running build has not written yet, by default


class Reader:
    """Reads GLOBAL batches (or this reader's rows of them) of a cache; see the module docstring.

    Args:
      cache: cache root (local path or fsspec URL such as ``gs://b/cache``), an open :class:`Cache`, or a
        mixture file (``*.json``, :mod:`reader.mixture.mixture`): rows then come from several caches by weight,
        each row's ``components`` naming its cache.
      options: :class:`ReadOptions`.
      num_readers, reader_index: this host is reader ``reader_index`` of ``num_readers`` (R, r).
      wait_timeout_s: while the build runs, how long to wait for a chunk that is not written yet before
        raising :class:`reader.storage.cache.CacheNotReady` (not ``ReadOptions.worker_timeout_s``, which
        bounds a reader that makes no progress at all).
      poll_interval_s: how often to look for build progress while waiting (at least four times per
        ``ReadOptions.worker_timeout_s``).
      storage_options: passed to fsspec (e.g. ``{"token": ...}`` for gcsfs).
      serve_rows: serve only these rows of every batch, a sorted subset of reader ``reader_index``'s
        rows, as :attr:`my_rows` (``batch``, ``batches``, ``iter_batches`` and the prefetch use them;
        ``num_readers``/``reader_index`` still tell its streams and lanes). Reader workers use it.

    Attributes: ``options``, ``cache``, ``store`` (I/O counters: ``bytes_fetched``, ``fetches``, ...),
    ``order`` (which tokens each example is), ``my_rows`` (the rows of each global batch served here),
    ``masked`` (the cache, or a component of the mixture, has loss masks: a flat batch then has
    ``loss_mask``, see ``reader.batch.schema``), ``continuation_slots`` (best fit: the columns of a flat
    batch's ``continuation_*`` fields; 0: none).
    For a mixture, ``cache`` is the :class:`reader.mixture.mixture.Mixture` (its component caches in
    ``cache.caches``), ``store`` a :class:`reader.mixture.io.MixtureStore` (``store.stores``) and
    ``order`` a :class:`reader.mixture.mixture.MixtureOrder`.
    """

    def __init__(self, cache: str | Cache, options: ReadOptions | None = None, num_readers: int = 1,
                 reader_index: int = 0, wait_timeout_s: float = WAIT_TIMEOUT_S, *, poll_interval_s: float = 1.0,
                 storage_options: dict | None = None, serve_rows=None):
        self.options = opts = options or ReadOptions()
        source = os.fspath(cache) if isinstance(cache, os.PathLike) else cache
        if isinstance(source, Cache):
            self.cache = source
        else:
            self.cache = None if is_mixture_path(source) else Cache(source, storage_options=storage_options)
        self.num_readers = int(num_readers)
        self.reader_index = int(reader_index)
        self.my_rows = reader_rows(opts.batch_size, self.num_readers, self.reader_index)
        if serve_rows is not None:
            rows = np.asarray(serve_rows, dtype=np.int64).reshape(-1)
            if not rows.size or (np.diff(rows) <= 0).any() or not np.isin(rows, self.my_rows).all():
                raise ValueError(f"serve_rows must be a non-empty, sorted subset of the rows of reader "
                                 f"{self.reader_index} of {self.num_readers}; got {rows.tolist()}")
            self.my_rows = rows
        self.wait_timeout_s = float(wait_timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self.progress = Progress()  # moves with every byte range fetched and every try of a read
        mixture = None if self.cache is not None else Mixture(source, storage_options=storage_options)
        # loss masks: a cache built from supervised records, or a mixture with one (its plain components'
        # rows then have the plain rule: every real token is a loss token)
        caches = mixture.caches if mixture is not None else [self.cache]
        self.masked = any(c.ledger.masked for c in caches)
        # best fit: a flat batch's slots for continuation pieces past column 0 (reader.batch.schema), by the
        # rule each cache's format version gives
        self.continuation_slots = opts.continuation_slots(int(c.ledger.raw["format_version"]) for c in caches)
        # the budget: batches assembled ahead by iter_batches (a quarter at most), decoded data (the rest)
        self.slab, self.ahead_bytes = self._read_ahead_size()
        data = dataclasses.replace(opts, memory_budget_bytes=opts.memory_budget_bytes - min(
            self.ahead_bytes, opts.memory_budget_bytes // 4))
        if self.cache is None:  # a mixture file: the same parts, one per component behind each
            self.cache, self.store, self.order, self.release, self.prefetcher = open_mixture(
                mixture, data, self.my_rows, self.num_readers, self.reader_index)
        else:
            view, seen = open_view(self.cache, opts.view, index_cache=opts.index_cache)  # (seen: as the view's reads see it)
            self.store = ChunkStore(self.cache, memory_budget_bytes=data.memory_budget_bytes,
                                    threads=opts.prefetch_threads, view=view, timeout_s=opts.worker_timeout_s)
            self.order = ExampleOrder(seen, data, self.store, self.my_rows)
            self.release = ReleasePolicy(self.store, self.order, data)
            self.prefetcher = Prefetcher(seen, self.store, self.order, data, self.release, self.my_rows,
                                         self.num_readers, self.reader_index)
        for store in getattr(self.store, "stores", [self.store]):  # (a mixture's: one per component)
            store.progress = self.progress.beat
        self._unwarned = serve_rows is None  # (a reader worker's parent warns, not the worker)
        # a remote cache read asynchronously: a read asks for all it needs at once, before it waits for any
        self._ask = any(s.asynchronous for s in getattr(self.store, "stores", [self.store]))
        self.assembler = Assembler(self.store, opts, on_windows=self.release.concat_windows_read, masked=self.masked,
                                   continuations=self.continuation_slots)
        self._pools: weakref.WeakSet = weakref.WeakSet()  # worker pools of open iter_batches (num_workers > 0)

    def close(self) -> None:
        for pool in list(self._pools):
            pool.close()
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _pass_limit(self):
        """A mixture's ``(first step refused, its error)`` by a component's ``max_passes``, or None."""
        limit = getattr(self.order, "pass_limit", None)
        return None if limit is None else limit()

    def _warn_repeats(self) -> None:
        """Warn, once, when this read serves rows twice within a pass: the ``"streams"`` rule (the default of
        caches older than format version 4) on fewer chunks than ``R*`` or unequal streams. (At the first
        read: it needs the per-chunk counts a read computes anyway.)"""
        if not self._unwarned:
            return
        self._unwarned = False
        for order in getattr(self.order, "orders", [self.order]):
            repeated = order.repeated_rows()
            if not repeated:
                continue
            E, n = order.pass_examples(), len(order.cache.table)
            warnings.warn(
                f"{order.cache.url}: pass_rule='streams' (the default for caches of format version "
                f"{order.cache.ledger.format_version}) serves about {repeated / E:.0%} of the {E:,} rows of each "
                f"pass twice within it ({n} chunks in ideal_readers={self.options.ideal_readers} streams: a "
                "stream with fewer rows than its share of a pass loops over its chunks again). "
                "ReadOptions(pass_rule='spans') serves every row once per pass (other batches than this run's so far)",
                RepeatedRowsWarning, stacklevel=2)

    @property
    def examples_per_pass(self) -> int | tuple[int, ...]:
        """``E``, the examples of one pass (training; the rows of an eval pass at these options, concat: its
        whole rows), waiting for the build to finish; a mixture's, one per component. Step ``b`` is in pass
        ``b * batch_size // E`` (docs/READING.md, "Passes")."""
        self.cache.wait_complete(timeout_s=self.wait_timeout_s, poll_s=self.poll_interval_s,
                                 what="the size of a pass")
        if hasattr(self.order, "components"):
            return tuple(order.pass_examples() for order in self.order.components)
        return self.order.pass_examples()

    def _read_ahead_size(self) -> tuple[int, int]:
        """``(batches per slab, bytes)`` of what ``iter_batches`` may hold assembled ahead: the
        ``prefetch_batches`` and up to three slabs (queued, being filled, being served), within a quarter
        of ``memory_budget_bytes`` when a slab of one batch fits there."""
        opts = self.options
        batch = sum(d.itemsize * int(np.prod(shape)) for _, d, shape in
                    batch_spec(opts.layout, opts.seq_len, len(self.my_rows), self.masked,
                               self.continuation_slots, opts.varlen_segments))
        depth = max(1, opts.prefetch_batches)
        slab = max(1, min(SLAB_BATCHES, (opts.memory_budget_bytes // 4 // batch - depth) // 3))
        return slab, (depth + 3 * slab) * batch

    def memory(self) -> dict[str, int]:
        """Bytes against ``memory_budget_bytes`` (``budget``): ``decoded`` (row groups and chunk layouts held
        now), ``ahead_limit`` (the most ``iter_batches`` holds assembled ahead); and, not the reader's alone, ``rss``: the whole process (with the
        interpreter, numpy and pyarrow, about 70 MiB, and whatever else it runs; 0 where unknown)."""
        stores = getattr(self.store, "stores", [self.store])
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            rss = 0
        return {"budget": self.options.memory_budget_bytes, "decoded": sum(s.used_bytes for s in stores),
                "ahead_limit": self.ahead_bytes, "rss": rss}

    def _wait(self, attempt, what: str):
        """``attempt()``, waiting while it needs chunks a running build has not written yet (each try
        is progress: a reader waiting for a build is not stalled)."""
        beat = self.progress.beat

        def counted():
            beat()
            return attempt()

        # a poll is what shows that a waiting reader is alive: several per worker_timeout_s
        poll_s = min(self.poll_interval_s, self.options.worker_timeout_s / 4)
        return self.cache.wait(counted, timeout_s=self.wait_timeout_s, poll_s=poll_s, what=what)

    # -- sizes ------------------------------------------------------------------------------------------
    def stream_index(self) -> StreamIndex:
        """The :class:`reader.order.streams.StreamIndex` over the chunks known now (all once the build is done)."""
        return self.order.stream_index()

    @property
    def num_examples(self) -> int | None:
        """Eval mode: examples in the single pass (waits for the build to finish). Training: None."""
        if not self.options.eval_mode:
            return None
        self.cache.wait_complete(timeout_s=self.wait_timeout_s, poll_s=self.poll_interval_s,
                                 what="the size of the eval pass")
        return self.order.num_examples()

    @property
    def dropped_long(self) -> dict[str, int]:
        """``ReadOptions(drop_long=True)``: the documents longer than ``seq_len`` (and their tokens) that the
        read skips, in the chunks known now (of every component of a mixture); zeros otherwise."""
        docs, tokens = self.order.dropped_long()
        return {"documents": docs, "tokens": tokens}

    @property
    def num_batches(self) -> int | None:
        """Eval mode: number of batches of the pass (last one padded). Training (looping): None."""
        n = self.num_examples
        return None if n is None else -(-n // self.options.batch_size)

    def has_batch(self, b: int) -> bool:
        """False for batches past the end of an eval pass (waits while a running build has not decided)."""
        if not self.options.eval_mode:
            return True
        return self._wait(lambda: self.order.has_example(b * self.options.batch_size), f"eval batch {b}")

    # -- reads ------------------------------------------------------------------------------------------
    def _read(self, ex: np.ndarray, into: dict[str, np.ndarray] | None = None,
              src: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The examples ``ex`` as a batch (into ``into`` if given); ``src``: their source indices."""
        limit = self._pass_limit()
        if limit is not None and ex.size and int(ex.max()) >= limit[0] * self.options.batch_size:
            raise limit[1]
        if ex.size:  # where the reads are (what they release, how far a remote read looks ahead)
            B = self.options.batch_size
            self.prefetcher.pace.note(int(ex[0]) // B, int(ex[-1]) // B)
            if self._ask:
                self.prefetcher.ask(ex)
        out = self.assembler.assemble(self.order.locate(ex, src), into)
        self.release.examples_read(ex)
        if self._unwarned:
            self._warn_repeats()
        return out

    def rows(self, b: int, rows) -> dict[str, np.ndarray]:
        """Rows ``rows`` (ints in [0, B)) of GLOBAL batch ``b`` as a dict of arrays (``reader.batch.schema``)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        B = self.options.batch_size
        if b < 0:
            raise ValueError(f"batch index must be >= 0, got {b}")
        if rows.size and (rows.min() < 0 or rows.max() >= B):
            raise ValueError(f"rows must lie in [0, batch_size={B})")
        ex = int(b) * B + rows
        return self._wait(lambda: self._read(ex), f"batch {b}")

    def batch(self, b: int) -> dict[str, np.ndarray]:
        """This reader's rows of GLOBAL batch ``b``: ``rows(b, my_rows)``."""
        return self.rows(b, self.my_rows)

    def examples(self, ex) -> dict[str, np.ndarray]:
        """Global examples ``ex`` (indices in the possibly shuffled order)."""
        ex = np.asarray(ex, dtype=np.int64).reshape(-1)
        return self._wait(lambda: self._read(ex), "examples")

    def batches(self, b: int, count: int, out: dict[str, np.ndarray] | None = None) -> list[dict[str, np.ndarray]]:
        """``[batch(b), ..., batch(b + count - 1)]`` assembled in one pass (the per-call costs of locating
        and gathering are paid once); each batch is a view of its rows of one set of arrays.

        Args:
          out: arrays of ``count * len(my_rows)`` rows (``reader.batch.schema.batch_spec``) to assemble into,
            rows of any stride (reader workers pass their rows of a shared-memory slot).
        """
        if count == 1 and out is None:
            return [self.batch(b)]
        B, rows = self.options.batch_size, self.my_rows
        exs = [(b + i) * B + rows for i in range(count)]
        ex = np.concatenate(exs)

        def attempt():
            # shuffled: per batch, so the cipher's answers are cached and computed ahead per batch
            src = ex if self.order.shuffle is None else np.concatenate(self.order.sources(exs))
            return self._read(ex, out, src)

        got = self._wait(attempt, f"batches {b}..{b + count - 1}")
        n = rows.size
        return [{k: v[i * n:(i + 1) * n] for k, v in got.items()} for i in range(count)]

    def iter_batches(self, start: int = 0, count: int | None = None) -> Iterator[tuple[int, dict]]:
        """Yield ``(b, self.batch(b))`` for b = start, start+1, ... (``count`` batches, or until the end of
        the eval pass, or forever when training).

        Background work (:func:`reader.batch.readahead.read_ahead`): the next ``prefetch_batches``
        batches are assembled on a thread, a slab of up to ``SLAB_BATCHES`` at a time, and the row
        groups that batch ``b + lookahead`` will need are fetched, verified and decoded on
        ``prefetch_threads`` threads while batch ``b`` is served (:meth:`lookahead_batches`), so
        decoding overlaps serving. With ``num_workers > 0`` the batches come from reader workers
        instead (:class:`reader.workers.pool.WorkerPool`): views of shared memory that stay valid,
        unchanged, for as long as they are referenced. Either way, work held for
        ``worker_timeout_s`` without progress raises :class:`reader.ReaderStalled`.
        """
        limit = self._pass_limit()
        if limit is not None and (count is None or start + int(count) > limit[0]):
            # a mixture component's max_passes: serve every step before the first one refused, then raise
            if limit[0] > start:
                yield from self._iter_batches(start, limit[0] - start)
            raise limit[1]
        yield from self._iter_batches(start, count)

    def _iter_batches(self, start: int, count: int | None) -> Iterator[tuple[int, dict]]:
        if self.options.num_workers > 0:
            self._warn_repeats()  # (the workers read, and do not warn)
            pool = WorkerPool(self, start, count)
            self._pools.add(pool)
            yield from pool
            return
        opts = self.options
        if self.ahead_bytes > opts.memory_budget_bytes // 4:
            mib = lambda n: f"{n / 2**20:.3g} MiB"  # noqa: E731
            warnings.warn(f"memory_budget_bytes={mib(opts.memory_budget_bytes)} is too small for batches of "
                          f"{mib(self.ahead_bytes // (max(1, opts.prefetch_batches) + 3))}: reading ahead holds up to "
                          f"{mib(self.ahead_bytes)} of them (prefetch_batches={opts.prefetch_batches} plus three "
                          f"slabs of one), beyond the quarter of the budget they may use, so the reader holds more "
                          f"than its budget. Raise memory_budget_bytes to {mib(4 * self.ahead_bytes)} or more, or "
                          f"lower batch_size or prefetch_batches",
                          RuntimeWarning, stacklevel=2)
        assembler = cf.ThreadPoolExecutor(1, thread_name_prefix="chunkledger-assemble")
        try:
            yield from read_ahead(
                self.batches, start, stop=None if count is None else start + int(count),
                available=self.has_batch, slab=self.slab, depth=max(1, opts.prefetch_batches),
                executor=assembler, hint=lambda b, n: self.prefetch(b, None, n), submit_hint=self.store.plan,
                lookahead=self.lookahead_batches if opts.prefetch_threads > 0 else 0,
                progress=self.progress, timeout_s=opts.worker_timeout_s,
                describe=lambda b, n: f"batches {b}..{b + n - 1} in this process")
        finally:
            assembler.shutdown(wait=False, cancel_futures=True)

    # -- prefetch hints for loaders ---------------------------------------------------------------------
    def lookahead_batches(self) -> int:
        """How many batches ahead ``iter_batches`` decodes: about one row group per stream, within budget; on a
        remote cache more, with the latency and rate it sees (:meth:`reader.batch.prefetch.Prefetcher.lookahead`:
        ask again as the read goes)."""
        return self.prefetcher.lookahead()

    def read_ahead(self, b: int, stop: int | None = None) -> Iterator[None]:
        """Decode, on this thread, one step at a time, what batches from ``b`` (before ``stop``) will need (best
        fit: the packing windows they enter, :meth:`reader.batch.prefetch.Prefetcher.read_ahead`; else
        nothing): for a reader worker's idle time."""
        go = getattr(self.prefetcher, "read_ahead", None)  # (a mixture's prefetcher has none)
        return go(b, stop) if go is not None else iter(())

    def prefetch(self, b: int, rows=None, count: int = 1, every: int = 1) -> list[cf.Future]:
        """Start loading, on the background threads, what rows ``rows`` (default: this reader's rows) of
        batch ``b`` (and of ``b + every``, ... : ``count`` batches, planned in one pass) need, and return
        at once. For loaders that call :meth:`rows` themselves; use it :meth:`lookahead_batches` ahead
        so decoding overlaps serving."""
        if every == 1:
            return self.prefetcher.prefetch(b, rows, count)
        return [f for i in range(count) for f in self.prefetcher.prefetch(b + i * every, rows)]


__all__ = ["Reader"]
