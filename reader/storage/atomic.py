"""Atomic writes: a file appears under its name complete, or not at all. The one implementation every writer
of the project uses (the builder, the importers, the exports, the reader's index, local memo caches).

The content is written under a temporary name in the file's own directory (``.tmp-<32 hex>-NAME``: the same
directory keeps the rename a rename, and the prefix marks a crashed writer's leftover, which readers ignore
and the next build sweeps), then renamed onto the name by :func:`publish`. A failed write removes its
temporary file (a full disk gets its space back now) and names the file when the OS error does not (a
``write()`` on a full disk names none). Writing the same bytes twice (a retried bundle) is harmless.

The operations come from a storage backend with ``create(path)`` (a binary file to write), ``rename(src,
dst)`` and ``remove(path)`` (a missing file is fine). :class:`FsspecStorage` serves local paths and every
fsspec URL; on ``gs://`` a rename is a server-side copy then a delete, so the final object appears whole.
The builder passes its own backend over Beam's FileSystems (``pipelines/inputs/fsutil.py``), so its writes
use the same client and credentials as its reads on every runner; the sequence stays this one.
"""

from __future__ import annotations

import functools
import os
import posixpath
import uuid
from typing import Any, BinaryIO, Callable

TMP_PREFIX = ".tmp-"
BLOCK = 1 << 20


class Storage:
    """Where atomic writes go: the three operations they need."""

    def create(self, path: str) -> BinaryIO:
        """A new binary file to write at ``path`` (its directory created where directories exist)."""
        raise NotImplementedError

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` onto ``dst``, replacing it."""
        raise NotImplementedError

    def remove(self, path: str) -> None:
        """Delete ``path``; a missing file is fine."""
        raise NotImplementedError


def _protocols(fs) -> tuple[str, ...]:
    p = fs.protocol
    return p if isinstance(p, tuple) else (p,)


def is_local(fs) -> bool:
    return "file" in _protocols(fs) or "local" in _protocols(fs)


class FsspecStorage(Storage):
    """:class:`Storage` over an fsspec filesystem (``fs``)."""

    def __init__(self, fs):
        self.fs = fs
        self.local = is_local(fs)

    def create(self, path: str) -> BinaryIO:
        if self.local:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return self.fs.open(path, "wb")

    def rename(self, src: str, dst: str) -> None:
        if self.local:
            os.replace(src, dst)  # atomic, and replaces an existing file
        elif set(_protocols(self.fs)) & {"gs", "gcs"}:
            # gcsfs's mv tries Cloud Storage's moveTo first and, where that is not served (a 501 from an
            # emulator or a gateway), retries it for about 30 s before doing exactly this.
            self.fs.copy(src, dst)
            self.fs.rm(src)
        else:
            self.fs.mv(src, dst, recursive=True)

    def remove(self, path: str) -> None:
        remove_quietly(self.fs, path)


StorageLike = Any  # a Storage, or an fsspec filesystem


def storage(fs: StorageLike) -> Storage:
    """``fs`` as a :class:`Storage` (an fsspec filesystem is wrapped)."""
    return fs if isinstance(fs, Storage) else FsspecStorage(fs)


@functools.lru_cache(maxsize=1)
def local() -> Storage:
    """The local filesystem (for writers of local files only)."""
    import fsspec

    return FsspecStorage(fsspec.filesystem("file"))


def temp_name(path: str) -> str:
    """A unique temporary name beside ``path`` (same directory), marked by :data:`TMP_PREFIX`."""
    d, base = posixpath.split(path.rstrip("/"))
    name = f"{TMP_PREFIX}{uuid.uuid4().hex}-{base}"
    return f"{d}/{name}" if d else name


def remove_quietly(fs, path: str) -> None:
    """Remove a file or directory tree through fsspec; a missing one is fine."""
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def publish(fs: StorageLike, tmp: str, path: str) -> None:
    """Rename the complete temporary file ``tmp`` onto ``path``: the last step of every atomic write here
    (tests kill a build exactly before or after it: ``tests/support/kill_at.py``)."""
    st = storage(fs)
    try:
        st.rename(tmp, path)
    except BaseException:
        _remove(st, tmp)
        raise


def write(fs: StorageLike, path: str, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``path`` atomically: ``data`` (bytes), or whatever ``data(f)`` writes into the binary file ``f``."""
    st = storage(fs)
    fill = data if callable(data) else (lambda f: f.write(data))
    tmp = temp_name(path)
    try:
        f = st.create(tmp)
        try:
            fill(f)
        finally:
            f.close()
    except BaseException as e:
        _remove(st, tmp)
        if isinstance(e, OSError) and e.errno and not e.filename:
            raise OSError(e.errno, e.strerror, path) from e  # name the file (a write() error does not)
        raise
    publish(st, tmp, path)


def write_stream(fs: StorageLike, path: str, source: BinaryIO, block: int = BLOCK) -> None:
    """:func:`write` with the content copied from the readable binary file ``source``, block by block."""

    def copy(f):
        while b := source.read(block):
            f.write(b)

    write(fs, path, copy)


def _remove(st: Storage, tmp: str) -> None:
    try:
        st.remove(tmp)
    except Exception:  # noqa: BLE001 - the original error matters, not this one
        pass
