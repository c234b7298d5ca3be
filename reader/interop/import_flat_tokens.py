"""Import a seqax flat-tokens dataset (zarr) into chunkledger caches, without re-tokenizing:
``python -m reader import-flat-tokens DIR.zarr --tokenizer_from CACHE_OR_JSON --out CACHE`` (or
``python -m pipelines.interop import-flat-tokens ... --tokenizer SPEC``).

The format (``reader/interop/flat_tokens.py``) is checked as it is read: both arrays of a group present, with
their dtypes (``encoded_tokens`` uint32, ``seq_starts`` uint64, one dimension), ``seq_starts`` from 0,
never decreasing, ending at the token count; the start bits exactly at the sequence starts; every token
id at most the group's ``max_token_id``, and that below the tokenizer's vocabulary size.

Layout: the ``train`` group becomes ``CACHE`` itself; if the ``validation`` group holds sequences, the
two become ``CACHE/train`` and ``CACHE/validation`` (each a complete cache, the layout that ``export``
reads back). Each group is one input shard; each sequence a document whose ``offset`` is the byte offset
of its first token in ``encoded_tokens`` (4 bytes a token); chunks follow the builder's rule
(``reader/interop/importer.py``) with ``chunk_bytes = 4 x --chunk_tokens``. flat-tokens stores no
end-of-sequence tokens: ``--append_eos`` appends the tokenizer's EOS to every document, as the builder's
``--append_eos`` does.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import numpy as np

from reader.format import spec as fmt
from reader.format import checks
from reader.interop.export import ExportError
from reader.interop.flat_tokens import open_dataset
from reader.interop.importer import (DEFAULT_CHUNK_TOKENS, DEFAULT_ROW_GROUP_TOKENS, ImportFailed, add_cache_arguments,
                       add_tokenizer_from, checked_identity, is_finished, make_config, write_cache)
from reader.storage.progress import counted

_BLOCK = 1 << 20
# How many bytes an array may claim per byte it holds in the store. Real flat-tokens data compresses
# 1.5-4x (Blosc lz4, the format's codec, cannot exceed about 255x); a claim beyond this is missing chunks
# (zarr reads them as fill values: a 188 KB dataset can claim 2**40 tokens) or a decompression bomb, and
# is refused before anything is read or written.
MAX_EXPANSION = 1000
_SLACK = 1 << 20  # bytes any dataset may claim beyond that (tiny arrays, fill-value tails)


class FlatTokensSource:
    """One split (``train`` / ``validation``) of a flat-tokens dataset, checked (see the module docstring)."""

    itemsize = 4
    eos_in_data = False  # the format stores no EOS; --append_eos appends it

    def __init__(self, root, where: str, split: str, vocab_size: int):
        self.where = f"{where}/{split}"
        self.name = f"{self.where}/encoded_tokens"
        self.path = self.where
        try:
            group = root[split]
        except KeyError:
            raise ImportFailed(f"{self.where}: no such group (a flat-tokens dataset has train and "
                               "validation)") from None
        arrays = {}
        for key, dtype in (("encoded_tokens", np.uint32), ("seq_starts", np.uint64)):
            try:
                arr = group[key]
                shape, chunks = tuple(arr.shape), tuple(arr.chunks)
                nbytes = int(arr.nbytes)
            except KeyError:
                raise ImportFailed(f"{self.where}/{key}: missing array (a flat-tokens group holds encoded_tokens "
                                   "and seq_starts)") from None
            except Exception as e:  # noqa: BLE001 - zarr raises many types for metadata it cannot use
                raise ImportFailed(f"{self.where}/{key}: unreadable array metadata ({type(e).__name__}: {e})") from None
            if not all(checks.is_int(int(n), 0, checks.MAX_COUNT) for n in shape) or not all(
                    checks.is_int(int(n), 1, checks.MAX_COUNT) for n in chunks) or nbytes > checks.MAX_TOTAL:
                raise ImportFailed(f"{self.where}/{key}: shape {list(shape)} / chunks {list(chunks)} out of range")
            if getattr(arr, "ndim", None) != 1 or np.dtype(arr.dtype) != np.dtype(dtype):
                raise ImportFailed(f"{self.where}/{key}: {getattr(arr, 'ndim', '?')}-d {arr.dtype}, the format needs "
                                   f"a 1-d {np.dtype(dtype).name} array")
            arrays[key] = arr
        self.tokens, self.starts = arrays["encoded_tokens"], arrays["seq_starts"]
        self._check_claims()
        max_id = group.attrs.get("max_token_id")
        if not isinstance(max_id, (int, np.integer)) or isinstance(max_id, bool) or max_id < 0:
            raise ImportFailed(f"{self.where}: attribute max_token_id missing or not a non-negative integer")
        self.max_token_id = int(max_id)
        if self.max_token_id >= vocab_size:
            raise ImportFailed(f"{self.where}: max_token_id {self.max_token_id} does not fit the tokenizer's "
                               f"vocabulary of {vocab_size} ids. Was this data tokenized with another tokenizer?")
        n_tokens, n_starts = int(self.tokens.shape[0]), int(self.starts.shape[0])
        if n_starts < 1:
            raise ImportFailed(f"{self.where}/seq_starts: empty (it holds at least the final token count)")
        self.size = n_tokens * self.itemsize
        self.num_docs = n_starts - 1
        prev = 0
        for lo in range(0, n_starts, _BLOCK):
            blk = np.asarray(self.starts[lo:lo + _BLOCK], dtype=np.uint64).astype(np.int64)
            if lo == 0 and int(blk[0]) != 0:
                raise ImportFailed(f"{self.where}/seq_starts: starts at {int(blk[0])}, must start at 0")
            steps = np.diff(np.concatenate([[prev], blk]))
            if bool((steps < 0).any()):
                raise ImportFailed(f"{self.where}/seq_starts: decreases (near entry {lo}); it must list the starts "
                                   "in increasing order")
            if steps.size and int(steps.max()) > checks.MAX_INDEX:
                raise ImportFailed(f"{self.where}/seq_starts: a sequence near entry {lo} has {int(steps.max())} "
                                   f"tokens, more than a document holds ({checks.MAX_INDEX})")
            prev = int(blk[-1])
        if prev != n_tokens:
            raise ImportFailed(f"{self.where}/seq_starts: ends at {prev}, encoded_tokens holds {n_tokens} tokens "
                               "(truncated or damaged)")

    def _check_claims(self) -> None:
        """The sizes the arrays' metadata claim against the bytes their chunks hold in the store (one listing
        of the arrays' keys), before any chunk is read (see :data:`MAX_EXPANSION`)."""
        claimed = int(self.tokens.nbytes) + int(self.starts.nbytes)
        stored = sum(_stored_bytes(a) for a in (self.tokens, self.starts))
        if claimed > MAX_EXPANSION * stored + _SLACK:
            raise ImportFailed(
                f"{self.where}: claims {int(self.tokens.shape[0]):,} tokens and {int(self.starts.shape[0]):,} sequence "
                f"starts ({claimed:,} bytes), but its arrays hold {stored:,} bytes in the store: more than "
                f"{MAX_EXPANSION}x, which no flat-tokens data compresses to. Chunks are missing (zarr would read "
                "them as fill values) or the dataset is damaged; nothing was imported")

    def doc_starts(self, lo: int, hi: int) -> np.ndarray:
        return np.asarray(self.starts[lo:hi], dtype=np.uint64).astype(np.int64) * self.itemsize

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        s = np.asarray(self.starts[lo:hi + 1], dtype=np.uint64).astype(np.int64)
        enc = np.asarray(self.tokens[int(s[0]):int(s[-1])], dtype=np.uint32)
        lengths = np.diff(s)
        want = np.zeros(enc.size, bool)
        want[s[:-1][lengths > 0] - s[0]] = True
        got = (enc & 1).astype(bool)
        if not np.array_equal(got, want):
            at = int(s[0]) + int(np.argmax(got != want))
            raise ImportFailed(f"{self.name}: token {at} has its start bit {'set' if got[at - s[0]] else 'clear'}, "
                               "but seq_starts says otherwise (damaged data)")
        ids = enc >> np.uint32(1)
        if ids.size and int(ids.max()) > self.max_token_id:
            raise ImportFailed(f"{self.name}: token id {int(ids.max())} exceeds the group's max_token_id "
                               f"{self.max_token_id}")
        return lengths, ids

    def input_entry(self) -> dict[str, Any]:
        return {}


