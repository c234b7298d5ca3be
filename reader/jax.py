"""Global batches as sharded ``jax.Array``s, one loader per JAX process (optional extra: ``jax``).

The only module that imports jax. On every host (JAX process) of a training job::

    from jax.sharding import PartitionSpec as P
    from reader.jax import JaxLoader

    mesh = jax.make_mesh((16, 4), ("data", "model"))
    loader = JaxLoader("gs://bucket/cache", ReadOptions(seq_len=2048, batch_size=256), mesh,
                       P("data", None))
    for step, batch in loader.iter_batches(start=restored_step):
        state, metrics = train_step(state, batch)   # batch["inputs"]: jax.Array [B, L], sharded

A process reads only the rows of global batch ``b`` its devices hold (:func:`process_rows`) and assembles
each field with ``jax.make_array_from_callback`` (``layout="flat"``: expanded on the devices,
:func:`expand_flat`). No step communicates between processes: batch ``b`` equals ``Reader(path, opts).batch(b)``
for any process count, mesh or partition spec; resuming is ``iter_batches(start=step)``. See docs/JAX.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import os
import threading
import time
import weakref
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from reader.options import ReadOptions
from reader.reader import Reader
from reader.batch.readahead import read_ahead
from reader.batch.schema import CONTINUATION_FIELDS, FIELDS, FLAT_FIELDS, ROW_FIELDS, TOKEN_FIELDS, VARLEN_FIELDS, \
    continuations, loss_mask
from reader.workers.pool import WorkerPool


def batch_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes a partition spec splits the batch axis (its first entry) over."""
    if len(spec) == 0 or spec[0] is None:
        return ()
    first = spec[0]
    return tuple(first) if isinstance(first, (tuple, list)) else (first,)


def batch_shardings(mesh: Mesh, spec: PartitionSpec | None = None) -> tuple[NamedSharding, NamedSharding]:
    """``(token_sharding, row_sharding)`` for ``[B, L]`` and ``[B]`` arrays.

    ``spec`` partitions ``[B, L]``; its first entry (one mesh axis name, a tuple of names, or None) is the
    batch axis. Default: the batch axis spans every mesh axis (pure data parallelism), ``L`` unsharded.
    Per-row arrays (``valid``, ``epochs``, ``example_ids``) use the same batch partitioning.
    """
    if spec is None:
        spec = PartitionSpec(tuple(mesh.axis_names), None)
    if not isinstance(spec, PartitionSpec):
        spec = PartitionSpec(*spec)
    if len(spec) > 2:
        raise ValueError(f"spec {spec} has {len(spec)} entries; a batch is [batch, seq_len] (2 at most)")
    for name in batch_axes(spec) + ((spec[1],) if len(spec) > 1 and isinstance(spec[1], str) else ()):
        if name not in mesh.axis_names:
            raise ValueError(f"spec {spec} names mesh axis {name!r}; the mesh has axes {mesh.axis_names}")
    token_spec = PartitionSpec(spec[0] if len(spec) else None, spec[1] if len(spec) > 1 else None)
    row_spec = PartitionSpec(token_spec[0])
    return NamedSharding(mesh, token_spec), NamedSharding(mesh, row_spec)


def slice_rows(index, batch_size: int) -> np.ndarray:
    """The global rows of a device's index (a tuple of slices) into a ``[B, ...]`` array."""
    return np.arange(batch_size, dtype=np.int64)[index[0]]


def device_rows(sharding: jax.sharding.Sharding, batch_size: int, seq_len: int) -> dict:
    """``{device: global rows}`` for every device of this process that holds part of a ``[B, L]`` batch."""
    imap = sharding.addressable_devices_indices_map((batch_size, seq_len))
    return {d: slice_rows(idx, batch_size) for d, idx in imap.items()}


def process_rows(sharding: jax.sharding.Sharding, batch_size: int, seq_len: int) -> np.ndarray:
    """Sorted, unique global rows of a ``[B, L]`` batch that this process's devices hold.

    The only rows this process reads. Rows replicated over several local devices appear once.
    """
    per = device_rows(sharding, batch_size, seq_len)
    if not per:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate(list(per.values())))


