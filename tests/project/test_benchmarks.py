"""The benchmark suite runs (quick profile, tiny inputs) and its output is well-formed.

No timing assertions: performance figures live in benchmarks/ only. This test exists so that the suite
cannot rot: every figure `make bench` reports must be produced, finite, and rendered in the report.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import corpus as corpus_mod
from benchmarks import report
from benchmarks.run import TARGETS

REPO = Path(__file__).resolve().parents[2]

# Every figure the targets and the report's tables name (plus the supporting ones the report explains).
REQUIRED = [
    "pipeline_vs_tiktoken_limit", "pipeline_vs_limit", "pipeline_hf_vs_raw_hf", "pipeline_vs_hf_datasets",
    "pipeline_hf_vs_hf_datasets", "pipeline_startup_fraction_max",
    "pipeline_scaling_2_vs_1", "reader_vs_memmap", "reader_tokens_per_s", "memmap_tokens_per_s",
    "reader_shuffled_vs_memmap", "reader_shuffled_tokens_per_s", "memmap_shuffled_tokens_per_s",
    "reader_mixture_vs_single", "reader_mixture_shuffled_vs_single", "mixture_open_vs_ledgers",
    "reader_1p_vs_memmap", "reader_shuffled_1p_vs_memmap", "reader_workers_peak_rss_mb",
    "seek_far_vs_near", "ledger_open_s_100k", "bytes_per_token", "pipeline_peak_rss_mb",
    "pipeline_peak_rss_mb_small_shards", "pipeline_peak_rss_ratio_4x_shards", "reader_peak_rss_mb",
    "reader_memory_budget_mb", "reader_rss_growth_vs_budget", "limit_tokens_per_s", "tiktoken_limit_tokens_per_s",
    "raw_hf_tokens_per_s", "pipeline_tokens_per_s", "pipeline_steady_tokens_per_s", "pipeline_hf_tokens_per_s",
    "hf_datasets_tokens_per_s", "hf_datasets_hf_tokens_per_s", "pipeline_1w_tokens_per_s",
    "hf_tiktoken_agreement", "hf_tiktoken_agreement_with_014_pattern", "corpus_mb", "tokens",
    # each encoder alone: MB per CPU-second and agreement on the same documents
    "encoder_tiktoken_mb_per_cpu_s", "encoder_fastokens_mb_per_cpu_s", "encoder_hf_tokenizers_mb_per_cpu_s",
    "encoder_fastokens_hf_json_mb_per_cpu_s", "encoder_fastokens_agreement", "encoder_hf_tokenizers_agreement",
    "encoder_fastokens_hf_json_agreement",
    # where a worker's CPU goes
    "stage_encode_share", "stage_parquet_share", "stage_parse_share", "stage_read_hash_share", "stage_encode_vs_whole",
    "stage_ceiling_without_writing", "stage_ceiling_parse_encode",
    # the fixed seconds of the 2-worker build, from its trace
    "pipeline_fixed_before_s", "pipeline_tail_s", "pipeline_fixed_after_s", "pipeline_workers_forked",
]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_suite_produces_every_figure(tmp_path):
    out = tmp_path / "quick.json"
    doc = tmp_path / "BENCHMARKS.md"
    cmd = [sys.executable, "-m", "benchmarks.run", "--quick", "--work", str(tmp_path / "work"),
           "--out", str(out), "--doc", str(doc), "--plots", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fig = json.loads(out.read_text())

    assert isinstance(fig, dict)
    missing = [k for k in REQUIRED if k not in fig]
    assert not missing, f"figures missing from {out}: {missing}"
    for k in REQUIRED + list(TARGETS):
        v = fig[k]
        assert isinstance(v, (int, float)) and not isinstance(v, bool), (k, v)
        assert math.isfinite(v), (k, v)
    # Flat: no nested objects; every value a finite number, a bool or a short string.
    for k, v in fig.items():
        assert isinstance(v, (int, float, str, bool)), (k, type(v))
        if isinstance(v, float):
            assert math.isfinite(v), (k, v)
    # Rates and sizes are positive; the tokenizer conversion avoided the trap.
    for k in ("limit_tokens_per_s", "pipeline_tokens_per_s", "reader_tokens_per_s", "memmap_tokens_per_s",
              "bytes_per_token", "pipeline_peak_rss_mb", "reader_peak_rss_mb", "tokens"):
        assert fig[k] > 0, k
    assert fig["hf_tiktoken_agreement"] >= 0.999
    # the encoders give the reference's tokens (the run also checks every build's token totals against them)
    assert fig["encoder_fastokens_agreement"] == 1.0 and fig["encoder_fastokens_hf_json_agreement"] == 1.0
    assert fig["encoder_hf_tokenizers_agreement"] >= 0.999
    # each stage alone costs less CPU than the whole ChunkBuilder that runs them all
    for k in ("read_hash", "parse", "encode", "parquet"):
        assert 0 < fig[f"stage_{k}_share"] < 1, k
        assert fig[f"stage_{k}_cpu_s"] < fig["stage_whole_cpu_s"], k
    # the bounds without writing, and with only parsing and encoding, lie between the whole's and 1
    assert fig["stage_encode_vs_whole"] < fig["stage_ceiling_without_writing"] < fig["stage_ceiling_parse_encode"] < 1
    # the local runner forked both workers of the 2-worker build from its warm process
    assert fig["pipeline_workers_forked"] == 2
    assert fig["reader_memmap_same_windows"] is True
    # The shuffle figures are included.
    assert any(k.startswith("shuffle_") for k in fig)

    # The report names every target figure with its value and verdict, and its plots exist.
    text = doc.read_text()
    assert "QUICK RUN" in text
    for k in TARGETS:
        assert f"`{k}`" in text, k
    assert (tmp_path / "bench_pipeline.png").stat().st_size > 0
    details = json.loads((tmp_path / "quick-details.json").read_text())
    assert details["profile"] == "quick" and details["samples"]
    # The machine's own 2-vs-1 scaling is measured beside ours, and a speed probe ran before every measured
    # command (encoders, the limit x3 (twice on 2 processes, once on 1), tiktoken's limit, builds x4, HF datasets
    # x2, raw HF, stages, reader, mixture), each shown in the report.
    assert fig["limit_1p_tokens_per_s"] > 0 and fig["limit_scaling_2_vs_1"] > 0
    assert math.isclose(fig["pipeline_scaling_vs_limit_scaling"],
                        fig["pipeline_scaling_2_vs_1"] / fig["limit_scaling_2_vs_1"])
    probes = details["speed_probes"]
    labels = [q["label"] for q in probes]
    assert labels.count("benchmarks.baselines limit --encoder fastokens") == 2
    assert labels.count("benchmarks.baselines limit --encoder fastokens --first_half") == 1
    assert labels.count("benchmarks.baselines limit --encoder tiktoken") == 1
    assert len(probes) == 15 and all(q["zstd_decompress_mb_s"] > 0 and q["memcpy_gb_s"] > 0 for q in probes)
    assert 0 < fig["probe_compute_min_vs_max"] <= 1 and 0 < fig["probe_memory_min_vs_max"] <= 1
    assert "### Machine speed during the run" in text and text.count("| benchmarks.baselines limit --encoder fastokens |") == 2
    assert "### The encoders alone" in text and "### Where a worker's CPU goes" in text
    # Quick mode never touches the committed figures.
    assert out.parent == tmp_path


def test_split_doc_bounds_and_keeps_text():
    text = "\n\n".join(("word " * 50).strip() for _ in range(200))
    pieces = corpus_mod.split_doc(text, max_chars=1000)
    assert all(len(p) <= 1000 for p in pieces)
    assert sum(p.count("word") for p in pieces) == text.count("word")


def test_man_to_text_strips_markup():
    src = '.\\" comment\n.TH LS 1\n.SH NAME\nls \\- list \\fBdirectory\\fR contents\n.PP\nText\\(em more.\n'
    out = corpus_mod.man_to_text(src)
    assert "comment" not in out and "\\f" not in out and ".TH" not in out
    assert "ls - list directory contents" in out and "Text— more." in out


def test_report_marks_missed_targets(tmp_path):
    fig = {"pipeline_vs_limit": 0.25, "seek_far_vs_near": 1.1, "bench_total_s": 1.0, "stage_encode_vs_whole": 0.3,
           "stage_encode_share": 0.3, "stage_parquet_share": 0.45, "pipeline_vs_tiktoken_limit": 4.0,
           "stage_ceiling_without_writing": 0.55, "stage_ceiling_parse_encode": 0.69}
    details = {"targets": {k: list(v) for k, v in TARGETS.items()}, "profile": "full"}
    report.write(fig, details, tmp_path / "B.md", tmp_path)
    text = (tmp_path / "B.md").read_text()
    row = text.split("| `pipeline_vs_limit` |")[1].split("\n")[0]
    assert "**missed**" in row and "met" in text.split("| `pipeline_vs_tiktoken_limit` |")[1].split("\n")[0]
    assert "met" in text.split("| `seek_far_vs_near` |")[1].split("\n")[0]
    # a missed target's reason, computed from the run's own figures
    why = text.split("- **`pipeline_vs_limit`**")[1].split("\n")[0]
    assert "30% of its CPU encoding" in why and "45% writing" in why and "at most 0.30 of the limit" in why
    assert "wrote nothing would reach at most 0.55" in why and "encoded them 0.69" in why
