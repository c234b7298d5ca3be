"""seqax's ``flat-tokens`` format (a zarr group; spec: seqax ``docs/flat-tokens.md``): the export, and
opening a dataset for ``reader/interop/import_flat_tokens.py``.

A flat-tokens *dataset* is a zarr group with the groups ``train`` and ``validation``, each a flat-tokens
*array* (``encoded_tokens``, ``seq_starts``, ``attrs.max_token_id``), written as seqax's own writer
writes it; docs/INTEROP.md ("seqax flat-tokens") has the layout. One cache document = one sequence, in
global order; the format stores no EOS (``keep_eos=True`` keeps a cache's), and ``import-flat-tokens
--append_eos`` puts it back, so a cache -> flat-tokens -> cache round trip gives the same tokens. zarr is
imported here only (the import opens its dataset with :func:`open_dataset`): it is the ``export`` extra
(``pip install 'chunkledger[export]'``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reader.format import spec as fmt
from reader.interop.export import SPLITS, ExportError, check_token_range, iter_blocks, open_finished, output_fs, rename, split_caches, vocab_size_of
from reader.storage.files import remove_quietly, temp_name

MAX_TOKEN_ID = (1 << 31) - 1  # the largest id token_id*2+1 can hold in uint32


def _zarr(command: str = "--format flat-tokens"):
    try:
        import numcodecs
        import zarr
    except ImportError as e:
        raise ExportError(f"{command} needs zarr: pip install 'chunkledger[export]'") from e
    return zarr, numcodecs


def open_dataset(where: str, command: str):
    """The zarr group at ``where``, read-only (for the import: ``reader.interop.import_flat_tokens`` checks it).

    Args:
      where: a local path or fsspec URL.
      command: what the error for a missing zarr names.

    Raises :class:`ExportError` naming ``where`` when it is no zarr group, or the extra to install.
    """
    zarr, _ = _zarr(command)
    try:
        return zarr.open_group(store=where, mode="r")
    except Exception as e:  # noqa: BLE001 - zarr raises several types for "not a group"
        raise ExportError(f"{where}: not a zarr group ({type(e).__name__}: {e})") from e


class _ChunkAligned:
    """Appends to a zarr array of known length, writing whole chunks (one write per zarr chunk)."""

    def __init__(self, array, chunk: int, dtype):
        self.array, self.chunk = array, chunk
        self.buf = np.empty(chunk, dtype=dtype)
        self.fill = 0
        self.pos = 0

    def append(self, values: np.ndarray) -> None:
        while values.size:
            k = min(self.chunk - self.fill, values.size)
            self.buf[self.fill:self.fill + k] = values[:k]
            self.fill += k
            values = values[k:]
            if self.fill == self.chunk:
                self.array[self.pos:self.pos + self.chunk] = self.buf
                self.pos += self.chunk
                self.fill = 0

    def close(self) -> int:
        if self.fill:
            self.array[self.pos:self.pos + self.fill] = self.buf[:self.fill]
            self.pos += self.fill
            self.fill = 0
        return self.pos


def encode(lengths: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``encoded_tokens`` of documents (``lengths`` tokens each, concatenated in ``values``)."""
    enc = values.astype(np.uint32) << np.uint32(1)
    starts = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    enc[starts[lengths > 0]] |= np.uint32(1)
    return enc


