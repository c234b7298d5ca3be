"""Global batches for PyTorch training loops (optional extra: ``torch``).

This is the only module of ``reader/`` that imports torch. Every rank of a ``torch.distributed`` job
runs the same code::

    from reader import ReadOptions
    from reader.torch import TokenBatches, token_loader

    ds = TokenBatches("gs://bucket/cache", ReadOptions(seq_len=2048, batch_size=256), start=step)
    for item in token_loader(ds, num_workers=4, pin_memory=True):  # a DataLoader that times out on a stall
        loss = model(item["inputs"].cuda(), item["targets"].cuda(), ...)   # item["step"]: the global batch

What a rank gets. Rank ``r`` of ``W`` receives, for every global batch ``b``, the rows ``k ≡ r (mod W)``
of it: exactly ``Reader(source, opts, num_readers=W, reader_index=r).batch(b)``, as tensors. Global
batch ``b`` does not depend on ``W``, on the DataLoader's ``num_workers`` or on a resume, so the
state of a run is one number, the next global batch, and it restores onto any world size and any
worker count.

DataLoader workers each serve whole global batches (worker ``w`` of ``k``: ``first + w``, ``first + w + k``,
...) with their own :class:`reader.Reader`; with ``num_workers=0`` the dataset reads in your process through
``Reader.iter_batches``. docs/TORCH.md says why, what each costs, and the dtypes :func:`as_tensors` gives
(``layout="flat"``'s uint32 ``tokens`` as an int32 view of the same bits, which :func:`expand_flat` reads).

State. ``state_dict()`` is ``{"step": next global batch, ...}``; :func:`resume_step` reads
it, and a whole ``StatefulDataLoader`` state, saved with any worker count or world size.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import os
import signal
import warnings
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from reader import ReadOptions, Reader
from reader.batch.readahead import ReaderStalled, read_ahead
from reader.batch.schema import CONTINUATION_FIELDS, FLAT_FIELDS, continuations, loss_mask
from reader.order.streams import reader_rows
from reader.reader import WAIT_TIMEOUT_S

__all__ = ["TokenBatches", "token_loader", "as_tensors", "expand_flat", "resume_step", "STATE_KEY"]

STATE_KEY = "chunkledger_torch"  # marks (and versions) a TokenBatches.state_dict()
STATE_VERSION = 1


def as_tensors(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A reader batch (numpy arrays) as CPU tensors sharing its memory.

    Dtypes are kept, except ``uint32`` (the ``tokens`` of ``layout="flat"``), which becomes an ``int32``
    view of the same bits (see :func:`expand_flat`). A read-only array is copied (torch tensors are
    writable).
    """
    out = {}
    for k, v in batch.items():
        a = np.asarray(v)
        if a.dtype == np.uint32:
            a = a.view(np.int32)
        if not a.flags.writeable:
            a = a.copy()
        out[k] = torch.from_numpy(a)
    return out


