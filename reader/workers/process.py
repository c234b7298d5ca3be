"""A reader worker process (``python -m reader.workers.process FD``): see :mod:`reader.workers.pool`.

The parent sends the setup over the socket ``FD``: the cache, the options and this worker's rows; the
worker opens an ordinary :class:`reader.Reader` serving those rows and answers each "fill slot k with
batches b.." by assembling them straight into its rows of that shared-memory slot.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from reader.workers.pool import FILL, OP_DONE, OP_ERROR, OP_READY, OP_SLOT, OP_STOP, Slot, progress_spec


def _send_error(conn: Connection, e: BaseException) -> None:
    tb = traceback.format_exc()
    try:
        payload = pickle.dumps((e, tb))
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
        payload = pickle.dumps((RuntimeError(f"{type(e).__name__}: {e}"), tb))
    conn.send_bytes(bytes([OP_ERROR]) + payload)


def _serve(conn: Connection) -> None:
    from reader.reader import Reader  # after the connection exists, so an import error is reported

    setup: dict[str, Any] = conn.recv()
    w, W, spec, n = setup["worker"], setup["workers"], setup["spec"], setup["rows"]
    reader = batches = None

    def rows_of(slot: Slot) -> dict[str, np.ndarray]:
        """This worker's rows of a slot: every W-th row from row w (batch i's are [i * n/W, (i+1) * n/W))."""
        return {key: a[w::W] for key, a in slot.arrays.items()}

    try:
        slots = {k: rows_of(Slot(p, spec, create=False)) for k, p in enumerate(setup["slots"])}
        progress = Slot(setup["progress"], progress_spec(W), create=False).arrays["progress"][w:w + 1]
        progress[0] += 1  # started: the parent watches this count while it waits for us
        reader = Reader(setup["cache"], setup["options"], num_readers=setup["num_readers"],
                        reader_index=setup["reader_index"], wait_timeout_s=setup["wait_timeout_s"],
                        poll_interval_s=setup["poll_interval_s"], storage_options=setup["storage_options"],
                        serve_rows=setup["my_rows"])
        reader.progress.share(progress)  # every fetch and every poll of a running build moves it
        inline = reader.options.prefetch_threads == 0  # all on this thread: the least CPU per batch
        if not inline:
            batches = reader.iter_batches(setup["start"], setup["count"])
    except BaseException as e:  # noqa: BLE001
        _send_error(conn, e)
        return
    conn.send_bytes(bytes([OP_READY]))
    ahead = None  # inline: decoding what the next slabs need while the parent has none for us
    stop = None if setup["count"] is None else setup["start"] + setup["count"]
    try:
        while True:
            if ahead is not None:
                for _ in ahead:
                    if conn.poll():
                        break
                else:
                    ahead = None
            try:
                msg = conn.recv_bytes()
            except EOFError:  # the parent is gone
                return
            op = msg[0]
            if op == OP_STOP:
                return
            if op == OP_SLOT:
                (k,) = struct.unpack_from("<i", msg, 1)
                slots[k] = rows_of(Slot(msg[5:].decode(), spec, create=False))
                continue
            _, b, k, want = FILL.unpack(msg)
            per = n // W  # this worker's rows per batch
            done = 0
            if inline:  # assembled straight into the slot, the whole slab in one pass
                while done < want and reader.has_batch(b + done):
                    done += 1
                if done:
                    reader.batches(b, done, {key: a[:done * per] for key, a in slots[k].items()})
                    ahead = reader.read_ahead(b + done, stop)
            else:
                for i in range(want):
                    try:
                        got, batch = next(batches)
                    except StopIteration:
                        break
                    if got != b + i:
                        raise RuntimeError(f"reader worker {w}: produced batch {got}, the parent asked for {b + i}")
                    for key, a in batch.items():
                        np.copyto(slots[k][key][i * per:(i + 1) * per], a, casting="no")
                    done += 1
            reader.progress.beat()
            conn.send_bytes(FILL.pack(OP_DONE, b, k, done))
    except BaseException as e:  # noqa: BLE001
        try:
            _send_error(conn, e)
        except OSError:
            pass
    finally:
        if batches is not None:
            batches.close()  # cancels its pending work
        if reader is not None:
            reader.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    conn = Connection(int(argv[0]))
    try:
        _serve(conn)
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: interpreter exit joins the prefetch threads, which may be waiting on a running build.
    os._exit(code)
