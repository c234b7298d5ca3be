"""The on-disk format of a chunkledger cache: names, schema, ledger and checksums.

This module is the single definition of the format (``docs/FORMAT.md`` is its prose twin). Both the
pipeline (writer) and the reader import it; it depends only on the standard library, numpy and pyarrow.

Layout of a cache rooted at ``ROOT``::

    ROOT/ledger.json                                  the ledger (written at start with finished=false,
                                                      rewritten atomically with finished=true at the end)
    ROOT/chunks/shard-SSSSS/chunk-KKKKKK.parquet      chunk K of input shard S
    ROOT/chunks/shard-SSSSS/chunk-KKKKKK.json         its sidecar (written after the parquet is in place)
    ROOT/chunks/shard-SSSSS/_DONE.json                compressed shards only: {"chunks": n, ...}
    ROOT/bad/shard-SSSSS/chunk-KKKKKK.jsonl           dead-lettered records of that chunk's byte range

A chunk's sidecar, its keys and the checks that a chunk's files agree with it: :mod:`reader.format.sidecar`.

Chunk K of shard S holds, in file order, every line of S whose first byte lies in the *uncompressed*
byte range ``[K * chunk_bytes, (K + 1) * chunk_bytes)``. A shard of U uncompressed bytes therefore has
exactly ``ceil(U / chunk_bytes)`` chunks (some may hold zero documents), a pure function of its bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from reader.format import checks
from reader.format.checks import load_json

FORMAT_NAME = "chunkledger"
FORMAT_VERSION = 4  # the version every new build writes (docs/FORMAT.md, "Versions")
# What builders before version 4 wrote for a cache that used nothing version 3 added (inputs other than JSON
# Lines, kept fields, loss masks); a rerun of such a cache keeps writing it.
BASE_FORMAT_VERSION = 2
# Versions this code reads: they differ for a reader only in optional columns (fields, loss_spans) and, from
# TABLE_VERSION on, in three things that came together (docs/FORMAT.md, "Versions"): the chunk table
# (reader/format/table.py), the default pass rule ("spans"; older caches keep "streams") and best fit's default
# continuation pieces (older caches keep one per row).
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4)
TABLE_VERSION = 4


def written_version(resumed: int | None) -> int:
    """The format version a build writes: :data:`FORMAT_VERSION` for a new cache (``resumed`` None); a rerun
    of a cache of an older version keeps that version (its bytes, and so its batches, stay what they were),
    an unfinished version 1 build becoming version 2 as before (it is rebuilt whole)."""
    if resumed is None or resumed >= FORMAT_VERSION:
        return FORMAT_VERSION
    return max(int(resumed), BASE_FORMAT_VERSION)


LEDGER_NAME = "ledger.json"
CHUNKS_DIR = "chunks"
BAD_DIR = "bad"
SHARD_DONE_NAME = "_DONE.json"
TMP_PREFIX = ".tmp-"  # a file being written, or a crashed writer's leftover: readers ignore it
LOCK_NAME = "_BUILDING.json"  # the builder's lock, held while a launcher runs
FAILED_NAME = "_FAILED.json"  # why a build stopped (its verdict), if it did

# Parquet columns of a chunk. One row per document, in file order.
TOKEN_COLUMN = "token_ids"  # list<int32>: the document's token ids (EOS appended if configured)
LENGTH_COLUMN = "num_tokens"  # int32: len(token_ids); lets readers size documents without decoding tokens
SHARD_COLUMN = "shard"  # int32: input shard index (provenance)
OFFSET_COLUMN = "offset"  # int64: byte offset of the line's first byte in the uncompressed shard
# Supervised caches only (``config.record_format`` other than "text"): list<int32>, the document's loss
# tokens as sorted, disjoint, non-empty half-open ranges flattened, ``[s0, e0, s1, e1, ...]``. The fifth
# column (index 4), before ``fields``.
LOSS_COLUMN = "loss_spans"

CHUNK_SCHEMA = pa.schema(
    [
        pa.field(TOKEN_COLUMN, pa.list_(pa.field("element", pa.int32(), nullable=False)), nullable=False),
        pa.field(LENGTH_COLUMN, pa.int32(), nullable=False),
        pa.field(SHARD_COLUMN, pa.int32(), nullable=False),
        pa.field(OFFSET_COLUMN, pa.int64(), nullable=False),
    ]
)

MASKED_CHUNK_SCHEMA = CHUNK_SCHEMA.append(
    pa.field(LOSS_COLUMN, pa.list_(pa.field("element", pa.int32(), nullable=False)), nullable=False))
# ``config.record_format`` of a cache without loss masks (absent means the same)
PLAIN_RECORD_FORMAT = "text"

# --keep_fields: one more column, a struct of the kept fields (nullable strings, in config.keep_fields order).
# Batches never read it; Cache.fields and `inspect --by` do.
FIELDS_COLUMN = "fields"


def is_masked(config: Mapping[str, Any]) -> bool:
    """Whether a cache with ledger ``config`` has the ``loss_spans`` column: any record format but text."""
    return config.get("record_format", PLAIN_RECORD_FORMAT) != PLAIN_RECORD_FORMAT


def chunk_schema(keep_fields: Sequence[str] = (), masked: bool = False) -> pa.Schema:
    """The schema of a chunk of a cache built with ``config.keep_fields`` and, if ``masked``, loss masks
    (CHUNK_SCHEMA when neither)."""
    schema = MASKED_CHUNK_SCHEMA if masked else CHUNK_SCHEMA
    if not keep_fields:
        return schema
    return schema.append(pa.field(FIELDS_COLUMN, pa.struct([pa.field(n, pa.string()) for n in keep_fields]),
                                  nullable=False))


# Key in a chunk's Parquet key-value metadata: JSON list of token counts per row group, so a reader can
# decode only the row groups a token range needs.
ROW_GROUP_TOKENS_KEY = b"chunkledger.row_group_tokens"


class FormatError(ValueError):
    """A cache does not match its ledger, or a ledger is not one this version can read."""


class DamagedCache(FormatError):
    """A file of a cache (its ledger, a sidecar, a chunk) is damaged or disagrees with the others; the
    message names it, and ``python -m reader validate`` lists every such problem."""


# --------------------------------------------------------------------------------------------------
# Names


def shard_dir(shard: int) -> str:
    return f"{CHUNKS_DIR}/shard-{shard:05d}"


def chunk_path(shard: int, index_in_shard: int) -> str:
    """Relative path of chunk ``index_in_shard`` of input shard ``shard``."""
    return f"{shard_dir(shard)}/chunk-{index_in_shard:06d}.parquet"


def sidecar_path(shard: int, index_in_shard: int) -> str:
    return f"{shard_dir(shard)}/chunk-{index_in_shard:06d}.json"


def shard_done_path(shard: int) -> str:
    return f"{shard_dir(shard)}/{SHARD_DONE_NAME}"


def dead_letter_path(shard: int, index_in_shard: int) -> str:
    return f"{BAD_DIR}/shard-{shard:05d}/chunk-{index_in_shard:06d}.jsonl"


def join(root: str, rel: str) -> str:
    return root.rstrip("/") + "/" + rel


def temp_patterns(root: str) -> tuple[str, ...]:
    """Glob patterns of every place in the cache at ``root`` where a writer leaves temporary files."""
    return tuple(join(root, f"{d}{TMP_PREFIX}*") for d in ("", f"{CHUNKS_DIR}/*/", f"{BAD_DIR}/*/"))


def compression_of(path: str) -> str:
    """The compression implied by an input file name."""
    if path.endswith(".gz"):
        return "gzip"
    if path.endswith(".zst") or path.endswith(".zstd"):
        return "zstd"
    return "none"


def num_chunks(uncompressed_bytes: int, chunk_bytes: int) -> int:
    """Number of chunks of a shard: one per started ``chunk_bytes`` of uncompressed input."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return math.ceil(uncompressed_bytes / chunk_bytes)


