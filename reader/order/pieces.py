"""Document pieces: how an unpacked read cuts a document of ``n`` tokens into ``ceil(n / L)`` examples (where
such an example lies in its chunk: :mod:`reader.order.placement`). Pure arithmetic on document lengths."""

from __future__ import annotations

import numpy as np


def pieces_per_doc(doc_lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Examples each document yields unpacked: ``ceil(len / seq_len)`` (a zero-length doc yields none)."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    return -(-lengths // seq_len)


def unpacked_examples_per_chunk(doc_lengths: np.ndarray, seq_len: int) -> int:
    return int(pieces_per_doc(doc_lengths, seq_len).sum())
