"""The storage port: the one door through which the project's code reads and writes files, and the one
atomic write every writer uses (the builder, the importers, the exports, the reader's index, local memos).

A :class:`Storage` is a small interface (read, a byte range, open, size, exists, list, match, and the atomic
write's create, rename and remove) with two adapters: :class:`FsspecStorage` here (local paths and every
fsspec URL) and the builder's ``BeamStorage`` over Beam's FileSystems (``pipelines/filesystem.py``), so the
builder's writes use the client and credentials its reads use on every runner. :class:`RangeFile` hands
pyarrow a file made only of byte ranges already read.

The door (:mod:`reader.storage.door`, whose functions are the port's): every local file the project opens is
opened through it, so a FIFO, a device or a directory where a file belongs is refused at once, naming it;
files inside a root follow symlinks only within it; a read is bounded where the format says how large a
file can be; a write never goes through a symlink. :class:`FsspecStorage` reads and writes local files so.

The atomic write: the content is written under a temporary name in the file's own directory
(``.tmp-<32 hex>-NAME``: the same directory keeps the rename a rename, and the prefix marks a crashed
writer's leftover, which readers ignore and the next build sweeps), then renamed onto the name by
:func:`publish`. A failed write removes its temporary file (a full disk gets its space back now) and names
the file when the OS error does not (a ``write()`` on a full disk names none). Writing the same bytes twice
(a retried bundle) is harmless. On ``gs://`` a rename is a server-side copy then a delete, so the final
object appears whole.
"""

from __future__ import annotations

import datetime
import functools
import io
import os
import posixpath
import uuid
from typing import Any, BinaryIO, Callable, Mapping, NamedTuple, Sequence

from reader.format.spec import TMP_PREFIX
from reader.storage.door import (MAX_SMALL_FILE_BYTES, UnsafeFile, create_local, inside, kind_of,  # noqa: F401
                                 no_symlink_below, not_regular, open_local, read_local, regular_size, too_large)

BLOCK = 1 << 20
GCS_PROTOCOLS = ("gs", "gcs")


class Entry(NamedTuple):
    """A file that :meth:`Storage.list` found."""

    path: str
    size: int | None
    mtime: float | None  # seconds since the epoch, None where the store does not say


class Storage:
    """Where files are read and written (see the module doc); every method names a file by its full path.

    ``read``: a file's bytes (``FileNotFoundError`` if there is none; :class:`UnsafeFile` past ``limit``
    bytes, or for what the door refuses); ``read_range``: bytes ``[start, end)`` of it (fewer at its end; to its
    end if ``end`` is None); ``read_ranges``: the bytes of each ``(start, end)`` range of one file (one open, or one
    request where a store can); ``read_many``: ``path -> bytes`` of those that
    exist (fetched concurrently where a store can); ``open``: a seekable file to read (without ``read_ahead``
    each read is one request for exactly its bytes); ``list``: what is directly in a directory, subdirectories
    too where a store has them (one prefix listing on object stores; none if it is not there); ``match``: the
    files a glob pattern matches (``*`` within one path segment); ``create``: a new file to write (its
    directory made where directories exist); ``rename`` onto an existing file replaces it; ``remove`` of a
    missing file is fine.
    """

    def read(self, path: str, limit: int | None = None) -> bytes:
        raise NotImplementedError

    def read_range(self, path: str, start: int, end: int | None) -> bytes:
        raise NotImplementedError

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        out = []
        with self.open(path, read_ahead=False) as f:
            for start, end in ranges:
                f.seek(start)
                out.append(f.read(end - start))
        return out

    def read_many(self, paths: Sequence[str]) -> dict[str, bytes]:
        out = {}
        for p in paths:
            try:
                out[p] = self.read(p)
            except FileNotFoundError:
                pass
        return out

    def open(self, path: str, read_ahead: bool = True) -> BinaryIO:
        raise NotImplementedError

    def size(self, path: str) -> int:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def list(self, directory: str) -> list[Entry]:
        raise NotImplementedError

    def match(self, pattern: str) -> list[Entry]:
        raise NotImplementedError

    def create(self, path: str) -> BinaryIO:
        raise NotImplementedError

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def remove(self, path: str) -> None:
        raise NotImplementedError


def protocols(fs) -> tuple[str, ...]:
    """An fsspec filesystem's protocol names."""
    p = fs.protocol
    return p if isinstance(p, tuple) else (p,)


def is_local(fs) -> bool:
    return "file" in protocols(fs) or "local" in protocols(fs)


def is_gcs(fs) -> bool:
    return bool(set(protocols(fs)) & set(GCS_PROTOCOLS))


