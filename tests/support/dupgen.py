"""Corpora with planted duplicates for the dedup job's tests, and the brute-force truth to check it against.

Originals are lines of words drawn at random from the sample corpus's vocabulary (so two originals share
almost no 5-token shingle). Exact copies are originals written again, word for word, into another shard; near
copies have 1-3% of their words replaced and some of their lines swapped. The truth is computed from the
cache the builder made (its token ids), independently of the job: exact groups by token sequence, and the
Jaccard similarity of every pair of documents over their sets of 5-token shingles (docs/CURATION.md).
"""

from __future__ import annotations

import json
import os
import random

import numpy as np

from build_helpers import SAMPLE_DIR, write_shard

SHINGLE = 5


def vocabulary() -> list[str]:
    """The sample corpus's words, each as often as it occurs there (drawn from, they have natural text's mix
    of short common words and long rare ones, so about as many tokens per word)."""
    with open(os.path.join(SAMPLE_DIR, "part-00.jsonl"), encoding="utf-8") as f:
        return sorted(w for line in f for w in json.loads(line)["text"].split() if w.isalpha())


def original(rng: random.Random, words: list[str]) -> str:
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 16))) for _ in range(rng.randint(15, 40))]
    return "\n".join(lines)


def near_copy(rng: random.Random, text: str, words: list[str]) -> str:
    """``text`` with 1-3% of its words replaced and two of its lines swapped (if it has two)."""
    lines = [line.split() for line in text.split("\n")]
    slots = [(i, j) for i, line in enumerate(lines) for j in range(len(line))]
    for i, j in rng.sample(slots, max(1, round(len(slots) * rng.uniform(0.01, 0.03)))):
        lines[i][j] = rng.choice(words)
    if len(lines) > 1:
        a, b = rng.sample(range(len(lines)), 2)
        lines[a], lines[b] = lines[b], lines[a]
    return "\n".join(" ".join(line) for line in lines)


def planted(out_dir: str, *, docs: int, shards: int, seed: int, near: bool) -> str:
    """Write ``shards`` JSON Lines shards of ``docs`` originals plus a copy of 10% of them (a fifth of those
    copied twice), each copy in another shard than its original; returns the input pattern."""
    rng = random.Random(seed)
    words = vocabulary()
    texts = [original(rng, words) for _ in range(docs)]
    by_shard: list[list[str]] = [[] for _ in range(shards)]
    for i, t in enumerate(texts):
        by_shard[i % shards].append(t)
    for i in rng.sample(range(docs), docs // 10):
        for _ in range(2 if rng.random() < 0.2 else 1):
            s = rng.choice([s for s in range(shards) if s != i % shards])
            copy = near_copy(rng, texts[i], words) if near else texts[i]
            by_shard[s].insert(rng.randint(0, len(by_shard[s])), copy)
    if not near:  # a duplicate the corpus already had, within one shard
        by_shard[0].append(by_shard[0][0])
    for s, lines in enumerate(by_shard):
        write_shard(os.path.join(out_dir, f"part-{s:02d}.jsonl"), [{"text": t} for t in lines])
    return os.path.join(out_dir, "*.jsonl")


def exact_truth(docs: list[np.ndarray]) -> dict[int, int]:
    """Document -> keeper of every document whose token sequence an earlier document has (global order)."""
    first: dict[bytes, int] = {}
    out = {}
    for i, d in enumerate(docs):
        key = np.asarray(d, np.int32).tobytes()
        if key in first:
            out[i] = first[key]
        else:
            first[key] = i
    return out


def shingle_sets(docs: list[np.ndarray]) -> list[set]:
    return [{tuple(d[i:i + SHINGLE]) for i in range(len(d) - SHINGLE + 1)} for d in (list(map(int, x)) for x in docs)]


def jaccard_pairs(docs: list[np.ndarray]) -> dict[tuple[int, int], float]:
    """``(a, b) -> J`` (a < b) of every pair of documents sharing a shingle (every other pair has J = 0)."""
    sets = shingle_sets(docs)
    holders: dict[tuple, list[int]] = {}
    for i, s in enumerate(sets):
        for sh in s:
            holders.setdefault(sh, []).append(i)
    inter: dict[tuple[int, int], int] = {}
    for ds in holders.values():
        for x in range(len(ds)):
            for y in range(x + 1, len(ds)):
                inter[(ds[x], ds[y])] = inter.get((ds[x], ds[y]), 0) + 1
    return {(a, b): n / (len(sets[a]) + len(sets[b]) - n) for (a, b), n in inter.items()}


def near_scores(keeper: np.ndarray, truth: dict[tuple[int, int], float]) -> dict[str, float]:
    """The job's marks (``keeper[d]``: -1 or the keeper of document d) against the truth: recall over the
    pairs with J >= 0.8 (a pair is caught when the marks leave at most one of the two), the same with both in
    one cluster, and the share of marked (document, keeper) pairs with J < 0.7."""
    def root(d: int) -> int:
        return d if keeper[d] < 0 else int(keeper[d])

    similar = [p for p, j in truth.items() if j >= 0.8]
    caught = sum(keeper[a] >= 0 or keeper[b] >= 0 for a, b in similar)
    together = sum(root(a) == root(b) for a, b in similar)
    marked = [(int(k), d) for d, k in enumerate(keeper) if k >= 0]
    wrong = sum(truth.get((k, d), 0.0) < 0.7 for k, d in marked)
    return {"pairs": len(similar), "recall": caught / max(1, len(similar)),
            "recall_same_cluster": together / max(1, len(similar)), "marked": len(marked),
            "false_share": wrong / max(1, len(marked))}
