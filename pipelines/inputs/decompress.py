"""Reading an input file's uncompressed bytes, checked to the end of the compressed stream.

A ``.gz`` or ``.zst`` shard that ends early must not read as a shorter file: that would build a cache of
half the input with exit code 0. :func:`open_input` returns a reader that raises
:class:`~pipelines.errors.DamagedInput` (naming the file and the uncompressed offset) when

* a gzip member is truncated, fails its CRC-32/length check or holds invalid deflate data (Python's
  ``gzip`` reports these; we only name the file and the offset), or
* a zstd stream ends inside a frame, holds bytes that are not a frame, or fails libzstd's decoding or
  its optional content checksum. python-zstandard's stream reader treats an input that ends mid-frame as
  a normal end of data, so :class:`ZstdFrameChecker` follows the frame and block headers of the
  compressed bytes as the decompressor reads them (no second pass, no copy of block contents) and
  knows whether the stream stopped on a frame boundary.

Decompression streams with bounded memory: each ``read(n)`` inflates at most ``n`` bytes (Beam's own
CompressedFile inflates 16 MiB of compressed input at once, unbounded for highly compressible data).
Concatenated gzip members and zstd frames (and zstd skippable frames) are read through.
"""

from __future__ import annotations

import gzip
import io
import zlib
from typing import BinaryIO

from pipelines.errors import DamagedInput
from pipelines.filesystem import BEAM

ZSTD_MAGIC = 0xFD2FB528
ZSTD_SKIPPABLE_MASK, ZSTD_SKIPPABLE_MAGIC = 0xFFFFFFF0, 0x184D2A50
_DID_BYTES = (0, 1, 2, 4)  # Dictionary_ID field size by its 2-bit flag
_FCS_BYTES = (0, 2, 4, 8)  # Frame_Content_Size field size by its 2-bit flag (flag 0: 1 byte if single segment)
READ_PIECE = 64 << 10  # uncompressed bytes asked of a decoder at a time: the resolution of a damage's offset


class ZstdFrameChecker:
    """Follows the structure of a zstd stream fed to it piece by piece (RFC 8878 frames and blocks).

    ``feed`` raises ValueError on bytes that cannot start a frame; :attr:`complete` says whether the bytes
    fed so far end exactly after a whole frame (or are empty).
    """

    def __init__(self):
        self.state = "magic"
        self.need = 4  # header bytes the current state waits for
        self.head = bytearray()
        self.skip = 0  # bytes of block (or skippable frame) content still to pass over
        self.checksum = False
        self.offset = 0  # compressed bytes fed
        self.frames = 0

    @property
    def complete(self) -> bool:
        return self.state == "magic" and not self.head and not self.skip

    def feed(self, data: bytes) -> None:
        view, i, n = memoryview(data), 0, len(data)
        while i < n:
            if self.skip:
                k = min(self.skip, n - i)
                self.skip -= k
                i += k
                continue
            k = min(self.need - len(self.head), n - i)
            self.head += view[i:i + k]
            i += k
            if len(self.head) == self.need:
                value, self.head = bytes(self.head), bytearray()
                self._advance(value, self.offset + i - len(value))
        self.offset += n

    def _advance(self, value: bytes, at: int) -> None:
        state = self.state
        if state == "magic":
            magic = int.from_bytes(value, "little")
            if magic == ZSTD_MAGIC:
                self.state, self.need = "descriptor", 1
            elif magic & ZSTD_SKIPPABLE_MASK == ZSTD_SKIPPABLE_MAGIC:
                self.state, self.need = "skippable_size", 4
            else:
                raise ValueError(f"bytes that are not a zstd frame at compressed offset {at} (magic {magic:#010x})")
        elif state == "skippable_size":
            self.skip = int.from_bytes(value, "little")
            self.state, self.need = "magic", 4
            self.frames += 1
        elif state == "descriptor":
            fhd = value[0]
            if fhd & 0x08:
                raise ValueError(f"a zstd frame header with its reserved bit set at compressed offset {at}")
            single = (fhd >> 5) & 1
            self.checksum = bool((fhd >> 2) & 1)
            fcs_flag = fhd >> 6
            rest = (0 if single else 1) + _DID_BYTES[fhd & 3] + (_FCS_BYTES[fcs_flag] or single)
            self.state, self.need = ("header", rest) if rest else ("block", 3)
        elif state == "header":
            self.state, self.need = "block", 3
        elif state == "block":
            header = int.from_bytes(value, "little")
            block_type, size = (header >> 1) & 3, header >> 3
            if block_type == 3:
                raise ValueError(f"a zstd block of the reserved type at compressed offset {at}")
            self.skip = 1 if block_type == 1 else size  # an RLE block stores one byte
            if header & 1:  # the frame's last block
                if self.checksum:
                    self.state, self.need = "checksum", 4
                else:
                    self.state, self.need = "magic", 4
                    self.frames += 1
        elif state == "checksum":
            self.state, self.need = "magic", 4
            self.frames += 1


