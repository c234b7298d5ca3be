"""Per-document attributes beside a cache's chunks: attribute sets (docs/FORMAT.md, "Attribute sets").

An attribute set is one Parquet file per chunk, each with one row per document of its chunk (in the chunk's
order), and a manifest written last. It is added to a finished cache without touching its chunks, ledger or
sidecars, and depends on the cache only through the chunks' checksums (recorded in the manifest and in each
file), so a set computed from another build of the cache is refused. Layout::

    ROOT/attributes/NAME/manifest.json                          the commit: written after every file below
    ROOT/attributes/NAME/shard-SSSSS/chunk-KKKKKK.parquet       the attributes of chunk K of shard S

The chain of checksums: ``manifest.json`` names the cache it was computed from (its fingerprint,
:func:`reader.format.table.fingerprint`, as the index files') and, per chunk in global order, its attribute file's size and sha256 and counts;
each file's Parquet key-value metadata names its chunk's checksum, its document count and the set. A file is
verified before anything of it is used (:func:`read_chunk`). Writers: ``pipelines/dedup/`` (duplicate marks).

Standard library, numpy and pyarrow only.
"""

from __future__ import annotations

import dataclasses
import io
import re
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reader.format import checks
from reader.format import spec as fmt
from reader.format import table as chunk_table

ATTRIBUTES_DIR = "attributes"
MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "chunkledger-attributes"
FORMAT_VERSION = 1  # the manifest's and files' own version (attribute sets are part of cache format 4)
READABLE_VERSIONS = (1,)
FILE_KEY = b"chunkledger.attributes"  # Parquet key-value metadata of every attribute file
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")

# Kinds of attribute sets and their columns, in file order: (name, Parquet type). A kept document has
# ``keeper`` -1; a marked one the global index of the document it duplicates, which precedes it in the
# global order (and ``jaccard`` its estimated Jaccard similarity with it; 0.0 for a kept document).
EXACT = "exact_duplicates"
NEAR = "near_duplicates"
KINDS: dict[str, tuple[tuple[str, str], ...]] = {
    EXACT: (("keeper", "int64"),),
    NEAR: (("keeper", "int64"), ("jaccard", "float32")),
}
KEPT = -1
# Per chunk in the manifest, in this order: attribute file size and sha256, marked documents and their tokens.
CHUNK_FIELDS = ("bytes", "checksum", "marked", "marked_tokens")


def set_dir(name: str) -> str:
    """``attributes/NAME``, relative to the cache root."""
    return f"{ATTRIBUTES_DIR}/{name}"


def manifest_path(name: str) -> str:
    return f"{set_dir(name)}/{MANIFEST_NAME}"


def file_path(name: str, shard: int, index_in_shard: int) -> str:
    """The attribute file of chunk ``index_in_shard`` of shard ``shard`` in the set ``name``."""
    return f"{set_dir(name)}/shard-{shard:05d}/chunk-{index_in_shard:06d}.parquet"


def schema(kind: str) -> pa.Schema:
    """The Parquet schema of an attribute file of ``kind`` (columns not nullable)."""
    return pa.schema([pa.field(n, pa.type_for_alias(t), nullable=False) for n, t in KINDS[kind]])


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"attribute set name {checks.short(name)}: use 1 to 64 of a-z, 0-9 and _, starting "
                         "with a letter")
    return name


# --------------------------------------------------------------------------------------------------
# Writing


def file_meta(name: str, kind: str, params_hash: str, chunk_checksum: str, docs: int) -> dict[str, Any]:
    """The key-value metadata an attribute file carries: what it belongs to."""
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "set": name, "kind": kind,
            "params": params_hash, "chunk_checksum": chunk_checksum, "docs": int(docs)}


