"""Byte ranges of an input file through the storage port (local paths and ``gs://`` alike).

:class:`ByteSource` reads exactly the ranges asked for (no read-ahead: on Cloud Storage each read is one
ranged request) and counts the bytes; a columnar input hands pyarrow a
:class:`reader.storage.files.RangeFile` of the ranges read, so a Parquet reader given the footer reads
nothing else.
"""

from __future__ import annotations

import os
from typing import Any

from reader.storage import files


def fingerprint(st: files.Storage, path: str) -> dict[str, Any]:
    """A cheap metadata fingerprint of a file, which any write changes: locally its size, ``mtime_ns``,
    ``ctime_ns`` (which no one can set back), device and inode; on Cloud Storage its size, generation and
    CRC32C; on other stores whatever of those (or an ETag, a modification time) the store reports."""
    if getattr(st, "local", False):
        s = os.stat(path)
        return {"size": s.st_size, "mtime_ns": s.st_mtime_ns, "ctime_ns": s.st_ctime_ns, "device": s.st_dev,
                "inode": s.st_ino}
    info = st.fs.info(path)
    out = {"size": int(info["size"])}
    for key in ("generation", "crc32c", "etag", "ETag", "mtime", "updated", "LastModified", "last_modified"):
        if info.get(key) is not None:
            out[key] = str(info[key])
    return out


class ByteSource:
    """Byte ranges of one file through fsspec (one request per read on remote stores: no read-ahead)."""

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None):
        self.path = path
        storage, p = files.url_storage(path, storage_options)
        stamp = fingerprint(storage, p)
        self.size, self.stamp = stamp["size"], tuple(sorted(stamp.items()))  # which version of the file it is
        self._f = storage.open(p, read_ahead=False)
        self.bytes_read = 0

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` (fewer only at the end of the file)."""
        self._f.seek(offset)
        parts, got = [], 0
        while got < n:
            b = self._f.read(n - got)
            if not b:
                break
            parts.append(b)
            got += len(b)
        self.bytes_read += got
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "ByteSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