class OneBuffer(dict):
    """An item made in a DataLoader worker. It pickles (on its way to the training process) as ONE
    buffer with every tensor a view of it: torch sends each tensor through its own shared-memory segment
    and file descriptor, a fixed cost per tensor that exceeds copying a batch. The training process gets
    a plain dict."""

    def __copy__(self):  # the worker's default_convert copies the item: keep the type
        return OneBuffer(self)

    def __reduce__(self):
        layout, extra, size = [], {}, 0
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                n = v.numel() * v.element_size()
                layout.append((k, v.dtype, tuple(v.shape), size, n))
                size += -(-n // 64) * 64  # aligned for every dtype's view
            else:
                extra[k] = v
        buf = torch.empty(size, dtype=torch.uint8)
        for k, dtype, shape, off, n in layout:
            buf[off:off + n].view(dtype).view(shape).copy_(self[k])
        return from_buffer, (buf, layout, extra)


def from_buffer(buf: torch.Tensor, layout: list, extra: dict) -> dict[str, Any]:
    out: dict[str, Any] = {k: buf[off:off + n].view(dtype).view(shape) for k, dtype, shape, off, n in layout}
    out.update(extra)
    return out


def bits32(x) -> torch.Tensor:
    """flat-tokens values (uint32 numpy, torch uint32/int32 bits, or int64 values) as int32 bits."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x).view(np.int32) if x.dtype == np.uint32 else x)
    x = torch.as_tensor(x)
    if x.dtype == torch.int32:
        return x
    if x.dtype == torch.uint32:
        return x.view(torch.int32)
    if x.dtype in (torch.int64, torch.uint64):
        x = x.to(torch.int64) & 0xFFFFFFFF
        return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)
    raise TypeError(f"tokens must hold flat-tokens values (uint32, or int32 bits, or int64), got {x.dtype}")


def expand_flat(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``reader.expand_flat`` in torch ops: the ``layout="arrays"`` fields of a ``layout="flat"`` batch.

    Args:
      batch: ``tokens`` ``[B, L+1]`` (int32 bits as :class:`TokenBatches` yields them, uint32, or int64
        values; numpy or torch, any device), ``first_positions`` and ``num_tokens`` ``[B]``, ``loss_mask``
        ``[B, L]`` for a cache with loss masks, ``continuation_*`` for best-fit rows that have them.

    Returns ``inputs``, ``targets``, ``segment_ids``, ``positions`` (int32 ``[B, L]``) and ``loss_mask``
    (bool ``[B, L]``) on the device of ``tokens``, equal to ``reader.expand_flat`` of the same rows;
    every other key of ``batch`` (``example_ids``, ``epochs``, ``valid``, ``step``) is passed through.
    Move the flat batch to the GPU first and expand it there: a quarter of the bytes cross the bus.
    """
    tok = bits32(batch["tokens"])
    if tok.dim() != 2 or tok.shape[1] < 2:
        raise ValueError(f"tokens must be [B, L+1] with L >= 1, got shape {tuple(tok.shape)}")
    dev, L = tok.device, tok.shape[1] - 1
    body = tok[:, 1:]
    start = (body & 1).bool()
    t = torch.arange(L, dtype=torch.int32, device=dev)
    num = torch.as_tensor(batch["num_tokens"], device=dev).to(torch.int32)
    real = t[None, :] < num[:, None]
    targets = (body >> 1) & 0x7FFFFFFF  # a logical shift of the uint32 bits
    inputs = torch.where(start, 0, (tok[:, :-1] >> 1) & 0x7FFFFFFF)
    none = torch.zeros((tok.shape[0], 0), dtype=torch.int32)
    cont, cont_inputs, seg_first = continuations(t[None, :], *(torch.as_tensor(batch.get(f"continuation_{k}", none),
                                                 device=dev).int() for k in ("columns", "positions", "inputs")), torch.int32)
    inputs = torch.where(cont, cont_inputs, inputs)
    boundary = start | cont
    segment_ids = torch.cumsum(boundary, dim=1, dtype=torch.int32) + (~boundary[:, :1]).to(torch.int32)
    last = torch.cummax(torch.where(boundary, t, -1), dim=1).values  # the latest segment start so far
    first = torch.as_tensor(batch["first_positions"], device=dev).to(torch.int32)[:, None]
    positions = torch.where(last >= 0, t - last + seg_first(last), first + t)
    out: dict[str, Any] = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
                           for k, v in batch.items() if k not in FLAT_FIELDS + CONTINUATION_FIELDS}
    out.update({k: torch.where(real, v, 0) for k, v in (("inputs", inputs), ("targets", targets),
                                                        ("segment_ids", segment_ids), ("positions", positions))})
    stored = torch.as_tensor(batch["loss_mask"], device=dev).bool() if "loss_mask" in batch else None
    out["loss_mask"] = loss_mask(real, stored)
    return out

