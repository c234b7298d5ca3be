"""Megatron-Core indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``): the layout, a validating index reader,
and the export of a cache.

Layout of ``PREFIX.idx`` (little-endian; Megatron-Core ``megatron/core/datasets/indexed_dataset.py``)::

    9 bytes   b"MMIDIDX\\x00\\x00"            magic
    u64       1                               version
    u8        dtype code                      1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                                              7 float32, 8 uint16: the element type of PREFIX.bin
    u64       S                               sequence count
    u64       D                               document count + 1 (length of the document index)
    int32[S]  sequence lengths                elements per sequence
    int64[S]  sequence pointers               byte offset of each sequence in PREFIX.bin
    int64[D]  document index                  0, then the end (exclusive sequence index) of each document

``PREFIX.bin`` is the sequences' elements back to back. Megatron chooses ``uint16`` when the vocabulary
has fewer than 65500 entries and ``int32`` otherwise (``DType.optimal_dtype``); so does the export.
The export writes one sequence per document, so ``S = documents`` and the document index is ``0..S``.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import tempfile
from typing import Callable, Iterable, Iterator

import numpy as np

from reader.format import spec as fmt
from reader.storage.cache import Cache
from reader.storage import files
from reader.storage.files import is_local
from reader.interop.export import ExportError, check_token_range, iter_blocks, open_finished, output_fs, rename, split_caches, vocab_size_of
from reader.storage.files import remove_quietly, temp_name

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # 34
DTYPES: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16),
                               4: np.dtype(np.int32), 5: np.dtype(np.int64), 6: np.dtype(np.float64),
                               7: np.dtype(np.float32), 8: np.dtype(np.uint16)}
CODES = {dt: code for code, dt in DTYPES.items()}
OPTIMAL_DTYPE_LIMIT = 65500  # Megatron's DType.optimal_dtype: uint16 below this vocabulary size
_BLOCK = 1 << 20  # index entries handled at a time (bounded memory for any index size)
# Sequences (and documents) an index may list beyond one per token of its .bin: Megatron writes empty
# ones only for empty documents, so more is a damaged or hostile index (a sparse .idx can claim 2**27 of
# them in 8 KB on disk), refused before any of it is read.
FREE_ENTRIES = 1 << 16


class MegatronError(fmt.FormatError):
    """A ``.bin``/``.idx`` pair is damaged or does not fit the tokenizer; the message names the file."""


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Megatron's rule: ``uint16`` for vocabularies below 65500 entries, else ``int32``."""
    return np.dtype(np.uint16) if vocab_size < OPTIMAL_DTYPE_LIMIT else np.dtype(np.int32)


def header_bytes(dtype: np.dtype, sequences: int, documents: int) -> bytes:
    """The 34-byte header of an ``.idx`` for ``sequences`` sequences and ``documents`` documents."""
    return (INDEX_HEADER + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", CODES[np.dtype(dtype)])
            + struct.pack("<Q", sequences) + struct.pack("<Q", documents + 1))


# --------------------------------------------------------------------------------------------------
# Reading (and checking) a .bin/.idx pair


