"""benchmarks/sft_bench.py on a few records: the mask figures against counts made here from the same records,
the encoding rates present and compared on the same bytes, and the report's section."""

from __future__ import annotations

import numpy as np

from benchmarks import report, sft_bench
from pipelines.chunking.supervised import spans_of
from pipelines.tokenize import sft
from pipelines.tokenize import sft_encoders
from pipelines.tokenize.tokenizer import resolve


def test_mask_figures_count_spans_and_bits_of_the_same_records():
    fig = sft_bench.mask_figures(60, seed=3)
    tt = sft_encoders.TiktokenSft(resolve("tiktoken:cl100k_base").load_reference().enc)
    tokens = runs = loss = bits = records = 0
    for msgs in sft_bench.conversations(60, seed=3):
        ids, mask = sft.encode_chat({"messages": msgs}, sft_bench.CHATML, tt, eos_token="<|endoftext|>")
        spans = spans_of(mask)
        tokens, runs, loss, records = tokens + len(ids), runs + len(spans) // 2, loss + int(mask.sum()), records + 1
        bits += len(np.packbits(mask))
    assert fig["sft_mask_tokens_per_record"] == tokens / records
    assert fig["sft_mask_spans_per_record"] == runs / records and runs >= records
    assert fig["sft_mask_loss_share"] == loss / tokens
    assert fig["sft_mask_spans_raw_bytes_per_token"] == 8 * runs / tokens
    assert fig["sft_mask_bits_raw_bytes_per_token"] == bits / tokens
    # stored: compressed, so below raw bits; both measured on the file, never zero
    assert 0 < fig["sft_mask_bits_bytes_per_token"] < fig["sft_mask_bits_raw_bytes_per_token"]
    assert 0 < fig["sft_mask_spans_bytes_per_token"]


def test_rate_figures_and_the_report_section():
    fig = {**sft_bench.mask_figures(30), **sft_bench.rate_figures(30, rounds=1)}
    for key in ("chat", "pc"):
        assert fig[f"sft_{key}_records_per_cpu_s_reference"] > 0 and fig[f"sft_{key}_records_per_cpu_s_fast"] > 0
        assert fig[f"sft_{key}_fast_vs_reference"] == (fig[f"sft_{key}_records_per_cpu_s_fast"]
                                                       / fig[f"sft_{key}_records_per_cpu_s_reference"])
    text = "\n".join(report.sft_section(fig))
    assert "## Loss masks: bytes per token" in text
    assert f"{fig['sft_mask_spans_bytes_per_token']:.4f}" in text and f"{fig['sft_chat_fast_vs_reference']:.2f}" in text
    assert report.sft_section({}) == []
