"""Import Megatron ``.bin``/``.idx`` datasets into a chunkledger cache, without re-tokenizing:
``python -m reader import-megatron PREFIX [PREFIX ...] --tokenizer_from CACHE_OR_JSON --out CACHE`` (or
``python -m pipelines.interop import-megatron ... --tokenizer SPEC``).

The result is an ordinary cache (docs/FORMAT.md) that ``Reader``, shuffles, eval mode and
``python -m reader validate`` use as they use a built one: each ``PREFIX.bin`` an input shard (sorted by
path), each Megatron document one document (``--unit sequence``: each sequence), chunks by the builder's
rule (``reader/interop/importer.py``). docs/INTEROP.md ("Shards, documents, chunks", "Ledger") maps every
term of the format.

Token ids are checked against the tokenizer (and the ``.bin``'s dtype must be able to hold its ids);
rerunning the same command after a crash finishes the import with identical bytes.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from reader.storage import files
from reader.interop.importer import (DEFAULT_CHUNK_TOKENS, DEFAULT_ROW_GROUP_TOKENS, ImportFailed, add_cache_arguments,
                       add_tokenizer_from, checked_identity, is_finished, make_config, write_cache)
from reader.interop.megatron import MegatronError, MegatronIndex, read_span
from reader.storage.progress import counted


def check_dtype(index: MegatronIndex, tokenizer: dict[str, Any]) -> None:
    """The ``.bin``'s dtype must be an integer type able to hold every id of the tokenizer."""
    dt, vocab = index.dtype, int(tokenizer["vocab_size"])
    if dt.kind not in "iu":
        raise MegatronError(f"{index.idx_path}: dtype {dt.name} is not an integer type; token ids are integers")
    if np.iinfo(dt).max < vocab - 1:
        raise MegatronError(
            f"{index.idx_path}: dtype {dt.name} holds ids up to {np.iinfo(dt).max}, but tokenizer "
            f"{tokenizer['spec']!r} has {vocab} ids (Megatron picks {dt.name} only for smaller vocabularies). "
            "Was this data tokenized with another tokenizer? Give the one it was made with.")


class MegatronSource:
    """A ``.bin``/``.idx`` pair as an import source (see ``reader.interop.importer.Source``)."""

    def __init__(self, index: MegatronIndex, unit: str):
        self.index, self.unit = index, unit
        self.name = index.bin_path
        self.path = index.bin_path
        self.size = index.bin_size
        self.itemsize = index.dtype.itemsize
        self.num_docs = index.num_sequences if unit == "sequence" else index.num_documents
        self.eos_in_data = True  # Megatron's --append-eod writes the EOS into the .bin

    def _seq_bounds(self, lo: int, hi: int) -> np.ndarray:
        if self.unit == "sequence":
            return np.arange(lo, hi + 1, dtype=np.int64)
        return np.asarray(self.index.document_indices[lo:hi + 1], dtype=np.int64)

    def doc_starts(self, lo: int, hi: int) -> np.ndarray:
        first = self._seq_bounds(lo, hi)[:-1]
        ptr = np.full(len(first), self.size, np.int64)  # a document of no sequence at the very end
        inside = first < self.index.num_sequences
        ptr[inside] = self.index.sequence_pointers[first[inside]]
        return ptr

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        with files.open_local(self.index.bin_path) as f:
            return read_span(self.index, self._seq_bounds(lo, hi), f)

    def input_entry(self) -> dict[str, Any]:
        return {"index": self.index.idx_path, "index_size": self.index.idx_size}


