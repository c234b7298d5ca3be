"""The pure ledger builder (pipelines/ledger.py): the finished ledger and the bad-record verdict."""

from __future__ import annotations

import json

import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing import test_pipeline

from build_helpers import FNAPI, small_plan
from pipelines.errors import BuildError
from pipelines.ledger import TooManyBadRecords, check_bad_fraction, finished_ledger
from pipelines.plan import UnitResult
from pipelines.chunking.transforms import BuildCache
from reader.format import spec as fmt


def test_finished_ledger_is_pure_and_ordered(tmp_path):
    plan, tok, _, _ = small_plan(tmp_path)
    out = str(tmp_path / "out")
    with test_pipeline.TestPipeline(options=PipelineOptions(FNAPI)) as p:
        _ = p | BuildCache(out, plan, tok, max_bad_fraction=1.0)
    ledger = json.load(open(f"{out}/{fmt.LEDGER_NAME}"))
    sidecars = [json.load(open(f"{out}/{fmt.sidecar_path(c['shard'], c['index_in_shard'])}")) for c in ledger["chunks"]]
    done = {"chunks": ledger["inputs"][1]["chunks"], "uncompressed_bytes": ledger["inputs"][1]["uncompressed_bytes"]}
    results = [UnitResult(shard=s["shard"], sidecars=(s,), done=None) for s in sidecars[::-1]]
    results.append(UnitResult(shard=1, sidecars=(), done=done))
    again = finished_ledger(plan, results)  # any arrival order gives the same ledger
    assert fmt.dumps_ledger(again) == open(f"{out}/{fmt.LEDGER_NAME}").read()
    with pytest.raises(BuildError, match="missing"):
        finished_ledger(plan, results[1:])
    with pytest.raises(BuildError, match="b.jsonl.gz was not completed"):
        finished_ledger(plan, results[:-1])


def test_bad_fraction_verdict_and_its_record():
    ledger = {"totals": {"docs": 96, "bad_records": 4}, "bad_records": {"empty_text": 1, "invalid_json": 3}}
    assert check_bad_fraction(ledger, 0.04) is None  # exactly at the limit still finishes
    assert check_bad_fraction({"totals": {"docs": 0, "bad_records": 0}, "bad_records": {}}, 0.0) is None
    failure = check_bad_fraction(ledger, 0.01)
    assert failure == TooManyBadRecords(bad_records=4, lines=100, max_bad_fraction=0.01,
                                        reasons={"empty_text": 1, "invalid_json": 3})
    assert TooManyBadRecords.from_json(json.loads(json.dumps(failure.to_json()))) == failure
    assert failure.to_json()["error"] == "too_many_bad_records"
    msg = failure.message("gs://b/cache")
    assert msg.startswith("too many bad records: 4 of 100 input lines (4.0000%)")
    assert "--max_bad_fraction=0.01 (empty_text: 1, invalid_json: 3)" in msg and "gs://b/cache/bad/" in msg
    assert msg.endswith("completed chunks are kept and the build just finalizes.")
