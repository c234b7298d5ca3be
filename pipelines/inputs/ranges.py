"""Byte ranges of a file through fsspec (local paths and ``gs://`` alike), and a file made of such ranges.

:class:`ByteSource` reads exactly the ranges asked for (no read-ahead: on Cloud Storage each read is one
ranged request) and counts the bytes. :class:`RangeFile` hands pyarrow a file made only of the ranges read
for it, so a Parquet reader given the footer reads nothing else: what is read, and hashed, is decided here,
not by pyarrow's read coalescing, which differs between versions.
"""

from __future__ import annotations

import io
from typing import Any

import fsspec


class ByteSource:
    """Byte ranges of one file through fsspec (one request per read on remote stores: no read-ahead)."""

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None):
        self.path = path
        fs, p = fsspec.core.url_to_fs(path, **(storage_options or {}))
        self.size = int(fs.size(p))
        self._f = fs.open(p, "rb", cache_type="none")
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


class RangeFile(io.RawIOBase):
    """A file for pyarrow made of the byte ranges read for it; reading elsewhere is an error (a bug)."""

    def __init__(self, path: str, size: int):
        self.path, self.size, self.pos = path, size, 0
        self.ranges: list[tuple[int, bytes]] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        for start, data in self.ranges:
            if start <= self.pos and self.pos + n <= start + len(data):
                out = memoryview(data)[self.pos - start:self.pos - start + n]  # no copy of a column chunk
                self.pos += n
                return out
        raise RuntimeError(f"{self.path}: pyarrow read bytes [{self.pos}, {self.pos + n}) outside the ranges read "
                           "for it (a bug: the planned ranges must cover every read)")

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)