def _stored_bytes(array) -> int:
    """Bytes an array's chunks (and metadata) take in its store, without reading them."""
    got = array.nbytes_stored
    return int(got() if callable(got) else got)


def import_flat_tokens(path: str, tokenizer: Mapping[str, Any], out: str, *, append_eos: bool = False,
                       chunk_tokens: int = DEFAULT_CHUNK_TOKENS, row_group_tokens: int = DEFAULT_ROW_GROUP_TOKENS,
                       threads: int = 2) -> dict[str, dict[str, Any]]:
    """Write caches from a flat-tokens dataset; returns ``{split: finished ledger}``.

    Args:
      path: the zarr directory (local or any fsspec URL zarr opens).
      tokenizer: the identity of the tokenizer the data was made with (a ledger's ``tokenizer`` object:
        ``reader.interop.tokenizer_from.load(CACHE_OR_JSON)`` or ``pipelines.tokenize.tokenizer.resolve(SPEC).identity()``).
      out: the cache root (``out/train`` + ``out/validation`` if the validation group holds sequences).
      append_eos: append the tokenizer's EOS to every document (recorded as config.append_eos).
      chunk_tokens, row_group_tokens, threads: as for ``import-megatron``.
    """
    tok = checked_identity(tokenizer)
    where = path if "://" in path else os.path.abspath(os.path.expanduser(path))
    try:
        root = open_dataset(where, "import-flat-tokens")
    except ExportError as e:
        raise ImportFailed(str(e)) from e
    sources = {"train": FlatTokensSource(root, where, "train", tok["vocab_size"])}
    if "validation" in root:
        val = FlatTokensSource(root, where, "validation", tok["vocab_size"])
        if val.num_docs:
            sources["validation"] = val
    results = {}
    for split, src in sources.items():
        config = make_config({"format": "flat-tokens", "split": split}, append_eos=append_eos,
                             chunk_bytes=chunk_tokens * src.itemsize, row_group_tokens=row_group_tokens)
        target = out if len(sources) == 1 else out.rstrip("/") + "/" + split
        results[split] = write_cache([src], tok, config, target, threads=threads)
    return results


