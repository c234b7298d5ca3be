"""What the launcher does before the job (pipelines/launcher.py), checked on real files."""

from __future__ import annotations

import json
import os

import pytest

from build_helpers import load_ledger, write_shard
from pipelines import status
from pipelines.errors import BuildError
from pipelines.launcher import check_output, match_inputs, plan_build, reconcile_output
from pipelines.options import parse_args
from pipelines.plan import MatchedFile
from reader.format import spec as fmt
from build_helpers import build
from build_helpers import mixed_lines


def test_match_inputs_sorts_paths_and_reads_sizes(tmp_path):
    b = write_shard(str(tmp_path / "b.jsonl"), [{"text": "two"}, {"text": "three"}])
    a = write_shard(str(tmp_path / "a.jsonl.gz"), [{"text": "one"}])
    (tmp_path / "sub").mkdir()  # a directory matched by the glob is not an input file
    assert match_inputs([str(tmp_path / "*"), b]) == [MatchedFile(a, os.path.getsize(a)),
                                                      MatchedFile(b, os.path.getsize(b))]
    with pytest.raises(BuildError, match="matches no file"):
        match_inputs([str(tmp_path / "nothing*")])


def test_links_and_duplicate_patterns_are_one_shard_with_a_note(tmp_path, caplog, monkeypatch):
    import logging

    # a library configuring logging earlier in the session may have disabled existing loggers
    monkeypatch.setattr(logging.getLogger("chunkledger.build"), "disabled", False)
    caplog.set_level(logging.WARNING, logger="chunkledger.build")
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": "one"}])
    os.symlink(a, tmp_path / "in" / "z-link.jsonl")
    os.link(a, tmp_path / "in" / "y-hard.jsonl")
    got = match_inputs([str(tmp_path / "in" / "*"), a])
    assert got == [MatchedFile(a, os.path.getsize(a))]
    notes = caplog.text
    assert "z-link.jsonl is the same file as" in notes and "y-hard.jsonl is the same file as" in notes
    assert "matched by more than one --input" in notes


def test_directory_input_and_file_output_say_what_to_do(tmp_path):
    (tmp_path / "d").mkdir()
    write_shard(str(tmp_path / "d" / "a.jsonl"), [{"text": "one"}])
    with pytest.raises(BuildError, match=r"is a directory, not a file.*--input '.*/d/\*\.jsonl'"):
        match_inputs([str(tmp_path / "d")])
    (tmp_path / "f").write_text("x")
    with pytest.raises(BuildError, match="is a file, not a directory"):
        check_output(str(tmp_path / "f"))
    with pytest.raises(BuildError, match="is a file, not a directory"):
        check_output(str(tmp_path / "f" / "cache"))
    check_output(str(tmp_path / "new" / "cache"))  # missing directories are created later


def test_prepare_forgets_an_earlier_verdict_before_a_rerun(tmp_path):
    lines, _ = mixed_lines(1, n_good=30)
    a = write_shard(str(tmp_path / "a.jsonl"), lines)
    with pytest.raises(BuildError, match="too many bad records"):
        build(tmp_path, [a], chunk_bytes=2000, max_bad_fraction=0.01)
    out = str(tmp_path / "cache")
    assert os.path.exists(os.path.join(out, fmt.FAILED_NAME))
    prepared = reconcile_output(plan_build(parse_args(["--input", a, "--output", out, "--tokenizer",
                                                       "tiktoken:cl100k_base", "--chunk_bytes", "2000",
                                                       "--max_bad_fraction", "0.5"])))
    assert prepared.resumed and prepared.finished is None
    # The rerun's job decides afresh: an old _FAILED.json must not stand in for its outcome.
    assert not os.path.exists(os.path.join(out, fmt.FAILED_NAME))
    assert status.read_outcome(out).failure is None and not status.read_outcome(out).finished
    assert load_ledger(out) == json.loads(json.dumps(prepared.plan.ledger()))


def test_the_output_tree_rules_name_the_readers_index_directory():
    from pipelines import launcher
    from reader.storage.index import INDEX_DIR

    assert launcher.INDEX_DIR == INDEX_DIR


def test_a_splits_manifest_nested_deep_is_a_one_line_error(tmp_path):
    from reader.format.splits import SplitSpec
    from pipelines.launcher import check_layout

    (tmp_path / "splits.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BuildError, match=r"splits.json is damaged \(ValueError: JSON nested more than 32 deep\)"):
        check_layout(str(tmp_path), SplitSpec(validation_fraction=0.1, seed=0))
