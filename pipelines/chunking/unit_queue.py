"""A shared queue of work units for the workers of one local build: no worker finishes alone.

Beam's local runner deals its input elements out to the workers once, before any of them starts, so a
worker that happens to run a little slower (another process on its core, a slower shard) is still
working when the others have finished: the build's tail. Instead, a local multi-process build gives each
worker one *slot* element, and every slot takes the next unclaimed unit of the plan's order (largest
first) until none is left. A claim is a file created with ``O_EXCL`` in a directory of this run (local
workers share the machine's file system), so each unit is built exactly once, by whichever worker is free
first, and the last units to start are the smallest.

The order and the claims change no output byte: each unit's chunks are a pure function of its input.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Iterator


class ClaimQueue:
    """Units ``0..n-1`` claimed through files in ``directory`` (shared by every worker of one run).

    Args:
      directory: an existing local directory, empty when the run starts.
      n: the number of units.
    """

    def __init__(self, directory: str, n: int):
        self.directory = directory
        self.n = n

    def __iter__(self) -> Iterator[int]:
        """The units this process claims, in order, until every unit is claimed."""
        for i in range(self.n):
            try:
                fd = os.open(os.path.join(self.directory, f"unit-{i:07d}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                             0o644)
            except FileExistsError:
                continue  # another worker has it
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            yield i


def new_claims_directory() -> str:
    """A fresh directory for one run's claims (remove it with :func:`remove` when the run ends)."""
    return tempfile.mkdtemp(prefix="chunkledger-claims-")


def remove(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