def expand_flat(batch: Mapping[str, Any]) -> dict[str, jax.Array]:
    """``reader.expand_flat`` in jax.numpy (jit-able): the five ``[B, L]`` token fields of a ``layout="flat"``
    batch (``tokens`` uint32 ``[B, L+1]``, ``first_positions``, ``num_tokens``; ``loss_mask``, ``continuation_*``)."""
    import jax.numpy as jnp

    tok = jnp.asarray(batch["tokens"]).astype(jnp.uint32)
    B, L = tok.shape[0], tok.shape[1] - 1
    start = (tok[:, 1:] & 1).astype(bool)
    t = jnp.arange(L, dtype=jnp.int32)[None, :]
    real = t < jnp.asarray(batch["num_tokens"]).astype(jnp.int32)[:, None]
    targets = (tok[:, 1:] >> 1).astype(jnp.int32)
    inputs = jnp.where(start, 0, (tok[:, :-1] >> 1).astype(jnp.int32))
    cont, cont_inputs, seg_first = continuations(t, *(jnp.asarray(batch.get(f"continuation_{k}", jnp.zeros(
        (B, 0), jnp.int32))).astype(jnp.int32) for k in ("columns", "positions", "inputs")), jnp.int32)
    inputs = jnp.where(cont, cont_inputs, inputs)
    boundary = start | cont
    segment_ids = jnp.cumsum(boundary.astype(jnp.int32), axis=1) + (~boundary[:, :1]).astype(jnp.int32)
    last = jax.lax.cummax(jnp.where(boundary, t, -1), axis=1)
    first = jnp.asarray(batch["first_positions"]).astype(jnp.int32)[:, None]
    positions = jnp.where(last >= 0, t - last + seg_first(last), first + t)
    zero = jnp.zeros_like(targets)
    stored = jnp.asarray(batch["loss_mask"]).astype(bool) if batch.get("loss_mask") is not None else None
    return {"inputs": jnp.where(real, inputs, zero), "targets": jnp.where(real, targets, zero),
            "segment_ids": jnp.where(real, segment_ids, zero), "positions": jnp.where(real, positions, zero),
            "loss_mask": loss_mask(real, stored)}


__all__ = ["JaxLoader", "expand_flat", "TOKEN_FIELDS", "ROW_FIELDS", "process_rows", "device_rows", "batch_shardings"]

# The layout the loader reads packed examples in when it opens the cache itself: same fields, bit for
# bit, as "arrays", for a quarter of the host work and host-to-device bytes (expanded on the devices).
# A Reader passed as source keeps its own layout (ReadOptions.layout, "arrays" by default).
LOADER_LAYOUT = "flat"

# The fields (reader.batch.schema): TOKEN_FIELDS are [B, L] arrays, ROW_FIELDS [B] arrays. The int64 per-row
# fields (example_ids, epochs) become int32 jax.Arrays unless jax_enable_x64 is on.


