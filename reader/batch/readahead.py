"""Read-ahead: the one loop that keeps a reader's work ahead of its consumer.

``Reader.iter_batches``, ``reader.jax.JaxLoader.iter_batches`` and ``reader.torch.TokenBatches`` (in a
DataLoader worker) all read this way: units ``first, first + 1, ...`` (batches, or a DataLoader worker's
own batches) are produced a slab at a time on an executor, about ``depth`` units ahead of the slab
being consumed, and yielded in order; and the row groups that the units ``lookahead`` ahead of the one
being queued will need are loaded on the store's threads (hints), several units per hint task, so
decoding overlaps serving. Closing the generator early cancels whatever has not started; a failed slab
raises its error in its turn; a hint never fails a read (the real read reports any error).

Liveness. A slab that is not done after ``timeout_s`` seconds in which the reader made no progress
(:class:`Progress`: no byte range fetched, no poll of a running build) raises :class:`ReaderStalled`
naming the slab, instead of waiting forever on a storage read that never returns.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from reader.storage.remote import ReaderStalled  # (with the storage errors: a request not answered raises it too)

MAX_HINTS = 64  # hint tasks queued or running; more would only plan loads the store's threads reach late


class Progress:
    """A count that moves whenever a reader makes progress: a byte range fetched, a poll of a running
    build, a slab assembled. Only its changes mean anything. Reader workers count into shared memory
    (:meth:`share`), where the parent watches them."""

    def __init__(self):
        self._lock = threading.Lock()  # (a lost increment could bring the count back to a value seen)
        self._cell = np.zeros(1, np.int64)

    def beat(self) -> None:
        with self._lock:
            self._cell[0] += 1

    @property
    def count(self) -> int:
        return int(self._cell[0])

    def share(self, cell: np.ndarray) -> None:
        """Count in ``cell`` (one int64, e.g. in shared memory) from now on, adding what was counted."""
        with self._lock:
            cell[0] += self._cell[0]
            self._cell = cell


def wait_result(fut: cf.Future, progress: Progress | None, timeout_s: float | None, what: Callable[[], str]):
    """``fut.result()``, raising :class:`ReaderStalled` once ``progress`` has not moved for ``timeout_s``
    seconds while waiting (None: wait as long as it takes)."""
    if progress is None or timeout_s is None:
        return fut.result()
    seen, since = progress.count, time.monotonic()
    while True:
        try:
            return fut.result(timeout=timeout_s / 4)
        except TimeoutError:
            if fut.done():  # the task itself raised a TimeoutError
                raise
        now = progress.count
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= timeout_s:
            fut.cancel()
            raise ReaderStalled(
                f"the reader made no progress for {timeout_s:g} s while assembling {what()} (ReadOptions."
                f"worker_timeout_s={timeout_s:g}): a storage read that does not return? Check the storage, or "
                f"raise worker_timeout_s") from None


def stride_of(lookahead: int) -> int:
    """Units per hint task for a lookahead of ``lookahead`` units: several (one vectorized plan), and
    more as the lookahead grows (a remote read's), so that a plan asks for several row groups of a chunk
    in one request rather than one at a time."""
    return max(1, min(8, lookahead // 2), min(64, lookahead // 16))


def read_ahead(produce: Callable[[int, int], list], first: int, *, stop: int | None = None,
               available: Callable[[int], bool] | None = None, slab: int = 1, depth: int = 1,
               executor: cf.Executor | None = None, hint: Callable[[int, int], Any] | None = None,
               submit_hint: Callable[..., cf.Future] | None = None, lookahead: int | Callable[[], int] = 0,
               progress: Progress | None = None, timeout_s: float | None = None,
               describe: Callable[[int, int], str] = lambda i, n: f"units {i}..{i + n - 1}",
               ) -> Iterator[tuple[int, Any]]:
    """Yield ``(i, item)`` for ``i = first, first + 1, ...``: the items ``produce(i, n)`` returns for
    units ``i .. i+n-1``, in order.

    Args:
      produce: ``produce(i, n)``: the list of the ``n`` items of units ``i .. i+n-1``.
      stop: the first unit not to produce (None: no end but ``available``).
      available: ``available(i)``: False past the end of the data (an eval pass; it may wait for a
        running build). Asked in the consumer's thread, in order.
      slab: units per ``produce`` call, at most.
      depth: units queued beyond the slab being consumed (at least one slab is).
      executor: runs ``produce`` (None: the consumer's thread runs it when its turn comes).
      hint: ``hint(i, n)`` starts loading what units ``i .. i+n-1`` need and returns at once. The first
        unit's hint runs in this thread (its chunks load in parallel at once); later ones are handed to
        ``submit_hint(hint, i, n)`` (which returns a future), ``lookahead`` units ahead of the unit
        being queued, :func:`stride_of` units per task; at most :data:`MAX_HINTS` tasks in flight.
      lookahead: 0: no hints; a callable: asked again at every unit queued (a remote read's lookahead
        grows with the latency and the rate it sees).
      progress, timeout_s: see :func:`wait_result`; ``describe(i, n)`` names a slab in its error.
    """
    pending: collections.deque[tuple[int, int, cf.Future | None]] = collections.deque()
    hints: collections.deque[cf.Future] = collections.deque()
    queued = 0  # units in `pending`
    nxt = first
    planned = first + 1  # the first unit not hinted yet
    ahead = lookahead if callable(lookahead) else (lambda: lookahead)

    def more(i: int) -> bool:
        return (stop is None or i < stop) and (available is None or available(i))

    def hint_ahead(i: int) -> None:  # unit i is queued: hint what `lookahead` units later will need
        nonlocal planned
        look = ahead() if lookahead else 0
        if look and planned <= i + look and (stop is None or planned < stop):
            while hints and hints[0].done():
                hints.popleft()
            stride = stride_of(look)
            k = stride if stop is None else min(stride, stop - planned)
            if len(hints) < MAX_HINTS:
                hints.append(submit_hint(hint, planned, k))
            planned += k

    try:
        if lookahead and more(first):
            try:
                got = hint(first, 1)
                hints.extend(got if isinstance(got, list) else [])
            except Exception:  # noqa: BLE001 - a hint only; the read reports any error
                pass
        while True:
            while queued < depth + slab and more(nxt):
                n = 1
                while n < slab and more(nxt + n):
                    n += 1
                pending.append((nxt, n, None if executor is None else executor.submit(produce, nxt, n)))
                queued += n
                for _ in range(n):
                    hint_ahead(nxt)
                    nxt += 1
            if not pending:
                return
            i, n, fut = pending.popleft()
            queued -= n
            items = produce(i, n) if fut is None else wait_result(fut, progress, timeout_s, lambda: describe(i, n))
            for k, item in enumerate(items):
                yield i + k, item
            del items
    finally:
        for _, _, fut in pending:
            if fut is not None:
                fut.cancel()
        for fut in hints:
            fut.cancel()
