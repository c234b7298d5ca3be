"""Worker memory is bounded by the chunk, not the shard, even for a shard of mostly bad lines."""

from __future__ import annotations

import gzip
import json
import tracemalloc

import pytest

from build_helpers import read_dead_letters, work_units
from pipelines.launcher import match_inputs
from pipelines.options import build_arg_parser, chunk_config
from pipelines.plan import make_plan
from pipelines.tokenize.tokenizer import resolve
from pipelines.chunking.transforms import BuildChunksFn


@pytest.mark.slow
def test_streamed_gzip_shard_of_bad_lines_keeps_python_memory_bounded(tmp_path):
    n_lines = 200_000
    path = tmp_path / "in" / "big.jsonl.gz"
    path.parent.mkdir()
    good = json.dumps({"text": "A real document. " * 20}).encode()
    with gzip.open(path, "wb", compresslevel=1) as f:
        for i in range(n_lines):
            f.write(good + b"\n" if i % 1000 == 0 else b'{"x": %d}\n' % i)
    size = sum(len(good) + 1 if i % 1000 == 0 else len(b'{"x": %d}' % i) + 1 for i in range(n_lines))
    args = build_arg_parser().parse_args(["--input", "x", "--output", "y", "--tokenizer", "tiktoken:cl100k_base",
                                             "--chunk_bytes", str(1 << 20)])
    tok = resolve("tiktoken:cl100k_base")
    plan = make_plan(tok.identity(), chunk_config(args), match_inputs([str(path)]))
    (unit,) = work_units(plan)
    out = str(tmp_path / "out")
    fn = BuildChunksFn(out, tok, plan.config)
    fn.setup()
    tracemalloc.start()
    try:
        (result,) = list(fn.process(unit))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.done == {"chunks": -(-size // (1 << 20)), "uncompressed_bytes": size}
    assert sum(s["bad_records"] for s in result.entries) == n_lines - n_lines // 1000
    assert sum(s["docs"] for s in result.entries) == n_lines // 1000
    # ~110k dead letters per chunk held as dicts would take far more than this
    print(f"peak Python memory {peak / 2**20:.1f} MiB")
    assert peak < 16 << 20, f"peak Python memory {peak / 2**20:.1f} MiB"
    dead = read_dead_letters(out)
    assert len(dead) == n_lines - n_lines // 1000
    offsets = [d["offset"] for d in dead]
    assert offsets == sorted(offsets) and dead[0]["reason"] == "missing_text"