class JaxLoader:
    """Global batches of a chunkledger cache as sharded ``jax.Array``s, with sliding-window prefetch.

    Args:
      source: a cache path/URL (``str`` or path; a :class:`reader.Reader` is created with
        ``num_readers=1``) or an existing ``Reader`` (its ``rows(b, rows)`` is used; its own
        ``num_readers`` does not matter, ``rows`` addresses global rows).
      opts: :class:`reader.ReadOptions` (required with a path; ignored with a Reader, which has its own).
        With a path and packed examples the loader reads :data:`LOADER_LAYOUT` (``"flat"``) whatever
        ``opts.layout`` says, and expands on the devices (same fields, bit for bit); pass a ``Reader``
        to choose the layout yourself.
      mesh: the ``jax.sharding.Mesh`` of the job (all devices of all processes).
      spec: ``PartitionSpec`` of the ``[B, L]`` arrays, e.g. ``P("data", None)``, ``P(("data", "fsdp"),
        None)`` or ``P("data", "seq")``. Default: batch over every mesh axis. A ``NamedSharding`` also
        works (then ``mesh`` may be None).
      start: first step of ``iter(loader)`` (a resumed job passes its restored step).
      prefetch: batches kept in flight ahead of the one being consumed (0 = synchronous).
      threads: threads that build batches concurrently (default 1). One is enough when a batch is
        read faster than a step runs (the plain reader already fetches chunks on its own threads); more
        help only when single reads are latency-bound (remote storage, cold cache) and add GIL contention.
        ``prefetch`` and ``threads`` apply to reads in this process; with ``ReadOptions(num_workers=W)``
        (W > 0) :meth:`iter_batches` reads through W reader workers (processes) instead (each decodes and
        assembles every W-th of :attr:`rows` into shared memory, ``prefetch_batches`` ahead; see the
        module docstring), which needs a ``reader.Reader`` or a path as ``source``, and W must divide
        the number of :attr:`rows`. ``global_batch`` always reads in this process.
      fields: fields to build (default: every field in :data:`TOKEN_FIELDS` and :data:`ROW_FIELDS`, and a
        varlen read's ``cu_seqlens`` ``[B, max_segments + 1]`` and ``max_seqlen``, sharded like the rows).
      reader_kwargs: extra keyword arguments for ``Reader(...)`` when ``source`` is a path
        (e.g. ``wait_timeout_s``).

    Attributes: ``batch_size``, ``seq_len``, ``token_sharding``, ``row_sharding``, ``rows`` (the global
    rows this process reads), ``num_batches`` (eval: finite; training: None), ``stats``.
    """

    def __init__(self, source, opts=None, mesh: Mesh | None = None,
                 spec: PartitionSpec | NamedSharding | None = None, *,
                 start: int = 0, prefetch: int = 2, threads: int | None = None,
                 fields: Sequence[str] | None = None, reader_kwargs: Mapping[str, Any] | None = None):
        if isinstance(spec, NamedSharding):
            if mesh is not None and mesh != spec.mesh:
                raise ValueError("pass either a mesh and a PartitionSpec, or a NamedSharding (not another mesh)")
            mesh, spec = spec.mesh, spec.spec
        if mesh is None:
            raise ValueError("JaxLoader needs a mesh, e.g. jax.make_mesh((jax.device_count(),), ('data',)), "
                             "or spec=NamedSharding(mesh, PartitionSpec(...))")
        if isinstance(source, (str, os.PathLike)):
            if opts is None:
                raise ValueError("JaxLoader(path, opts, mesh, spec): opts (reader.ReadOptions) is required with a path")
            if opts.packed and opts.layout != LOADER_LAYOUT:
                opts = dataclasses.replace(opts, layout=LOADER_LAYOUT)
            self.reader = Reader(os.fspath(source), opts, num_readers=1, reader_index=0, **dict(reader_kwargs or {}))
            self._owns_reader = True
        else:
            if not hasattr(source, "rows"):
                raise TypeError(f"source must be a cache path or a reader.Reader, got {type(source).__name__}")
            self.reader = source
            self._owns_reader = False
        self.opts = getattr(self.reader, "options", None)
        if self.opts is None:
            raise TypeError(f"{type(self.reader).__name__} has no .options; pass a reader.Reader or a cache path")
        self.num_workers = int(getattr(self.opts, "num_workers", 0) or 0)
        self.batch_size = int(self.opts.batch_size)
        self.seq_len = int(self.opts.seq_len)
        self.mesh = mesh
        self.token_sharding, self.row_sharding = batch_shardings(mesh, spec)
        self.spec = self.token_sharding.spec
        n_shards = int(np.prod([mesh.shape[a] for a in batch_axes(self.spec)], dtype=np.int64))
        if self.batch_size % n_shards:
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by the {n_shards} batch shards of spec "
                f"{self.spec} on mesh {dict(mesh.shape)}; pick a batch_size that is a multiple of {n_shards}")
        if len(self.spec) > 1 and self.spec[1] is not None:
            seq_axes = self.spec[1] if isinstance(self.spec[1], tuple) else (self.spec[1],)
            n_seq = int(np.prod([mesh.shape[a] for a in seq_axes], dtype=np.int64))
            if self.seq_len % n_seq:
                raise ValueError(f"seq_len {self.seq_len} is not divisible by the {n_seq} sequence shards of {self.spec}")
        # a varlen read's cu_seqlens and max_seqlen (reader.batch.schema), sharded like the rows
        self._segments = getattr(self.opts, "varlen_segments", None)
        known = TOKEN_FIELDS + VARLEN_FIELDS * (self._segments is not None) + ROW_FIELDS
        if fields is None:
            fields = known
        unknown = set(fields) - set(known)
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}; known: {known}")
        self.fields = tuple(fields)
        # other [B, X] arrays (flat tokens, continuation slots, cu_seqlens): rows partitioned, columns whole
        self._wide_sharding = NamedSharding(mesh, PartitionSpec(self.spec[0] if len(self.spec) else None, None))
        # layout="flat": ship tokens [B, L+1] (uint32, flat-tokens) and two ints per row, then expand them
        # on the devices (jit): about 4x fewer bytes from host to device than the five [B, L] arrays.
        self.flat = getattr(self.opts, "layout", ReadOptions.layout) == "flat"
        # flat rows' loss_mask (a masked cache) and continuation slots (best fit) go to the devices too
        self._slots = int(getattr(self.reader, "continuation_slots", 0))
        self._flat_fields = list(FLAT_FIELDS) + ["loss_mask"] * (self.flat and bool(getattr(self.reader, "masked", 0))) \
            + list(CONTINUATION_FIELDS) * bool(self.flat and self._slots)
        if self.flat:
            names = tuple(self._flat_fields)
            self._expand = jax.jit(lambda *arrays: expand_flat(dict(zip(names, arrays))), out_shardings=self.token_sharding)
        self.rows = process_rows(self.token_sharding, self.batch_size, self.seq_len)
        self._row_pos = self._local_positions()
        if self.num_workers:
            if not isinstance(self.reader, Reader):
                raise TypeError(f"ReadOptions(num_workers={self.num_workers}) needs a reader.Reader or a cache path "
                                f"as source (the worker processes open the cache themselves), got "
                                f"{type(self.reader).__name__}; pass the Reader itself, or num_workers=0")
            if self.rows.size % self.num_workers:
                raise ValueError(
                    f"ReadOptions(num_workers={self.num_workers}): the {self.rows.size} rows of each batch that "
                    f"this process's devices hold (of batch_size {self.batch_size}, spec {self.spec}) do not split "
                    f"evenly over {self.num_workers} worker processes; use a num_workers that divides "
                    f"{self.rows.size}, or a batch_size that gives each process a multiple of {self.num_workers} rows")
        self.start = int(start)
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.prefetch = int(prefetch)
        self.threads = max(1, int(threads if threads is not None else 1))
        self._pool: cf.ThreadPoolExecutor | None = None
        self._worker_pools: weakref.WeakSet = weakref.WeakSet()  # open reader.workers.pool.WorkerPools
        self._lock = threading.Lock()
        self.stats = {"batches": 0, "rows_loaded": 0, "fetch_seconds": 0.0, "wait_seconds": 0.0,
                      "max_wait_seconds": 0.0}

    # -- geometry -----------------------------------------------------------------------------
    def _local_positions(self) -> dict:
        """For each distinct device row slice: a slice (or index array) into the process-local rows."""
        out = {}
        for sharding in (self.token_sharding, self.row_sharding):
            shape = (self.batch_size, self.seq_len) if sharding is self.token_sharding else (self.batch_size,)
            for idx in sharding.addressable_devices_indices_map(shape).values():
                key = (idx[0].start, idx[0].stop, idx[0].step)
                if key in out:
                    continue
                want = slice_rows(idx, self.batch_size)
                pos = np.searchsorted(self.rows, want)
                if pos.size and pos[-1] - pos[0] + 1 == pos.size and (np.diff(pos) == 1).all():
                    out[key] = slice(int(pos[0]), int(pos[-1]) + 1)
                else:
                    out[key] = pos
        return out

    @property
    def num_batches(self) -> int | None:
        """Eval mode: number of batches of the single pass; training (looping): None."""
        return getattr(self.reader, "num_batches", None)

    # -- one batch ------------------------------------------------------------------------------
    def host_rows(self, b: int) -> dict[str, np.ndarray]:
        """This process's rows (:attr:`rows`, in that order) of global batch ``b`` as numpy arrays."""
        if self.rows.size == 0:  # this process holds no part of the mesh: nothing to read
            return {}
        t0 = time.perf_counter()
        data = self.reader.rows(int(b), self.rows)
        with self._lock:
            self.stats["rows_loaded"] += int(self.rows.size)
            self.stats["fetch_seconds"] += time.perf_counter() - t0
        return data

    def _assemble(self, data: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        if self.flat:
            return self._assemble_flat(data)
        return self._put(data, self.fields)

    def _assemble_flat(self, data: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Flat-tokens rows -> device arrays -> the five token fields, expanded on the devices."""
        want_tokens = [f for f in self.fields if f in TOKEN_FIELDS]
        flat = self._flat_fields
        out = self._put(data, [f for f in self.fields if f not in TOKEN_FIELDS] + (flat if want_tokens else []))
        if want_tokens:
            expanded = self._expand(*(out.pop(f) for f in flat))
            out.update({f: expanded[f] for f in want_tokens})
        return out

    def _put(self, data: Mapping[str, np.ndarray], fields: Sequence[str]) -> dict[str, jax.Array]:
        n, L = int(self.rows.size), self.seq_len
        out = {}
        for name in fields:
            field = FIELDS[name]
            if n == 0:  # no addressable shard: the callback is never called; the schema gives the type
                arr = np.zeros(field.shape(0, L, self._slots, self._segments), field.dtype)
            elif name not in data:
                raise KeyError(f"the reader returned no field {name!r} (it returned {sorted(data)}); "
                               f"pass fields=... to JaxLoader to build fewer fields")
            else:
                arr = np.asarray(data[name])
            per_token = field.columns == 0  # [n, L]; other [n, X] arrays: rows partitioned, columns whole
            want = field.shape(n, L, self._slots, self._segments)
            if arr.shape != want:
                raise ValueError(f"reader field {name!r} has shape {arr.shape}, expected {want}")
            if arr.dtype == np.int64 and not jax.config.jax_enable_x64:
                # jax without x64 stores int32; say so instead of wrapping around silently.
                if arr.size and (arr.max() > np.iinfo(np.int32).max or arr.min() < np.iinfo(np.int32).min):
                    raise OverflowError(
                        f"field {name!r} holds values beyond int32 and jax_enable_x64 is off; enable it "
                        f"(jax.config.update('jax_enable_x64', True)) or leave {name!r} out of fields=")
                arr = arr.astype(np.int32)
            shape = (self.batch_size,) + want[1:]
            sharding = self.token_sharding if per_token else self._wide_sharding if len(want) > 1 else self.row_sharding

            def cb(index, arr=arr, per_token=per_token):
                local = arr[self._row_pos[(index[0].start, index[0].stop, index[0].step)]]
                return local[:, index[1]] if per_token else local

            out[name] = jax.make_array_from_callback(shape, sharding, cb, dtype=arr.dtype)
        return out

    def global_batch(self, b: int) -> dict[str, jax.Array]:
        """Global batch ``b`` as a dict of sharded ``jax.Array``s (synchronous; reads only this process's rows)."""
        out = self._assemble(self.host_rows(b))
        with self._lock:
            self.stats["batches"] += 1
        return out

    # -- iteration with a sliding prefetch window ----------------------------------------------
    def _executor(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="chunkledger-jax")
        return self._pool

    def iter_batches(self, start: int | None = None, count: int | None = None) -> Iterator[tuple[int, dict]]:
        """Yield ``(step, global_batch(step))`` for ``step = start, start+1, ...``.

        Stops after ``count`` batches, at the end of an eval pass, or never (training). ``prefetch``
        batches are always in flight behind the one being consumed; taking one submits the next
        (sliding window). Resuming after a restart is ``iter_batches(start=restored_step)``. With
        ``ReadOptions(num_workers=W)`` worker processes read the batches instead (same values, bit for
        bit); they stop when the iterator ends or is closed, or at :meth:`close`.
        """
        b = self.start if start is None else int(start)
        stop = None if count is None else b + int(count)
        if self.num_batches is not None:
            stop = self.num_batches if stop is None else min(stop, self.num_batches)
        if self.num_workers and self.rows.size:
            it = self._from_workers(b, stop)
        elif self.prefetch == 0:
            it = ((s, self.global_batch(s)) for s in (itertools.count(b) if stop is None else range(b, stop)))
        else:
            it = self._read_ahead(b, stop)
        try:  # the time the caller waits for each batch goes into stats
            while True:
                t0 = time.perf_counter()
                got = next(it, None)
                if got is None:
                    return
                waited = time.perf_counter() - t0
                with self._lock:
                    self.stats["wait_seconds"] += waited
                    self.stats["max_wait_seconds"] = max(self.stats["max_wait_seconds"], waited)
                yield got
                del got  # (a worker's slot is refilled only once nothing refers to its batches)
        finally:
            it.close()

    def _read_ahead(self, b: int, stop: int | None) -> Iterator[tuple[int, dict]]:
        """Batches built on :attr:`threads` threads, ``prefetch`` ahead; the reader loads their row groups
        further ahead (:func:`reader.batch.readahead.read_ahead`)."""
        reader = self.reader
        if isinstance(reader, Reader):  # the reader's own threads plan the hints; its progress shows liveness
            hint, submit, progress = (lambda i, n: reader.prefetch(i, self.rows, n)), reader.store.plan, reader.progress
        else:
            hint = lambda i, n: [f for s in range(i, i + n) for f in reader.prefetch(s, self.rows)]  # noqa: E731
            submit, progress = self._executor().submit, None
        return read_ahead(lambda i, n: [self.global_batch(i)], b, stop=stop, depth=self.prefetch,
                          executor=self._executor(), hint=hint, submit_hint=submit, lookahead=self._lookahead(),
                          progress=progress, timeout_s=getattr(self.opts, "worker_timeout_s", None),
                          describe=lambda i, n: f"global batch {i} for JaxLoader")

    def _from_workers(self, b: int, stop: int | None) -> Iterator[tuple[int, dict]]:
        """``ReadOptions(num_workers=W)``: this process's rows of each batch come from W worker processes
        (views of shared memory) and are put on the devices here."""
        if stop is not None and b >= stop:
            return
        t0 = time.perf_counter()  # (the workers' start-up is time the loop waits too)
        pool = WorkerPool(self.reader, b, None if stop is None else stop - b, rows=self.rows)
        self._worker_pools.add(pool)
        try:
            for step, data in pool:
                with self._lock:
                    self.stats["batches"] += 1
                    self.stats["rows_loaded"] += int(self.rows.size)
                    self.stats["fetch_seconds"] += time.perf_counter() - t0
                # jax may alias `data` (zero-copy on CPU): the arrays then reference it, which keeps the
                # pool from refilling its slot while they live
                batch = self._assemble(data)
                del data
                yield step, batch
                del batch
                t0 = time.perf_counter()
        finally:
            pool.close()  # stops the workers: the iterator was exhausted, closed early or failed
            self._worker_pools.discard(pool)

    def _lookahead(self):
        """Batches ahead to hint with ``Reader.prefetch`` (0: none; the reader's, asked again as the read goes)."""
        if self.rows.size == 0 or not hasattr(self.reader, "prefetch"):
            return 0
        get = getattr(self.reader, "lookahead_batches", None)
        return (lambda: int(get())) if callable(get) else self.prefetch + 1

    def __iter__(self) -> Iterator[dict]:
        """Batches from :attr:`start` on (just the dicts; use :meth:`iter_batches` for step numbers)."""
        for _, batch in self.iter_batches():
            yield batch

    def close(self) -> None:
        for pool in list(self._worker_pools):
            pool.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)  # (not for a read that never returns)
            self._pool = None
        close = getattr(self.reader, "close", None)
        if callable(close) and self._owns_reader:
            close()

    def __enter__(self) -> "JaxLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