class _Tee(io.RawIOBase):
    """The compressed source, showing every byte read to a :class:`ZstdFrameChecker` on the way."""

    def __init__(self, source, checker: ZstdFrameChecker):
        self._source, self._checker = source, checker

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._source.read(n)
        self._checker.feed(data)
        return data


class CheckedInput(io.RawIOBase):
    """Uncompressed bytes of one input file; damage is a :class:`DamagedInput` naming file and offset.

    ``position`` counts the uncompressed bytes returned so far. Closing closes the source too.
    """

    def __init__(self, path: str, decoder, source, checker: ZstdFrameChecker | None = None):
        self.path = path
        self.position = 0
        self._decoder, self._source, self._checker = decoder, source, checker

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            return b"".join(iter(lambda: self.read(READ_PIECE), b""))
        pieces, got = [], 0
        while got < n:  # in pieces, so that an error's offset is exact to a piece
            try:
                data = self._decoder.read(min(n - got, READ_PIECE))
            except (EOFError, gzip.BadGzipFile, zlib.error, ValueError) as e:
                raise DamagedInput(self.path, self.position + got, _reason(e)) from e
            except Exception as e:  # zstandard.ZstdError (imported lazily)
                if type(e).__name__ == "ZstdError":
                    raise DamagedInput(self.path, self.position + got, f"zstd: {e}") from e
                raise
            if not data:
                break
            pieces.append(data)
            got += len(data)
        if not got and n and self._checker is not None and not self._checker.complete:
            raise DamagedInput(self.path, self.position,
                               f"the zstd stream ends inside a frame (truncated after {self._checker.offset} "
                               "compressed bytes)")
        self.position += got
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def close(self) -> None:
        try:
            if self._decoder is not self._source:
                self._decoder.close()
        finally:
            self._source.close()
            super().close()


def _reason(e: BaseException) -> str:
    if isinstance(e, EOFError):
        return "the gzip stream ends before its end-of-stream marker (truncated)"
    if isinstance(e, gzip.BadGzipFile):
        return f"gzip: {e}"
    if isinstance(e, zlib.error):
        return f"invalid deflate data ({e})"
    return str(e)


def open_input(path: str, compression: str) -> CheckedInput:
    """Open ``path`` (any Beam filesystem) for reading its uncompressed bytes, checked to the end.

    Args:
      path: the input file.
      compression: "none", "gzip" or "zstd" (``reader.format.spec.compression_of``).
    """
    raw = BEAM.open(path)
    try:
        if compression == "none":
            return CheckedInput(path, raw, raw)
        if compression == "gzip":
            return CheckedInput(path, gzip.GzipFile(fileobj=raw, mode="rb"), raw)
        if compression == "zstd":
            import zstandard

            checker = ZstdFrameChecker()
            reader = zstandard.ZstdDecompressor().stream_reader(_Tee(raw, checker), read_across_frames=True,
                                                                 closefd=False)
            return CheckedInput(path, reader, raw, checker)
    except Exception:
        raw.close()
        raise
    raw.close()
    raise ValueError(f"unknown compression {compression!r} for {path}")


def open_raw(path: str) -> BinaryIO:
    """``path`` as stored (no decompression): the first bytes of a compressed shard, for its ratio."""
    return BEAM.open(path)
