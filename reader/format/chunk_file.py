"""Writing chunks: the Parquet bytes of one chunk, its row-group index (its sidecar: :mod:`reader.format.sidecar`).

The format-level half of every chunkledger writer. The Beam builder (``pipelines/chunking/chunk_writer.py``) and the
Megatron import (``reader/interop/import_megatron.py``) both use it, so a chunk written by either has the same
encoding, row-group layout, metadata and sidecar. Everything here is a pure function of its arguments
(no clocks, hosts or random names); callers do the I/O (temporary file, then rename).

A chunk is held in memory while it is written: its size is bounded by the chunk size of the cache
(``config.chunk_bytes`` of input), never by the size of the cache.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reader.format import spec as fmt
from reader.format.sidecar import loss_tokens, row_group_index

TOKEN_LEAF = f"{fmt.TOKEN_COLUMN}.list.element"
LOSS_LEAF = f"{fmt.LOSS_COLUMN}.list.element"
_TOKEN_TYPE = fmt.CHUNK_SCHEMA.field(fmt.TOKEN_COLUMN).type


def parquet_writer_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """ParquetWriter keyword arguments for a chunk, from the ledger config (measured choice: FORMAT.md)."""
    comp = config["compression"]
    opts: dict[str, Any] = {
        "compression": "none" if comp == "none" else comp,
        "use_dictionary": [fmt.SHARD_COLUMN],
        "write_statistics": False,
        "store_schema": True,
        "data_page_size": 1 << 20,
    }
    if config.get("compression_level") is not None and comp in ("zstd", "gzip", "brotli"):
        opts["compression_level"] = int(config["compression_level"])
    enc = config.get("token_encoding", "PLAIN")
    if enc != "PLAIN":
        # Column options must name the leaf path; the bare column name is silently ignored by pyarrow.
        opts["column_encoding"] = {TOKEN_LEAF: enc, fmt.LENGTH_COLUMN: "PLAIN", fmt.OFFSET_COLUMN: "DELTA_BINARY_PACKED"}
    else:
        opts["column_encoding"] = {fmt.OFFSET_COLUMN: "DELTA_BINARY_PACKED"}
    if fmt.is_masked(config):  # PLAIN like the tokens (no dictionary: only the shard column has one)
        opts["column_encoding"][LOSS_LEAF] = "PLAIN"
    return opts


def row_group_table(arrays: list[np.ndarray], shard: int, offsets: list[int], eos_id: int | None,
                    *, fields: Mapping[str, Sequence[str | None]] | None = None,
                    loss_spans: Sequence[Sequence[int]] | None = None) -> pa.Table:
    """One row group: documents' token arrays (EOS appended when ``eos_id`` is not None).

    Args:
      arrays: one int32 token array per document, in file order.
      shard: the input shard of every document (the ``shard`` column).
      offsets: each document's byte offset in its uncompressed input shard (the ``offset`` column).
      eos_id: appended to every document when not None.
      fields: the kept fields (``config.keep_fields``, in that order): name -> one value per document.
      loss_spans: a masked cache's ``loss_spans`` per document (flattened ``[s0, e0, ...]``, offsets in its
        tokens, EOS included), or None for a plain cache.
    """
    n = len(arrays)
    if eos_id is not None:
        eos = np.array([eos_id], dtype=np.int32)
        parts = []
        for a in arrays:
            parts.append(a)
            parts.append(eos)
        lengths = np.fromiter((len(a) + 1 for a in arrays), dtype=np.int32, count=n)
    else:
        parts = arrays
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=n)
    values = np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, np.int32)
    return flat_row_group_table(values, lengths, shard, offsets, fields=fields, loss_spans=loss_spans)


def _lists(lengths, values) -> pa.ListArray:
    offs = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offs[1:])
    return pa.ListArray.from_arrays(pa.array(offs), pa.array(np.asarray(values, dtype=np.int32), type=pa.int32()),
                                    type=_TOKEN_TYPE)


def flat_row_group_table(values: np.ndarray, lengths: np.ndarray, shard: int, offsets,
                         *, fields: Mapping[str, Sequence[str | None]] | None = None,
                         loss_spans: Sequence[Sequence[int]] | None = None) -> pa.Table:
    """One row group from the documents' tokens concatenated (``values``) and their ``lengths``; with
    ``loss_spans`` (one flattened span list per document, see :func:`row_group_table`), a masked one."""
    n = len(lengths)
    columns = [_lists(lengths, values), pa.array(np.asarray(lengths, dtype=np.int32), type=pa.int32()),
               pa.array(np.full(n, shard, dtype=np.int32)), pa.array(np.asarray(offsets, dtype=np.int64))]
    if loss_spans is not None:
        if len(loss_spans) != n:
            raise ValueError(f"{len(loss_spans)} loss_spans lists for {n} documents")
        spans = [np.asarray(s, dtype=np.int32).reshape(-1) for s in loss_spans]
        columns.append(_lists([s.size for s in spans], np.concatenate(spans) if spans else np.zeros(0, np.int32)))
    schema = fmt.chunk_schema(tuple(fields or ()), loss_spans is not None)
    if fields:
        columns.append(pa.StructArray.from_arrays([pa.array(v, type=pa.string()) for v in fields.values()],
                                                  fields=list(schema.field(fmt.FIELDS_COLUMN).type)))
    return pa.Table.from_arrays(columns, schema=schema)


class ChunkParquet:
    """Row groups in, a chunk file's bytes and its row-group index out.

    Call :meth:`write` once per row group (a table from :func:`row_group_table`), then :meth:`finish`.
    """

    def __init__(self, config: Mapping[str, Any], *, writer_options: Mapping[str, Any] | None = None):
        """``writer_options``: ParquetWriter keyword arguments instead of the configuration's (tests that
        make chunks with other encodings)."""
        self.sink = pa.BufferOutputStream()
        self.masked = fmt.is_masked(config)
        schema = fmt.chunk_schema(tuple(config.get("keep_fields") or ()), self.masked)
        opts = parquet_writer_options(config) if writer_options is None else dict(writer_options)
        self.writer = pq.ParquetWriter(self.sink, schema, **opts)
        self.row_group_tokens: list[int] = []
        self.docs = 0
        self.loss_tokens = 0  # masked caches: the sidecar's loss_tokens

    @property
    def tokens(self) -> int:
        return sum(self.row_group_tokens)

    def write(self, table: pa.Table, tokens: int) -> None:
        """Append ``table`` as one row group holding ``tokens`` tokens."""
        if self.masked != (fmt.LOSS_COLUMN in table.column_names):
            raise ValueError(f"a row group {'without' if self.masked else 'with'} {fmt.LOSS_COLUMN} for a chunk of a "
                             f"{'masked' if self.masked else 'plain'} cache")
        self.writer.write_table(table, row_group_size=max(1, len(table)))
        self.row_group_tokens.append(int(tokens))
        self.docs += len(table)
        if self.masked:
            self.loss_tokens += loss_tokens(table.column(fmt.LOSS_COLUMN))

    def finish(self) -> tuple[bytes, list[list[Any]], list[Any]]:
        """``(file bytes, row_group_index, footer)``; the writer cannot be used afterwards."""
        self.writer.add_key_value_metadata({fmt.ROW_GROUP_TOKENS_KEY: json.dumps(self.row_group_tokens)})
        self.writer.close()
        data = self.sink.getvalue().to_pybytes()
        self.sink = None
        # byte range + sha256 of each row group and of the footer: readers fetch and verify row groups alone
        rg_index, footer = row_group_index(data)
        assert [e[3] for e in rg_index] == self.row_group_tokens, "row-group index disagrees with writer"
        return data, rg_index, footer