@dataclasses.dataclass(frozen=True)
class MegatronIndex:
    """A checked ``PREFIX.idx`` and the size of its ``PREFIX.bin``.

    Arrays are memory-mapped for local files (an index of a billion documents is not read into memory).
    """

    prefix: str
    idx_path: str
    bin_path: str
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 [S]
    sequence_pointers: np.ndarray  # int64 [S]
    document_indices: np.ndarray  # int64 [D + 1]
    bin_size: int
    idx_size: int

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @staticmethod
    def open(prefix: str) -> "MegatronIndex":
        """Read and check ``prefix.idx`` against ``prefix.bin``. Raises :class:`MegatronError` naming the file.

        Checks: magic, version, dtype code, the file size the counts imply (a truncated or padded
        index), a document index that starts at 0, never decreases and ends at S, non-negative lengths,
        pointers that lay the sequences out back to back from byte 0 (what every Megatron writer does),
        and a ``.bin`` of exactly the size the index describes.
        """
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise MegatronError(f"{p}: no such file (a Megatron dataset is PREFIX.bin + PREFIX.idx; give "
                                    "PREFIX without the extension)")
        idx_size, bin_size = os.path.getsize(idx_path), os.path.getsize(bin_path)
        with files.open_local(idx_path) as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:len(INDEX_HEADER)] != INDEX_HEADER:
            raise MegatronError(f"{idx_path}: not a Megatron index (the file does not start with the "
                                f"{INDEX_HEADER!r} magic of MMapIndexedDataset / IndexedDataset)")
        (version,) = struct.unpack_from("<Q", head, 9)
        if version != INDEX_VERSION:
            raise MegatronError(f"{idx_path}: index version {version}, only version {INDEX_VERSION} exists "
                                "(damaged file?)")
        code = head[17]
        if code not in DTYPES:
            raise MegatronError(f"{idx_path}: unknown dtype code {code} (known: "
                                f"{', '.join(f'{c} {d.name}' for c, d in DTYPES.items())})")
        dtype = DTYPES[code]
        seqs, docs1 = struct.unpack_from("<QQ", head, 18)
        want = HEADER_BYTES + 12 * seqs + 8 * docs1
        if idx_size == want + seqs and seqs:
            raise MegatronError(f"{idx_path}: has a sequence-mode array (a multimodal dataset); only token "
                                "datasets can be imported")
        if idx_size != want:
            raise MegatronError(f"{idx_path}: {idx_size} bytes, but its header ({seqs} sequences, {docs1} "
                                f"document-index entries) implies {want}: the index is truncated or damaged")
        if docs1 < 1:
            raise MegatronError(f"{idx_path}: the document index is empty (it must start with 0)")
        tokens = bin_size // dtype.itemsize
        for what, n in (("sequences", seqs), ("documents", docs1 - 1)):
            if n > tokens + FREE_ENTRIES:
                raise MegatronError(
                    f"{idx_path}: lists {n} {what}, but {bin_path} holds only {tokens} {dtype.name} tokens: an index "
                    f"lists at most one {what[:-1]} per token (plus {FREE_ENTRIES} empty ones). The index is damaged, "
                    "or does not belong to this .bin")
        mm = np.memmap(idx_path, mode="r", dtype=np.uint8)
        lengths = np.frombuffer(mm, dtype="<i4", count=seqs, offset=HEADER_BYTES)
        pointers = np.frombuffer(mm, dtype="<i8", count=seqs, offset=HEADER_BYTES + 4 * seqs)
        doc_idx = np.frombuffer(mm, dtype="<i8", count=docs1, offset=HEADER_BYTES + 12 * seqs)
        index = MegatronIndex(prefix, idx_path, bin_path, dtype, lengths, pointers, doc_idx, bin_size, idx_size)
        index._check()
        return index

    def _check(self) -> None:
        d = self.document_indices
        if int(d[0]) != 0 or int(d[-1]) != self.num_sequences:
            raise MegatronError(f"{self.idx_path}: the document index runs from {int(d[0])} to {int(d[-1])}, it "
                                f"must run from 0 to the sequence count {self.num_sequences}")
        item = self.dtype.itemsize
        pos = 0
        for lo in range(0, max(len(d), 1), _BLOCK):
            blk = d[lo:lo + _BLOCK + 1]
            if blk.size > 1 and bool((np.diff(blk) < 0).any()):
                raise MegatronError(f"{self.idx_path}: the document index decreases near entry "
                                    f"{lo + int(np.argmax(np.diff(blk) < 0))}")
        for lo in range(0, self.num_sequences, _BLOCK):
            lens = self.sequence_lengths[lo:lo + _BLOCK].astype(np.int64)
            if bool((lens < 0).any()):
                raise MegatronError(f"{self.idx_path}: negative sequence length at sequence "
                                    f"{lo + int(np.argmax(lens < 0))}")
            want = pos + np.concatenate([[0], np.cumsum(lens[:-1] * item)])
            got = self.sequence_pointers[lo:lo + _BLOCK]
            if not np.array_equal(got, want):
                at = lo + int(np.argmax(got != want))
                raise MegatronError(f"{self.idx_path}: sequence {at} starts at byte {int(self.sequence_pointers[at])} "
                                    f"of the .bin, expected {int(want[at - lo])} (sequences must be back to back, "
                                    "as Megatron writes them)")
            pos = int(want[-1] + lens[-1] * item)
        if self.bin_size != pos:
            how = "truncated" if self.bin_size < pos else "longer than its index describes"
            raise MegatronError(f"{self.bin_path}: {self.bin_size} bytes, the index {self.idx_path} describes "
                                f"{pos} ({pos // item} {self.dtype.name} tokens): the .bin is {how}. Copy it "
                                "again or rebuild it.")