_WORKER_GROUP = 4  # batches a DataLoader worker assembles per reader call (the per-call costs, paid once)


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (int(info.id), int(info.num_workers))


def _distributed() -> tuple[int, int] | None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return None


def token_loader(ds: "TokenBatches", *, num_workers: int = 0, loader: type = DataLoader, **kwargs):
    """A ``DataLoader`` over ``ds`` (``batch_size=None``) that does not hang on a stalled worker.

    In a DataLoader worker the dataset's code runs in another process and cannot raise in this one, so
    the loader's ``timeout`` is what ends a wait for a worker that stopped or is stuck on a storage
    read: ``ds.options.worker_timeout_s`` plus the reader's ``wait_timeout_s`` (a worker may wait that
    long, legitimately, for chunks a running build has not written yet). When it fires,
    :class:`reader.ReaderStalled` names the worker (index, pid) and the batch due from it, and the
    loader's workers are shut down. With ``num_workers=0`` the dataset reads in this process, where the
    reader itself raises ``ReaderStalled`` (torch allows no timeout there: a ``timeout`` given is not passed
    on, so the same call works with any worker count).

    Args:
      ds: a :class:`TokenBatches`.
      loader: the loader class: ``DataLoader``, or torchdata's ``StatefulDataLoader``.
      kwargs: other loader arguments (``pin_memory``, ``prefetch_factor``, ``persistent_workers``,
        ``multiprocessing_context``, ``worker_init_fn``; ``timeout`` replaces the one above).
    """
    if kwargs.pop("batch_size", None) is not None:
        raise ValueError("token_loader: every TokenBatches item already is a whole batch; drop batch_size")
    watch_loader(ds, num_workers, kwargs, get_worker_info)
    return watched_loader(loader)(ds, batch_size=None, num_workers=num_workers, **kwargs)


# --------------------------------------------------------------------------------------------------
# The dataset


