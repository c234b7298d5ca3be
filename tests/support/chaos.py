"""What the chaos tests (tests/end_to_end/test_chaos*.py) share: the corpus, the build options, how many
random cases to run, and the outcome report behind docs/RELIABILITY.md.

``CHUNKLEDGER_CHAOS=long`` runs many more random cases; ``CHUNKLEDGER_CHAOS_SEED`` draws others;
``CHUNKLEDGER_CHAOS_REPORT=path.json`` collects every case's outcome (merged into the file if it exists).
"""

from __future__ import annotations

import collections
import json
import os

from build_helpers import mixed_lines, sample_texts, write_shard

LONG = os.environ.get("CHUNKLEDGER_CHAOS", "").lower() == "long"
SEED = int(os.environ.get("CHUNKLEDGER_CHAOS_SEED", "0"))
CHUNK = 3000
OPTS = dict(chunk_bytes=CHUNK, max_bad_fraction=1.0)

OUTCOMES: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def n(quick: int, long: int) -> int:
    return long if LONG else quick


def record(case: str, outcome: str) -> None:
    OUTCOMES[case][outcome] += 1


def write_report() -> None:
    """Merge the outcomes recorded so far into ``$CHUNKLEDGER_CHAOS_REPORT`` (if set), then forget them."""
    path = os.environ.get("CHUNKLEDGER_CHAOS_REPORT")
    if path:
        old = json.load(open(path)) if os.path.exists(path) else {}
        for case, counts in OUTCOMES.items():
            merged = collections.Counter(old.get(case, {}))
            merged.update(counts)
            old[case] = dict(merged)
        with open(path, "w") as f:
            json.dump(old, f, indent=1, sort_keys=True)
    OUTCOMES.clear()


def argv(inputs: str, out: str, *extra: str) -> list[str]:
    """The command line of a chaos build (FnApiRunner: one process, the fastest to start)."""
    return ["--input", inputs, "--output", out, "--tokenizer", "tiktoken:cl100k_base", "--chunk_bytes", str(CHUNK),
            "--max_bad_fraction", "1.0", "--runner=FnApiRunner", *extra]


def write_corpus(d) -> None:
    """A plain shard with bad lines, a gzip and a zstd shard, in the directory ``d`` (a pathlib.Path)."""
    lines, _ = mixed_lines(31, n_good=70)
    write_shard(str(d / "a.jsonl"), lines)
    write_shard(str(d / "b.jsonl.gz"), [{"text": t} for t in sample_texts(40, seed=32)])
    write_shard(str(d / "c.jsonl.zst"), [{"text": t} for t in sample_texts(30, seed=33)])