# --------------------------------------------------------------------------------------------------
# Checksums and deterministic JSON


def checksum(data: bytes | memoryview) -> str:
    """Checksum of a chunk file's bytes, as stored in the ledger."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def dumps(obj: Any) -> str:
    """Deterministic JSON: sorted keys, no NaN, trailing newline."""
    return json.dumps(obj, sort_keys=True, indent=1, allow_nan=False, ensure_ascii=False) + "\n"


def dumps_ledger(ledger: Mapping[str, Any]) -> str:
    """Ledger JSON: one top-level key per line, one chunk per line (readable, diffable, fast to parse)."""

    def enc(v: Any) -> str:
        return json.dumps(v, sort_keys=True, allow_nan=False, ensure_ascii=False)

    parts = []
    for key in sorted(ledger):
        value = ledger[key]
        if key == "chunks" and value:
            body = "[\n" + ",\n".join("  " + enc(c) for c in value) + "\n ]"
        else:
            body = enc(value)
        parts.append(f" {enc(key)}: {body}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


# --------------------------------------------------------------------------------------------------
# The ledger


@dataclasses.dataclass(frozen=True)
class ChunkTable:
    """Per-chunk metadata in global order, as numpy arrays (one entry per chunk, never per document)."""

    paths: list[str]
    checksums: list[str]
    shard: np.ndarray  # int32
    index_in_shard: np.ndarray  # int32
    docs: np.ndarray  # int64
    tokens: np.ndarray  # int64
    nbytes: np.ndarray  # int64, file size
    sidecar_checksums: list | None = None  # finished ledger: sha256 of each sidecar file (None entries: unknown)
    loss_tokens: np.ndarray | None = None  # int64, a cache with loss masks: each chunk's loss tokens

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def doc_offsets(self) -> np.ndarray:
        """Cumulative document counts, length N+1: chunk c holds documents [off[c], off[c+1])."""
        return np.concatenate([[0], np.cumsum(self.docs, dtype=np.int64)])

    @property
    def token_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.tokens, dtype=np.int64)])

    @staticmethod
    def from_entries(entries: Sequence[Mapping[str, Any]], num_inputs: int | None = None) -> "ChunkTable":
        """The table of chunk entries (a finished ledger's, or sidecars), checked: raises ``ValueError``
        naming the first bad entry (its number in ``entries``) for a missing key, an integer out of range
        (a shard outside ``num_inputs``, a count above :data:`MAX_COUNT`), or a path (or dead-letter path)
        other than the one the format defines for the entry's shard and index."""
        n = len(entries)
        try:
            paths = [e["path"] for e in entries]
            checksums = [e["checksum"] for e in entries]
            ints = {key: np.fromiter((e[key] for e in entries), dtype=np.int64, count=n)
                    for key in ("shard", "index_in_shard", "docs", "tokens", "bytes")}
            loss = (np.fromiter((e["loss_tokens"] for e in entries), dtype=np.int64, count=n)
                    if n and all("loss_tokens" in e for e in entries) else None)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            i, what = checks.first_malformed(entries)
            raise ValueError(f"chunk entry {i}: {what or repr(e)}") from None
        wrong = checks.ranges_problem(entries, ints, num_inputs)
        if wrong:
            raise ValueError(wrong)
        _check_paths(entries, paths, ints["shard"], ints["index_in_shard"])
        return ChunkTable(
            paths=paths,
            checksums=checksums,
            shard=ints["shard"].astype(np.int32),
            index_in_shard=ints["index_in_shard"].astype(np.int32),
            docs=ints["docs"],
            tokens=ints["tokens"],
            nbytes=ints["bytes"],
            sidecar_checksums=[e.get("sidecar_checksum") for e in entries],
            loss_tokens=loss,
        )


def _check_paths(entries: Sequence[Mapping[str, Any]], paths: list, shard: np.ndarray, index: np.ndarray) -> None:
    """Every entry's path (and dead-letter path) is exactly the one the format defines for its shard and
    index, compared as strings: so no ledger or sidecar can make a reader open a file outside the cache
    (resolving links for 100k chunks would cost more than opening the ledger)."""
    s_list, k_list = shard.tolist(), index.tolist()
    # chunk_path(s, k), assembled from each distinct shard's and index's part (5x faster for 100k chunks)
    head = {s: shard_dir(s) + "/chunk-" for s in set(s_list)}
    tail = {k: f"{k:06d}.parquet" for k in set(k_list)}
    if [head[s] + tail[k] for s, k in zip(s_list, k_list)] != paths:
        i = next(i for i, (p, s, k) in enumerate(zip(paths, s_list, k_list)) if p != chunk_path(s, k))
        s, k = s_list[i], k_list[i]
        raise ValueError(f"chunk entry {i}: path {checks.short(paths[i], 200)}, the format's path of shard {s} "
                         f"chunk {k} is {chunk_path(s, k)!r}")
    for i, dl in enumerate(e.get("dead_letters") for e in entries):
        s, k = s_list[i], k_list[i]
        if dl is not None and dl != dead_letter_path(s, k):
            raise ValueError(f"chunk entry {i}: dead_letters {checks.short(dl, 200)}, the format's path of the dead "
                             f"letters of shard {s} chunk {k} is {dead_letter_path(s, k)!r}")


@dataclasses.dataclass(frozen=True)
class Ledger:
    """A parsed ``ledger.json``. ``chunks`` is empty until the build has finished."""

    raw: Mapping[str, Any]
    chunks: ChunkTable

    @property
    def finished(self) -> bool:
        return bool(self.raw.get("finished", False))

    @property
    def format_version(self) -> int:
        return int(self.raw["format_version"])

    @property
    def tokenizer(self) -> Mapping[str, Any]:
        return self.raw["tokenizer"]

    @property
    def config(self) -> Mapping[str, Any]:
        return self.raw["config"]

    @property
    def inputs(self) -> list[Mapping[str, Any]]:
        return list(self.raw["inputs"])

    @property
    def totals(self) -> Mapping[str, Any]:
        return self.raw.get("totals", {})

    @property
    def masked(self) -> bool:
        """True for a cache whose chunks carry loss masks (``loss_spans``)."""
        return is_masked(self.config)

    @staticmethod
    def parse(text: str | bytes, *, where: str = LEDGER_NAME) -> "Ledger":
        try:
            raw = load_json(text)
        except ValueError as e:
            raise DamagedCache(f"{where}: not valid JSON ({e}); the file is damaged or half-written") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise DamagedCache(f"{where}: not a chunkledger ledger (missing \"format\": \"{FORMAT_NAME}\")")
        version = raw.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS:
            raise FormatError(
                f"{where}: format_version {version!r}, this reader reads "
                f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}; "
                "upgrade chunkledger or rebuild the cache"
            )
        for key in ("tokenizer", "config", "inputs"):
            if key not in raw:
                raise DamagedCache(f"{where}: missing required key {key!r}")
        fix = "the ledger is damaged or was edited: restore it, or rebuild the cache"
        wrong = checks.header_problem(raw)
        if wrong:
            raise DamagedCache(f"{where}: {wrong}; {fix}")
        try:
            table = ChunkTable.from_entries(raw.get("chunks", []), num_inputs=len(raw["inputs"]))
        except ValueError as e:
            raise DamagedCache(f"{where}: {e}; {fix}") from None
        return Ledger(raw=raw, chunks=table)


def chunk_input_bytes(entry: Mapping[str, Any], size: int, rows: int | None = None) -> int:
    """How much of its input file a chunk's entry (ledger or sidecar) covers, for progress: its byte range
    (uncompressed bytes), or, for a columnar chunk (``row_range``), its rows' share of the file's ``size``
    bytes (``rows``: the file's rows)."""
    br = entry.get("byte_range")
    if br is not None:
        return max(0, int(br[1]) - int(br[0]))
    rr = entry.get("row_range")
    if rr is None or not rows:
        return 0
    return int(size) * max(0, int(rr[1]) - int(rr[0])) // int(rows)


def config_fingerprint(tokenizer: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    """What must match for a rerun to resume into an existing cache (tokenizer identity + chunking config)."""
    return hashlib.sha256(dumps({"tokenizer": tokenizer, "config": config}).encode()).hexdigest()