# --------------------------------------------------------------------------------------------------
# Export


def choose_dtype(vocab_size: int, dtype: str | None, where: str) -> np.dtype:
    """The ``.bin`` dtype: ``dtype`` (``"uint16"``/``"int32"``, refused if the vocabulary does not fit), or
    Megatron's :func:`optimal_dtype` for None."""
    if dtype is None:
        return optimal_dtype(vocab_size)
    dt = np.dtype(dtype)
    if vocab_size - 1 > np.iinfo(dt).max:
        raise ExportError(f"--dtype {dtype}: cannot hold the token ids of {where}'s tokenizer (vocab_size "
                          f"{vocab_size}); use int32 or leave --dtype at auto")
    return dt


def open_source(url: str, dtype: str | None, command: str = "python -m reader export") -> tuple[Cache, int, np.dtype]:
    """``(cache, vocab_size, dtype)`` of the finished cache ``url`` to export; raises :class:`ExportError`
    for a directory of train/validation caches, an unfinished build or a ledger without vocab_size.

    Args:
      url: the cache root.
      dtype: ``uint16``, ``int32`` or None (Megatron's rule from the vocabulary size).
      command: the export command the refusal of a split build's top directory suggests.
    """
    splits = split_caches(url)
    if set(splits) != {"train"} or splits["train"] != url:
        # a .bin holds one document sequence: mixing the two caches would leak validation into training
        names = " and ".join(f"{s}/" for s in splits)
        todo = "; ".join(f"{command} {u} --format megatron --out PREFIX_{s}" for s, u in splits.items())
        raise ExportError(f"{url}: the top of a split build (it holds the {names} caches), not a cache; export "
                          f"each to its own prefix: {todo}")
    cache = open_finished(url)
    vocab = vocab_size_of(cache)
    return cache, vocab, choose_dtype(vocab, dtype, url)


def bin_bytes(values: np.ndarray, dtype: np.dtype) -> bytes:
    """Tokens as they lie in ``PREFIX.bin``."""
    return values.astype(dtype).tobytes()


def write_index(f, dtype: np.dtype, docs: int, lengths: Callable[[], Iterable[np.ndarray]]) -> None:
    """Write a whole ``PREFIX.idx`` (one sequence per document) to the open binary file ``f``.

    Args:
      f: the output file.
      dtype: the element type of ``PREFIX.bin``.
      docs: the number of documents (= sequences).
      lengths: returns a new iterator over the documents' token counts, in order and in arrays of any
        size; called twice (the lengths, then the pointers computed from them), so the index never has to
        be held in memory.
    """
    f.write(header_bytes(dtype, docs, docs))
    seen = 0
    for block in lengths():
        f.write(np.asarray(block).astype("<i4").tobytes())
        seen += len(block)
    if seen != docs:
        raise ExportError(f"the index of {docs} documents was given {seen} lengths")
    item, pos = np.dtype(dtype).itemsize, 0
    for block in lengths():
        if len(block):
            ends = np.cumsum(np.asarray(block, np.int64))
            f.write((pos + (ends - block) * item).astype("<i8").tobytes())
            pos += int(ends[-1]) * item
    for lo in range(0, docs + 1, _BLOCK):
        f.write(np.arange(lo, min(lo + _BLOCK, docs + 1), dtype="<i8").tobytes())


