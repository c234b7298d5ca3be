"""Input formats: chosen per file by its name, then checked against its bytes, before any work.

- ``.jsonl``, ``.ndjson`` (plain, ``.gz``, ``.zst``): JSON Lines;
- ``.json`` (plain, ``.gz``, ``.zst``): one JSON array of records if its first byte other than whitespace
  (after a byte-order mark) is ``[``, else JSON Lines;
- ``.parquet``: Parquet, any codec;
- ``.arrow``: Arrow IPC, the stream format (what Hugging Face ``datasets`` writes) or the file format.

:func:`detect` reads a file's first 4 KiB (decompressed for ``.gz`` / ``.zst``) and, for Parquet and Arrow,
its last bytes. A file whose bytes contradict its name (a Parquet file named ``.jsonl``, a ``.gz`` that is
not gzip, text named ``.parquet``, binary data named ``.jsonl``) and a name of any other kind are refused
(:class:`UnsupportedInput`, naming the file, what its bytes look like and the formats accepted). Text is
refused as binary when NUL bytes are at least 1 in 8 of its first 4 KiB (UTF-16 text and most binary data
hold far more; a bad line holding a NUL byte is a bad record, not a binary file: :func:`is_binary`).

A directory written by ``datasets.Dataset.save_to_disk`` (its ``state.json`` and ``dataset_info.json``)
stands for its ``.arrow`` files in ``state.json`` order (:func:`saved_dataset_files`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import posixpath
import zlib
from typing import Any

from reader.storage import files

from pipelines.errors import BuildError, DamagedFile
from pipelines.inputs import arrow_ipc
from pipelines.inputs.json_array import first_byte

JSONL, JSON_ARRAY, PARQUET, ARROW = "jsonl", "json_array", "parquet", "arrow"
TEXT_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
ACCEPTED = ("formats accepted: .jsonl, .ndjson or .json (each plain, .gz or .zst), .parquet, .arrow (Arrow IPC "
            "stream or file), or a directory written by datasets' save_to_disk")
SNIFF_BYTES = 4096
COMPRESSED_SNIFF = 64 << 10  # compressed bytes read to decompress the first SNIFF_BYTES
SAVED_STATE, SAVED_INFO, SAVED_DICT = "state.json", "dataset_info.json", "dataset_dict.json"
# What the first bytes of a file say it is (longest first: checked in order).
MAGICS = (
    (b"SQLite format 3\x00", "an SQLite database"),
    (arrow_ipc.FILE_HEAD, "an Arrow IPC file"),
    (b"\xfd7zXZ\x00", "xz-compressed data"),
    (b"PK\x03\x04", "a zip archive"),
    (b"PAR1", "a Parquet file"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data"),
    (arrow_ipc.CONTINUATION, "an Arrow IPC stream"),
    (b"BZh", "bzip2-compressed data"),
    (b"\x1f\x8b", "gzip-compressed data"),
    (b"\xff\xfe", "UTF-16 text (convert it to UTF-8)"),
    (b"\xfe\xff", "UTF-16 text (convert it to UTF-8)"),
)
_SUFFIX_OF = {"a Parquet file": ".parquet", "an Arrow IPC file": ".arrow", "an Arrow IPC stream": ".arrow",
              "gzip-compressed data": ".jsonl.gz", "zstd-compressed data": ".jsonl.zst"}


class UnsupportedInput(BuildError):
    """An input of no accepted format, or whose bytes contradict its name."""


@dataclasses.dataclass(frozen=True)
class InputFormat:
    kind: str  # JSONL, JSON_ARRAY, PARQUET or ARROW
    compression: str = "none"  # of the file as stored: "none", "gzip" or "zstd" (text formats only)

    @property
    def columnar(self) -> bool:
        return self.kind in (PARQUET, ARROW)


def _suffixes(path: str) -> tuple[str, str, str]:
    """``(suffix, compression, the name's whole format suffix)``: ``(".jsonl", "gzip", ".jsonl.gz")``."""
    name = posixpath.basename(path.rstrip("/")).lower()
    stem, ext = posixpath.splitext(name)
    compression = COMPRESSION_SUFFIXES.get(ext, "none")
    if compression != "none":
        stem, inner = posixpath.splitext(stem)
        return inner, compression, inner + ext
    return ext, compression, ext


def known_suffix(path: str) -> str | None:
    """The accepted format suffix of the file's name (``.jsonl.gz``, ``.parquet``), None for any other name."""
    ext, _, whole = _suffixes(path)
    return whole if ext in TEXT_SUFFIXES or ext in (".parquet", ".arrow") else None


def unknown_name(path: str) -> str | None:
    """What is wrong with a file name of no accepted format (``extension '.txt'``), None for an accepted one."""
    if known_suffix(path) is not None:
        return None
    ext = _suffixes(path)[0]
    return f"extension {ext!r}" if ext else "no extension"


def by_name(path: str) -> tuple[str, str]:
    """``(suffix, compression)`` from the file name: suffix ``.jsonl``, ``.ndjson``, ``.json``, ``.parquet`` or
    ``.arrow``. UnsupportedInput for any other name."""
    ext, compression, _ = _suffixes(path)
    if ext in TEXT_SUFFIXES:
        return ext, compression
    if ext in (".parquet", ".arrow"):
        if compression != "none":
            raise UnsupportedInput(f"input file {path}: a compressed {ext} file; {ext[1:].title()} compresses its "
                                   f"own data: decompress it (and name it *{ext})")
        return ext, compression
    raise UnsupportedInput(f"input file {path}: unknown format ({unknown_name(path)}); {ACCEPTED}")


def looks_like(head: bytes) -> str | None:
    """What the first bytes of a file are, when they are a known binary format."""
    for magic, what in MAGICS:
        if head.startswith(magic):
            return what
    return None


def _contradiction(path: str, named: str, what: str) -> UnsupportedInput:
    fix = f"; rename it to *{_SUFFIX_OF[what]}" if what in _SUFFIX_OF else ""
    return UnsupportedInput(f"input file {path} is named {named} but holds {what}{fix} ({ACCEPTED})")


def _decompressed_head(path: str, data: bytes, compression: str) -> bytes:
    """The first :data:`SNIFF_BYTES` of a compressed file's content, from its first compressed bytes."""
    try:
        if compression == "gzip":
            if not data.startswith(b"\x1f\x8b"):
                raise _contradiction(path, "*.gz", looks_like(data) or "bytes that are not gzip data")
            return zlib.decompressobj(wbits=31).decompress(data, SNIFF_BYTES)
        import zstandard

        magic = int.from_bytes(data[:4], "little")
        if magic != 0xFD2FB528 and magic & 0xFFFFFFF0 != 0x184D2A50:
            raise _contradiction(path, "*.zst", looks_like(data) or "bytes that are not zstd data")
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as r:
            return r.read(SNIFF_BYTES)
    except (zlib.error, ValueError) as e:
        raise DamagedFile(path, "at its start", f"{compression} data that does not decompress ({e})") from e
    except Exception as e:
        if type(e).__name__ == "ZstdError":
            raise DamagedFile(path, "at its start", f"zstd data that does not decompress ({e})") from e
        raise


def sniff(path: str, head: bytes, tail: bytes, size: int) -> InputFormat:
    """The format of ``path`` from its name, its first bytes ``head`` (as stored) and its last bytes ``tail``.

    UnsupportedInput if they disagree, DamagedFile for a Parquet or Arrow file cut short.
    """
    suffix, compression = by_name(path)
    if suffix == ".parquet":
        if head.startswith(b"PAR1") and size >= 12:
            if tail.endswith(b"PARE"):
                raise UnsupportedInput(f"input file {path} is an encrypted Parquet file; decrypt it first")
            if not tail.endswith(b"PAR1"):
                raise DamagedFile(path, "at its last 4 bytes", "no closing PAR1 magic (truncated?)")
            return InputFormat(PARQUET)
        raise _contradiction(path, "*.parquet", looks_like(head) or _text_or_binary(head))
    if suffix == ".arrow":
        if head.startswith(arrow_ipc.FILE_HEAD):
            if not tail.endswith(arrow_ipc.FILE_MAGIC):
                raise DamagedFile(path, "at its last 6 bytes", "an Arrow file without its closing ARROW1 (truncated?)")
            return InputFormat(ARROW)
        if head.startswith(arrow_ipc.CONTINUATION):
            return InputFormat(ARROW)
        raise _contradiction(path, "*.arrow", looks_like(head) or _text_or_binary(head))
    text = head if compression == "none" else _decompressed_head(path, head, compression)
    text = text[:SNIFF_BYTES]
    what = looks_like(text) or ("binary data (NUL bytes in its first 4 KiB)" if is_binary(text) else None)
    if what is not None:
        raise _contradiction(path, f"*{suffix}" + ("" if compression == "none" else " (compressed)"), what)
    if suffix == ".json" and first_byte(text) == ord("["):
        return InputFormat(JSON_ARRAY, compression)
    return InputFormat(JSONL, compression)


def _text_or_binary(head: bytes) -> str:
    return "binary data of no known format" if is_binary(head[:SNIFF_BYTES]) else "text"


def is_binary(head: bytes) -> bool:
    """At least 1 in 8 bytes of ``head`` is NUL (never in JSON text: a raw NUL is only ever in a bad line)."""
    return head.count(0) * 8 >= len(head) > 0


def detect(path: str, storage_options: dict[str, Any] | None = None) -> InputFormat:
    """The format of the input file ``path`` (local or any fsspec URL), checked against its bytes (see
    :func:`sniff`): one read of its start and, for Parquet and Arrow, one of its end."""
    suffix, compression = by_name(path)
    storage, p = files.url_storage(path, storage_options)
    size = storage.size(p)
    want = SNIFF_BYTES if compression == "none" else COMPRESSED_SNIFF
    with storage.open(p, read_ahead=False) as f:
        head = f.read(min(want, size))
        tail = b""
        if suffix in (".parquet", ".arrow") and size >= 8:
            f.seek(size - 8)
            tail = f.read(8)
    return sniff(path, head, tail, size)


def _join(directory: str, name: str) -> str:
    return directory.rstrip("/") + "/" + name


def saved_dataset_files(directory: str, storage_options: dict[str, Any] | None = None) -> list[str] | None:
    """The ``.arrow`` files of a ``datasets.Dataset.save_to_disk`` directory, in ``state.json`` order; None if
    ``directory`` is not one. UnsupportedInput for a ``DatasetDict`` (one directory per split), a damaged
    ``state.json``, or one naming anything but a regular file of the directory (``..``, a subdirectory, a
    symlink out of it, a FIFO): files found inside a directory are read only within it (the storage port)."""
    storage, p = files.url_storage(directory, storage_options)
    storage = files.FsspecStorage(storage.fs, root=p)
    try:
        if storage.exists(_join(p, SAVED_DICT)):
            splits = json.loads(storage.read(_join(p, SAVED_DICT), limit=files.MAX_SMALL_FILE_BYTES)).get("splits", [])
            first = _join(directory, splits[0] if splits else "train")
            raise UnsupportedInput(f"--input {directory} is a datasets DatasetDict (splits: {', '.join(splits)}); "
                                   f"pass one split's directory, e.g. --input {first}")
        if not (storage.exists(_join(p, SAVED_STATE)) and storage.exists(_join(p, SAVED_INFO))):
            return None
        raw = storage.read(_join(p, SAVED_STATE), limit=files.MAX_SMALL_FILE_BYTES)
    except files.UnsafeFile as e:
        raise UnsupportedInput(f"--input {directory}: {e}") from None
    try:
        state = json.loads(raw)
        names = [d["filename"] for d in state["_data_files"]]
        if not all(isinstance(n, str) for n in names):
            raise TypeError("a filename that is not a string")
    except (ValueError, KeyError, TypeError) as e:
        raise UnsupportedInput(f"{_join(directory, SAVED_STATE)} is not a datasets state file ({type(e).__name__}: "
                               f"{e}); pass the directory's .arrow files instead") from e
    paths = [_join(directory, n) for n in names]
    for q, n in zip(paths, names):
        problem = None
        if n in ("", ".", "..") or "/" in n or "\\" in n:
            problem = "not the name of a file in the directory"
        elif not storage.exists(_join(p, n)):
            problem = "missing"
        elif storage.local:
            try:
                files.regular_size(_join(p, n), root=p)
            except files.UnsafeFile as e:
                problem = e.what
        if problem is not None:
            raise UnsupportedInput(f"--input {directory}: state.json names {n!r} ({q}), {problem}; only the directory's "
                                   "own regular files are read: save the dataset again")
    return paths
