"""The builder's file system: the storage port (:mod:`reader.storage.files`) over Beam's FileSystems, through
which the builder reads its inputs' lines and writes every file of a cache (chunks, sidecars, dead letters,
status files, the lock), local paths and ``gs://`` alike; and what a path on the command line means.

Beam's FileSystems serve it rather than fsspec so that the builder's writes use the client and the
credentials its reads use, on every runner (gcsfs is not needed on Flink or Spark workers). Paths are
joined with :func:`reader.format.spec.join`, the one definition shared with the reader.
"""

from __future__ import annotations

import glob
import os
import stat
from typing import BinaryIO

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from reader.format import spec as fmt
from reader.storage import files
from reader.storage.files import Entry

from pipelines.errors import BuildError


def is_remote(path: str) -> bool:
    return "://" in path


def absolute(path: str) -> str:
    """A local path made absolute (``~`` expanded); a URL such as ``gs://...`` unchanged."""
    return path if is_remote(path) else os.path.abspath(os.path.expanduser(path))


class BeamStorage(files.Storage):
    """:class:`reader.storage.files.Storage` over Beam's FileSystems. Local files are read and matched directly:
    Beam's local filesystem globs on every open and walks the whole tree to match a pattern, which a build of
    tens of thousands of shard directories and a million entries cannot afford."""

    def open(self, path: str, read_ahead: bool = True) -> BinaryIO:
        if not is_remote(path):  # local files through the door (a FIFO is refused, not waited on)
            return files.open_local(path)
        return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)

    def read(self, path: str, limit: int | None = None) -> bytes:
        if not is_remote(path):
            return files.read_local(path, limit=limit)
        with self.open(path) as f:
            data = f.read() if limit is None else f.read(limit + 1)
        if limit is not None and len(data) > limit:
            raise files.too_large(path, len(data), limit)
        return data

    def read_range(self, path: str, start: int, end: int | None) -> bytes:
        if not is_remote(path):
            return files.read_local(path, start=start, end=end)
        with self.open(path) as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)

    def size(self, path: str) -> int:
        found = self.match(path)
        if not found:
            raise FileNotFoundError(path)
        return found[0].size

    def exists(self, path: str) -> bool:
        return os.path.exists(path) if not is_remote(path) else FileSystems.exists(path)

    def list(self, directory: str) -> list[Entry]:
        try:
            return self.match(fmt.join(directory, "*"))
        except Exception:  # noqa: BLE001 - Beam raises when nothing matches on some filesystems
            return []

    def match(self, pattern: str) -> list[Entry]:
        if not is_remote(pattern):
            out = []
            for p in glob.glob(pattern, include_hidden=True):
                try:
                    st = os.stat(p)
                except OSError:  # removed meanwhile
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    out.append(Entry(p, st.st_size, st.st_mtime))
            return out
        found = FileSystems.match([pattern])[0].metadata_list
        return [Entry(m.path, m.size_in_bytes, m.last_updated_in_seconds or None) for m in found]

    def create(self, path: str) -> BinaryIO:
        if not is_remote(path):  # a new file, never through a symlink
            return files.create_local(path)
        return FileSystems.create(path, mime_type="application/octet-stream",
                                  compression_type=CompressionTypes.UNCOMPRESSED)

    def rename(self, src: str, dst: str) -> None:
        FileSystems.rename([src], [dst])

    def remove(self, path: str) -> None:
        if FileSystems.exists(path):
            FileSystems.delete([path])


BEAM = BeamStorage()


def read_or_none(path: str, limit: int | None = None) -> bytes | None:
    """The file's bytes, None if there is none; what the door refuses (a FIFO, a device, more than ``limit``
    bytes) is a BuildError naming the file."""
    try:
        return BEAM.read(path, limit=limit) if not is_remote(path) or BEAM.exists(path) else None
    except files.UnsafeFile as e:
        raise BuildError(str(e)) from None
    except (OSError, IOError, FileNotFoundError):
        return None
    except Exception as e:  # BeamIOError and friends
        if "not found" in str(e).lower() or "no such" in str(e).lower():
            return None
        raise


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` under a temporary name in the same directory, then rename over ``path``
    (:mod:`reader.storage.files`). A reader sees either no file or the complete file."""
    files.write(BEAM, path, data)


def remove_temp_files(root: str, older_than: float | None = None) -> int:
    """Delete the temporary files a crashed build left in a cache (where atomic writes put them).

    Args:
      root: the cache root.
      older_than: a Unix time; only files last modified before it are deleted, so a build running
        concurrently into the same root keeps the temporary files it is writing.
    """
    paths = [e.path for pattern in fmt.temp_patterns(root) for e in BEAM.match(pattern)
             if older_than is None or not e.mtime or e.mtime < older_than]
    if paths:
        try:
            FileSystems.delete(paths)
        except Exception:  # noqa: BLE001 - another run removed some of them first: that is the goal anyway
            pass
    return len(paths)


def list_sizes(pattern: str) -> dict[str, int]:
    """``path -> size`` of every file matching ``pattern`` (empty if none)."""
    try:
        return {e.path: e.size for e in BEAM.match(pattern)}
    except Exception:  # noqa: BLE001 - Beam raises when nothing matches on some filesystems
        return {}
