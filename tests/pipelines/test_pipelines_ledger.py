"""The finished ledger (pipelines/finalize.py) and the bad-record verdict (pipelines/ledger.py)."""

from __future__ import annotations

import glob
import json
import os

import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing import test_pipeline

from build_helpers import FNAPI, small_plan, write_plan
from cachegen import ledger_chunks
from pipelines import finalize
from pipelines.errors import BuildError
from pipelines.ledger import TooManyBadRecords, check_bad_fraction_of
from pipelines.chunking.transforms import BuildCache
from reader.format import spec as fmt
from reader.format import table as chunk_table
from reader.format.sidecar import ledger_entry
from reader.storage import finish
from reader.order.streams import round_robin_order
from reader.storage.cache import Cache


def test_finished_ledger_is_a_pure_function_of_the_entries_in_order(tmp_path):
    """The finalize streams the chunks' entries into the table: the same entries give the same table and ledger
    (its name is its checksum); a missing entry or an unfinished compressed shard is an error naming it."""
    plan, tok, _, _ = small_plan(tmp_path)
    out = str(tmp_path / "out")
    write_plan(out, plan)
    raw_plan = json.load(open(f"{out}/{fmt.LEDGER_NAME}"))
    with test_pipeline.TestPipeline(options=PipelineOptions(FNAPI)) as p:
        _ = p | BuildCache(out, plan, tok, max_bad_fraction=1.0)
    text = open(f"{out}/{fmt.LEDGER_NAME}").read()
    ledger = json.loads(text)
    assert ledger["format_version"] == 4 and "chunks" not in ledger
    inputs = finalize.final_inputs(raw_plan, out)
    order = round_robin_order([i["chunks"] for i in inputs])
    sidecars = [json.load(open(f"{out}/{fmt.sidecar_path(s, k)}")) for s, k in order.tolist()]
    entries = [ledger_entry(sc) for sc in sidecars]
    for block_rows in (chunk_table.BLOCK_ROWS, 3):  # (any block size: the same rows)
        draft = finalize.draft_table(out, raw_plan, inputs, [entries[i:i + block_rows]
                                                             for i in range(0, len(entries), block_rows)],
                                     block_rows=block_rows)
        again = draft.ledger
        finish.discard(draft)
        if block_rows == chunk_table.BLOCK_ROWS:
            assert fmt.dumps_ledger(again) == text
    t = Cache(out).table
    assert list(t.checksums) == [sc["checksum"] for sc in sidecars]
    assert list(t.sidecar_checksums) == [e["sidecar_checksum"] for e in entries]
    assert t.tokens.tolist() == [sc["tokens"] for sc in sidecars] and t.paths[:] == [sc["path"] for sc in sidecars]
    # the entry files (kept) say the same
    assert [json.load(open(p)) for p in sorted(glob.glob(f"{out}/chunks/*/*.entry"))] == \
        sorted(entries, key=lambda e: (e["shard"], e["index_in_shard"]))
    finish.discard(finalize.draft_table(out, raw_plan, inputs))
    os.remove(f"{out}/{chunk_table.entry_path(0, 1)}")
    with pytest.raises(BuildError, match=r"chunk .*chunk-000001.parquet is missing after the build"):
        finalize.draft_table(out, raw_plan, inputs)
    # a rerun of an unfinished cache of an older version finishes it in that version: its chunk list made from
    # the same entries, as a finalize of that version made it from the sidecars; no table
    for version in (2, 3):
        old = finalize.draft_table(out, dict(raw_plan, format_version=version), inputs, [entries[:3], entries[3:]],
                                   block_rows=3)
        assert old.tmp is None and "table" not in old.ledger and old.ledger["format_version"] == version
        assert (old.ledger["chunks"], old.ledger["bad_records"]) == ledger_chunks(sidecars)
        assert old.ledger["totals"] == ledger["totals"]
    os.remove(f"{out}/{fmt.shard_done_path(1)}")
    with pytest.raises(BuildError, match="b.jsonl.gz was not completed"):
        finalize.final_inputs(raw_plan, out)


def test_bad_fraction_verdict_and_its_record():
    ledger = {"totals": {"docs": 96, "bad_records": 4}, "bad_records": {"empty_text": 1, "invalid_json": 3}}
    assert check_bad_fraction_of([ledger], 0.04) is None  # exactly at the limit still finishes
    assert check_bad_fraction_of([{"totals": {"docs": 0, "bad_records": 0}, "bad_records": {}}], 0.0) is None
    failure = check_bad_fraction_of([ledger], 0.01)
    assert failure == TooManyBadRecords(bad_records=4, lines=100, max_bad_fraction=0.01,
                                        reasons={"empty_text": 1, "invalid_json": 3})
    assert TooManyBadRecords.from_json(json.loads(json.dumps(failure.to_json()))) == failure
    assert failure.to_json()["error"] == "too_many_bad_records"
    msg = failure.message("gs://b/cache")
    assert msg.startswith("too many bad records: 4 of 100 input lines (4.0000%)")
    assert "--max_bad_fraction=0.01 (empty_text: 1, invalid_json: 3)" in msg and "gs://b/cache/bad/" in msg
    assert msg.endswith("completed chunks are kept and the build just finalizes.")