class TokenBatches(IterableDataset):
    """This rank's rows of every global batch of a chunkledger cache, as a dict of tensors per batch.

    Use it with ``DataLoader(ds, batch_size=None, num_workers=k)`` (or torchdata's
    ``StatefulDataLoader``): every item is one global batch, in order, as ``Reader(source, opts,
    num_readers=world_size, reader_index=rank).batch(step)`` returns it (each array a tensor, see
    :func:`as_tensors`) plus ``"step"`` (int), the global batch index. Training streams loop forever;
    an eval pass (``eval_mode=True``) ends after ``num_batches`` items, its last batch padded with
    ``valid == False`` rows.

    Args:
      source: a cache path or URL (anything ``reader.Reader`` opens), opened lazily in each process that
        iterates (each DataLoader worker opens its own reader).
      opts: :class:`reader.ReadOptions`; ``batch_size`` is GLOBAL and must be a multiple of
        ``world_size``. ``num_workers`` (reader worker processes) applies only when the dataset iterates
        in your process (DataLoader ``num_workers=0``).
      rank, world_size: this rank's place among the data-parallel ranks. Default: ``torch.distributed``'s
        rank and world size when it is initialized, else 0 and 1 (an error if ``WORLD_SIZE`` says > 1). With tensor or pipeline parallelism,
        pass the data-parallel rank and size (ranks that must see the same data pass the same rank).
      start: the global batch an iteration begins at (a resumed run passes its saved step).
      reader_kwargs: keyword arguments for ``Reader`` (``wait_timeout_s``, ``poll_interval_s``,
        ``storage_options``).

    Attributes: ``options``, ``rank``, ``world_size``, ``start``, ``rows`` (the rows of each global batch
    this rank gets), ``num_batches`` (eval: the size of the pass; training: None), ``loader_timeout_s``
    (the DataLoader's timeout, set by :func:`token_loader`; without one, workers warn), ``watch``.
    """

    def __init__(self, source, opts=None, rank: int | None = None, world_size: int | None = None, *,
                 start: int = 0, reader_kwargs: Mapping[str, Any] | None = None):
        self.source = os.fspath(source) if isinstance(source, os.PathLike) else source
        if not isinstance(self.source, str):
            raise TypeError(f"source must be a cache path or URL (each DataLoader worker opens its own reader), "
                            f"got {type(source).__name__}")
        self.options = opts if opts is not None else ReadOptions()
        dist = _distributed()
        if rank is None and world_size is None:
            launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
            if dist is None and launched > 1:  # torchrun started this rank, but the group is not up yet
                raise ValueError(
                    f"WORLD_SIZE={launched} (torchrun) but torch.distributed is not initialized, so this rank's "
                    f"rows are unknown: call torch.distributed.init_process_group() before TokenBatches(...), "
                    f"or pass rank= and world_size=")
            rank, world_size = dist or (0, 1)
        elif world_size is None:
            if dist is None:
                raise ValueError(f"TokenBatches(rank={rank}) needs world_size too (torch.distributed is not initialized)")
            world_size = dist[1]
        elif rank is None:
            raise ValueError(f"TokenBatches(world_size={world_size}) needs rank too")
        self.rank, self.world_size = int(rank), int(world_size)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")
        B = int(self.options.batch_size)
        if B % self.world_size:
            raise ValueError(
                f"ReadOptions(batch_size={B}) is the GLOBAL batch and must be a multiple of world_size "
                f"{self.world_size} (each rank gets batch_size / world_size of its rows); use a batch_size "
                f"that is a multiple of {self.world_size}, e.g. {-(-B // self.world_size) * self.world_size}")
        if int(start) < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self.start = int(start)
        self.rows = reader_rows(B, self.world_size, self.rank)
        self.reader_kwargs = dict(reader_kwargs or {})
        self._reader = None
        self._reader_pid = None
        # the next iteration in this process resumes here: ("global", step, None) or, in a DataLoader
        # worker restored by StatefulDataLoader, ("worker", its own next batch, the iteration's start)
        self._resume: tuple[str, int, int | None] | None = None
        self._iter_state: dict[str, Any] | None = None  # the latest iteration in this process
        # the timeout of the DataLoader this dataset runs under (token_loader sets it; set it yourself for
        # a DataLoader you build with timeout=...), and where its workers say what they are doing
        self.loader_timeout_s = 0.0
        self.watch = WorkerTable(0)

    # -- the reader of this process ---------------------------------------------------------------
    def _open(self):
        if self._reader is None or self._reader_pid != os.getpid():
            # a reader inherited through fork belongs to the parent (its threads do not exist here)
            self._reader = Reader(self.source, self.options, num_readers=self.world_size,
                                  reader_index=self.rank, **self.reader_kwargs)
            self._reader_pid = os.getpid()
        return self._reader

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_reader=None, _reader_pid=None, _iter_state=None)
        return state

    def close(self) -> None:
        """Close this process's reader (a later iteration opens a new one)."""
        if self._reader is not None and self._reader_pid == os.getpid():
            self._reader.close()
        self._reader = self._reader_pid = None

    @property
    def num_batches(self) -> int | None:
        """Eval mode: batches in the pass (opens the cache here; waits for a running build to finish).
        Training: None."""
        if not self.options.eval_mode:
            return None
        return self._open().num_batches

    def __len__(self) -> int:
        """Eval mode: the items the next iteration yields. Training streams have no length (TypeError)."""
        if not self.options.eval_mode:
            raise TypeError("a training TokenBatches loops forever and has no len(); eval_mode=True has one")
        first, _ = self._first(self._resume, 0)
        return max(0, self.num_batches - first)

    # -- iteration --------------------------------------------------------------------------------
    def _first(self, resume, w: int) -> tuple[int, int]:
        """(this worker's first batch, the iteration's first global batch)."""
        if resume is None:
            return self.start + w, self.start
        kind, step, start = resume
        if kind == "worker":
            return step, start
        return step + w, step

    def __iter__(self) -> Iterator[dict[str, Any]]:
        resume, self._resume = self._resume, None  # a loaded state applies to the next iteration only
        w, k = _worker()
        first, start = self._first(resume, w)
        return self._iterate(first, start, w, k)

    def iter_from(self, step: int) -> Iterator[dict[str, Any]]:
        """Iterate from global batch ``step`` (in this process, or as DataLoader worker w of k: every
        k-th batch from ``step + w``), ignoring ``start`` and any loaded state."""
        if int(step) < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        w, k = _worker()
        return self._iterate(int(step) + w, int(step), w, k)

    def _iterate(self, first: int, start: int, w: int, k: int) -> Iterator[dict[str, Any]]:
        if get_worker_info() is not None and self.options.num_workers:
            raise ValueError(
                f"ReadOptions(num_workers={self.options.num_workers}) starts reader worker processes, and this "
                f"dataset already runs in DataLoader worker {w} of {k}: use ReadOptions(num_workers=0) with "
                f"DataLoader workers, or DataLoader(num_workers=0) with reader workers")
        if get_worker_info() is not None:
            self.watch.next_batch(w, first)
            warn_without_timeout(self.loader_timeout_s, w)
        # set now, not when the generator starts: StatefulDataLoader asks for the state right after iter()
        st = {"pid": os.getpid(), "next": first, "start": start, "finished": False, "worker": (w, k)}
        self._iter_state = st
        return self._batches(st, first, k)

    def _batches(self, st: dict, first: int, k: int) -> Iterator[dict[str, Any]]:
        reader = self._open()
        wrap = OneBuffer if get_worker_info() is not None else dict  # items leave a worker by pickle
        if k == 1:  # every batch in turn: the reader's own pipeline (prefetch thread, reader workers)
            it, step_of = reader.iter_batches(first), int
        else:
            it, step_of = self._worker_batches(reader, first, k), lambda j: first + j * k
        try:
            for j, data in it:
                item = wrap(as_tensors(data))
                item["step"] = step = step_of(j)
                del data
                st["next"] = step + k  # before the yield: a state taken after this item resumes after it
                self.watch.next_batch(st["worker"][0], st["next"])
                yield item
        finally:
            it.close()
        st["finished"] = True

    def _worker_batches(self, reader, first: int, k: int):
        """DataLoader worker w of k: batches first, first + k, ... (its own batch j is first + j * k), a group
        of them assembled per reader call; the reader loads ahead on its threads."""
        end = reader.num_batches  # eval: the pass's size (waits for the build); training: None
        B, rows, n = int(self.options.batch_size), self.rows, int(self.rows.size)

        def produce(j: int, m: int) -> list[dict]:  # own batches j .. j+m-1: rows(step, rows) of each, one call
            steps = [first + (j + i) * k for i in range(m)]
            data = reader.examples(np.concatenate([step * B + rows for step in steps]))
            return [{key: v[i * n:(i + 1) * n] for key, v in data.items()} for i in range(m)]

        return read_ahead(produce, 0, stop=None if end is None else max(0, -(-(end - first) // k)), slab=_WORKER_GROUP,
                          depth=0, hint=lambda j, m: reader.prefetch(first + j * k, None, m, k),
                          submit_hint=reader.store.plan, lookahead=lambda: max(1, -(-reader.lookahead_batches() // k)))

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"step": n, ...}``: ``n`` is the next global batch of this process's iteration (or, before
        one, where the next begins). In DataLoader worker ``w`` of ``k`` it is that worker's next batch;
        torchdata's StatefulDataLoader stores one per worker, and :func:`resume_step` turns its whole
        state into the global step. Other keys: ``start`` (the iteration's first global batch),
        ``worker_id``/``num_workers``, ``finished`` (the iteration has ended), ``rank``/``world_size``
        (for information: a resume may use another world size)."""
        w, k = _worker()
        st = self._iter_state
        if self._resume is None and st is not None and st["pid"] == os.getpid() and st["worker"] == (w, k):
            step, start, finished = st["next"], st["start"], st["finished"]
        else:
            (step, start), finished = self._first(self._resume, w), False
        return {STATE_KEY: STATE_VERSION, "step": int(step), "start": int(start), "worker_id": w,
                "num_workers": k, "finished": bool(finished), "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next iteration continue where ``state`` left off.

        Args:
          state: ``{"step": n}`` (the next global batch), a :meth:`state_dict`, or a whole
            ``StatefulDataLoader.state_dict()`` saved with any ``num_workers`` and world size (see
            :func:`resume_step`). A state whose pass has ended (an eval pass) makes the next iteration a
            new pass from ``start``. Inside DataLoader worker ``w`` of ``k``, StatefulDataLoader hands
            each worker its own state back (same ``num_workers``); that worker then continues its batches.

        Applies to the next iteration started in this process; later ones begin at ``start`` again.
        DataLoader workers iterate copies of the dataset made when the loader's iterator starts, so
        load the state before iterating (an eval loader that iterates again after a resumed pass: set
        ``start`` or load ``{"step": 0}`` before the next pass).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        if STATE_KEY not in state and "step" in state and len(state) == 1:  # a bare {"step": n}
            state = {STATE_KEY: STATE_VERSION, "step": state["step"]}
        if STATE_KEY in state:
            w, k = _worker()
            saved = (int(state.get("worker_id", 0)), int(state.get("num_workers", 1)))
            step = int(state["step"])
            if step < 0:
                raise ValueError(f"state step must be >= 0, got {step}")
            if get_worker_info() is not None and "start" in state:
                if saved != (w, k):
                    raise ValueError(
                        f"StatefulDataLoader.load_state_dict restores a loader onto the num_workers it was saved "
                        f"with ({saved[1]}; this loader has {k}). To resume on another worker count, pass the saved "
                        f"state to TokenBatches.load_state_dict(state) instead and start a fresh loader")
                # StatefulDataLoader restoring one worker (same num_workers): its own batches, as they were
                self._resume = ("worker", step, int(state["start"]))
                return
            if saved[1] > 1:
                resume_step(state)  # raises: one worker's state does not give the global step
            self._resume = None if state.get("finished") else ("global", step, None)
            return
        step = resume_step(state)  # a StatefulDataLoader's state (any num_workers)
        self._resume = None if state.get("_iterator_finished") else ("global", step, None)


# -- the resume state (TokenBatches.state_dict, a StatefulDataLoader's state) --------------------------------
def _ours(state: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(state, Mapping) or STATE_KEY not in state:
        raise ValueError(f"{where} holds no TokenBatches state (got {type(state).__name__}"
                         f"{' with keys ' + str(sorted(state)) if isinstance(state, Mapping) else ''}); was "
                         f"the DataLoader's dataset a reader.torch.TokenBatches?")
    return state


def resume_step(state: Mapping[str, Any]) -> int:
    """The next global batch recorded in ``state``.

    Args:
      state: a :meth:`reader.torch.TokenBatches.state_dict` of the process that iterated (not of one DataLoader
        worker), or a whole ``torchdata.stateful_dataloader.StatefulDataLoader.state_dict()`` over a
        :class:`reader.torch.TokenBatches`, saved with any ``num_workers`` and any world size (every rank of a job
        holds the same step; any rank's state will do).

    A StatefulDataLoader with ``k`` workers stores each worker's own next batch plus the number of
    items it has yielded in order; every worker's state also holds the batch its iteration began at,
    so the next global batch is that batch plus the items yielded. At the end of an eval pass this is
    the pass's ``num_batches``.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    if STATE_KEY in state:
        if int(state.get("num_workers", 1)) > 1:
            raise ValueError(
                f"this is the state of DataLoader worker {state.get('worker_id')} of {state.get('num_workers')}, "
                "which knows only its own batches; pass the StatefulDataLoader's whole state_dict(), or the "
                "step of the last item you trained on + 1 ({'step': n})")
        return int(state["step"])
    if "_snapshot" in state:  # StatefulDataLoader, num_workers > 0
        snap = state["_snapshot"]
        workers = [_ours((ws or {}).get("dataset_state"), f"StatefulDataLoader worker state {key!r}")
                   for key, ws in sorted(snap.get("_worker_snapshots", {}).items())]
        starts = {int(w["start"]) for w in workers}
        if len(starts) != 1:
            raise ValueError(f"the StatefulDataLoader's workers began at different batches {sorted(starts)}; "
                             "the state is not one TokenBatches iteration")
        return starts.pop() + int(snap["_snapshot_step"]) + int(state.get("_steps_since_snapshot", 0))
    if "_num_yielded" in state:  # StatefulDataLoader, num_workers == 0: the dataset iterated in-process
        return resume_step(_ours(state.get("dataset_state"), "the StatefulDataLoader state"))
    raise ValueError(f"not a TokenBatches or StatefulDataLoader state (keys {sorted(state)}); "
                     "pass TokenBatches.state_dict(), StatefulDataLoader.state_dict(), or {'step': n}")


# -- which DataLoader worker stalled, and on what ------------------------------------------------------------
# Which DataLoader worker stalled, and on what (for :func:`reader.torch.token_loader`; no torch needed).
#
# In a DataLoader worker the dataset's code runs in another process, so nothing it does can raise in the
# training process: torch's own ``timeout`` is what ends a wait for a stalled worker there, and its error
# says only "DataLoader timed out". A loader made by ``token_loader`` gives its dataset a
# :class:`WorkerTable` in shared memory, where each worker keeps its pid and the next batch it delivers;
# :class:`WatchedIterator` turns torch's timeout into a :class:`reader.ReaderStalled` that names the worker
# the loader was waiting for and what it was doing, and shuts the loader's workers down.
class WorkerTable:
    """Per DataLoader worker: its pid and the next global batch it delivers. ``WorkerTable(0)`` records
    nothing (a dataset outside ``token_loader``)."""

    def __init__(self, num_workers: int):
        self.k = int(num_workers)
        # shared with the workers: inherited through fork, or pickled while spawning them
        self._cells = multiprocessing.RawArray("q", 2 * self.k) if self.k else None

    def __reduce__(self):
        if self._cells is not None and multiprocessing.context.get_spawning_popen() is not None:
            return _table, (self.k, self._cells)
        return WorkerTable, (0,)  # pickled for anything but starting a worker: shared memory does not travel

    def next_batch(self, w: int, step: int) -> None:
        """Worker ``w`` (this process) delivers global batch ``step`` next."""
        if self._cells is not None and w < self.k:
            self._cells[2 * w:2 * w + 2] = [os.getpid(), step]

    def holder(self, want: int | None) -> tuple[int, int, int] | None:
        """``(worker, pid, its next batch)`` of the worker that serves global batch ``want`` (a worker's
        batches are all alike modulo the worker count; None: the first batch, worker 0's), or None."""
        if self._cells is None:
            return None
        for w in range(self.k):
            pid, step = self._cells[2 * w:2 * w + 2]
            if pid and (w == 0 if want is None else (step - want) % self.k == 0):
                return w, pid, step
        return None


def watch_loader(ds, num_workers: int, kwargs: dict, worker_info) -> None:
    """Set up ``token_loader(ds, num_workers=..., **kwargs)``: the loader's ``timeout`` in ``kwargs``
    (unless given), ``ds.loader_timeout_s``, ``ds.watch``, and a ``worker_init_fn`` that notes each
    worker in it before the caller's runs (``worker_info``: torch's ``get_worker_info``)."""
    if num_workers > 0:
        wait_s = float(ds.reader_kwargs.get("wait_timeout_s", WAIT_TIMEOUT_S))
        kwargs.setdefault("timeout", ds.options.worker_timeout_s + wait_s)
    else:  # torch allows no timeout without workers; the reader in this process raises ReaderStalled itself
        kwargs.pop("timeout", None)
    ds.loader_timeout_s = float(kwargs.get("timeout", 0.0))
    ds.watch = WorkerTable(num_workers)
    kwargs["worker_init_fn"] = functools.partial(_note_worker, worker_info, kwargs.get("worker_init_fn"))


def _note_worker(worker_info, init, worker_id: int) -> None:
    """A worker is noted from its start (one stuck before its first batch is named too)."""
    ds = worker_info().dataset
    ds.watch.next_batch(worker_id, int(ds.state_dict()["step"]))
    if init is not None:
        init(worker_id)


def _table(k: int, cells) -> WorkerTable:
    t = WorkerTable(0)
    t.k, t._cells = k, cells
    return t


class WatchedIterator:
    """A DataLoader's iterator whose timeout raises :class:`reader.ReaderStalled` naming the worker."""

    def __init__(self, it: Iterator, table: WorkerTable, timeout_s: float, why: str):
        self._it, self._table, self._timeout, self._why = it, table, timeout_s, why
        self._want: int | None = None  # the global batch expected next (None: the first)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)

    def __next__(self):
        try:
            item = next(self._it)
        except RuntimeError as e:
            if not (self._timeout and "timed out" in str(e)):
                raise
            raise self._stalled() from e
        step = item.get("step") if isinstance(item, dict) else None
        if step is not None:
            self._want = int(step) + 1
        return item

    def _stalled(self) -> ReaderStalled:
        held = self._table.holder(self._want)
        who, due = "a DataLoader worker", "its next batch"
        if held is not None:
            w, pid, step = held
            who, due = f"DataLoader worker {w} (pid {pid})", f"global batch {step if self._want is None else self._want}"
            try:  # a stopped worker cannot be shut down: let it run so that it can
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        shutdown = getattr(self._it, "_shutdown_workers", None)  # torch's; else when the iterator is dropped
        if callable(shutdown):
            shutdown()
        return ReaderStalled(f"{who} delivered no batch for {self._timeout:g} s, the DataLoader's timeout "
                             f"({self._why}), while {due} was due from it: stopped, or stuck on a storage read. "
                             "The loader's workers were shut down; check the storage, or raise "
                             "ReadOptions.worker_timeout_s")


_warned = False


def warn_without_timeout(timeout_s: float, w: int) -> None:
    """In DataLoader worker ``w``: warn once (from worker 0) when the loader has no timeout."""
    global _warned
    if timeout_s or w != 0 or _warned:
        return
    _warned = True
    warnings.warn("reader.torch.TokenBatches runs in DataLoader workers with no timeout (torch's default "
                  "timeout=0): a worker that stalls (stopped, or stuck on a storage read) hangs training forever. "
                  "Make the loader with reader.torch.token_loader(ds, num_workers=...), which sets the timeout "
                  "from ReadOptions.worker_timeout_s; for a DataLoader built with timeout=T, set "
                  "ds.loader_timeout_s = T.", RuntimeWarning, stacklevel=2)


@functools.cache
def watched_loader(base: type) -> type:
    class Loader(base):
        __doc__ = f"A {base.__name__} whose timeout names the worker that stalled (reader.torch.token_loader)."

        def __iter__(self):
            ds = self.dataset
            why = (f"ReadOptions.worker_timeout_s={ds.options.worker_timeout_s:g} + "
                   f"wait_timeout_s={ds.reader_kwargs.get('wait_timeout_s', WAIT_TIMEOUT_S):g}")
            return WatchedIterator(super().__iter__(), ds.watch, self.timeout, why)

    Loader.__name__ = Loader.__qualname__ = "Token" + base.__name__
    return Loader
