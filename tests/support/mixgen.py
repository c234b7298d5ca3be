"""Mixture files over small synthetic caches, for the mixture tests."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

import cachegen


def unique_chunks(num_chunks: int, first_id: int, rng: np.random.Generator, *, max_docs: int = 5,
                  max_len: int = 40) -> tuple[list[list[np.ndarray]], int]:
    """Chunks whose every token id is distinct (from ``first_id`` on), so a test can tell any two tokens
    apart; returns the chunks and the next free id."""
    out, nxt = [], first_id
    for _ in range(num_chunks):
        docs = []
        for _ in range(int(rng.integers(1, max_docs + 1))):
            n = int(rng.integers(1, max_len + 1))
            docs.append(np.arange(nxt, nxt + n, dtype=np.int32))
            nxt += n
        out.append(docs)
    return out, nxt


def write_components(root: str, sizes: Sequence[int], *, seed: int = 0, row_group_tokens: int = 16,
                     **kw) -> tuple[list[str], list[list[list[np.ndarray]]]]:
    """One finished cache per entry of ``sizes`` (chunks), in ``root/c0``, ``root/c1`` ...; token ids are
    distinct across all of them. Returns the paths and the chunks."""
    rng = np.random.default_rng(seed)
    paths, all_chunks, nxt = [], [], 1
    for i, n in enumerate(sizes):
        chunks, nxt = unique_chunks(n, nxt, rng, **kw)
        p = os.path.join(root, f"c{i}")
        cachegen.write_synthetic_cache(p, chunks, chunks_per_shard=[n - n // 2, n // 2] if n > 1 else [n],
                                       row_group_tokens=row_group_tokens)
        paths.append(p)
        all_chunks.append(chunks)
    return paths, all_chunks


def write_mixture(path: str, components: Sequence[tuple[str, str, float]], *, schedule=None, **top: Any) -> str:
    """Write a mixture file: ``components`` as ``(name, path, weight)``; ``schedule`` as
    ``[(start_batch, {name: weight})]``; ``top``: other top-level keys (seed, block)."""
    doc: dict[str, Any] = {"mixture": 1, "components": [{"name": n, "path": p, "weight": w} for n, p, w in components]}
    if schedule:
        doc["schedule"] = [{"start_batch": b, "weights": ws} for b, ws in schedule]
    doc.update(top)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path