# --------------------------------------------------------------------------------------------------
# Command line


def add_parser(sub, tokenizer: Callable[[Any], None] = add_tokenizer_from) -> None:
    """The ``import-flat-tokens`` subcommand of ``python -m reader`` (``tokenizer``: how the tokenizer is given,
    see :func:`reader.interop.importer.add_cache_arguments`; ``pipelines.interop`` reuses this parser with a spec)."""
    m = sub.add_parser(
        "import-flat-tokens", help="turn a seqax flat-tokens zarr dataset into chunkledger cache(s)",
        description="Write chunkledger caches from a flat-tokens dataset (zarr groups train and validation). "
                    "train becomes CACHE; a non-empty validation group makes CACHE/train and CACHE/validation. "
                    "Each sequence becomes a document; the ledger records the tokenizer's identity exactly as a build "
                    "with it does, and token ids are checked against its vocabulary. See docs/INTEROP.md.")
    m.add_argument("path", metavar="DIR.zarr", help="the flat-tokens dataset")
    m.add_argument("--append_eos", action="store_true",
                   help="append the tokenizer's EOS to every document, as the builder's --append_eos (flat-tokens "
                        "stores none; export leaves it out again)")
    add_cache_arguments(m, tokenizer=tokenizer)
    m.set_defaults(fn=cmd_import)


def cmd_import(args) -> int:
    done = is_finished(args.out) or is_finished(args.out.rstrip("/") + "/train")
    results = import_flat_tokens(args.path, args.identity_of(args), args.out, append_eos=args.append_eos,
                                 chunk_tokens=args.chunk_tokens, row_group_tokens=args.row_group_tokens,
                                 threads=args.threads)
    for split, ledger in results.items():
        t = ledger["totals"]
        where = args.out if len(results) == 1 else args.out.rstrip("/") + "/" + split
        print(f"{'cache' if done else 'wrote'} {where} ({split}): {counted(t['docs'], 'document')}, "
              f"{counted(t['tokens'], 'token')}, {counted(t['chunks'], 'chunk')}" + (" (already complete; nothing to do)" if done else ""))
    return 0
