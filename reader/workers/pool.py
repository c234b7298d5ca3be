"""Reader worker processes: ``ReadOptions(num_workers=W)`` decodes and assembles batches in W processes.

One reader process is bound by the GIL (docs/DESIGN.md has the measurements). With ``num_workers=W``
the reader's rows of every batch are divided between W child processes, each an ordinary
:class:`reader.Reader` assembling its rows straight into a slot of shared memory; the parent only hands
out slots and returns views of them (docs/READING.md, "Reader workers").

The division is the one among reader hosts, one level down: worker ``w`` of reader ``r`` (of ``R``) is
reader ``r + R * w`` of ``R * W``, so its rows are every W-th of this reader's rows, its streams are its
own when ``R * W`` divides ``R*``, and the batch is identical, bit for bit, to what one process returns.
A caller may name the rows instead (``WorkerPool(reader, rows=...)``, as :class:`reader.jax.JaxLoader`
does): worker ``w`` then serves ``rows[w::W]``.

Batches are views of a ring of shared-memory slots, each holding a slab of consecutive batches
(``Reader.batches``). A slot is refilled only once nothing refers to any batch that was in it (CPython
reference counts); a batch that is kept keeps its memory, and the ring gets a new slot instead.

This module is the parent's side and the protocol; the workers run :mod:`reader.workers.process`,
started as ``python -m reader.workers.process`` (not ``multiprocessing``), so a training script
needs no ``if __name__ == "__main__"`` guard and no fork of a process that runs threads. A worker
that fails raises its exception (with the worker's traceback as a note) in the consumer; a worker
that dies is reported with its exit code; workers exit when the parent closes the iterator or dies.

Liveness: each worker counts its progress (:class:`reader.batch.readahead.Progress`: every byte range
fetched, every poll of a running build, every slab filled) in a shared array. The parent waits for a
worker's report with a bounded poll and checks that count four times per ``worker_timeout_s``: a
worker that holds work (its start-up, a slab) and does not move it for that long (stopped, or stuck on a
storage read) is reported as :class:`reader.ReaderStalled`, naming it and its batches, and every worker
is killed.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from multiprocessing.connection import Connection
from typing import Iterator

import numpy as np

from reader.batch.assemble import SLAB_BATCHES
from reader.batch.readahead import ReaderStalled
from reader.batch.schema import batch_spec

OP_STOP, OPFILL, OP_SLOT = 0, 1, 2  # parent -> worker
OP_READY, OP_DONE, OP_ERROR = 10, 11, 13  # worker -> parent
FILL = struct.Struct("<Bqii")  # op, first batch, slot, batches (asked for, or filled)
_ALIGN = 64
_SLOT_BYTES = 8 << 20
_START_S = 60.0  # a worker's start-up (a new interpreter, imports, opening the cache) may take this long at least


def progress_spec(workers: int) -> list:
    """The shared array where each worker's :class:`reader.batch.readahead.Progress` counts."""
    return [("progress", np.dtype(np.int64), (workers,))]