def file_bytes(kind: str, columns: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> bytes:
    """The bytes of one attribute file: ``columns`` (each of the chunk's length, named as ``KINDS[kind]``)
    in one row group, zstd, no statistics or dictionary; a pure function of its arguments (and pyarrow's
    version, as for chunks)."""
    sch = schema(kind)
    arrays = [pa.array(np.asarray(columns[n], dtype=t), type=pa.type_for_alias(t)) for n, t in KINDS[kind]]
    buf = io.BytesIO()
    with pq.ParquetWriter(buf, sch, compression="zstd", use_dictionary=False, write_statistics=False,
                          store_schema=False) as w:
        w.write_table(pa.Table.from_arrays(arrays, schema=sch), row_group_size=max(1, int(meta["docs"])))
        w.add_key_value_metadata({FILE_KEY: fmt.dumps(dict(meta))})
    return buf.getvalue()


def manifest(name: str, kind: str, params: Mapping[str, Any], table: fmt.ChunkTable,
             chunks: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """The manifest of a set over the cache of chunk table ``table``; ``chunks``: per chunk in global order,
    its ``CHUNK_FIELDS``."""
    docs = int(table.docs.sum())
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "name": check_name(name), "kind": kind,
        "columns": [list(c) for c in KINDS[kind]], "params": dict(params), "params_hash": params_hash(params),
        "cache": {"fingerprint": chunk_table.fingerprint(table), "chunks": len(table), "docs": docs},
        "chunk_fields": list(CHUNK_FIELDS), "chunks": [list(c) for c in chunks],
        "totals": {"docs": int(docs), "marked": int(sum(c[2] for c in chunks)),
                   "marked_tokens": int(sum(c[3] for c in chunks))},
    }


def params_hash(params: Mapping[str, Any]) -> str:
    """``sha256:`` of a set's parameters (deterministic JSON): files and manifest of one computation share it."""
    return fmt.checksum(fmt.dumps(dict(params)).encode())


def manifest_bytes(m: Mapping[str, Any]) -> bytes:
    """The manifest file: one key per line, one chunk per line (as the ledger)."""
    return fmt.dumps_ledger(m).encode()


# --------------------------------------------------------------------------------------------------
# Reading and checking


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A parsed, checked ``manifest.json``: per chunk in global order its file's ``nbytes`` and
    ``checksums``, and ``marked`` documents and ``marked_tokens`` (int64 arrays)."""

    raw: Mapping[str, Any]
    name: str
    kind: str
    nbytes: np.ndarray
    checksums: list[str]
    marked: np.ndarray
    marked_tokens: np.ndarray

    @property
    def fingerprint(self) -> str:
        return self.raw["cache"]["fingerprint"]

    @property
    def params_hash(self) -> str:
        return self.raw["params_hash"]

    @staticmethod
    def parse(text: str | bytes, *, where: str) -> "Manifest":
        """Parse and check a manifest (``where`` names it in errors: ``DamagedCache``, or ``FormatError``
        for a version this code does not read)."""
        fix = "the attribute set is damaged or was edited: remove its directory and compute it again"
        try:
            raw = checks.load_json(text)
        except ValueError as e:
            raise fmt.DamagedCache(f"{where}: not valid JSON ({e}); {fix}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise fmt.DamagedCache(f"{where}: not an attribute manifest (missing \"format\": \"{FORMAT_NAME}\")")
        if raw.get("format_version") not in READABLE_VERSIONS:
            raise fmt.FormatError(f"{where}: format_version {checks.short(raw.get('format_version'))}, this code "
                                  f"reads {', '.join(map(str, READABLE_VERSIONS))}; upgrade chunkledger")
        wrong = _manifest_problem(raw)
        if wrong:
            raise fmt.DamagedCache(f"{where}: {wrong}; {fix}")
        rows = raw["chunks"]
        ints = np.asarray([[r[0], r[2], r[3]] for r in rows], dtype=np.int64).reshape(-1, 3)
        return Manifest(raw=raw, name=raw["name"], kind=raw["kind"], nbytes=ints[:, 0],
                        checksums=[r[1] for r in rows], marked=ints[:, 1], marked_tokens=ints[:, 2])

    def check_cache(self, table: fmt.ChunkTable, *, where: str) -> None:
        """Refuse a set computed from another cache (or another build of this one) than ``table``'s."""
        cache = self.raw["cache"]
        got = chunk_table.fingerprint(table)
        if cache["fingerprint"] != got or cache["chunks"] != len(table):
            raise fmt.DamagedCache(
                f"{where}: computed from another build of this cache ({cache['chunks']} chunks, fingerprint "
                f"{cache['fingerprint'][:12]}...; the ledger has {len(table)} chunks, fingerprint "
                f"{got[:12]}...): compute the set again")
        if (self.marked > table.docs).any():
            c = int(np.flatnonzero(self.marked > table.docs)[0])
            raise fmt.DamagedCache(f"{where}: chunk {c} has {int(self.marked[c])} marked documents of "
                                   f"{int(table.docs[c])}")


def _manifest_problem(raw: Mapping[str, Any]) -> str | None:
    kind, name, rows = raw.get("kind"), raw.get("name"), raw.get("chunks")
    if kind not in KINDS:
        return f"kind {checks.short(kind)} is not one of {', '.join(KINDS)}"
    if not isinstance(name, str) or not NAME_RE.match(name):
        return f"name {checks.short(name)} is not a set name"
    if raw.get("columns") != [list(c) for c in KINDS[kind]] or raw.get("chunk_fields") != list(CHUNK_FIELDS):
        return f"columns or chunk_fields are not those of a {kind} set"
    cache, params = raw.get("cache"), raw.get("params")
    if not isinstance(cache, dict) or not isinstance(cache.get("fingerprint"), str) or not isinstance(params, dict):
        return "cache must be an object with a fingerprint, params an object"
    if raw.get("params_hash") != params_hash(params):
        return "params_hash is not the hash of params"
    if not checks.is_int(cache.get("chunks"), 0, checks.MAX_TOTAL) or not isinstance(rows, list) \
            or len(rows) != cache["chunks"]:
        return "chunks must list one entry per chunk of the cache"
    for i, r in enumerate(rows):
        if not (isinstance(r, list) and len(r) == len(CHUNK_FIELDS) and checks.is_int(r[0], 0, checks.MAX_COUNT)
                and isinstance(r[1], str) and r[1].startswith("sha256:") and checks.is_int(r[2], 0, checks.MAX_COUNT)
                and checks.is_int(r[3], 0, checks.MAX_COUNT)):
            return f"chunk entry {i} is not [bytes, \"sha256:...\", marked, marked_tokens]"
    return None


def read_chunk(data: bytes, m: Manifest, table: fmt.ChunkTable, c: int, *, where: str) -> dict[str, np.ndarray]:
    """The verified columns of chunk ``c``'s attribute file ``data`` (numpy arrays, one value per document of
    the chunk, in its order). Raises ``DamagedCache`` naming ``where`` if the bytes are not the ones the
    manifest records, if the file belongs to another chunk, set or computation, or if a value is out of range
    (a keeper must precede its document in the global order; a Jaccard lies in [0, 1])."""
    fix = "compute the set again (python -m pipelines.dedup)"
    if len(data) != int(m.nbytes[c]) or fmt.checksum(data) != m.checksums[c]:
        raise fmt.DamagedCache(f"{where}: its size or sha256 is not the one {MANIFEST_NAME} records (edited or "
                               f"damaged); {fix}")
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        meta = checks.load_json((pf.metadata.metadata or {})[FILE_KEY])
        got = pf.read()
    except (KeyError, ValueError, OSError, pa.ArrowException) as e:
        raise fmt.DamagedCache(f"{where}: not a readable attribute file ({e}); {fix}") from None
    docs = int(table.docs[c])
    want = {"set": m.name, "kind": m.kind, "params": m.params_hash, "chunk_checksum": table.checksums[c], "docs": docs}
    wrong = [k for k, v in want.items() if not isinstance(meta, dict) or meta.get(k) != v]
    if wrong or not got.schema.equals(schema(m.kind)) or got.num_rows != docs:
        raise fmt.DamagedCache(f"{where}: belongs to another chunk, set or computation ({', '.join(wrong) or 'schema'}"
                               f" differ; {got.num_rows} rows for {docs} documents); {fix}")
    cols = {n: got.column(n).to_numpy() for n, _ in KINDS[m.kind]}
    first = int(table.doc_offsets[c]) if c else 0
    keeper = cols["keeper"]
    own = np.arange(first, first + docs, dtype=np.int64)
    bad = (keeper < KEPT) | ((keeper != KEPT) & (keeper >= own))
    if "jaccard" in cols:
        j = cols["jaccard"]
        bad |= ~((j >= 0) & (j <= 1)) | ((keeper == KEPT) & (j != 0))
    if bad.any() or int((keeper != KEPT).sum()) != int(m.marked[c]):
        row = int(np.flatnonzero(bad)[0]) if bad.any() else None
        what = (f"row {row} (document {first + row}) has keeper {int(keeper[row])}" if row is not None
                else f"{int((keeper != KEPT).sum())} marked documents, the manifest says {int(m.marked[c])}")
        raise fmt.DamagedCache(f"{where}: {what}; {fix}")
    return cols
