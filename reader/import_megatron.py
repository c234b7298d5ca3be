"""Import Megatron ``.bin``/``.idx`` datasets into a chunkledger cache, without re-tokenizing:
``python -m reader import-megatron PREFIX [PREFIX ...] --tokenizer SPEC --out CACHE``.

The result is an ordinary cache (docs/FORMAT.md) that ``Reader``, shuffles, eval mode and
``python -m reader validate`` use as they use a built one. How the format's terms map:

* **Shards.** Each ``PREFIX.bin`` is an input shard, the prefixes sorted by path (as the builder sorts
  its inputs). The shard's "uncompressed bytes" are the ``.bin``'s bytes.
* **Documents.** Each Megatron document is one chunkledger document (its sequences joined, for data made
  with ``--split-sentences``; ``--unit sequence`` makes every sequence a document instead). Its
  ``offset`` is the byte offset of its first token in the ``.bin``.
* **Chunks.** Chunk ``k`` of a shard holds the documents whose first token lies at a byte offset in
  ``[k*chunk_bytes, (k+1)*chunk_bytes)``, exactly the builder's rule with the ``.bin`` as the input file
  (documents of zero tokens at the very end go to the last chunk). ``chunk_bytes`` is ``--chunk_tokens``
  (default 16 Mi, about what the builder's 64 MiB chunk of text holds) times the token size.
* **Ledger.** ``tokenizer`` is what the builder records for the same ``--tokenizer`` spec
  (``reader.tokenizer_id``); ``config`` has the builder's keys (``text_key``, ``piece_chars``,
  ``max_piece_chars`` null) plus ``source`` (``format``, ``dtype``, ``unit``); each input also names its
  ``index`` file.

Chunks are written with the builder's own chunk writer (``reader.chunk_writer``): same encoding, row
groups and sidecars. Every file is written under a temporary name and renamed; the ledger is written
first as a plan (``finished: false``) and last as the finished ledger, so an interrupted import never
looks complete, and rerunning the same command finishes it with identical bytes.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
from typing import Any, Sequence

import numpy as np

from . import format as fmt
from . import tokenizer_id
from .chunk_writer import ChunkParquet, flat_row_group_table, ledger_chunks, make_sidecar
from .export import TMP_PREFIX, output_fs, remove_quietly, rename, temp_name
from .megatron import MegatronError, MegatronIndex, read_span
from .order import round_robin_order

DEFAULT_CHUNK_TOKENS = 1 << 24
DEFAULT_ROW_GROUP_TOKENS = 128 << 10  # the builder's default
_BLOCK = 1 << 20


class ImportMegatronError(MegatronError):
    """The import cannot run (output in the way, tokenizer mismatch); the message names the fix."""


def _write_atomic(fs, path: str, data: bytes) -> None:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    tmp = temp_name(path)
    try:
        fs.pipe_file(tmp, data)
        rename(fs, tmp, path)
    finally:
        remove_quietly(fs, tmp)


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


def _seq_bounds(index: MegatronIndex, unit: str, lo: int, hi: int) -> np.ndarray:
    """Sequence index bounds of documents ``[lo, hi)`` (``hi - lo + 1`` entries)."""
    if unit == "sequence":
        return np.arange(lo, hi + 1, dtype=np.int64)
    return np.asarray(index.document_indices[lo:hi + 1], dtype=np.int64)


def _num_docs(index: MegatronIndex, unit: str) -> int:
    return index.num_sequences if unit == "sequence" else index.num_documents


def num_chunks(index: MegatronIndex, unit: str, chunk_bytes: int) -> int:
    n = fmt.num_chunks(index.bin_size, chunk_bytes)
    return max(n, 1) if _num_docs(index, unit) else n


def chunk_doc_bounds(index: MegatronIndex, unit: str, chunk_bytes: int) -> np.ndarray:
    """``bounds[k]..bounds[k+1]``: the documents of chunk ``k`` (by the byte offset of their first token)."""
    n = num_chunks(index, unit, chunk_bytes)
    counts = np.zeros(n, np.int64)
    docs = _num_docs(index, unit)
    for lo in range(0, docs, _BLOCK):
        first_seq = _seq_bounds(index, unit, lo, min(lo + _BLOCK, docs))[:-1]
        ptr = np.full(len(first_seq), index.bin_size, np.int64)  # a document of no sequence at the very end
        inside = first_seq < index.num_sequences
        ptr[inside] = index.sequence_pointers[first_seq[inside]]
        counts += np.bincount(np.minimum(ptr // chunk_bytes, n - 1), minlength=n)
    return np.concatenate([[0], np.cumsum(counts)])


def _row_group_ends(lengths: np.ndarray, row_group_tokens: int) -> list[int]:
    """End (exclusive) document of each row group: cut once a group holds >= row_group_tokens (the builder's rule)."""
    cum = np.cumsum(lengths, dtype=np.int64)
    ends, start, base = [], 0, 0
    while start < len(lengths):
        j = int(np.searchsorted(cum, base + row_group_tokens, side="left"))
        end = min(j + 1, len(lengths))
        ends.append(end)
        base = int(cum[end - 1])
        start = end
    return ends


def _write_chunk(fs, root: str, index: MegatronIndex, shard: int, k: int, docs: tuple[int, int],
                 tokenizer: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    unit = config["source"]["unit"]
    cb = config["chunk_bytes"]
    a, b = docs
    bounds = _seq_bounds(index, unit, a, b)
    with open(index.bin_path, "rb") as f:
        lengths, raw = read_span(index, bounds, f)
    vocab = int(tokenizer["vocab_size"])
    if raw.size and (int(raw.min()) < 0 or int(raw.max()) >= vocab):
        bad_pos = int(np.flatnonzero((raw < 0) | (raw >= vocab))[0])
        doc = a + int(np.searchsorted(np.cumsum(lengths), bad_pos, side="right"))
        raise MegatronError(f"{index.bin_path}: {unit} {doc} holds token id {int(raw[bad_pos])}, outside the "
                            f"vocabulary [0, {vocab}) of tokenizer {tokenizer['spec']!r}. Was this data tokenized "
                            "with another tokenizer?")
    values = raw.astype(np.int32)
    ends = np.cumsum(lengths, dtype=np.int64)
    if config["append_eos"]:
        eos = tokenizer["eos_id"]
        ok = lengths > 0
        ok[ok] = values[ends[ok] - 1] == eos
        if not bool(ok.all()):
            doc = a + int(np.argmin(ok))
            raise MegatronError(f"{index.bin_path}: {unit} {doc} does not end with the EOS id {eos}; leave out "
                                "--append_eos (it records that every document ends with EOS)")
    starts = np.concatenate([[0], ends[:-1]]) if len(lengths) else np.zeros(0, np.int64)
    item = index.dtype.itemsize
    first_ptr = int(index.sequence_pointers[bounds[0]]) if bounds[0] < index.num_sequences else index.bin_size
    offsets = first_ptr + starts * item
    parquet = ChunkParquet(config)
    lo = 0
    for hi in _row_group_ends(lengths, int(config["row_group_tokens"])):
        t0, t1 = int(starts[lo]), int(ends[hi - 1])
        parquet.write(flat_row_group_table(values[t0:t1], lengths[lo:hi].astype(np.int32), shard, offsets[lo:hi]),
                      t1 - t0)
        lo = hi
    data, rg_index, footer = parquet.finish()
    byte_range = [k * cb, min((k + 1) * cb, index.bin_size)]
    sidecar = make_sidecar(shard=shard, index_in_shard=k, byte_range=byte_range, data=data, row_group_index=rg_index,
                           footer=footer, docs=b - a, tokens=int(values.size))
    _write_atomic(fs, fmt.join(root, fmt.chunk_path(shard, k)), data)
    _write_atomic(fs, fmt.join(root, fmt.sidecar_path(shard, k)), fmt.sidecar_bytes(sidecar))
    return sidecar


def plan(prefixes: Sequence[str], tokenizer_spec: str, *, unit: str = "document", append_eos: bool = False,
         chunk_tokens: int = DEFAULT_CHUNK_TOKENS, row_group_tokens: int = DEFAULT_ROW_GROUP_TOKENS,
         compression: str = "zstd", compression_level: int | None = 3) -> tuple[dict[str, Any], list[MegatronIndex]]:
    """The plan ledger of an import and the checked indexes of its shards (raises naming the bad file)."""
    if chunk_tokens <= 0 or row_group_tokens <= 0:
        raise ImportMegatronError("--chunk_tokens and --row_group_tokens must be positive")
    if not prefixes:
        raise ImportMegatronError("give at least one PREFIX (PREFIX.bin + PREFIX.idx)")
    tok = tokenizer_id.identity(tokenizer_spec)
    if append_eos and tok["eos_id"] is None:
        raise ImportMegatronError(f"--append_eos: tokenizer {tokenizer_spec!r} has no end-of-sequence token")
    paths = sorted({os.path.abspath(os.path.expanduser(p[:-4] if p.endswith((".bin", ".idx")) else p))
                    for p in prefixes})
    indexes = [MegatronIndex.open(p) for p in paths]
    for ix in indexes:
        check_dtype(ix, tok)
    dtypes = {ix.dtype.name for ix in indexes}
    if len(dtypes) > 1:
        raise ImportMegatronError(f"the inputs have different dtypes ({', '.join(sorted(dtypes))}); import each dtype into "
                           "its own cache")
    dt = indexes[0].dtype
    chunk_bytes = chunk_tokens * dt.itemsize
    config = {
        "text_key": None, "append_eos": bool(append_eos), "chunk_bytes": chunk_bytes,
        "row_group_tokens": int(row_group_tokens), "compression": compression,
        "compression_level": compression_level if compression in ("zstd", "gzip", "brotli") else None,
        "token_encoding": "PLAIN", "piece_chars": None, "max_piece_chars": None,
        "source": {"format": "megatron", "dtype": dt.name, "unit": unit},
    }
    inputs = [{"shard": i, "path": ix.bin_path, "size": ix.bin_size, "compression": "none",
               "chunks": num_chunks(ix, unit, chunk_bytes), "index": ix.idx_path, "index_size": ix.idx_size}
              for i, ix in enumerate(indexes)]
    ledger = {"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "finished": False, "tokenizer": tok,
              "config": config, "inputs": inputs, "chunks": [], "totals": {}, "bad_records": {}}
    return ledger, indexes


def _same_import(old: dict[str, Any], new: dict[str, Any]) -> bool:
    keys = ("path", "size", "index", "index_size")
    return (fmt.config_fingerprint(old.get("tokenizer", {}), old.get("config", {}))
            == fmt.config_fingerprint(new["tokenizer"], new["config"])
            and [[i.get(k) for k in keys] for i in old.get("inputs", [])]
            == [[i[k] for k in keys] for i in new["inputs"]])


def import_megatron(prefixes: Sequence[str], tokenizer_spec: str, out: str, *, threads: int = 2,
                    **options) -> dict[str, Any]:
    """Write the cache ``out`` from Megatron datasets; returns the finished ledger.

    Args:
      prefixes: paths without ``.bin``/``.idx`` (local files).
      tokenizer_spec: the tokenizer the data was made with (``tiktoken:...`` or a tokenizer.json / directory).
      out: the cache root to create (local or any fsspec URL). An unfinished import of the same inputs
        there is redone; a finished one is left as it is; anything else is refused.
      threads: chunks written in parallel.
      options: ``unit``, ``append_eos``, ``chunk_tokens``, ``row_group_tokens``, ``compression``,
        ``compression_level`` (see :func:`plan`).
    """
    ledger, indexes = plan(prefixes, tokenizer_spec, **options)
    fs, root = output_fs(out.rstrip("/") + "/" + fmt.LEDGER_NAME)
    root = root.rsplit("/", 1)[0]
    ledger_path = fmt.join(root, fmt.LEDGER_NAME)
    if fs.exists(ledger_path):
        try:
            old = fmt.Ledger.parse(fs.cat_file(ledger_path), where=ledger_path).raw
        except fmt.FormatError as e:
            raise ImportMegatronError(f"{e}. Use another --out or delete {out}") from e
        if not _same_import(old, ledger):
            raise ImportMegatronError(f"{out} already holds a different cache (other inputs, tokenizer or options). Use "
                               f"another --out, or delete {out} to import again.")
        if old.get("finished"):
            return old
    elif fs.exists(root) and fs.ls(root):
        raise ImportMegatronError(f"{out} exists and is not empty (and holds no ledger.json); choose an empty or new --out")
    _write_atomic(fs, ledger_path, fmt.dumps_ledger(ledger).encode())
    cfg, tok = ledger["config"], ledger["tokenizer"]
    jobs = []
    for shard, ix in enumerate(indexes):
        bounds = chunk_doc_bounds(ix, cfg["source"]["unit"], cfg["chunk_bytes"])
        jobs += [(shard, k, (int(bounds[k]), int(bounds[k + 1]))) for k in range(len(bounds) - 1)]
    with cf.ThreadPoolExecutor(max(1, threads)) as pool:
        futures = {(s, k): pool.submit(_write_chunk, fs, root, indexes[s], s, k, docs, tok, cfg)
                   for s, k, docs in jobs}
        sidecars = {key: f.result() for key, f in futures.items()}
    for tmp in fs.glob(fmt.join(root, f"{fmt.CHUNKS_DIR}/*/{TMP_PREFIX}*")) + fs.glob(fmt.join(root, TMP_PREFIX + "*")):
        remove_quietly(fs, tmp)  # left by an interrupted run
    order = round_robin_order([inp["chunks"] for inp in ledger["inputs"]])
    chunks, bad = ledger_chunks(sidecars[(int(s), int(k))] for s, k in order)
    inputs = [dict(inp, uncompressed_bytes=inp["size"]) for inp in ledger["inputs"]]
    ledger.update(finished=True, inputs=inputs, chunks=chunks, bad_records=bad, totals={
        "docs": sum(c["docs"] for c in chunks), "tokens": sum(c["tokens"] for c in chunks), "chunks": len(chunks),
        "bytes": sum(c["bytes"] for c in chunks), "input_bytes": sum(i["size"] for i in inputs),
        "uncompressed_bytes": sum(i["size"] for i in inputs), "bad_records": 0})
    _write_atomic(fs, ledger_path, fmt.dumps_ledger(ledger).encode())
    return ledger


# --------------------------------------------------------------------------------------------------
# Command line


def add_parser(sub) -> None:
    """The ``import-megatron`` subcommand of ``python -m reader``."""
    m = sub.add_parser(
        "import-megatron", help="turn Megatron .bin/.idx datasets into a chunkledger cache (no re-tokenizing)",
        description="Write a chunkledger cache from Megatron-Core / Megatron-LM indexed datasets (PREFIX.bin + "
                    "PREFIX.idx, as tools/preprocess_data.py writes them). Each .bin is an input shard (sorted by "
                    "path), each document a document, chunks of about --chunk_tokens tokens; the ledger records "
                    "the tokenizer as the builder does for the same spec. Token ids are checked against it. "
                    "Rerun the same command after a crash. See docs/INTEROP.md.")
    m.add_argument("prefixes", nargs="+", metavar="PREFIX", help="dataset path without .bin/.idx (local)")
    m.add_argument("--tokenizer", required=True, metavar="SPEC",
                   help="the tokenizer the data was made with: 'tiktoken:<encoding>', or a tokenizer.json file or "
                        "a directory holding one (recorded in the ledger, as the builder records it)")
    m.add_argument("--out", required=True, metavar="CACHE", help="cache root to create (local or gs://...)")
    m.add_argument("--append_eos", action="store_true",
                   help="the documents end with the tokenizer's EOS (Megatron's --append-eod); checked, and "
                        "recorded as config.append_eos")
    m.add_argument("--unit", choices=["document", "sequence"], default="document",
                   help="what becomes a chunkledger document: a Megatron document (its sequences joined; "
                        "default) or each sequence (data made with --split-sentences)")
    m.add_argument("--chunk_tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help=f"tokens per chunk, about (default {DEFAULT_CHUNK_TOKENS}); chunk_bytes = this x token size")
    m.add_argument("--row_group_tokens", type=int, default=DEFAULT_ROW_GROUP_TOKENS,
                   help=f"cut a Parquet row group once it holds this many tokens (default {DEFAULT_ROW_GROUP_TOKENS})")
    m.add_argument("--threads", type=int, default=2, help="chunks written in parallel (default 2)")
    m.set_defaults(fn=cmd_import)


def cmd_import(args) -> int:
    ledger = import_megatron(args.prefixes, args.tokenizer, args.out, threads=args.threads, unit=args.unit,
                             append_eos=args.append_eos, chunk_tokens=args.chunk_tokens,
                             row_group_tokens=args.row_group_tokens)
    t = ledger["totals"]
    print(f"wrote {args.out}: {t['docs']:,} documents, {t['tokens']:,} tokens, {t['chunks']:,} chunks from "
          f"{len(ledger['inputs'])} Megatron dataset(s); tokenizer {ledger['tokenizer']['spec']} "
          f"(vocab_size {ledger['tokenizer']['vocab_size']})")
    return 0