def export_megatron(url: str, prefix: str, *, overwrite: bool = False, dtype: str | None = None,
                    threads: int = 2) -> str:
    """Write a finished cache as ``prefix.bin`` + ``prefix.idx`` (one sequence per document, global order).

    Args:
      url: the cache root.
      prefix: output path without extension (local or any fsspec URL).
      overwrite: replace existing output files (otherwise refuse).
      dtype: ``"uint16"`` / ``"int32"``, or None for Megatron's rule from the tokenizer's vocab_size.
      threads: chunks fetched and decoded ahead in parallel.

    Returns a one-line summary. The ``.bin`` is renamed into place before the ``.idx``: an ``.idx`` with
    its final name always describes a complete ``.bin``. (``pipelines/export/job.py`` writes the same files
    with Apache Beam, for caches too large for one process.)
    """
    cache, vocab, dt = open_source(url, dtype)
    fs, out = output_fs(prefix)
    bin_path, idx_path = out + ".bin", out + ".idx"
    if not overwrite:
        for p in (bin_path, idx_path):
            if fs.exists(p):
                raise ExportError(f"{p} exists; pass --overwrite to replace it, or choose another --out")
    n_docs = int(cache.table.docs.sum())
    bin_tmp, idx_tmp = temp_name(bin_path), temp_name(idx_path)
    local_dir = os.path.dirname(os.path.abspath(out)) if is_local(fs) else None
    try:
        with fs.open(bin_tmp, "wb") as fb, tempfile.TemporaryFile(dir=local_dir) as lens_f:
            docs, tokens = 0, 0
            for block in iter_blocks(cache, prefetch=threads):
                check_token_range(block, vocab, cache)
                fb.write(bin_bytes(block.values, dt))
                lens_f.write(block.lengths.astype("<i4").tobytes())
                docs += len(block.lengths)
                tokens += block.values.size
            if docs != n_docs:
                raise ExportError(f"{cache.display(fmt.LEDGER_NAME)}: the chunks hold {docs} documents, the "
                                  f"ledger {n_docs}")

            def lengths() -> Iterator[np.ndarray]:
                lens_f.seek(0)
                while raw := lens_f.read(4 * _BLOCK):
                    yield np.frombuffer(raw, "<i4")

            with fs.open(idx_tmp, "wb") as fi:
                write_index(fi, dt, docs, lengths)
        if fs.exists(idx_path):
            fs.rm(idx_path)  # never leave an old .idx beside a new .bin
        rename(fs, bin_tmp, bin_path)
        rename(fs, idx_tmp, idx_path)
    finally:
        remove_quietly(fs, bin_tmp)
        remove_quietly(fs, idx_tmp)
    return (f"wrote {prefix}.bin and {prefix}.idx: {docs:,} documents, {tokens:,} tokens, dtype {dt.name} "
            f"(vocab_size {vocab})")


def read_span(index: MegatronIndex, seq_bounds: np.ndarray, f) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, tokens)`` of consecutive documents read from the open ``.bin`` file ``f``.

    Document ``i`` of the span is sequences ``[seq_bounds[i], seq_bounds[i+1])`` of ``index`` (their
    tokens joined); ``tokens`` are all of them back to back, in the file's dtype. The sequences lie back
    to back (:meth:`MegatronIndex.open` checked it), so a document's tokens run from its first sequence's
    pointer to the next document's: memory per document, whatever its number of sequences.
    """
    item = index.dtype.itemsize
    bounds = np.asarray(seq_bounds, np.int64)
    ptr = np.full(bounds.size, index.bin_size, np.int64)  # sequence S starts at the end of the .bin
    inside = bounds < index.num_sequences
    ptr[inside] = index.sequence_pointers[bounds[inside]]
    start, count = int(ptr[0]), (int(ptr[-1]) - int(ptr[0])) // item
    f.seek(start)
    raw = f.read(count * item)
    if len(raw) != count * item:
        raise MegatronError(f"{index.bin_path}: ends at byte {start + len(raw)}, sequences {int(bounds[0])}.."
                            f"{int(bounds[-1]) - 1} need bytes up to {start + count * item} (truncated while being "
                            "read?)")
    tokens = np.frombuffer(raw, dtype=index.dtype.newbyteorder("<"))
    return np.diff(ptr) // item, tokens
