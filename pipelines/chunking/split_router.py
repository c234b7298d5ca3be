"""The router that sends a chunk's documents to the Parquet file of their split's cache (a split build, by the
format's rule in :mod:`reader.format.splits`).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from reader.format import spec as fmt
from reader.format.chunk_file import ChunkParquet, row_group_table
from reader.format.splits import SplitSpec, cache_names


class _Part:
    """One cache's share of a chunk: documents in file order, cut into row groups, then one Parquet file."""

    def __init__(self, config: Mapping[str, Any], shard: int, eos_id: int | None, row_group_tokens: int):
        self.shard, self.eos_id, self.row_group_tokens = shard, eos_id, row_group_tokens
        self.keep_fields = tuple(config.get("keep_fields") or ())
        self.extra = 1 if eos_id is not None else 0
        self.arrays: list[np.ndarray] = []
        self.offsets: list[int] = []
        self.fields: list[tuple] = []  # each document's kept fields, in config.keep_fields order
        self.spans: list[np.ndarray] | None = [] if fmt.is_masked(config) else None  # each one's loss_spans
        self.tokens = 0
        self.parquet = ChunkParquet(config)

    def add(self, array: np.ndarray, offset: int, fields: tuple = (), spans: np.ndarray | None = None) -> None:
        self.arrays.append(array)
        self.offsets.append(offset)
        self.fields.append(fields)
        if self.spans is not None:
            self.spans.append(spans)
        self.tokens += len(array) + self.extra
        if self.tokens >= self.row_group_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.arrays:
            return
        kept = {name: [f[i] for f in self.fields] for i, name in enumerate(self.keep_fields)} or None
        self.parquet.write(row_group_table(self.arrays, self.shard, self.offsets, self.eos_id, fields=kept,
                                           loss_spans=self.spans),
                           self.tokens)
        self.arrays, self.offsets, self.fields, self.tokens = [], [], [], 0
        if self.spans is not None:
            self.spans = []


class SplitRouter:
    """A chunk's tokenized documents -> one Parquet writer per cache of the build.

    Without splits there is one writer (the chunk of the cache); with splits, train and validation, and
    :meth:`route` picks a document's writer from its text. Each writer cuts its own row groups.

    Args:
      config: the ledger's chunking configuration (``row_group_tokens``, compression).
      shard: the chunk's input shard (the ``shard`` column).
      eos_id: appended to every document when not None.
      spec: the split, or None for a plain build.
    """

    def __init__(self, config: Mapping[str, Any], shard: int, eos_id: int | None, spec: SplitSpec | None):
        self.spec = spec
        self.names = cache_names(spec)
        rgt = int(config["row_group_tokens"])
        self.parts = [_Part(config, shard, eos_id, rgt) for _ in self.names]

    def route(self, text: str) -> int:
        """Index of the cache (in :func:`cache_names` order) that the document ``text`` belongs to (a supervised
        record's canonical form, pipelines/chunking/supervised.py)."""
        return 0 if self.spec is None else int(self.spec.is_validation(text))

    def add(self, part: int, array: np.ndarray, offset: int, fields: tuple = (),
            spans: np.ndarray | None = None) -> None:
        self.parts[part].add(array, offset, fields, spans)

    def finish(self) -> list[ChunkParquet]:
        """Flush the last row groups; the Parquet writers, one per cache, ready for ``finish()``."""
        for p in self.parts:
            p.flush()
        return [p.parquet for p in self.parts]
