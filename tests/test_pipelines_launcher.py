"""What the launcher does before the job (pipelines/launcher.py), checked on real files."""

from __future__ import annotations

import json
import os

import pytest

from build_helpers import load_ledger, write_shard
from pipelines import status
from pipelines.errors import BuildError
from pipelines.launcher import match_inputs, prepare
from pipelines.options import parse_args
from test_build_cache import build
from test_build_cache_bad_input import mixed_lines


def test_match_inputs_sorts_paths_and_reads_sizes(tmp_path):
    b = write_shard(str(tmp_path / "b.jsonl"), [{"text": "two"}, {"text": "three"}])
    a = write_shard(str(tmp_path / "a.jsonl.gz"), [{"text": "one"}])
    (tmp_path / "sub").mkdir()  # a directory matched by the glob is not an input file
    assert match_inputs([str(tmp_path / "*"), b]) == [(a, os.path.getsize(a)), (b, os.path.getsize(b))]
    with pytest.raises(BuildError, match="matches no file"):
        match_inputs([str(tmp_path / "nothing*")])


def test_prepare_forgets_an_earlier_verdict_before_a_rerun(tmp_path):
    lines, _ = mixed_lines(1, n_good=30)
    a = write_shard(str(tmp_path / "a.jsonl"), lines)
    with pytest.raises(BuildError, match="too many bad records"):
        build(tmp_path, [a], chunk_bytes=2000, max_bad_fraction=0.01)
    out = str(tmp_path / "cache")
    assert os.path.exists(os.path.join(out, status.FAILED_NAME))
    prepared = prepare(parse_args(["--input", a, "--output", out, "--tokenizer", "tiktoken:cl100k_base",
                                   "--chunk_bytes", "2000", "--max_bad_fraction", "0.5"]))
    assert prepared.resumed and prepared.finished is None
    # The rerun's job decides afresh: an old _FAILED.json must not stand in for its outcome.
    assert not os.path.exists(os.path.join(out, status.FAILED_NAME))
    assert status.read_outcome(out).failure is None and not status.read_outcome(out).finished
    assert load_ledger(out) == json.loads(json.dumps(prepared.plan.ledger()))
