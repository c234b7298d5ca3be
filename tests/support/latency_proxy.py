"""A latency-injecting HTTP proxy on loopback, for reading ``gs://`` through the GCS emulator as if it were far.

Every request is held ``delay_s`` seconds (from the moment its head has arrived) before it is passed on to
the upstream server, so a client sees each request take at least that long, as from a real bucket, while
requests in flight together wait together (latency, not bandwidth). The upstream is the GCS emulator
(``gcp-storage-emulator``: HTTP/1.0, one request per connection), so the proxy relays one request per
client connection: it reads the request, waits, opens a connection upstream, relays both ways until the
upstream closes, and closes the client connection.

For tests, ``stall(pred)`` holds every request whose first line matches ``pred`` until the proxy closes
(a storage read that never returns), and ``fail(pred, status)`` answers such requests with ``status``
instead of passing them on (a storage read that fails).

Bounded: it listens on 127.0.0.1 only, passes requests only to a 127.0.0.1 upstream, and stops after
``max_s`` seconds (or when closed, or when its parent process dies). In-process (tests)::

    with LatencyProxy(emu.port, delay_s=0.05) as proxy:
        Reader(url, opts, storage_options={**emu.storage_options, "endpoint_url": proxy.endpoint})

or as a process of its own (``python tests/support/latency_proxy.py --upstream_port P --delay_ms D``), which
prints ``PORT <n>`` once it listens and reports ``STATS {json}`` (requests and bytes relayed) on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import re
import signal
import sys
import threading
import time
from typing import Callable

_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 1 << 16


class LatencyProxy:
    """The proxy on a thread of its own with its own event loop (see the module docstring)."""

    def __init__(self, upstream_port: int, delay_s: float = 0.0, *, max_s: float = 600.0):
        self.upstream_port = int(upstream_port)
        self.delay_s = float(delay_s)  # may be changed while the proxy runs
        self.max_s = float(max_s)
        self.port = 0
        self.requests = 0  # requests passed on (or failed on purpose)
        self.bytes_out = 0  # response bytes relayed to clients
        self.seen: list[str] = []  # first line of every request (the latest 10,000)
        self._stalls: list[Callable[[str], bool]] = []
        self._fails: list[tuple[Callable[[str], bool], int]] = []
        self.stalled = threading.Event()  # set when a request is first held by stall()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- test controls ------------------------------------------------------------------------------
    def stall(self, pred: Callable[[str], bool]) -> None:
        """Hold every later request whose first line (``GET /path HTTP/1.1``) satisfies ``pred`` until the
        proxy closes."""
        self._stalls.append(pred)

    def fail(self, pred: Callable[[str], bool], status: int) -> None:
        """Answer every later request whose first line satisfies ``pred`` with HTTP ``status``."""
        self._fails.append((pred, int(status)))

    # -- lifecycle ----------------------------------------------------------------------------------
    def __enter__(self) -> "LatencyProxy":
        self._thread = threading.Thread(target=self._run, name="latency-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"the latency proxy did not start: {self._error!r}")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop has already ended
                pass
            self._thread.join(30)

    def _run(self) -> None:
        try:
            asyncio.run(self.serve())
        except BaseException as e:  # noqa: BLE001 - reported by __enter__ when it happens at start
            self._error = e
            self._ready.set()

    async def serve(self, on_ready: Callable[[int], None] | None = None) -> None:
        """Listen, relay, and return when closed or after ``max_s`` seconds."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        tasks: set[asyncio.Task] = set()

        async def track(reader, writer):
            t = asyncio.current_task()
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            await self._relay(reader, writer)

        server = await asyncio.start_server(track, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        if on_ready is not None:
            on_ready(self.port)
        self._ready.set()
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=self.max_s)
        except asyncio.TimeoutError:
            pass
        finally:
            server.close()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- one request ----------------------------------------------------------------------------------
    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_writer = None
        try:
            try:
                head = await reader.readuntil(_HEAD_END)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            arrived = time.monotonic()
            if len(head) > _MAX_HEAD:
                return
            first = head.split(b"\r\n", 1)[0].decode("latin-1")
            m = re.search(rb"\r\ncontent-length:\s*(\d+)", head, re.IGNORECASE)
            body = await reader.readexactly(int(m.group(1))) if m else b""
            self.seen.append(first)
            del self.seen[:-10_000]
            if any(p(first) for p in self._stalls):
                self.stalled.set()
                await asyncio.Event().wait()  # until the proxy closes (the task is cancelled)
            wait = arrived + self.delay_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.requests += 1
            status = next((s for p, s in self._fails if p(first)), None)
            if status is not None:
                msg = f'{{"error": {{"code": {status}, "message": "injected by the latency proxy"}}}}'.encode()
                writer.write(f"HTTP/1.1 {status} Injected\r\nContent-Type: application/json\r\nContent-Length: "
                             f"{len(msg)}\r\nConnection: close\r\n\r\n".encode() + msg)
                await writer.drain()
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            up_writer.write(head + body)
            await up_writer.drain()
            while True:
                data = await up_reader.read(1 << 16)
                if not data:
                    break
                self.bytes_out += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (up_writer, writer):
                if w is not None:
                    w.close()


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream_port", type=int, required=True, help="the emulator's port on 127.0.0.1")
    ap.add_argument("--delay_ms", type=float, default=0.0)
    ap.add_argument("--max_s", type=float, default=3600.0, help="stop after this many seconds whatever happens")
    a = ap.parse_args(argv)
    _die_with_parent()
    proxy = LatencyProxy(a.upstream_port, a.delay_ms / 1000, max_s=a.max_s)

    async def run():
        loop = asyncio.get_running_loop()
        serving = asyncio.ensure_future(proxy.serve(lambda port: print(f"PORT {port}", flush=True)))
        while proxy._stop is None:
            await asyncio.sleep(0)
        loop.add_signal_handler(signal.SIGTERM, proxy._stop.set)
        await serving

    asyncio.run(run())
    print("STATS " + json.dumps({"requests": proxy.requests, "bytes": proxy.bytes_out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