def _slot_layout(spec) -> tuple[list[tuple[str, np.dtype, tuple, int]], int]:
    out, off = [], 0
    for k, d, shape in spec:
        out.append((k, d, shape, off))
        off += -(-(d.itemsize * int(np.prod(shape))) // _ALIGN) * _ALIGN
    return out, max(off, _ALIGN)


def _shm_dir() -> str:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


class Slot:
    """One batch's arrays in a shared file mapping (``path`` is unlinked once every worker mapped it)."""

    def __init__(self, path: str, spec, create: bool):
        layout, size = _slot_layout(spec)
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:  # reserve the pages now: a full tmpfs must fail here, not with SIGBUS on first write
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    os.close(fd)
                    fd = -1
                    os.unlink(path)
                    raise OSError(e.errno, f"cannot reserve {size} bytes of shared memory in "
                                           f"{os.path.dirname(path)} for reader worker batches ({e.strerror}). "
                                           "In Docker, raise --shm-size; or use fewer num_workers or "
                                           "prefetch_batches.") from None
            mm = mmap.mmap(fd, size)
        finally:
            if fd >= 0:
                os.close(fd)
        self.path = path
        self.linked = True
        # the arrays keep the mapping alive (no explicit close: a caller's views may outlive the ring)
        # np.ndarray over the mapping: each array is the base of every view of it, so its reference
        # count tells whether a batch handed out is still alive (a reshape would hide the views)
        self.arrays = {k: np.ndarray(s, d, buffer=mm, offset=off) for k, d, s, off in layout}
        del mm

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def free(self) -> bool:
        """True when no view of the slot's arrays is alive (refs: ``self.arrays`` and the argument)."""
        arrays = self.arrays
        for k in arrays:
            if sys.getrefcount(arrays[k]) > 2:
                return False
        return True


class WorkerError(RuntimeError):
    """A reader worker process exited without reporting an exception (killed, out of memory, ...)."""


class WorkerPool:
    """Batches ``start, start+1, ...`` of ``reader``'s rows (or of the global rows ``rows``), assembled
    by ``reader.options.num_workers`` child processes. Iterate it once; :meth:`close` (or the end of
    iteration) stops the workers.

    ``rows``: a sorted set of global rows to serve instead of ``reader.my_rows`` (``reader.jax.JaxLoader``
    passes the rows its process's devices hold). Worker ``w`` serves ``rows[w::W]`` as the reader
    ``i`` of ``N`` that holds them (``N`` = the gcd of ``B`` and their spacings: ``R*W`` for
    ``reader.my_rows``, where worker ``w`` is reader ``r + R*w``; ``W`` for a block of consecutive rows);
    when ``N`` divides ``R*`` the workers' streams, hence their chunks, are disjoint.

    A slot holds a slab of ``slab`` consecutive batches (the workers assemble them in one pass); the ring
    has ``depth`` slots. A slot goes back to the workers when the caller has moved past its batches
    and holds none of them (else a new slot takes its place in the ring).
    """

    def __init__(self, reader, start: int = 0, count: int | None = None, rows=None):
        opts = reader.options
        W = int(opts.num_workers)
        B = opts.batch_size
        if rows is None:
            R = reader.num_readers
            if B % (R * W):
                raise ValueError(f"num_workers={W}: batch_size {B} must be a multiple of num_readers x "
                                 f"num_workers = {R * W} (each worker serves every {W}th of this reader's rows)")
            rows = reader.my_rows
        else:
            rows = np.asarray(rows, dtype=np.int64).reshape(-1)
            if not rows.size or (np.diff(rows) <= 0).any() or rows[0] < 0 or rows[-1] >= B:
                raise ValueError(f"rows must be a non-empty, sorted set of distinct rows in [0, batch_size={B})")
            if rows.size % W:
                raise ValueError(f"num_workers={W}: the {rows.size} rows of each batch read here do not divide "
                                 f"evenly over {W} workers (each serves every {W}th row); use a num_workers "
                                 f"that divides {rows.size}, or a batch_size that gives a multiple of {W} rows")
        self.start = int(start)
        self.stop = None if count is None else self.start + int(count)
        self.rows = len(rows)  # per batch
        # a flat batch's loss_mask and continuation slots, the varlen fields (reader.batch.schema)
        shape = (bool(getattr(reader, "masked", False)), int(getattr(reader, "continuation_slots", 0)),
                 opts.varlen_segments)
        batch_bytes = _slot_layout(batch_spec(opts.layout, opts.seq_len, self.rows, *shape))[1]
        # batches per slot: a worker's pass, at most _SLOT_BYTES a slot (Docker's /dev/shm is 64 MB)
        self.slab = max(1, min(SLAB_BATCHES, _SLOT_BYTES // batch_bytes))
        self.spec = batch_spec(opts.layout, opts.seq_len, self.slab * self.rows, *shape)
        self.num_workers = W
        self.depth = max(2, -(-max(1, opts.prefetch_batches) // self.slab)) + 1  # slots
        self._tag = f"chunkledger-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._nslot = 0
        self._slots: list[Slot] = []
        self._retired: list[Slot] = []  # replaced while a caller still held one of their batches
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._closed = False
        self.timeout_s = float(opts.worker_timeout_s)
        self._progress: Slot | None = None
        try:
            self._slots = [self._new_slot() for _ in range(self.depth)]
            self._progress = Slot(os.path.join(_shm_dir(), f"{self._tag}-progress"), progress_spec(W), create=True)
            # On a local cache the workers decode inline (prefetch_threads=0): CPU, not I/O, is what
            # they share, and planning ahead costs CPU. Remote caches keep the prefetch threads, which
            # hide the fetch latency.
            wopts = dataclasses.replace(opts, num_workers=0,
                                        prefetch_threads=0 if reader.cache.is_local else opts.prefetch_threads,
                                        memory_budget_bytes=max(1, opts.memory_budget_bytes // W))
            env = dict(os.environ)
            # workers do no linear algebra: without this, numpy's OpenBLAS starts a thread per core that
            # spins while the worker starts, on the cores the workers need (a first batch 20% later)
            env.setdefault("OPENBLAS_NUM_THREADS", "1")
            here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project
            env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            for w in range(W):
                mine_rows = rows[w::W]
                N = int(np.gcd.reduce(np.append(np.diff(mine_rows), B)))  # reader i of N holds them
                mine, theirs = socket.socketpair()
                try:
                    p = subprocess.Popen([sys.executable, "-m", "reader.workers.process", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
                finally:
                    theirs.close()
                self._procs.append(p)
                self._conns.append(Connection(mine.detach()))
                self._conns[-1].send({
                    "cache": reader.cache.url, "storage_options": reader.cache.storage_options,
                    "options": wopts, "num_readers": N, "reader_index": int(mine_rows[0]) % N,
                    "my_rows": mine_rows,
                    "wait_timeout_s": reader.wait_timeout_s, "poll_interval_s": reader.poll_interval_s,
                    "start": self.start, "count": count, "worker": w, "workers": W, "spec": self.spec,
                    "rows": self.rows, "slots": [s.path for s in self._slots], "progress": self._progress.path,
                })
            for w in range(W):
                self._expect(w, OP_READY, what="starting (opening the cache)", limit=max(self.timeout_s, _START_S))
            for s in self._slots + [self._progress]:  # every worker has mapped them: the names can go
                s.unlink()
            self._owner: dict[int, tuple[int, int]] = {}  # first batch of a granted slab -> (slot, batches)
            self._next_grant = self.start
            for k in range(self.depth):
                if not self._grant(k):
                    break
        except BaseException:
            self.close()
            raise

    # -- slots ------------------------------------------------------------------------------------
    def _new_slot(self) -> Slot:
        path = os.path.join(_shm_dir(), f"{self._tag}-{self._nslot}")
        self._nslot += 1
        return Slot(path, self.spec, create=True)

    def _grant(self, k: int) -> bool:
        """Ask every worker to fill slot ``k`` with the next slab of batches; False past ``stop``."""
        b = self._next_grant
        n = self.slab if self.stop is None else min(self.slab, self.stop - b)
        if n <= 0:
            return False
        self._send(FILL.pack(OPFILL, b, k, n))
        self._owner[b] = (k, n)
        self._next_grant += n
        return True

    def _reclaim(self, k: int) -> None:
        """The caller is done with slot ``k``'s batches: give the slot the next slab, or, if one of them
        is still held, give the ring a new slot in its place."""
        slot = self._slots[k]
        if not slot.free():
            self._retired.append(slot)
            self._retired = [s for s in self._retired if not s.free()]
            slot = self._slots[k] = self._new_slot()  # unlinked once the workers have filled it
            self._send(bytes([OP_SLOT]) + struct.pack("<i", k) + slot.path.encode())
        self._grant(k)

    # -- messages ------------------------------------------------------------------------------------
    def _send(self, msg: bytes) -> None:
        for w, c in enumerate(self._conns):
            try:
                c.send_bytes(msg)
            except OSError:  # the worker is gone: raise the error it reported, if it did
                while True:
                    try:
                        got = self._conns[w].recv_bytes()
                    except (EOFError, OSError):
                        self._dead(w)
                    if got[0] == OP_ERROR:
                        self._raise(w, got)

    def _recv(self, w: int, what: str, limit: float) -> bytes:
        """Worker ``w``'s next message; :class:`ReaderStalled` once its progress count has not moved for
        ``limit`` seconds while waiting (``what``: the work it holds)."""
        conn = self._conns[w]
        count = self._progress.arrays["progress"]
        seen, since = int(count[w]), time.monotonic()
        while True:
            try:
                if conn.poll(min(limit / 4, max(0.0, since + limit - time.monotonic()))):
                    return conn.recv_bytes()
            except (EOFError, OSError):  # only the worker holds the other end: it has exited
                self._dead(w)
            if int(count[w]) != seen:
                seen, since = int(count[w]), time.monotonic()
            elif time.monotonic() - since >= limit:
                self._stalled(w, what, limit)

    def _stalled(self, w: int, what: str, limit: float):
        pid = self._procs[w].pid
        for p in self._procs:  # the stalled worker cannot finish, and the others serve the same batches
            p.kill()
            p.wait()
        raise ReaderStalled(f"reader worker {w} (pid {pid}) made no progress for {limit:g} s while {what} "
                            f"(ReadOptions.worker_timeout_s={self.timeout_s:g}): stopped, or stuck on a storage "
                            "read; the reader workers were killed. Check the storage, or raise worker_timeout_s")

    def _raise(self, w: int, msg: bytes):
        exc, tb = pickle.loads(msg[1:])
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised in reader worker {w}, pid {self._procs[w].pid}:)\n{tb}")
        raise exc

    def _dead(self, w: int):
        proc = self._procs[w]
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = "unknown (still running)"
        raise WorkerError(f"reader worker {w} (pid {proc.pid}) exited with code {code} without a report; "
                          "see its output above (out of memory? killed?)") from None

    def _expect(self, w: int, op: int, b: int | None = None, what: str = "", limit: float | None = None) -> int:
        """Receive worker ``w``'s next report and return its batch count (``op`` with batch ``b``
        expected, for ``what``, within ``limit`` seconds without progress: default ``worker_timeout_s``);
        raise the worker's exception if it reports one."""
        msg = self._recv(w, what, self.timeout_s if limit is None else limit)
        got = msg[0]
        if got == OP_ERROR:
            self._raise(w, msg)
        if got != op or (b is not None and FILL.unpack(msg)[1] != b):
            raise WorkerError(f"reader worker {w}: unexpected report {msg[:24]!r} (wanted op {op}, batch {b})")
        return FILL.unpack(msg)[3] if b is not None else 0

    # -- iteration -------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        b = self.start
        n = self.rows
        prev = None  # the slot of the slab read before this one
        try:
            while b in self._owner:
                k, want = self._owner.pop(b)
                # batches the workers filled: fewer than asked only at the end of an eval pass
                what = f"assembling batches {b}..{b + want - 1} (shared-memory slot {k})"
                got = min(self._expect(w, OP_DONE, b, what) for w in range(self.num_workers))
                slot = self._slots[k]
                slot.unlink()  # a new slot's name is needed only until the workers have mapped it
                arrays = slot.arrays
                for i in range(got):
                    yield b + i, {key: arrays[key][i * n:(i + 1) * n] for key in arrays}
                    if prev is not None:  # the caller has let go of the previous slab's last batch
                        self._reclaim(prev)
                        prev = None
                if got < want:
                    return  # the end of the data
                prev = k
                b += got
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self._conns:
            try:
                c.send_bytes(bytes([OP_STOP]))
            except OSError:
                pass
        for p in self._procs:  # a worker finishes its current slab first (it may be waiting on a build)
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for c in self._conns:
            c.close()
        for s in self._slots + self._retired + ([self._progress] if self._progress else []):
            s.unlink()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
