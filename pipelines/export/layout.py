"""The plan of a Beam export to Megatron ``.bin``/``.idx``, from the ledger alone: pure, O(chunks), no I/O.

The ``.bin`` is every document's tokens back to back in global order, so chunk ``c`` starts at byte
``token_offsets[c] * itemsize`` and its documents are ``doc_offsets[c] ..``; the ledger's per-chunk token
and document counts fix where every chunk's bytes go before any chunk is read. Consecutive chunks are
grouped into *parts*: chunk ``c`` belongs to part ``floor(start byte of c / part_bytes)`` (parts of at most
about ``part_bytes``, each at least one chunk), and parts without documents are left out. A worker writes
one part's ``.bin`` bytes and its documents' lengths; the finalize step joins them in part order.

The plan's ``fingerprint`` names everything the output depends on (the chunks' sha256 in order, the
dtype, the part size), so parts a crashed run left are kept only by the same export.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

import numpy as np

from reader.interop.megatron import HEADER_BYTES

PLAN_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PartSpec:
    """One part: global chunks ``[chunk_lo, chunk_hi)`` (their documents, in order) and where they go."""

    index: int
    chunk_lo: int
    chunk_hi: int
    docs: int
    tokens: int
    doc_offset: int  # first document's index in the output
    byte_offset: int  # first byte in PREFIX.bin
    nbytes: int  # bytes in PREFIX.bin (tokens x itemsize)

    @property
    def chunks(self) -> range:
        return range(self.chunk_lo, self.chunk_hi)


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """A whole export: the cache, the dtype, the parts in order, and the totals.

    Attributes:
      cache: the cache URL the workers open.
      dtype: numpy name of the ``.bin`` element type (``uint16`` / ``int32``).
      vocab_size: the ledger's tokenizer vocabulary (every token id must be below it).
      part_bytes: the part size the parts were cut for.
      parts: the parts in output order (none holds zero documents).
      docs, tokens: totals of the cache.
      fingerprint: sha256 naming the chunks (in order), the dtype and the part size.
    """

    cache: str
    dtype: str
    vocab_size: int
    part_bytes: int
    parts: tuple[PartSpec, ...]
    docs: int
    tokens: int
    fingerprint: str

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def bin_bytes(self) -> int:
        return self.tokens * self.itemsize

    @property
    def idx_bytes(self) -> int:
        """Size of ``PREFIX.idx``: header, int32 lengths and int64 pointers per document, document index."""
        return HEADER_BYTES + 12 * self.docs + 8 * (self.docs + 1)

    def to_json(self) -> dict[str, Any]:
        """What ``plan.json`` in the parts directory records (enough to tell a leftover of another export)."""
        return {"version": PLAN_VERSION, "fingerprint": self.fingerprint, "cache": self.cache, "dtype": self.dtype,
                "part_bytes": self.part_bytes, "parts": len(self.parts), "docs": self.docs, "tokens": self.tokens}


def fingerprint(checksums: Sequence[str], dtype: str, part_bytes: int) -> str:
    """sha256 over the chunks' checksums in global order, the dtype and the part size."""
    h = hashlib.sha256(f"chunkledger-megatron-export/{PLAN_VERSION}/{dtype}/{part_bytes}\n".encode())
    for c in checksums:
        h.update(c.encode() + b"\n")
    return h.hexdigest()


def plan_parts(docs: np.ndarray, tokens: np.ndarray, itemsize: int, part_bytes: int) -> tuple[PartSpec, ...]:
    """The parts of an export of chunks with ``docs[c]`` documents and ``tokens[c]`` tokens (global order).

    Args:
      docs, tokens: per-chunk counts from the ledger.
      itemsize: bytes per token in the ``.bin``.
      part_bytes: target bytes of ``.bin`` per part (a chunk is never split).
    """
    if part_bytes <= 0:
        raise ValueError(f"part_bytes must be positive, got {part_bytes}")
    docs, tokens = np.asarray(docs, np.int64), np.asarray(tokens, np.int64)
    tok_off = np.concatenate([[0], np.cumsum(tokens)])
    doc_off = np.concatenate([[0], np.cumsum(docs)])
    if not len(docs):
        return ()
    group = tok_off[:-1] * itemsize // part_bytes  # non-decreasing: groups are runs of consecutive chunks
    bounds = (np.flatnonzero(np.diff(group)) + 1).tolist()
    parts = []
    for lo, hi in zip([0] + bounds, bounds + [len(docs)]):
        n_docs = int(doc_off[hi] - doc_off[lo])
        if n_docs == 0:
            continue
        n_tok = int(tok_off[hi] - tok_off[lo])
        parts.append(PartSpec(index=len(parts), chunk_lo=lo, chunk_hi=hi, docs=n_docs, tokens=n_tok,
                              doc_offset=int(doc_off[lo]), byte_offset=int(tok_off[lo]) * itemsize,
                              nbytes=n_tok * itemsize))
    return tuple(parts)


def make_plan(cache: str, checksums: Sequence[str], docs: np.ndarray, tokens: np.ndarray, dtype: str,
              vocab_size: int, part_bytes: int) -> ExportPlan:
    """The export plan of a finished cache's chunk table (see :func:`plan_parts`).

    Args:
      cache: the cache URL.
      checksums, docs, tokens: the ledger's per-chunk sha256, document and token counts, global order.
      dtype: numpy name of the ``.bin`` dtype.
      vocab_size: the tokenizer's vocabulary size.
      part_bytes: target ``.bin`` bytes per part.
    """
    itemsize = np.dtype(dtype).itemsize
    return ExportPlan(cache=cache, dtype=np.dtype(dtype).name, vocab_size=int(vocab_size), part_bytes=int(part_bytes),
                      parts=plan_parts(docs, tokens, itemsize, part_bytes), docs=int(np.sum(docs, dtype=np.int64)),
                      tokens=int(np.sum(tokens, dtype=np.int64)),
                      fingerprint=fingerprint(checksums, np.dtype(dtype).name, int(part_bytes)))
