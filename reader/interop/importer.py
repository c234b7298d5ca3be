"""Writing a cache from already tokenized documents (the shared half of ``import-megatron`` and
``import-flat-tokens``).

A *source* is one input shard: documents in order, each with the byte offset of its first token in the
shard's token file (the format's ``offset``). Chunk ``k`` of a shard holds the documents whose first
token lies at a byte offset in ``[k*chunk_bytes, (k+1)*chunk_bytes)``: the builder's rule, with the token
file as the input file. Documents of zero tokens at the very end of the file (offset = its size) go to
the last chunk, and a shard that has documents has at least one chunk.

Chunks are written with the builder's chunk writer (``reader.format.chunk_file``): same encoding, row groups
(cut once a group holds ``row_group_tokens``) and sidecars. Every file is written under a temporary name
and renamed; the ledger is written first as a plan (``finished: false``) and last as the finished
ledger, so an interrupted import never looks complete and rerunning the same command finishes it with
identical bytes. Token ids are checked against the tokenizer's vocabulary before anything of a chunk is
written. With ``config.append_eos``, a source whose documents carry their EOS (Megatron's
``--append-eod``) is checked for it, and one whose format stores none (flat-tokens) gets it appended.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from reader.format import spec as fmt
from reader.format import tokenizer_id
from reader.interop import tokenizer_from
from reader.format.chunk_file import ChunkParquet, flat_row_group_table
from reader.format.sidecar import ledger_entry, make_sidecar, sidecar_bytes
from reader.format.table import entry_bytes, entry_path
from reader.storage import files
from reader.storage.finish import finish_cache
from reader.interop.export import output_fs, output_location
from reader.order.streams import round_robin_order

DEFAULT_CHUNK_TOKENS = 1 << 24  # about what the builder's default 64 MiB chunk of jsonl text holds
DEFAULT_ROW_GROUP_TOKENS = 128 << 10  # the builder's default


class ImportFailed(fmt.FormatError):
    """An import cannot run or its input is bad; the message names the file and the fix."""


NOT_HERE = ("not an option of {prog}: it takes the tokenizer's identity and computes none (it imports no "
            "tokenizer library). Either give --tokenizer_from CACHE_OR_JSON (a cache built with that tokenizer, "
            "or a JSON file from: python -m pipelines.interop tokenizer-identity SPEC --out FILE.json), or run "
            "python -m pipelines.interop {command} ... --tokenizer SPEC (needs 'chunkledger[pipeline]')")


class _NotHere(argparse.Action):
    """``--tokenizer SPEC`` given to ``python -m reader``: a usage error that says the two ways."""

    def __call__(self, parser, namespace, values, option_string=None):
        prog, command = parser.prog.rsplit(" ", 1)
        parser.error(f"argument {option_string}: " + NOT_HERE.format(prog=prog, command=command))


def identity_from_args(args) -> dict[str, Any]:
    """The tokenizer identity of ``--tokenizer_from`` (:func:`reader.interop.tokenizer_from.load`)."""
    return tokenizer_from.load(args.tokenizer_from)


def add_tokenizer_from(parser) -> None:
    """``--tokenizer_from CACHE_OR_JSON``, the reader's way of naming the tokenizer; ``args.identity_of(args)``
    gives the identity. ``--tokenizer SPEC`` is refused with a message naming both ways."""
    parser.add_argument("--tokenizer_from", required=True, metavar="CACHE_OR_JSON",
                        help="the tokenizer the data was made with, as its identity (recorded in the ledger): a "
                             "cache built with it (the directory holding ledger.json, local or gs://...), a flat-tokens "
                             "export of one, or a "
                             "JSON file holding the identity (python -m pipelines.interop tokenizer-identity SPEC "
                             "--out FILE.json). With a tokenizer spec instead: python -m pipelines.interop "
                             f"{parser.prog.split()[-1]} ... --tokenizer SPEC")
    parser.add_argument("--tokenizer", action=_NotHere, nargs="?", metavar="SPEC", help=argparse.SUPPRESS)
    parser.set_defaults(identity_of=identity_from_args)


def add_cache_arguments(parser, tokens_help: str = "", tokenizer: Callable[[Any], None] = add_tokenizer_from) -> None:
    """The options every ``import-*`` subcommand shares: the tokenizer, the cache to write and its chunking.

    Args:
      parser: the subcommand's parser.
      tokens_help: appended to ``--chunk_tokens``' help.
      tokenizer: adds the tokenizer option(s) and sets ``identity_of`` (a function of the parsed arguments
        returning the identity): :func:`add_tokenizer_from` for ``python -m reader``;
        ``pipelines.interop`` gives ``--tokenizer SPEC``.
    """
    tokenizer(parser)
    parser.add_argument("--out", required=True, metavar="CACHE", help="cache root to create (local or gs://...)")
    parser.add_argument("--chunk_tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                        help=f"tokens per chunk, about (default {DEFAULT_CHUNK_TOKENS}){tokens_help}")
    parser.add_argument("--row_group_tokens", type=int, default=DEFAULT_ROW_GROUP_TOKENS,
                        help="cut a Parquet row group once it holds this many tokens "
                             f"(default {DEFAULT_ROW_GROUP_TOKENS})")
    parser.add_argument("--threads", type=int, default=2, help="chunks written in parallel (default 2)")


def checked_identity(tokenizer: Any) -> dict[str, Any]:
    """The identity an import records, checked; a spec string is refused with the two ways to get one."""
    if isinstance(tokenizer, (str, bytes, os.PathLike)):
        raise ImportFailed(f"tokenizer {tokenizer!r}: give the tokenizer identity (a ledger's tokenizer object), "
                           "not a spec: reader.interop.tokenizer_from.load(CACHE_OR_JSON), or "
                           "pipelines.tokenize.tokenizer.resolve(SPEC).identity()")
    return tokenizer_id.check(tokenizer, "tokenizer")


_BLOCK = 1 << 20  # documents handled at a time when scanning a source (bounded memory)


class Source(Protocol):
    """One input shard of an import."""

    name: str  # what error messages call it (a file path)
    path: str  # the ledger's inputs[].path
    size: int  # bytes of the shard's token file
    itemsize: int  # bytes per token in that file
    num_docs: int
    eos_in_data: bool  # with config.append_eos: True = every document already ends with EOS (checked),
    # False = the format stores none and the import appends it (as the builder does)

    def doc_starts(self, lo: int, hi: int) -> np.ndarray:
        """int64 byte offsets of the first token of documents ``[lo, hi)`` (``size`` for a trailing empty one)."""

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths, tokens)`` of documents ``[lo, hi)``: token counts, and all their tokens back to back."""

    def input_entry(self) -> dict[str, Any]:
        """Extra keys of the ledger's ``inputs`` entry (e.g. the index file)."""


