"""Worker memory stays bounded whatever the shard size (Megatron-LM issues 154 and 444: OOM on 40 GB+ inputs).

A build of one shard runs in a fresh process (FnApiRunner: launcher, runner and SDK worker in one process,
so its peak RSS is the worst case) for a small and a 6x larger shard, uncompressed (one work unit per
chunk) and gzip (one work unit streaming the whole shard). The larger build's peak RSS may exceed the
smaller one's by at most ``ALLOWED_GROWTH``, a cap several times smaller than the extra input; keeping the
shard's bytes, its lines or its token ids in memory would exceed it many times over.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys

import pytest

from build_helpers import sample_texts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL, LARGE = 10_000_000, 60_000_000  # input bytes (uncompressed)
ALLOWED_GROWTH = 16 << 20  # peak RSS growth allowed for 50 MB more input
CHUNK = 1 << 20

# Runs in the child: one build, then print the process's peak RSS.
CHILD = """
import json, resource, sys
from pipelines import build_cache
res = build_cache.run(["--input", sys.argv[1], "--output", sys.argv[2], "--tokenizer", "tiktoken:cl100k_base",
                       "--chunk_bytes", sys.argv[3], "--row_group_tokens", "65536", "--runner=FnApiRunner"])
t = res["ledger"]["totals"]
print("RESULT " + json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                              "chunks": t["chunks"], "uncompressed_bytes": t["uncompressed_bytes"]}))
"""


def write_corpus(path: str, n_bytes: int) -> int:
    texts = sample_texts(500, seed=11)
    opener = (lambda p: gzip.open(p, "wb", compresslevel=1)) if path.endswith(".gz") else (lambda p: open(p, "wb"))
    size = i = 0
    with opener(path) as f:
        block = []
        while size < n_bytes:
            line = (json.dumps({"text": texts[i % len(texts)], "id": i}) + "\n").encode()
            block.append(line)
            size += len(line)
            i += 1
            if len(block) == 2000:
                f.write(b"".join(block))
                block = []
        f.write(b"".join(block))
    return size


def peak_rss(tmp_path, name: str, n_bytes: int) -> tuple[float, dict]:
    path = str(tmp_path / name)
    size = write_corpus(path, n_bytes)
    env = dict(os.environ, MALLOC_ARENA_MAX="2")  # fewer glibc arenas: less noise in RSS
    proc = subprocess.run([sys.executable, "-c", CHILD, path, str(tmp_path / (name + ".cache")), str(CHUNK)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert res["uncompressed_bytes"] == size and res["chunks"] == math.ceil(size / CHUNK)
    return res["maxrss_kb"] * 1024, res


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"], ids=["uncompressed", "gzip"])
def test_peak_rss_does_not_grow_with_shard_size(tmp_path, suffix):
    small, _ = peak_rss(tmp_path, "small" + suffix, SMALL)
    large, res = peak_rss(tmp_path, "large" + suffix, LARGE)
    assert res["chunks"] >= 50
    growth = large - small
    assert growth < ALLOWED_GROWTH, (
        f"{suffix}: peak RSS {small / 2**20:.0f} MiB for {SMALL / 1e6:.0f} MB of input but {large / 2**20:.0f} MiB "
        f"for {LARGE / 1e6:.0f} MB (+{growth / 2**20:.0f} MiB, cap {ALLOWED_GROWTH / 2**20:.0f} MiB): worker "
        "memory grows with the shard size")
