"""A storage read that never returns, for the reader liveness tests: chunk files replaced by FIFOs."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil


def release(fifo: str) -> None:
    """Let every read blocked opening ``fifo`` go on (it then reads nothing)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as e:
        if e.errno != errno.ENXIO:  # ENXIO: nobody is waiting
            raise


@contextlib.contextmanager
def hanging_chunks(cache: str, root: str):
    """A copy of ``cache`` at ``root`` whose chunk files are FIFOs: opening one blocks until a writer
    comes. Afterwards the real files are put back and the blocked reads are let go."""
    shutil.copytree(cache, root)
    victims = glob.glob(os.path.join(root, "chunks", "*", "*.parquet"))
    for victim in victims:
        os.replace(victim, victim + ".real")
        os.mkfifo(victim)
        os.link(victim, victim + ".fifo")  # the FIFO stays reachable once the real file is back
    try:
        yield root
    finally:
        for victim in victims:
            os.replace(victim + ".real", victim)
            release(victim + ".fifo")