def mtime(info: Mapping[str, Any]) -> float | None:
    """An fsspec listing entry's modification time in seconds since the epoch (local files, Cloud Storage, S3)."""
    for key in ("mtime", "updated", "LastModified", "last_modified", "created"):
        v = info.get(key)
        if v is None:
            continue
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            try:
                v = datetime.datetime.fromisoformat(v.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(v, datetime.datetime):
            return (v if v.tzinfo else v.replace(tzinfo=datetime.timezone.utc)).timestamp()
    return None


class FsspecStorage(Storage):
    """:class:`Storage` over an fsspec filesystem (``fs``). Local files go through the door
    (:func:`open_local`); with ``root``, as files found inside that root (symlinks only within it, and no
    write through one)."""

    def __init__(self, fs, root: str | None = None):
        self.fs = fs
        self.local = is_local(fs)
        self.root = root if self.local else None

    def read(self, path: str, limit: int | None = None) -> bytes:
        if self.local:
            return read_local(path, root=self.root, limit=limit)
        if limit is None:
            return self.fs.cat_file(path)
        data = self.fs.cat_file(path, start=0, end=limit + 1)
        if len(data) > limit:
            raise too_large(path, len(data), limit)
        return data

    def read_range(self, path: str, start: int, end: int | None) -> bytes:
        if self.local:
            return read_local(path, root=self.root, start=start, end=end)
        return self.fs.cat_file(path, start=start, end=end)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        if self.local or len(ranges) < 2:
            return super().read_ranges(path, ranges)
        got = self.fs.cat_ranges([path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges],
                                 on_error="raise")
        return [bytes(g) for g in got]

    def read_many(self, paths: Sequence[str]) -> dict[str, bytes]:
        if len(paths) < 2 or self.local:
            return super().read_many(paths)
        got = self.fs.cat(list(paths), on_error="omit")
        out = {}
        for p in paths:  # the store may name a file otherwise than it was asked for (a leading "/")
            data = got.get(p)
            if data is None:
                data = next((v for q, v in got.items() if q.endswith(p.lstrip("/"))), None)
            if data is not None and not isinstance(data, Exception):
                out[p] = data
        return out

    def open(self, path: str, read_ahead: bool = True) -> BinaryIO:
        if self.local:
            return open_local(path, root=self.root)
        return self.fs.open(path, "rb") if read_ahead else self.fs.open(path, "rb", cache_type="none")

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def list(self, directory: str) -> list[Entry]:
        try:
            found = self.fs.ls(directory, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [Entry(str(info["name"]), info.get("size"), mtime(info)) for info in found]

    def match(self, pattern: str) -> list[Entry]:
        found = self.fs.glob(pattern, detail=True)
        return [Entry(str(info.get("name", p)), info.get("size"), mtime(info)) for p, info in found.items()
                if info.get("type") != "directory"]

    def create(self, path: str) -> BinaryIO:
        if self.local:
            if self.root is not None:
                no_symlink_below(self.root, path)
            return create_local(path)
        return self.fs.open(path, "wb")

    def rename(self, src: str, dst: str) -> None:
        if self.local:
            os.replace(src, dst)  # atomic, and replaces an existing file
        elif is_gcs(self.fs):
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


def url_storage(url: str, storage_options: Mapping[str, Any] | None = None,
                root: str | None = None) -> tuple[FsspecStorage, str]:
    """``(storage, path)`` of a local path or fsspec URL; ``root``: a local directory the files read stay in."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return FsspecStorage(fs, root=root), path


def read_url(url: str, storage_options: Mapping[str, Any] | None = None, limit: int | None = None) -> bytes:
    """The bytes of a local path or fsspec URL named by the user (a template, a config), through the door."""
    st, path = url_storage(url, storage_options)
    return st.read(path, limit=limit)


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


class RangeFile(io.RawIOBase):
    """A read-only file of ``size`` bytes for pyarrow, made only of the byte ranges read for it (``ranges``:
    ``(offset, bytes)`` pairs, which a caller may replace between reads). What is read, and hashed, is
    decided by whoever read the ranges, not by pyarrow's read coalescing, which differs between versions;
    a read anywhere else is an error (a bug: the ranges must cover every read), never zeros."""

    def __init__(self, size: int, ranges: Sequence[tuple[int, Any]] = (), name: str = "a file"):
        super().__init__()
        self.size, self.ranges, self.name, self.pos = size, list(ranges), name, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> memoryview:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        for start, data in self.ranges:
            if start <= self.pos and self.pos + n <= start + len(data):
                out = memoryview(data)[self.pos - start:self.pos - start + n]  # no copy of a column chunk
                self.pos += n
                return out
        raise RuntimeError(f"{self.name}: pyarrow read bytes [{self.pos}, {self.pos + n}) outside the ranges read "
                           "for it (a bug: the ranges must cover every read)")

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)
