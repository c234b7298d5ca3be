"""What the dedup job costs and finds on the distinct bench corpus (benchmarks/distinct_corpus.py).

    python -m benchmarks.dedup_bench --cache CACHE --corpus DIR --work DIR [--quick]

``make bench`` runs it on the suite's cache of the distinct corpus (built by benchmarks/peer_suite.py):

- ``exact`` and ``near``: ``python -m pipelines.dedup CACHE [--near]`` with 2 local workers, the whole command
  monitored; the figure is MB of input text (the ledger's ``uncompressed_bytes``) per CPU-second of the
  command's process tree (target for exact: >= 20 per core, i.e. per CPU-second);
- ``signatures``: the MinHash signatures alone (pipelines/dedup/minhash.py) on every chunk's tokens, read
  first, in this process: tokens per CPU-second (target >= 5 M);
- planted copies: ``--planted`` documents of the corpus, 10% of them copied once with 1-3% of their words
  changed and two lines swapped (tests/support/dupgen.py's recipe), built into a cache (FnApiRunner) and marked
  with ``--near``. Recall over the planted pairs whose true Jaccard (5-token shingles of the cache's ids) is
  >= 0.8 (caught when the marks leave at most one of the two), and the share of all marked (document, keeper)
  pairs with a true Jaccard below 0.7 (the corpus's own near duplicates included).

Prints one ``BENCH_RESULT`` line.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np

PLANTED_DOCS = 4000


def near_copy(rng: random.Random, text: str, words: list[str]) -> str:
    """``text`` with 1-3% of its words replaced by ``words`` and two of its lines swapped (if it has two)."""
    lines = [line.split(" ") for line in text.split("\n")]
    slots = [(i, j) for i, line in enumerate(lines) for j in range(len(line)) if line[j]]
    for i, j in rng.sample(slots, max(1, round(len(slots) * rng.uniform(0.01, 0.03)))) if slots else []:
        lines[i][j] = rng.choice(words)
    if len(lines) > 1:
        a, b = rng.sample(range(len(lines)), 2)
        lines[a], lines[b] = lines[b], lines[a]
    return "\n".join(" ".join(line) for line in lines)


def _shingles(doc: np.ndarray) -> set:
    d = doc.tolist()
    return {tuple(d[i:i + 5]) for i in range(len(d) - 4)}


def true_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    sa, sb = _shingles(a), _shingles(b)
    return len(sa & sb) / max(1, len(sa | sb))


def _tokens(root: str) -> list[np.ndarray]:
    from reader.interop.export import iter_blocks
    from reader.storage.cache import Cache

    out = []
    for b in iter_blocks(Cache(root)):
        out.extend(np.split(b.values, np.cumsum(b.lengths)[:-1]))
    return out


def planted(corpus: Path, work: Path, docs: int) -> dict:
    """Recall and false share of the near marks on ``docs`` documents of the corpus with planted copies."""
    from pipelines.dedup import job
    from reader.storage.attributes import AttributeSet
    from reader.storage.cache import Cache

    rng = random.Random(5)
    texts = []
    for path in sorted(corpus.glob("shard-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            texts.extend(json.loads(line)["text"] for line in f)
            if len(texts) >= docs:
                break
    texts = texts[:docs]
    words = [w for t in texts[:200] for w in t.split() if w.isalpha()] or ["x"]
    shards: list[list[str]] = [[], []]
    origin = {}  # (shard, position) of a copy -> its original's index
    for i, t in enumerate(texts):
        shards[0].append(t)
    for i in rng.sample(range(len(texts)), len(texts) // 10):
        shards[1].append(near_copy(rng, texts[i], words))
        origin[len(shards[1]) - 1] = i
    d = work / "planted"
    shutil.rmtree(d, ignore_errors=True)
    (d / "in").mkdir(parents=True)
    for s, lines in enumerate(shards):
        with open(d / "in" / f"part-{s}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in lines)
    from pipelines import build_cache

    root = str(d / "cache")
    build_cache.run(["--input", str(d / "in" / "*.jsonl"), "--output", root, "--tokenizer", "tiktoken:cl100k_base",
                     "--chunk_bytes", "4MiB", "--runner=FnApiRunner"])
    job.run([root, "--near", "--runner=FnApiRunner"])
    cache = Cache(root)
    s = AttributeSet(cache, job.NEAR_NAME)
    keeper = np.concatenate([s.chunk(c)["keeper"] for c in range(len(cache.table))])
    toks = _tokens(root)
    # global index of each document: shard 0's documents then shard 1's, by the ledger's chunk order
    where = {}
    for c in range(len(cache.table)):
        sh, first = int(cache.table.shard[c]), int(cache.table.doc_offsets[c])
        base = sum(int(cache.table.docs[k]) for k in range(c) if int(cache.table.shard[k]) == sh)
        for r in range(int(cache.table.docs[c])):
            where[(sh, base + r)] = first + r
    pairs = [(where[(0, i)], where[(1, k)]) for k, i in origin.items()]
    similar = [(a, b) for a, b in pairs if true_jaccard(toks[a], toks[b]) >= 0.8]
    caught = sum(keeper[a] >= 0 or keeper[b] >= 0 for a, b in similar)
    marked = [(int(k), d) for d, k in enumerate(keeper) if k >= 0]
    wrong = sum(true_jaccard(toks[k], toks[d]) < 0.7 for k, d in marked)
    shutil.rmtree(d, ignore_errors=True)
    return {"dedup_planted_docs": len(texts), "dedup_planted_copies": len(pairs),
            "dedup_planted_pairs_j08": len(similar), "dedup_planted_recall": caught / max(1, len(similar)),
            "dedup_marked_pairs": len(marked), "dedup_marked_false_share": wrong / max(1, len(marked))}


def signature_rate(root: str, rounds: int) -> float:
    """Tokens per CPU-second of ``minhash.signatures`` over every chunk's tokens (read beforehand)."""
    from pipelines.dedup import minhash
    from pipelines.dedup.transforms import chunk_tokens
    from reader.storage.cache import Cache

    cache = Cache(root)
    chunks = [chunk_tokens(cache, c) for c in range(len(cache.table))]
    tokens = sum(len(v) for v, _ in chunks)
    best = 0.0
    for _ in range(rounds):
        t = time.process_time()
        for v, n in chunks:
            if len(n):
                minhash.signatures(v, n)
        best = max(best, tokens / (time.process_time() - t))
    return best