def make_config(source: dict[str, Any], *, append_eos: bool, chunk_bytes: int, row_group_tokens: int,
                compression: str = "zstd", compression_level: int | None = 3) -> dict[str, Any]:
    """The ledger ``config`` of an import: the builder's keys (text-only ones null) plus ``source``."""
    if chunk_bytes <= 0 or row_group_tokens <= 0:
        raise ImportFailed("--chunk_tokens and --row_group_tokens must be positive")
    return {"text_key": None, "append_eos": bool(append_eos), "chunk_bytes": int(chunk_bytes),
            "row_group_tokens": int(row_group_tokens), "compression": compression,
            "compression_level": compression_level if compression in ("zstd", "gzip", "brotli") else None,
            "token_encoding": "PLAIN", "piece_chars": None, "max_piece_chars": None, "source": source}


def num_chunks(src: Source, chunk_bytes: int) -> int:
    n = fmt.num_chunks(src.size, chunk_bytes)
    return max(n, 1) if src.num_docs else n


def chunk_doc_bounds(src: Source, chunk_bytes: int) -> np.ndarray:
    """``bounds[k]..bounds[k+1]``: the documents of chunk ``k`` (by the byte offset of their first token)."""
    n = num_chunks(src, chunk_bytes)
    counts = np.zeros(n, np.int64)
    for lo in range(0, src.num_docs, _BLOCK):
        ptr = src.doc_starts(lo, min(lo + _BLOCK, src.num_docs))
        counts += np.bincount(np.minimum(ptr // chunk_bytes, n - 1), minlength=n)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def row_group_ends(lengths: np.ndarray, row_group_tokens: int) -> list[int]:
    """End (exclusive) document of each row group: cut once a group holds >= row_group_tokens (the builder's rule)."""
    cum = np.cumsum(lengths, dtype=np.int64)
    ends, start, base = [], 0, 0
    while start < len(lengths):
        end = min(int(np.searchsorted(cum, base + row_group_tokens, side="left")) + 1, len(lengths))
        ends.append(end)
        base = int(cum[end - 1])
        start = end
    return ends


def _check_tokens(src: Source, lo: int, lengths: np.ndarray, raw: np.ndarray, tokenizer: dict[str, Any],
                  append_eos: bool) -> None:
    vocab = int(tokenizer["vocab_size"])
    ends = np.cumsum(lengths, dtype=np.int64)
    if raw.size and (int(raw.min()) < 0 or int(raw.max()) >= vocab):
        bad = int(np.flatnonzero((raw < 0) | (raw >= vocab))[0])
        doc = lo + int(np.searchsorted(ends, bad, side="right"))
        raise ImportFailed(f"{src.name}: document {doc} holds token id {int(raw[bad])}, outside the vocabulary "
                           f"[0, {vocab}) of tokenizer {tokenizer['spec']!r}. Was this data tokenized with another "
                           "tokenizer? Give the one it was made with.")
    if append_eos:
        eos = tokenizer["eos_id"]
        ok = lengths > 0
        ok[ok] = raw[ends[ok] - 1] == eos
        if not bool(ok.all()):
            raise ImportFailed(f"{src.name}: document {lo + int(np.argmin(ok))} does not end with the EOS id {eos}; "
                               "leave out --append_eos (it records that every document ends with EOS)")


def write_chunk(st: files.Storage, root: str, src: Source, shard: int, k: int, docs: tuple[int, int], tokenizer: dict[str, Any],
                config: dict[str, Any]) -> dict[str, Any]:
    """Write chunk ``k`` of ``shard`` (documents ``docs``), its sidecar and its entry; returns the sidecar."""
    a, b = docs
    lengths, raw = src.read(a, b)
    lengths = np.asarray(lengths, np.int64)
    _check_tokens(src, a, lengths, raw, tokenizer, config["append_eos"] and src.eos_in_data)
    values = raw.astype(np.int32)
    if config["append_eos"] and not src.eos_in_data:
        values = np.insert(values, np.cumsum(lengths, dtype=np.int64), np.int32(tokenizer["eos_id"]))
        lengths = lengths + 1
    ends = np.cumsum(lengths, dtype=np.int64)
    starts = ends - lengths
    offsets = src.doc_starts(a, b)
    parquet = ChunkParquet(config)
    lo = 0
    for hi in row_group_ends(lengths, int(config["row_group_tokens"])):
        t0, t1 = int(starts[lo]), int(ends[hi - 1])
        parquet.write(flat_row_group_table(values[t0:t1], lengths[lo:hi].astype(np.int32), shard, offsets[lo:hi]),
                      t1 - t0)
        lo = hi
    data, rg_index, footer = parquet.finish()
    cb = int(config["chunk_bytes"])
    sidecar = make_sidecar(shard=shard, index_in_shard=k, byte_range=[k * cb, min((k + 1) * cb, src.size)],
                           data=data, row_group_index=rg_index, footer=footer, docs=b - a, tokens=int(values.size))
    files.write(st, fmt.join(root, fmt.chunk_path(shard, k)), data)
    files.write(st, fmt.join(root, fmt.sidecar_path(shard, k)), sidecar_bytes(sidecar))
    files.write(st, fmt.join(root, entry_path(shard, k)), entry_bytes(sidecar))  # what a follower reads
    return sidecar


def is_finished(out: str) -> bool:
    """True if ``out`` holds a finished ledger (a rerun of the import then has nothing to do)."""
    fs, path = output_location(out.rstrip("/") + "/" + fmt.LEDGER_NAME)
    try:
        return bool(fmt.Ledger.parse(files.storage(fs).read(path)).finished)
    except (FileNotFoundError, fmt.FormatError):
        return False


def plan_ledger(sources: Sequence[Source], tokenizer: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    if config["append_eos"] and tokenizer.get("eos_id") is None:
        raise ImportFailed(f"--append_eos: tokenizer {tokenizer['spec']!r} has no end-of-sequence token")
    inputs = [dict({"shard": i, "path": s.path, "size": s.size, "compression": "none",
                    "chunks": num_chunks(s, config["chunk_bytes"])}, **s.input_entry())
              for i, s in enumerate(sources)]
    return {"format": fmt.FORMAT_NAME, "format_version": fmt.written_version(None), "finished": False,
            "tokenizer": tokenizer, "config": config, "inputs": inputs, "chunks": [], "totals": {},
            "bad_records": {}}


def _same_plan(old: dict[str, Any], new: dict[str, Any]) -> bool:
    def key(inputs):
        return [{k: v for k, v in i.items() if k not in ("chunks", "uncompressed_bytes")} for i in inputs]

    return (fmt.config_fingerprint(old.get("tokenizer", {}), old.get("config", {}))
            == fmt.config_fingerprint(new["tokenizer"], new["config"])
            and key(old.get("inputs", [])) == key(new["inputs"]))


def write_cache(sources: Sequence[Source], tokenizer: dict[str, Any], config: dict[str, Any], out: str, *,
                threads: int = 2) -> dict[str, Any]:
    """Write the cache ``out`` from ``sources`` (its shards, in order); returns the finished ledger.

    An unfinished import of the same plan at ``out`` is redone; a finished one is returned as it is;
    anything else at ``out`` is refused.
    """
    ledger = plan_ledger(sources, tokenizer, config)
    fs, ledger_path = output_fs(out.rstrip("/") + "/" + fmt.LEDGER_NAME)
    st = files.storage(fs)
    root = ledger_path.rsplit("/", 1)[0]
    if st.exists(ledger_path):
        try:
            old = fmt.Ledger.parse(st.read(ledger_path), where=ledger_path).raw
        except fmt.FormatError as e:
            raise ImportFailed(f"{e}. Use another --out or delete {out}") from e
        if not _same_plan(old, ledger):
            raise ImportFailed(f"{out} already holds a different cache (other inputs, tokenizer or options). Use "
                               f"another --out, or delete {out} to import again.")
        if old.get("finished"):
            return old
        ledger["format_version"] = fmt.written_version(old["format_version"])  # (a rerun keeps its version)
    elif st.list(root):
        raise ImportFailed(f"{out} exists, is not empty and holds no ledger.json; choose an empty or new --out")
    files.write(st, ledger_path, fmt.dumps_ledger(ledger).encode())
    jobs = []
    for shard, src in enumerate(sources):
        bounds = chunk_doc_bounds(src, config["chunk_bytes"])
        jobs += [(shard, k, (int(bounds[k]), int(bounds[k + 1]))) for k in range(len(bounds) - 1)]
    with cf.ThreadPoolExecutor(max(1, threads)) as pool:
        futures = {(s, k): pool.submit(write_chunk, st, root, sources[s], s, k, docs, tokenizer, config)
                   for s, k, docs in jobs}
        sidecars = {key: f.result() for key, f in futures.items()}
    for tmp in [e.path for pattern in fmt.temp_patterns(root) for e in st.match(pattern)]:
        st.remove(tmp)  # left by an interrupted run
    order = round_robin_order([inp["chunks"] for inp in ledger["inputs"]])
    inputs = [dict(inp, uncompressed_bytes=inp["size"]) for inp in ledger["inputs"]]
    return finish_cache(st, root, ledger, inputs, (ledger_entry(sidecars[(int(s), int(k))]) for s, k in order))
