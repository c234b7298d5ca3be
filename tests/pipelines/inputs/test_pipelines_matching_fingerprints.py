"""Input fingerprints (pipelines/inputs/matching.py) at the scale issue's sizes: 25,000 input files
fingerprinted when planned and checked again in seconds and a few MiB; a change of any one is named."""

from __future__ import annotations

import os
import time
import tracemalloc

from pipelines.inputs.matching import fingerprints_of, input_changed
from pipelines.plan import ChunkConfig, MatchedFile, make_plan


def test_25000_inputs_are_checked_in_bounded_time_and_memory(tmp_path):
    n = 25_000
    paths = []
    for i in range(n):
        p = str(tmp_path / f"shard-{i:05d}.jsonl")
        with open(p, "wb") as f:
            f.write(b'{"text": "x"}\n')
        paths.append(p)
    t0 = time.time()
    stamps = fingerprints_of(paths)
    config = ChunkConfig(text_key="text", append_eos=False, chunk_bytes=1 << 20, row_group_tokens=1 << 16,
                         compression="zstd", compression_level=3, token_encoding="uint32", piece_chars=1 << 16,
                         max_piece_chars=1 << 20)
    plan = make_plan({"spec": "x"}, config, [MatchedFile(p, 14, fingerprint=stamps[p]) for p in paths])
    assert plan.ledger()["inputs"][7]["fingerprint"] == stamps[paths[7]]
    tracemalloc.start()
    assert input_changed(plan.ledger()["inputs"]) is None
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.time() - t0 < 30 and peak < 32 << 20, (time.time() - t0, peak)
    with open(paths[12345], "r+b") as f:  # the same size, the same bytes even: written to
        f.write(b"{")
    os.utime(paths[12345], ns=(stamps[paths[12345]]["mtime_ns"],) * 2)  # its mtime put back: ctime still moved
    said = input_changed(plan.ledger()["inputs"])
    assert said.startswith(f"input file {paths[12345]} changed while the cache was built (ctime_ns ") and \
        "mtime_ns" not in said