def strip_eos(block, eos: int, cache) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, values)`` of a block without the EOS that ends each of its documents."""
    ends = np.cumsum(block.lengths, dtype=np.int64)
    if bool((block.lengths <= 0).any()) or not bool((block.values[ends - 1] == eos).all()):
        raise ExportError(f"{cache.display(cache.table.paths[block.chunk])}: a document does not end with the EOS "
                          f"id {eos}, yet the ledger says append_eos; pass --keep_eos to export the tokens as they are")
    keep = np.ones(block.values.size, bool)
    keep[ends - 1] = False
    return block.lengths - 1, block.values[keep]


def _write_split(group, cache, tokens_chunk: int, seq_chunk: int, numcodecs, keep_eos: bool,
                 threads: int) -> dict[str, int]:
    comp = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.BITSHUFFLE)
    n_tokens = int(cache.table.tokens.sum()) if cache is not None else 0
    n_docs = int(cache.table.docs.sum()) if cache is not None else 0
    eos = None
    if cache is not None and cache.ledger.config.get("append_eos") and not keep_eos:
        eos = cache.ledger.tokenizer.get("eos_id")
        n_tokens -= n_docs
    tok_arr = group.create_array("encoded_tokens", shape=(n_tokens,), chunks=(tokens_chunk,), dtype="uint32",
                                 compressors=comp, fill_value=None)
    seq_arr = group.create_array("seq_starts", shape=(n_docs + 1,), chunks=(seq_chunk,), dtype="uint64",
                                 compressors=comp, filters=[numcodecs.Delta(dtype="i8")], fill_value=0)
    toks = _ChunkAligned(tok_arr, tokens_chunk, np.uint32)
    seqs = _ChunkAligned(seq_arr, seq_chunk, np.uint64)
    pos, docs, max_id = 0, 0, 0
    if cache is not None:
        vocab = vocab_size_of(cache)
        for block in iter_blocks(cache, prefetch=threads):
            check_token_range(block, min(vocab, MAX_TOKEN_ID + 1), cache)
            lengths, values = (block.lengths, block.values) if eos is None else strip_eos(block, eos, cache)
            toks.append(encode(lengths, values))
            starts = np.zeros(len(lengths), np.int64)
            np.cumsum(lengths[:-1], out=starts[1:])
            seqs.append((starts + pos).astype(np.uint64))
            if values.size:
                max_id = max(max_id, int(values.max()))
            pos += values.size
            docs += len(lengths)
    seqs.append(np.array([pos], np.uint64))
    if toks.close() != n_tokens or seqs.close() != n_docs + 1:
        raise ExportError(f"{cache.display(fmt.LEDGER_NAME)}: the chunks hold {docs} documents / {pos} tokens, "
                          f"the ledger {n_docs} / {n_tokens}")
    group.attrs["max_token_id"] = max_id
    return {"tokens": pos, "sequences": docs, "max_token_id": max_id}


def export_flat_tokens(url: str, out: str, *, overwrite: bool = False, tokens_chunk_size: int = 1 << 22,
                       seq_starts_chunk_size: int = 1 << 20, keep_eos: bool = False, threads: int = 2) -> str:
    """Write a cache (or a directory of ``train``/``validation`` caches) as a flat-tokens zarr dataset.

    Args:
      url: a cache root, or a directory holding ``train/`` and (optionally) ``validation/`` caches.
      out: the zarr directory to create (local or any fsspec URL); written under a temporary name and
        renamed into place when complete.
      overwrite: replace an existing ``out``.
      tokens_chunk_size, seq_starts_chunk_size: zarr chunk lengths (seqax's defaults).
      keep_eos: keep the EOS that ends every document of a cache built with ``--append_eos``.
      threads: chunks fetched and decoded ahead in parallel.

    Returns a one-line summary.
    """
    if tokens_chunk_size <= 0 or seq_starts_chunk_size <= 0:
        raise ExportError("--tokens_chunk_size and --seq_starts_chunk_size must be positive")
    zarr, numcodecs = _zarr()
    caches = {name: open_finished(u) for name, u in split_caches(url).items()}
    hashes = {name: c.ledger.tokenizer.get("hash") for name, c in caches.items()}
    if len(set(hashes.values())) > 1:
        raise ExportError(f"{url}: train/ and validation/ were built with different tokenizers ({hashes}); "
                          "a flat-tokens dataset has one vocabulary")
    fs, path = output_fs(out)
    if fs.exists(path) and not overwrite:
        raise ExportError(f"{out} exists; pass --overwrite to replace it, or choose another --out")
    tmp = temp_name(path)
    target = tmp if "://" not in out else out.split("://", 1)[0] + "://" + tmp
    stats: dict[str, Any] = {}
    try:
        root = zarr.open_group(store=target, mode="w-", zarr_format=2)
        root.attrs["chunkledger"] = {"tokenizer": dict(caches["train"].ledger.tokenizer)}
        for name in SPLITS:
            stats[name] = _write_split(root.create_group(name), caches.get(name), tokens_chunk_size,
                                       seq_starts_chunk_size, numcodecs, keep_eos, threads)
        old = None
        if fs.exists(path):
            old = temp_name(path)
            rename(fs, path, old)
        rename(fs, tmp, path)
        if old is not None:
            remove_quietly(fs, old)
    finally:
        remove_quietly(fs, tmp)
    parts = ", ".join(f"{k}: {v['sequences']:,} sequences / {v['tokens']:,} tokens" for k, v in stats.items())
    return f"wrote {out} (flat-tokens, zarr v2): {parts}"