def main(argv=None) -> None:
    from benchmarks.common import emit_result, log, run_monitored
    from pipelines.dedup import job
    from reader.format import attributes as attrs
    from reader.storage.cache import Cache

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True, help="a finished cache of the distinct corpus")
    ap.add_argument("--corpus", required=True, type=Path, help="the distinct corpus (its shard-*.jsonl)")
    ap.add_argument("--work", required=True, type=Path, help="scratch directory")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--planted", type=int, default=PLANTED_DOCS, help="documents of the planted-copies corpus")
    ap.add_argument("--quick", action="store_true", help="1 round, 300 planted documents")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.planted = 1, 300
    cache = Cache(a.cache)
    mb = int(cache.ledger.totals.get("uncompressed_bytes", 0)) / 1e6
    tokens = int(cache.table.tokens.sum())
    res: dict = {"dedup_corpus_mb": mb, "dedup_corpus_docs": int(cache.table.docs.sum()), "dedup_corpus_tokens": tokens}
    for near in (False, True):
        label, name = ("near", job.NEAR_NAME) if near else ("exact", job.EXACT_NAME)
        best = None
        for _ in range(a.rounds):
            shutil.rmtree(Path(a.cache) / attrs.set_dir(name), ignore_errors=True)
            m = run_monitored([sys.executable, "-m", "pipelines.dedup", a.cache, *(["--near"] if near else []),
                               "--direct_num_workers=2"])
            best = m if best is None or m.cpu_s < best.cpu_s else best
        marked = json.loads((Path(a.cache) / attrs.manifest_path(name)).read_text())["totals"]["marked"]
        res.update({f"dedup_{label}_mb_per_cpu_s": mb / best.cpu_s, f"dedup_{label}_wall_s": best.wall_s,
                    f"dedup_{label}_cpu_s": best.cpu_s, f"dedup_{label}_marked": marked,
                    f"dedup_{label}_other_cores": best.other_cores})
        log(f"dedup {label}: {mb / best.cpu_s:.1f} MB of text per CPU-second ({mb:.0f} MB, {best.cpu_s:.1f} CPU-s, "
            f"{best.wall_s:.1f} s); {marked} documents marked")
    res["dedup_signature_tokens_per_cpu_s"] = signature_rate(a.cache, a.rounds)
    log(f"signatures: {res['dedup_signature_tokens_per_cpu_s'] / 1e6:.1f} M tokens per CPU-second")
    a.work.mkdir(parents=True, exist_ok=True)
    res.update(planted(a.corpus, a.work, a.planted))
    log(f"planted near copies: recall {res['dedup_planted_recall']:.3f} over {res['dedup_planted_pairs_j08']} pairs "
        f"with J >= 0.8; {res['dedup_marked_false_share']:.3f} of {res['dedup_marked_pairs']} marked pairs below 0.7")
    emit_result(res)


if __name__ == "__main__":
    main()
