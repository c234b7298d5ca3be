"""Which DataLoader worker stalled, and on what (for :func:`reader.torch.token_loader`; no torch needed).

In a DataLoader worker the dataset's code runs in another process, so nothing it does can raise in the
training process: torch's own ``timeout`` is what ends a wait for a stalled worker there, and its error
says only "DataLoader timed out". A loader made by ``token_loader`` gives its dataset a
:class:`WorkerTable` in shared memory, where each worker keeps its pid and the next batch it delivers;
:class:`WatchedIterator` turns torch's timeout into a :class:`reader.ReaderStalled` that names the worker
the loader was waiting for and what it was doing, and shuts the loader's workers down.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import os
import signal
import warnings
from typing import Any, Iterator

from reader.batch.readahead import ReaderStalled
from reader.reader import WAIT_TIMEOUT_S


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
