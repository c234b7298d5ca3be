"""``counting://``: the local filesystem as an asynchronous fsspec filesystem that records every read.

What the reader does with a remote cache on an asynchronous filesystem (gcsfs), on local files and in one
process: ``Reader("counting://" + path)`` reads ``path`` through :class:`CountingFileSystem`, whose
``_cat_file`` records each request (path, start, end), counts the requests in flight (and the most at
once), and can hold requests until released (:meth:`CountingFileSystem.hold`) or fail them
(:meth:`CountingFileSystem.fail`). The record is kept on the class (instances come and go with fsspec's
cache); :func:`counting` installs the protocol and clears the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Callable

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem


class CountingFileSystem(AsyncFileSystem):
    protocol = "counting"
    cachable = False
    local = LocalFileSystem()
    lock = threading.Condition()
    calls: list[tuple[str, int | None, int | None]] = []
    in_flight = 0
    most_in_flight = 0
    held: list[tuple[str, int | None, int | None]] = []  # requests waiting for the gate
    _gate: Callable[[str, int | None, int | None], bool] | None = None  # which requests to hold
    _let_go: threading.Event = threading.Event()  # held requests go on once set (not _open: the filesystem's open)
    _waiting: list = []  # (event loop, asyncio.Event) of the held requests
    _fail: Callable[[str, int | None, int | None], BaseException | None] | None = None

    @classmethod
    def reset(cls) -> None:
        with cls.lock:
            cls.calls, cls.held, cls.in_flight, cls.most_in_flight = [], [], 0, 0
            cls._gate, cls._fail, cls._waiting = None, None, []
            cls._let_go = threading.Event()

    @classmethod
    def hold(cls, pred: Callable[[str, int | None, int | None], bool]) -> None:
        """Hold every later request ``pred(path, start, end)`` accepts until :meth:`release` (or for ever)."""
        cls._gate = pred

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls._let_go.set()
            waiting, cls._waiting = cls._waiting, []
        for loop, ev in waiting:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that loop is closed
                pass

    @classmethod
    def fail(cls, what: Callable[[str, int | None, int | None], BaseException | None]) -> None:
        """Fail every later request for which ``what(path, start, end)`` returns an exception, with it."""
        cls._fail = what

    @classmethod
    def wait_held(cls, pred: Callable[[list], bool], timeout: float = 60) -> bool:
        """Wait until ``pred(held requests)`` holds (True), or ``timeout`` seconds (False)."""
        with cls.lock:
            return cls.lock.wait_for(lambda: pred(list(cls.held)), timeout)

    async def _cat_file(self, path, start=None, end=None, **kwargs):
        cls = type(self)
        req = (path, start, end)
        with cls.lock:
            cls.calls.append(req)
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        try:
            gate = cls._gate
            if gate is not None and gate(*req):
                ev = asyncio.Event()
                with cls.lock:
                    cls.held.append(req)
                    if not cls._let_go.is_set():
                        cls._waiting.append((asyncio.get_running_loop(), ev))
                    else:
                        ev.set()
                    cls.lock.notify_all()
                await ev.wait()
            err = cls._fail(*req) if cls._fail is not None else None
            if err is not None:
                raise err
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: cls.local.cat_file(path, start=start, end=end))
        finally:
            with cls.lock:
                cls.in_flight -= 1

    async def _info(self, path, **kwargs):
        return self.local.info(path)

    async def _ls(self, path, detail=True, **kwargs):
        return self.local.ls(path, detail=detail)


@contextlib.contextmanager
def counting():
    """``counting://`` installed (and its record cleared) for the block; held requests are let go after it."""
    fsspec.register_implementation("counting", CountingFileSystem, clobber=True)
    CountingFileSystem.reset()
    try:
        yield CountingFileSystem
    finally:
        CountingFileSystem.release()