def import_megatron(prefixes: Sequence[str], tokenizer: Mapping[str, Any], out: str, *, unit: str = "document",
                    append_eos: bool = False, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                    row_group_tokens: int = DEFAULT_ROW_GROUP_TOKENS, threads: int = 2) -> dict[str, Any]:
    """Write the cache ``out`` from Megatron datasets; returns the finished ledger.

    Args:
      prefixes: paths without ``.bin``/``.idx`` (local files); sorted by path, they are the shards.
      tokenizer: the identity of the tokenizer the data was made with (a ledger's ``tokenizer`` object:
        ``reader.interop.tokenizer_from.load(CACHE_OR_JSON)`` or ``pipelines.tokenize.tokenizer.resolve(SPEC).identity()``).
      out: the cache root to create (local or any fsspec URL).
      unit: ``"document"`` (a Megatron document, its sequences joined) or ``"sequence"``.
      append_eos: every document ends with the tokenizer's EOS (checked; recorded in the config).
      chunk_tokens: about this many tokens per chunk (``chunk_bytes`` = this x the token size).
      row_group_tokens: Parquet row groups are cut once they hold this many tokens.
      threads: chunks written in parallel.
    """
    if unit not in ("document", "sequence"):
        raise ImportFailed(f"--unit {unit!r}: choose document or sequence")
    if not prefixes:
        raise ImportFailed("give at least one PREFIX (PREFIX.bin + PREFIX.idx)")
    tok = checked_identity(tokenizer)
    paths = sorted({os.path.abspath(os.path.expanduser(p[:-4] if p.endswith((".bin", ".idx")) else p))
                    for p in prefixes})
    indexes = [MegatronIndex.open(p) for p in paths]
    for ix in indexes:
        check_dtype(ix, tok)
    dtypes = {ix.dtype.name for ix in indexes}
    if len(dtypes) > 1:
        raise ImportFailed(f"the inputs have different dtypes ({', '.join(sorted(dtypes))}); import each dtype into "
                           "its own cache")
    dt = indexes[0].dtype
    config = make_config({"format": "megatron", "dtype": dt.name, "unit": unit}, append_eos=append_eos,
                         chunk_bytes=chunk_tokens * dt.itemsize, row_group_tokens=row_group_tokens)
    return write_cache([MegatronSource(ix, unit) for ix in indexes], tok, config, out, threads=threads)


# --------------------------------------------------------------------------------------------------
# Command line


def add_parser(sub, tokenizer: Callable[[Any], None] = add_tokenizer_from) -> None:
    """The ``import-megatron`` subcommand of ``python -m reader`` (``tokenizer``: how the tokenizer is given, see
    :func:`reader.interop.importer.add_cache_arguments`; ``pipelines.interop`` reuses this parser with a spec)."""
    m = sub.add_parser(
        "import-megatron", help="turn Megatron .bin/.idx datasets into a chunkledger cache (no re-tokenizing)",
        description="Write a chunkledger cache from Megatron-Core / Megatron-LM indexed datasets (PREFIX.bin + "
                    "PREFIX.idx, as tools/preprocess_data.py writes them). Each .bin is an input shard (sorted by "
                    "path), each document a document, chunks of about --chunk_tokens tokens; the ledger records "
                    "the tokenizer's identity exactly as a build with it does, and token ids are checked against "
                    "its vocabulary. "
                    "Rerun the same command after a crash. See docs/INTEROP.md.")
    m.add_argument("prefixes", nargs="+", metavar="PREFIX", help="dataset path without .bin/.idx (local)")
    m.add_argument("--append_eos", action="store_true",
                   help="the documents end with the tokenizer's EOS (Megatron's --append-eod); checked, and "
                        "recorded as config.append_eos")
    m.add_argument("--unit", choices=["document", "sequence"], default="document",
                   help="what becomes a chunkledger document: a Megatron document (its sequences joined; "
                        "default) or each sequence (data made with --split-sentences)")
    add_cache_arguments(m, tokens_help="; chunk_bytes = this x token size", tokenizer=tokenizer)
    m.set_defaults(fn=cmd_import)


def cmd_import(args) -> int:
    done = is_finished(args.out)
    ledger = import_megatron(args.prefixes, args.identity_of(args), args.out, threads=args.threads, unit=args.unit,
                             append_eos=args.append_eos, chunk_tokens=args.chunk_tokens,
                             row_group_tokens=args.row_group_tokens)
    t = ledger["totals"]
    note = " (already complete; nothing to do)" if done else ""
    print(f"{'cache' if done else 'wrote'} {args.out}: {counted(t['docs'], 'document')}, "
          f"{counted(t['tokens'], 'token')}, {counted(t['chunks'], 'chunk')} from {len(ledger['inputs'])} Megatron dataset(s); tokenizer "
          f"{ledger['tokenizer']['spec']} (vocab_size {ledger['tokenizer']['vocab_size']}){note}")
    return 0
