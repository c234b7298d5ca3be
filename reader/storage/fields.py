"""Kept fields (``--keep_fields``): per-document metadata in a cache's chunks, read for any document range.

A cache built with ``--keep_fields source,url`` records ``config.keep_fields`` and gives each chunk one
more Parquet column, ``fields``: a struct of nullable strings, one per kept field (integers as their
decimal text). Batches never read it. :func:`read_fields` returns the fields of documents ``[start, stop)``
in global order (reading only the ``fields`` column of the row groups that hold them), and :func:`tally`
counts documents and tokens per value of one field (``python -m reader inspect CACHE --by source``).
"""

from __future__ import annotations

import bisect
import collections
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow.parquet as pq

from reader.format import spec as fmt


class NoSuchField(ValueError):
    """A field that the cache does not keep."""


def kept_fields(cache: Any) -> tuple[str, ...]:
    """The fields ``cache`` keeps (its ``config.keep_fields``), in order."""
    return tuple(cache.ledger.config.get("keep_fields") or ())


def _check(cache: Any, names: Sequence[str] | None) -> tuple[str, ...]:
    kept = kept_fields(cache)
    names = kept if names is None else tuple(names)
    missing = [n for n in names if n not in kept]
    if missing:
        have = ", ".join(kept) if kept else "none (it was built without --keep_fields)"
        raise NoSuchField(f"{cache.url} keeps no field {missing[0]!r}; the fields it keeps: {have}")
    return names


def _chunk_rows(cache: Any, c: int, lo: int, hi: int, columns: list[str]) -> Iterator[dict[str, list]]:
    """Columns ``columns`` of rows ``[lo, hi)`` of chunk ``c``, one dict of Python lists per row group read."""
    with cache.storage.open(cache.path(cache.table.paths[c])) as f:
        pf = pq.ParquetFile(f)
        start = 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                t = pf.read_row_group(g, columns=columns).slice(a - start, b - a)
                yield {name: t.column(name).to_pylist() for name in columns}
            start += n


def read_fields(cache: Any, start: int, stop: int, names: Sequence[str] | None = None) -> dict[str, list]:
    """``name -> [value of document d for d in range(start, stop)]`` (None where a document has none).

    Documents are numbered in global order, as ``doc_offset`` in the ledger. Raises NoSuchField for a field
    the cache does not keep and IndexError for a range outside the documents known.
    """
    names = _check(cache, names)
    offsets = cache.table.doc_offsets
    if not 0 <= start <= stop <= int(offsets[-1]):
        raise IndexError(f"documents [{start}, {stop}) are outside the {int(offsets[-1])} documents of {cache.url}")
    out: dict[str, list] = {n: [] for n in names}
    c = bisect.bisect_right(offsets.tolist(), start) - 1
    while start < stop:
        first = int(offsets[c])
        hi = min(stop, int(offsets[c + 1]))
        if hi > start:
            for part in _chunk_rows(cache, c, start - first, hi - first, [fmt.FIELDS_COLUMN]):
                for row in part[fmt.FIELDS_COLUMN]:
                    for n in names:
                        out[n].append(row[n])
            start = hi
        c += 1
    return out


def tally(cache: Any, name: str) -> dict[str | None, tuple[int, int]]:
    """``value -> (documents, tokens)`` of field ``name`` over every document known, most tokens first."""
    _check(cache, [name])
    docs: collections.Counter = collections.Counter()
    tokens: collections.Counter = collections.Counter()
    for c in range(len(cache.table)):
        if not cache.table.docs[c]:
            continue
        for part in _chunk_rows(cache, c, 0, int(cache.table.docs[c]), [fmt.FIELDS_COLUMN, fmt.LENGTH_COLUMN]):
            values = [row[name] for row in part[fmt.FIELDS_COLUMN]]
            lengths = np.asarray(part[fmt.LENGTH_COLUMN], dtype=np.int64)
            for v, n in zip(values, lengths.tolist()):
                docs[v] += 1
                tokens[v] += n
    order = sorted(docs, key=lambda v: (-tokens[v], -docs[v], v is None, v or ""))
    return {v: (docs[v], tokens[v]) for v in order}
