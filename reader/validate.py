"""Checking chunk files against the ledger: :class:`ChunkError`, whole-file checks, ``validate``.

Every check of a chunk (the store's per-row-group checks, :func:`parse_chunk` on a whole file, and
:func:`validate_chunk` behind ``python -m reader validate``) reports a mismatch as a :class:`ChunkError`
that names the file and says how to repair it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import format as fmt
from .cache import Cache
from .pages import int_values


class ChunkError(fmt.FormatError):
    """A chunk file is missing, truncated, corrupted, or does not match its ledger entry."""


def chunk_error(cache: Cache, rel: str, what: str) -> ChunkError:
    return ChunkError(
        f"{cache.display(rel)}: {what}. The file does not match the ledger; no tokens were returned from "
        "it. Rerun the build command that made this cache (it rewrites missing chunks; delete a damaged "
        "chunk and its .json sidecar first), or run `python -m reader validate` to list every problem."
    )


def parse_chunk(cache: Cache, index: int, data: bytes, entry: dict[str, Any] | None = None) -> WholeChunk:
    """Verify ``data`` (the bytes of global chunk ``index``) against the ledger and read its layout."""
    t = cache.table
    rel = t.paths[index]
    want_bytes = int(t.nbytes[index])
    if len(data) != want_bytes:
        kind = "truncated" if len(data) < want_bytes else "longer than recorded"
        raise chunk_error(cache, rel, f"{kind}: {len(data)} bytes, the ledger says {want_bytes}")
    got = fmt.checksum(data)
    if got != t.checksums[index]:
        raise chunk_error(cache, rel, f"checksum mismatch: file has {got}, the ledger says {t.checksums[index]}")
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        kv = pf.metadata.metadata or {}
        rg_tokens = json.loads(kv[fmt.ROW_GROUP_TOKENS_KEY])
        lengths = int_values(pf.read(columns=[fmt.LENGTH_COLUMN], use_threads=False).column(0)).astype(np.int64)
        rg_rows = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
    except KeyError:
        raise chunk_error(cache, rel, f"no {fmt.ROW_GROUP_TOKENS_KEY.decode()} key in the Parquet metadata") from None
    except Exception as e:  # pyarrow raises several types for damaged files
        raise chunk_error(cache, rel, f"not a readable Parquet chunk ({e})") from e
    if len(rg_tokens) != len(rg_rows):
        raise chunk_error(cache, rel, f"{len(rg_rows)} row groups but {len(rg_tokens)} row-group token counts")
    if lengths.size != int(t.docs[index]) or int(lengths.sum()) != int(t.tokens[index]):
        raise chunk_error(cache, rel, f"{lengths.size} documents / {int(lengths.sum())} tokens, the ledger says "
                          f"{int(t.docs[index])} / {int(t.tokens[index])}")
    rg_doc_starts = np.concatenate([[0], np.cumsum(rg_rows, dtype=np.int64)])
    doc_starts = np.concatenate([[0], np.cumsum(lengths)])
    rg_token_starts = np.concatenate([[0], np.cumsum(np.asarray(rg_tokens, dtype=np.int64))])
    if not np.array_equal(doc_starts[rg_doc_starts], rg_token_starts):
        raise chunk_error(cache, rel, "row-group token counts disagree with the num_tokens column")
    return WholeChunk(index, rel, data, rg_token_starts, rg_doc_starts, lengths, doc_starts, pf.metadata)


@dataclasses.dataclass(frozen=True)
class WholeChunk:
    """A chunk file fetched whole and verified against the ledger (``validate`` and old sidecars)."""

    index: int
    path: str
    data: bytes
    rg_token_starts: np.ndarray
    rg_doc_starts: np.ndarray
    doc_lengths: np.ndarray
    doc_starts: np.ndarray
    file_meta: Any = None


def validate_chunk(cache: Cache, index: int, *, decode: bool = True) -> list[str]:
    """Problems with global chunk ``index`` (empty list if it is sound): file, checksum, layout, sidecar."""
    t = cache.table
    rel = t.paths[index]
    problems = []
    data = None
    try:
        try:
            data = cache.fs.cat_file(cache.path(rel))
        except FileNotFoundError:
            raise chunk_error(cache, rel, "missing") from None
        m = parse_chunk(cache, index, data)
        if decode:
            pf = pq.ParquetFile(pa.BufferReader(m.data))
            for g in range(pf.metadata.num_row_groups):
                col = pf.read_row_group(g, columns=[fmt.TOKEN_COLUMN]).column(0)
                n = len(col.combine_chunks().flatten())
                want = int(m.rg_token_starts[g + 1] - m.rg_token_starts[g])
                if n != want:
                    raise chunk_error(cache, rel, f"row group {g} decodes to {n} tokens, metadata says {want}")
    except fmt.FormatError as e:
        problems.append(str(e).split(". The file does not match")[0])
    except Exception as e:  # noqa: BLE001 - report, never crash the validator
        problems.append(f"{cache.display(rel)}: {e!r}")
    shard, k = int(t.shard[index]), int(t.index_in_shard[index])
    side = fmt.sidecar_path(shard, k)
    try:
        raw = cache.fs.cat_file(cache.path(side))
        entry = json.loads(raw)
        if cache.complete:
            want = dict(cache.ledger.raw["chunks"][index])
            want_sum = want.pop("sidecar_checksum", None)
            want.pop("doc_offset", None)
            want.pop("token_offset", None)
            got = {key: v for key, v in entry.items() if key not in fmt.SIDECAR_ONLY_KEYS}
            if got != want:
                diff = sorted(key for key in set(got) | set(want) if got.get(key) != want.get(key))
                problems.append(f"{cache.display(side)}: sidecar differs from the ledger entry in {diff}")
            elif want_sum is not None and fmt.checksum(raw) != want_sum:
                problems.append(f"{cache.display(side)}: sidecar checksum {fmt.checksum(raw)}, the ledger says "
                                f"{want_sum}")
        if data is not None:
            try:
                index_want, footer_want = fmt.row_group_index(data)
                if [entry.get("row_group_index"), entry.get("footer")] != [index_want, footer_want]:
                    problems.append(f"{cache.display(side)}: row_group_index/footer do not match the chunk file "
                                    "(or are missing: sidecar written by an older chunkledger; rebuild)")
            except fmt.FormatError:
                pass  # the chunk itself was reported above
    except FileNotFoundError:
        problems.append(f"{cache.display(side)}: sidecar missing")
    except ValueError as e:
        problems.append(f"{cache.display(side)}: not valid JSON ({e})")
    return problems
