"""Reading a remote cache ahead: range requests on an asynchronous filesystem's event loop, many in flight.

A remote cache on an asynchronous filesystem (gcsfs for ``gs://``: fsspec runs its requests on one event
loop) is read ahead without a thread waiting on each request. :class:`ReadAhead` (a
:class:`reader.storage.store.ChunkStore`'s remote side) opens chunks (:func:`reader.storage.chunk.open_chunk_steps`
driven by the returning requests: its sidecar, then its footer) and requests row groups (adjacent ones in
one request, up to ``MERGE_BYTES``) and returns at once; as each request returns, its row groups are
decoded on the store's threads. :class:`Requests` keeps at most ``MAX_REQUESTS`` of them out (later ones
wait their turn; one a read waits for goes first) and the average latency they see (the read-ahead sizes
itself with it: :mod:`reader.batch.prefetch`). So as many requests are in flight as the read-ahead asks
for, whatever the number of threads, and a request's latency is paid once for all of them.

Liveness. Every request has a deadline, ``timeout_s`` (``ReadOptions.worker_timeout_s``) from the moment it
is sent, its client's retries included: one not answered by then is cancelled and fails with
:class:`reader.ReaderStalled` naming the file and the byte range. Every wait for a request (a read's, a
chunk's opening, a load another thread runs) therefore ends, even while other requests keep the reader's
progress moving. gcsfs alone sets no deadline unless given ``requests_timeout`` (its default None is aiohttp's
"no timeout"), so a connection that never answers would be waited for forever.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import threading
import time
from typing import Any, Callable

from reader.storage.cache import Cache
from reader.storage.remote import ReaderStalled
from reader.storage.chunk import RANGE, ChunkMeta, open_chunk_steps
from reader.storage.validate import chunk_error

MAX_REQUESTS = 64  # range requests in flight at once per store (more wait their turn)
MERGE_BYTES = 8 << 20  # adjacent row groups wanted together are one request up to this many bytes
_LATENCY_WEIGHT = 0.2  # weight of each new request in the latency average
TIMEOUT_S = 600.0  # a request's deadline unless the store is given one (ReadOptions.worker_timeout_s's default)


class Requests:
    """One store's range requests on the filesystem's event loop (see the module docstring)."""

    def __init__(self, cache: Cache, timeout_s: float = TIMEOUT_S):
        self.cache = cache
        self.timeout_s = float(timeout_s)  # a request not answered in this long fails (module docstring)
        self._lock = threading.Lock()
        self._out = 0  # requests in flight
        self._waiting: collections.deque = collections.deque()  # (rel, start, end, future) waiting their turn
        self._sent: set[cf.Future] = set()  # the event loop's futures of the requests in flight
        self.latency_s: float | None = None  # seconds, a moving average over the requests that returned
        self.waited_s = 0.0  # seconds reads spent waiting for requests (the read-ahead's pace leaves them out)

    def wait(self, fut: cf.Future) -> Any:
        """``fut.result()`` for a read that needs it now, counting the time it waits in :attr:`waited_s`."""
        if fut.done():
            return fut.result()
        t0 = time.monotonic()
        try:
            return fut.result()
        finally:
            took = time.monotonic() - t0
            with self._lock:
                self.waited_s += took

    def request(self, rel: str, start: int | None = None, end: int | None = None, urgent: bool = False,
                out: cf.Future | None = None) -> cf.Future:
        """Bytes ``[start, end)`` of file ``rel`` (None: the whole file), as a future (``out`` if given). A
        failure is what :meth:`reader.storage.cache.Cache.failure` says (a missing file:
        ``FileNotFoundError``). An ``urgent`` request waiting its turn goes first."""
        out = cf.Future() if out is None else out
        with self._lock:
            go = self._out < MAX_REQUESTS
            if go:
                self._out += 1
            elif urgent:
                self._waiting.appendleft((rel, start, end, out))
            else:
                self._waiting.append((rel, start, end, out))
        if go:
            self._send(rel, start, end, out)
        return out

    def hurry(self, out: cf.Future) -> None:
        """A read waits for request ``out``: if it is still waiting its turn, it goes first."""
        with self._lock:
            for i, w in enumerate(self._waiting):
                if w[3] is out:
                    del self._waiting[i]
                    self._waiting.appendleft(w)
                    return

    def close(self) -> None:
        """Cancel the requests in flight and fail those waiting (nobody will read what they bring; a thread
        still waiting for one wakes)."""
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
            sent = list(self._sent)
        for fut in sent:
            fut.cancel()
        for rel, _, _, out in waiting:
            out.set_exception(RuntimeError(f"{self.cache.display(rel)}: not read, the reader was closed"))

    def _send(self, rel: str, start: int | None, end: int | None, out: cf.Future) -> None:
        fs, t0 = self.cache.fs, time.monotonic()
        request = fs._cat_file(self.cache.path(rel), start=start, end=end)
        coro = self._in_time(request, rel, start, end)
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, fs.loop)
        except BaseException as e:  # noqa: BLE001 - e.g. the loop is gone: the request fails
            coro.close()
            request.close()
            fut = cf.Future()
            fut.set_exception(e)
        with self._lock:
            self._sent.add(fut)
        fut.add_done_callback(lambda f: self._returned(rel, out, f, t0))

    async def _in_time(self, coro, rel: str, start: int | None, end: int | None) -> bytes:
        """``await coro`` (a request), raising :class:`ReaderStalled` once it has taken :attr:`timeout_s`."""
        try:
            async with asyncio.timeout(self.timeout_s) as deadline:
                return await coro
        except TimeoutError:
            if not deadline.expired():
                raise  # the client's own timeout
        what = "" if end is None else f" bytes {start or 0}..{end - 1}"
        raise ReaderStalled(
            f"{self.cache.display(rel)}{what}: no answer in {self.timeout_s:g} s (ReadOptions.worker_timeout_s="
            f"{self.timeout_s:g}, retries included): the network or the storage endpoint does not answer. "
            "Check them, or raise worker_timeout_s")

    def _returned(self, rel: str, out: cf.Future, fut: cf.Future, t0: float) -> None:
        with self._lock:
            self._sent.discard(fut)
            nxt = self._waiting.popleft() if self._waiting else None
            if nxt is None:
                self._out -= 1
        if nxt is not None:
            self._send(*nxt)
        try:
            data = fut.result()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for these bytes
            out.set_exception(self.cache.failure(rel, e))
            return
        last, took = self.latency_s, time.monotonic() - t0
        self.latency_s = took if last is None else last + _LATENCY_WEIGHT * (took - last)
        out.set_result(data)


class ReadAhead:
    """A :class:`reader.storage.store.ChunkStore`'s remote side: chunks opened and row groups requested
    without a thread waiting (see the module docstring). Its tables share the store's lock."""

    def __init__(self, store):  # a reader.storage.store.ChunkStore (which imports this module)
        self.store = store
        self.requests = Requests(store.cache, store.timeout_s)
        self._fetched: dict[Any, tuple[cf.Future, int, int]] = {}  # row groups requested: (request, at, length)
        self._when_open: dict[int, list[Callable[[ChunkMeta], None]]] = {}  # chunk -> what to do once open
        self._opening: dict[int, list] = {}  # chunk being opened -> [its request now, a read waits]

    def when_open(self, index: int, fn: Callable[[ChunkMeta], None]) -> None:
        """:meth:`reader.storage.store.ChunkStore.when_open`: ``fn(meta)`` now if chunk ``index`` is open, else
        once its sidecar and footer have come back (opening it, if nobody is)."""
        st, key = self.store, ("chunk", index)
        with st._lock:
            hit = st._lru.get(key)
            if hit is None:
                self._when_open.setdefault(index, []).append(fn)
        if hit is not None:
            st._quietly(fn, hit[0])
            return
        _, fut, owner = st._begin(key)
        if fut is not None and owner:  # (None: opened meanwhile, and its when_open work ran)
            self._open(index, fut)

    def opened(self, index: int) -> list[Callable[[ChunkMeta], None]]:
        """What to run now that chunk ``index`` is open (the store's lock is held)."""
        return self._when_open.pop(index, [])

    def meta(self, index: int) -> ChunkMeta:
        """Chunk ``index``'s layout, waiting for it (its opening's requests go first)."""
        st = self.store
        hit, fut, owner = st._begin(("chunk", index))
        if fut is None:
            return hit
        if owner:
            with st._lock:
                self._opening[index] = [None, True]
            self._open(index, fut)
        elif not fut.done():
            with st._lock:
                state = self._opening.get(index)
                if state is not None:
                    state[1] = True
            if state is not None and state[0] is not None:
                self.requests.hurry(state[0])
        return self.requests.wait(fut)

    def _open(self, index: int, fut: cf.Future) -> None:
        """Open chunk ``index`` with requests on the event loop; each step runs in the thread a request returns
        in (the event loop's: parsing a sidecar and a footer is short), so no thread waits for it."""
        st, key = self.store, ("chunk", index)
        steps = open_chunk_steps(st.cache, index, st._count)

        def advance(send=None, error: BaseException | None = None) -> None:
            try:
                want = steps.throw(error) if error is not None else steps.send(send)
            except BaseException as e:  # noqa: BLE001 - opened (StopIteration) or failed: tell who waits
                with st._lock:
                    self._opening.pop(index, None)
                if isinstance(e, StopIteration):
                    st._end(key, fut, *e.value)
                else:
                    st._end(key, fut, error=e)
                return
            req: cf.Future = cf.Future()
            with st._lock:
                state = self._opening.setdefault(index, [None, False])
                state[0] = req
            rel, start, end = (list(want[1:]) + [None, None])[:3]  # (a sidecar, a whole file: no range)
            self.requests.request(rel, start, end, urgent=state[1], out=req)
            req.add_done_callback(lambda r: returned(r, want))

        def returned(r: cf.Future, want) -> None:
            e = r.exception()
            if e is None:
                advance(r.result())
            elif want[0] == RANGE and isinstance(e, FileNotFoundError):
                advance(error=chunk_error(st.cache, want[1], "missing"))
            else:
                advance(error=e)

        advance()

    def warm(self, index: int, groups) -> None:
        """Request row groups ``groups`` of chunk ``index`` (once it is open) that are neither cached nor
        loading nor requested."""
        groups = list(groups)
        self.when_open(index, lambda m: self._fetch(m, self.store.touch_row_groups(index, groups)))

    def _fetch(self, m: ChunkMeta, groups) -> None:
        """Request row groups ``groups`` of chunk ``m`` not requested yet, adjacent ones together (up to
        ``MERGE_BYTES`` a request); each is decoded on the store's threads once its bytes are here."""
        st = self.store
        if m.data is not None:  # a whole-file chunk: its bytes are here
            st.submit(self._decode, m.index, list(groups))
            return
        runs: list[list[int]] = []
        rg = m.rg_ranges
        with st._lock:
            for g in sorted(set(groups)):
                key = ("rg", m.index, g)
                if key in st._lru or key in st._inflight or key in self._fetched:
                    continue
                if runs and runs[-1][-1] == g - 1 and rg[g, 0] + rg[g, 1] - rg[runs[-1][0], 0] <= MERGE_BYTES:
                    runs[-1].append(g)
                else:
                    runs.append([g])
            reqs = []
            for run in runs:  # registered before the lock is let go: a read of them then waits for these
                req: cf.Future = cf.Future()
                start = int(rg[run[0], 0])
                for g in run:
                    self._fetched[("rg", m.index, g)] = (req, int(rg[g, 0]) - start, int(rg[g, 1]))
                reqs.append((req, start, int(rg[run[-1], 0] + rg[run[-1], 1])))
        for run, (req, start, end) in zip(runs, reqs):
            self.requests.request(m.path, start, end, out=req)
            req.add_done_callback(lambda r, run=run: self._arrived(m.index, run, r))

    def _arrived(self, index: int, run: list[int], req: cf.Future) -> None:
        st = self.store
        if req.exception() is not None:
            with st._lock:  # a later read asks again; one waiting for these bytes got the error
                for g in run:
                    if self._fetched.get(("rg", index, g), (None,))[0] is req:
                        del self._fetched[("rg", index, g)]
            return
        st._count(index, len(req.result()), data=True)
        try:
            st.submit(self._decode, index, run)
        except RuntimeError:  # the store is closed
            pass

    def _decode(self, index: int, groups: list[int]) -> None:
        st = self.store
        for g in groups:
            try:
                st._get(("rg", index, g), lambda: st._load_row_group(index, g), wait=False)
            except Exception:  # noqa: BLE001 - read-ahead work; the read itself reports
                pass

    def bytes_of(self, m: ChunkMeta, group: int) -> bytes | None:
        """Row group ``group``'s bytes if they were requested (waiting for them if they are on their way),
        else None."""
        if not self._fetched:
            return None
        with self.store._lock:
            ahead = self._fetched.pop(("rg", m.index, group), None)
        if ahead is None:
            return None
        req, at, n = ahead
        if not req.done():
            self.requests.hurry(req)
        try:
            data = self.requests.wait(req)
        except FileNotFoundError:
            raise chunk_error(self.store.cache, m.path, "missing") from None
        return data if at == 0 and n == len(data) else data[at:at + n]
