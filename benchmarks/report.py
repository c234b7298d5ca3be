"""Render docs/BENCHMARKS.md (and PNG plots) from the figures of one run of benchmarks.run.

    python -m benchmarks.report [--figures benchmarks/latest.json] [--doc docs/BENCHMARKS.md] [--plots docs]

re-renders the report from saved figures without re-measuring.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from benchmarks import report_peers
from benchmarks.common import REPO
from benchmarks.report_peers import stage_table

# (key, meaning, format): the targeted figures first, the build's before the reader's.
MAIN_ROWS = report_peers.PEER_MAIN_ROWS + [
    ("pipeline_vs_tiktoken_limit", "our build (DirectRunner, 2 workers, whole command, tiktoken's cl100k tokens via the "
     "fast backend) / tiktoken's limit (tiktoken alone, 2 processes, texts in memory)", "ratio"),
    ("pipeline_vs_limit", "our build / fastokens (as our fast backend runs it) alone, 2 processes, texts in memory "
     "(reported: no build that reads and writes files reaches an encoder on texts in memory)", "ratio"),
    ("pipeline_vs_hf_datasets", "our build / HF `datasets` json→map(num_proc=2)→to_parquet with tiktoken", "ratio"),
    ("pipeline_hf_vs_raw_hf", "our build with the cl100k `tokenizer.json` (fast backend) / raw HF `tokenizers` on 2 "
     "cores", "ratio"),
    ("pipeline_startup_fraction_max", "largest share of start-up and tail in any timed build (2 workers, 1 worker, HF)",
     "ratio"),
    ("pipeline_scaling_2_vs_1", "our build, 2 workers / 1 worker (the encoder alone scales {limit_scaling_2_vs_1:.2f} "
     "on this machine in the same run)", "ratio"),
    ("pipeline_parquet_vs_jsonl_input", "our build of the corpus's first shards as Parquet (zstd, 8 MB row groups) / of "
     "the same jsonl shards, whole command, side by side (the mean of the two jsonl builds around it)", "ratio"),
    ("reader_vs_memmap", "packed sequential batches (L=2048, B=64, flat-tokens layout; one reader with "
     "{reader_num_workers} worker processes, steady state) / memmap of a flat uint32 file", "ratio"),
    ("reader_tokens_per_s", "reader tokens/s, packed sequential (absolute floor)", "rate"),
    ("reader_shuffled_vs_memmap", "growing-window shuffle, default budget, {reader_num_workers} workers / memmap, "
     "same permutation", "ratio"),
    ("reader_mixture_vs_single", "a mixture of 4 components (weights 0.4/0.3/0.2/0.1, each the benchmark cache "
     "with its own store) / the cache alone, packed sequential, {reader_num_workers} workers, alternating runs", "ratio"),
    ("seek_far_vs_near", "open + first batch at step 10^6 / the same at step 0", "ratio"),
    ("ledger_open_s_100k", "seconds to open a synthetic ledger of 100k chunks with the reader", "s"),
    ("bytes_per_token", "cache size on disk (all files) per token", "num"),
    ("pipeline_peak_rss_ratio_4x_shards", "pipeline peak RSS (process tree), {pipeline_shard_mb:.3g} MB shards / "
     "{pipeline_shard_mb_small:.3g} MB shards (flat if <= 1.25)", "ratio"),
    ("reader_rss_growth_vs_budget", "reader RSS growth while reading / its memory budget", "ratio"),
    ("best_fit_padding_L2048", "best-fit packing (`packing=\"best_fit\"`, each chunk per window), L=2048: padding "
     "tokens / row tokens", "ratio"),
    ("long_docs_best_fit_padding_L256", "best fit, L=256, on synthetic long documents (200-5,000 tokens, "
     "log-uniform; 64 Mi tokens in chunks of 64 Mi, windows of 4 Mi): padding", "pct"),
    ("long_docs_best_fit_padding_over_plain_bfd_L256", "the same, less plain best-fit decreasing's on the same "
     "windows' pieces (no cap on continuation pieces per row)", "pct"),
    ("best_fit_short_documents_cut_L2048", "best fit, L=2048: documents of at most L tokens that a row sees "
     "without their beginning", "int"),
    ("best_fit_short_documents_cut_L8192", "the same at L=8192", "int"),
    ("best_fit_vs_concat_L2048", "best fit / concat, real tokens per second, L=2048 ({reader_num_workers} "
     "workers, flat layout, R*=16, as many tokens as the cache holds, from opening the reader)", "ratio"),
    ("best_fit_vs_concat_L8192", "the same at L=8192", "ratio"),
    ("dedup_exact_mb_per_cpu_s", "`python -m pipelines.dedup` (exact duplicates, 2 local workers, whole command): MB "
     "of input text per CPU-second of its process tree, i.e. per core (docs/CURATION.md)", "num"),
    ("dedup_near_mb_per_cpu_s", "the same with `--near` (MinHash, LSH, verified pairs; {dedup_near_wall_s:.0f} s for "
     "{dedup_corpus_mb:.0f} MB)", "num"),
    ("dedup_signature_tokens_per_cpu_s", "MinHash signatures alone (pipelines/dedup/minhash.py), tokens per CPU-second",
     "rate"),
    ("dedup_planted_recall", "near marks on {dedup_planted_docs} documents of the corpus with 10% planted near copies: "
     "recall over the planted pairs with true Jaccard >= 0.8", "ratio"),
    ("dedup_marked_false_share", "of the {dedup_marked_pairs} marked (document, keeper) pairs there, the share with "
     "true Jaccard < 0.7", "ratio"),
    ("mask_train_ratio", "a cache with loss masks / the same documents without, real tokens per second "
     "(benchmarks/mask_cost.py: flat layout, batch 64, L=2048, R*=16, 2 workers, one pass of 96 Mi tokens)", "ratio"),
    ("view_train_ratio", "a view keeping 80% of the documents (`language_score >= 0.2`) / the whole cache, real "
     "tokens per second (benchmarks/view_cost.py: flat layout, batch 64, L=2048, R*=16, 2 workers; docs/CURATION.md, "
     "\"Views\")", "ratio"),
    ("latency_50ms_vs_0ms_min", "gs:// with every request held 50 ms / the same read at 0 ms, steady, the least of "
     "packed, shuffled and a 4-cache mixture (benchmarks/latency_bench.py: host 1 of 4, L=2048, B=32, from step "
     "3000, a 64 MiB budget about half the host's share decoded; \"Reading from object storage\" below)", "ratio"),
    ("latency_first_batch_s_50ms_max", "seconds from opening the reader to the first batch at step 3000, gs:// at 50 ms "
     "per request, the most of the three reads", "s"),
    ("latency_rss_growth_vs_budget", "the bench process's RSS growth during a 50 ms read of each kind with the default "
     "budget / that budget", "ratio"),
]

# The encoders alone on the same documents (benchmarks/tokenizer_bench.py throughput): (label, figure prefix,
# what its agreement is measured against).
ENCODER_ROWS = [
    ("tiktoken (`encode_to_numpy`, the reference)", "encoder_tiktoken", "itself (the definition)"),
    ("fastokens on tiktoken's cl100k ranks (our fast backend)", "encoder_fastokens", "tiktoken, every document"),
    ("HF `tokenizers` on the cl100k `tokenizer.json` (`encode_batch_fast`, 1 thread)", "encoder_hf_tokenizers",
     "tiktoken, documents without special-token strings"),
    ("fastokens on the same `tokenizer.json` (our fast backend)", "encoder_fastokens_hf_json",
     "HF `tokenizers`, every document"),
]

SECONDARY_ROWS = [
    ("limit_tokens_per_s", "the limit: fastokens alone, 2 processes, texts in memory (faster of the runs before "
     "and after our builds)", "rate"),
    ("limit_tokens_per_s_a", "the limit, run before our builds", "rate"),
    ("limit_tokens_per_s_b", "the limit, run after our builds", "rate"),
    ("tiktoken_limit_tokens_per_s", "tiktoken's limit (reference row): tiktoken alone, 2 processes, texts in memory, "
     "the corpus's first {corpus_prefix_mb:.0f} MB", "rate"),
    ("tiktoken_limit_vs_limit", "tiktoken's limit / the limit", "ratio"),
    ("raw_hf_tokens_per_s", "raw HF tokenizers, `encode_batch_fast`, 2 threads (first {hf_corpus_mb:.0f} MB)", "rate"),
    ("pipeline_cpu_vs_limit", "CPU efficiency (tokens per CPU-second, robust to contention): our build / the limit",
     "ratio"),
    ("pipeline_cpu_vs_tiktoken_limit", "CPU efficiency: our build / tiktoken's limit", "ratio"),
    ("pipeline_hf_cpu_vs_raw_hf", "CPU efficiency: our HF build / raw HF tokenizers", "ratio"),
    ("pipeline_cpu_vs_hf_datasets", "CPU efficiency: our build / HF datasets (tiktoken)", "ratio"),
    ("pipeline_hf_cpu_vs_hf_datasets", "CPU efficiency: our HF build / HF datasets (HF tokenizers)", "ratio"),
    ("limit_tokens_per_cpu_s", "the limit, tokens per CPU-second of encoding", "rate"),
    ("tiktoken_limit_tokens_per_cpu_s", "tiktoken's limit, tokens per CPU-second of encoding", "rate"),
    ("pipeline_tokens_per_cpu_s", "our build, tokens per CPU-second (whole process tree, whole command)", "rate"),
    ("hf_datasets_tokens_per_cpu_s", "HF datasets (tiktoken), tokens per CPU-second (whole command)", "rate"),
    ("stage_whole_tokens_per_cpu_s", "one worker's per-document path (ChunkBuilder), tokens per CPU-second", "rate"),
    ("stage_encode_vs_whole", "the encoder's share of that CPU: the most a build can reach of the limit", "ratio"),
    ("stage_ceiling_without_writing", "the same for a worker that wrote nothing (read, hash, parse, encode)", "ratio"),
    ("stage_ceiling_parse_encode", "the same for one that only parsed JSON lines in memory and encoded them", "ratio"),
    ("raw_hf_vs_limit", "raw HF tokenizers / the limit", "ratio"),
    ("pipeline_tokens_per_s", "our build, whole command (tiktoken, 2 workers)", "rate"),
    ("pipeline_steady_tokens_per_s", "our build, steady state (tokens / seconds the workers spent in work units)",
     "rate"),
    ("pipeline_steady_vs_limit", "steady state / the limit", "ratio"),
    ("pipeline_startup_fraction", "share of the whole command outside the steady state (2 workers)", "ratio"),
    ("pipeline_1w_startup_fraction", "the same, 1 worker", "ratio"),
    ("pipeline_hf_startup_fraction", "the same, HF tokenizers build", "ratio"),
    ("pipeline_fixed_before_s", "2-worker build: seconds before the first work unit starts", "s"),
    ("pipeline_tail_s", "2-worker build: seconds one worker works alone at the end", "s"),
    ("pipeline_fixed_after_s", "2-worker build: seconds after the last work unit (finalize, shutdown)", "s"),
    ("pipeline_launcher_to_run_cpu_s", "2-worker build: the launcher's CPU-seconds until the run starts (Python, "
     "Beam, planning)", "s"),
    ("pipeline_worker_to_first_unit_cpu_s", "2-worker build: a worker's CPU-seconds until its first unit (forked "
     "workers: almost none)", "s"),
    ("pipeline_workers_forked", "2-worker build: workers forked from the warm process (pipelines/runners/local_workers.py)",
     "int"),
    ("pipeline_hf_fixed_before_s", "HF build: seconds before the first work unit starts", "s"),
    ("pipeline_hf_tail_s", "HF build: seconds one worker works alone at the end", "s"),
    ("pipeline_1w_fixed_before_s", "1-worker build: seconds before the first work unit starts", "s"),
    ("fastokens_load_cpu_s", "loading fastokens from tiktoken's ranks, CPU-seconds (once per build, in the warm "
     "process)", "s"),
    ("fastokens_hf_json_load_cpu_s", "loading fastokens from the cl100k `tokenizer.json`, CPU-seconds", "s"),
    ("conformance_check_cpu_s", "the conformance check, CPU-seconds (once per build, in the warm process)", "s"),
    ("verify_every_1000_share", "re-encoding 1 document in 1000 by the reference, share of the fast encoding's CPU",
     "ratio"),
    ("pipeline_wall_s", "our build, whole command", "s"),
    ("pipeline_hf_tokens_per_s", "our build with HF tokenizers, whole command", "rate"),
    ("pipeline_hf_steady_tokens_per_s", "our build with HF tokenizers, steady state", "rate"),
    ("pipeline_hf_steady_vs_raw_hf", "its steady state / raw HF tokenizers", "ratio"),
    ("pipeline_1w_tokens_per_s", "our build, 1 worker, whole command", "rate"),
    ("pipeline_steady_scaling_2_vs_1", "steady state, 2 workers / 1 worker", "ratio"),
    ("pipeline_1w_cores", "cores the 1-worker build used on average (CPU-seconds of its process tree / wall)", "ratio"),
    ("pipeline_2w_cores", "the same, 2-worker build", "ratio"),
    ("pipeline_cpu_efficiency_2_vs_1", "tokens per CPU-second, 2-worker build / 1-worker build", "ratio"),
    ("limit_scaling_2_vs_1", "the machine's own scaling: the limit (2 processes) / fastokens in 1 process (first half "
     "of the texts, other core idle)", "ratio"),
    ("limit_per_core_2p_vs_1p", "one core's fastokens rate with the other core busy / with it idle (same texts)",
     "ratio"),
    ("pipeline_scaling_vs_limit_scaling", "our build's 2-vs-1 scaling / the machine's (1 = scales as well as "
     "the encoder alone)", "ratio"),
    ("limit_1p_tokens_per_s", "fastokens, 1 process, first half of the texts, in memory", "rate"),
    ("probe_compute_min_vs_max", "the machine's compute speed during the run: slowest probe / fastest (see "
     "\"Machine speed during the run\")", "ratio"),
    ("probe_memory_min_vs_max", "the same for memory copies", "ratio"),
    ("hf_datasets_tokens_per_s", "HF datasets with tiktoken, whole command", "rate"),
    ("hf_datasets_vs_tiktoken_limit", "HF datasets with tiktoken / tiktoken's limit (same texts)", "ratio"),
    ("hf_datasets_map_tokens_per_s", "HF datasets with tiktoken, `.map` phase only", "rate"),
    ("hf_datasets_hf_tokens_per_s", "HF datasets with HF tokenizers, whole command", "rate"),
    ("hf_datasets_hf_vs_raw_hf", "HF datasets with HF tokenizers / raw HF tokenizers", "ratio"),
    ("hf_datasets_bytes_per_token", "HF datasets' default Parquet, bytes per token", "num"),
    ("parquet_bytes_per_token", "our chunk Parquet files only, bytes per token", "num"),
    ("pipeline_peak_rss_mb", "pipeline peak RSS, whole process tree, main shards (MB)", "mb"),
    ("pipeline_peak_rss_mb_small_shards", "the same, shards 4x smaller (MB)", "mb"),
    ("pipeline_peak_rss_proc_mb", "largest single process, main shards (MB)", "mb"),
    ("pipeline_peak_rss_proc_mb_small_shards", "largest single process, shards 4x smaller (MB)", "mb"),
    ("memmap_tokens_per_s", "memmap baseline, sequential", "rate"),
    ("reader_shuffled_tokens_per_s", "reader, shuffled ({reader_num_workers} workers)", "rate"),
    ("reader_1p_vs_memmap", "reader in one process (`num_workers=0`), packed sequential / memmap", "ratio"),
    ("reader_1p_tokens_per_s", "reader in one process, packed sequential", "rate"),
    ("reader_shuffled_1p_vs_memmap", "reader in one process, shuffled / memmap", "ratio"),
    ("reader_shuffled_1p_tokens_per_s", "reader in one process, shuffled", "rate"),
    ("reader_from_open_tokens_per_s", "reader ({reader_num_workers} workers), packed sequential, from opening the "
     "reader ({reader_batches} batches)", "rate"),
    ("reader_first_batch_s", "its first batch after opening, worker start-up included (s)", "s"),
    ("reader_1p_first_batch_s", "the same in one process (s)", "s"),
    ("reader_arrays_vs_memmap", "reader, five-array layout (inputs, targets, segment_ids, positions, loss_mask), "
     "{reader_num_workers} workers / memmap", "ratio"),
    ("reader_arrays_tokens_per_s", "reader, five-array layout, packed sequential", "rate"),
    ("reader_arrays_shuffled_vs_memmap", "reader, five-array layout, shuffled / memmap", "ratio"),
    ("reader_arrays_1p_vs_memmap", "reader, five-array layout, one process / memmap", "ratio"),
    ("reader_arrays_shuffled_1p_vs_memmap", "reader, five-array layout, one process, shuffled / memmap", "ratio"),
    ("memmap_shuffled_tokens_per_s", "memmap baseline, same permutation", "rate"),
    ("reader_mixture_tokens_per_s", "mixture of 4, packed sequential, {reader_num_workers} workers", "rate"),
    ("reader_mixture_shuffled_vs_single", "mixture of 4 / the cache alone, shuffled, {reader_num_workers} workers "
     "(each component decodes the mixes it is in, whole: over {mixture_batches} batches the heavier components "
     "end partway into a second mix, a cost that shrinks as runs get longer)", "ratio"),
    ("reader_mixture_cpu_vs_single", "mixture of 4 / the cache alone, sequential, {reader_num_workers} workers, "
     "tokens per CPU-second of the process tree", "ratio"),
    ("reader_mixture_shuffled_cpu_vs_single", "the same, shuffled", "ratio"),
    ("reader_mixture_1p_vs_single", "mixture of 4 / the cache alone, sequential, one process", "ratio"),
    ("reader_mixture_1p_cpu_vs_single", "the same, tokens per CPU-second", "ratio"),
    ("reader_mixture_shuffled_1p_vs_single", "mixture of 4 / the cache alone, shuffled, one process", "ratio"),
    ("mixture_share_max_error", "largest gap between a component's share of the mixture's first 16 batches and "
     "its weight", "num"),
    ("mixture_open_s_50x10k", "seconds to open a mixture of 50 synthetic ledgers of 10k chunks and locate "
     "batch 10^6", "s"),
    ("mixture_open_s_8x1k", "seconds to open a mixture of 8 synthetic ledgers of 1k chunks and locate batch 10^6",
     "s"),
    ("mixture_open_vs_ledgers", "that / opening its ledgers one by one with Reader(cache)", "ratio"),
    ("parquet_decode_tokens_per_s_1core", "decoding the chunks' token column, 1 core, bytes in memory (pyarrow)", "rate"),
    ("parquet_decode_vs_memmap_1core", "that decode rate / memmap (the ceiling per decoding core)", "ratio"),
    ("parquet_decode_and_verify_tokens_per_s_1core", "decode + sha256 of the chunk bytes, 1 core", "rate"),
    ("reader_peak_rss_mb", "reader process peak RSS, one process (MB)", "mb"),
    ("reader_workers_peak_rss_mb", "reader and its worker processes together, peak RSS (MB)", "mb"),
    ("reader_rss_before_mb", "the same process before reading (interpreter, numpy, pyarrow) (MB)", "mb"),
    ("reader_memory_budget_mb", "reader memory budget (default) (MB)", "mb"),
    ("seek_near_s", "open + first batch at step 0 (s)", "s"),
    ("seek_far_s", "open + first batch at step 10^6 (s)", "s"),
    ("ledger_100k_mb", "size of the 100k-chunk ledger (MB)", "mb"),
    ("hf_tiktoken_agreement", "converted cl100k tokenizer.json (original pattern): documents identical to tiktoken", "ratio"),
    ("hf_tiktoken_agreement_with_014_pattern", "the same with tiktoken 0.14's possessive pattern (the trap)", "ratio"),
    ("corpus_mb", "corpus size (MB)", "mb"),
    ("corpus_prefix_mb", "its first shards, where tiktoken's limit and HF datasets with tiktoken run (MB)", "mb"),
    ("hf_corpus_mb", "its first shards, where raw HF tokenizers and HF datasets with HF tokenizers run (MB)", "mb"),
    ("corpus_distinct_mb", "distinct text in it (MB)", "mb"),
    ("corpus_repeat_factor", "times the distinct text is repeated", "num"),
    ("tokens", "tokens in the corpus (cl100k)", "int"),
    ("bench_total_s", "whole suite (s)", "s"),
]

# Why a target is missed and what would close it: filled in from the evidence of the runs.
NOTES: dict[str, str] = {}
NOTES_FILE = Path(__file__).with_name("notes.json")


def _fmt(v, kind: str) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return str(v)
    if kind == "rate":
        return f"{v / 1e6:.2f} M tok/s"
    if kind == "ratio":
        return f"{v:.3f}"
    if kind == "pct":
        return f"{v:.2%}"
    if kind == "s":
        return f"{v:.2f} s" if v < 100 else f"{v:.0f} s"
    if kind == "mb":
        return f"{v:.0f}"
    if kind == "int":
        return f"{int(v):,}"
    return f"{v:.3g}"


def _target_text(t) -> str:
    """A target ``(value, op)`` as the report prints it ("" when there is none)."""
    if not t:
        return ""
    return f"{t[1]} {t[0]:g}" if t[0] < 1e6 else f"{t[1]} {t[0] / 1e6:g} M tok/s"


def _meets(v, t) -> bool | None:
    """Whether figure ``v`` meets target ``(value, op)``; None without a target or a finite figure."""
    if not t or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return {">=": v >= t[0], "<=": v <= t[0], "<": v < t[0]}[t[1]]


def plot_pipeline(details: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = details.get("samples") or {}
    if not samples:
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    labels = {"tiktoken_2w": "tiktoken, 2 workers", "hf_2w": "HF tokenizers, 2 workers",
              "tiktoken_1w": "tiktoken, 1 worker", "tiktoken_2w_small_shards": "tiktoken, 2 workers, 20 MB shards"}
    for k, s in samples.items():
        pts = [(x[0], x[3]) for x in s if x[3] is not None]
        if pts:
            ax1.plot([p[0] for p in pts], [p[1] / 1e6 for p in pts], label=labels.get(k, k), drawstyle="steps-post")
        ax2.plot([x[0] for x in s[:-1]], [x[2] for x in s[:-1]], label=labels.get(k, k), lw=0.8)
    ax1.set_ylabel("tokens in finished chunks (M)")
    ax1.set_title("Pipeline builds: progress and CPU over time (same corpus, same run)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.set_ylabel("CPU cores used (process tree)")
    ax2.set_xlabel("seconds since the command started")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _meaning(text: str, fig: dict) -> str:
    """A row's meaning with figures filled in (``{key}``), left as written when one is missing."""
    try:
        return text.format(**fig)
    except (KeyError, ValueError):
        return text


def plot_reader_budget(details: dict, fig_: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = details.get("reader_budget_curve") or []
    if len(curve) < 2:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([c[0] for c in curve], [c[1] / 1e6 for c in curve], "o-", label="reader, shuffled")
    if fig_.get("memmap_shuffled_tokens_per_s"):
        ax.axhline(fig_["memmap_shuffled_tokens_per_s"] / 1e6, color="gray", ls="--",
                   label="memmap, same permutation")
        ax.axhline(0.2 * fig_["memmap_shuffled_tokens_per_s"] / 1e6, color="red", ls=":", label="target (0.2x memmap)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("reader memory_budget_bytes (MB)")
    ax.set_ylabel("tokens/s (M)")
    ax.set_title("Reader throughput against its memory budget (L=2048, B=64, shuffled)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


SHUFFLE_ORDERS = ("none", "eras", "ours", "ours_lanes1", "full")
SHUFFLE_COLS = [
    ("within_doc_steady", "batches with 2 examples of one document"),
    ("within_shard_steady", "batches with 2 examples of one shard"),
    ("shard_pair_rate_steady", "same-shard example pairs"),
    ("between_doc_steady", "documents of batch b again in b+1"),
    ("entropy_steady", "neighbour entropy (bits)"),
    ("displacement_mean", "mean displacement / N"),
    ("io_chunk_amp", "I/O amplification (whole chunks)"),
    ("io_rg_amp", "I/O amplification (row groups)"),
]


def shuffle_table(fig: dict, plots: Path, rel) -> list[str]:
    """A compact view of the shuffle figures (all of them are in latest.json under ``shuffle_*``)."""
    if not any(k.startswith("shuffle_") for k in fig):
        return []
    out = ["", "### Shuffle quality (from `benchmarks/shuffle_quality.py`)", "",
           "Measured after our window reached its maximum (`_steady`), at the same batch size, on one cache. "
           "All figures (including early-training ones and 4-host I/O) are in `latest.json` under `shuffle_*`.",
           "", "| order | " + " | ".join(c[1] for c in SHUFFLE_COLS) + " |",
           "|---|" + "---|" * len(SHUFFLE_COLS)]
    for o in SHUFFLE_ORDERS:
        vals = [fig.get(f"shuffle_{o}_{c}") for c, _ in SHUFFLE_COLS]
        if all(v is None for v in vals):
            continue
        out.append(f"| {o} | " + " | ".join(_fmt(v, "num") for v in vals) + " |")
    targets = sorted(k for k in fig if k.startswith("shuffle_target_"))
    if targets:
        out += ["", "| shuffle target | met |", "|---|---|"]
        out += [f"| `{k}` | {'met' if fig[k] in (True, 1, 1.0) else '**missed**'} |" for k in targets]
    png = plots / "bench_shuffle_quality.png"
    if png.exists():
        out += ["", f"![shuffle correlation against training position]({rel(png)})"]
    return out


def packing_table(fig: dict) -> list[str]:
    """Best fit against concatenation and unpacked reading (``benchmarks/packing_cost.py --cache``)."""
    if "best_fit_padding_L2048" not in fig:
        return []
    out = ["", "### Best-fit packing (from `benchmarks/packing_cost.py --cache`)", "",
           f"The benchmark cache's {int(fig.get('packing_chunks', 0))} chunks "
           f"({fig.get('packing_tokens_per_chunk', 0) / 1e6:.1f} M tokens each on average), each packed by "
           "best-fit decreasing per window of whole row groups of about "
           f"{fig.get('packing_window_tokens', 0) / 2**20:.3g} Mi tokens (`ReadOptions(packing=\"best_fit\")`, "
           f"docs/FORMAT.md), at most {fig.get('packing_continuations', 1)} continuation pieces per row (a cache of "
           "format version 4's default), against concatenation "
           "(the documents in global order cut every L tokens) and unpacked reading (a row per L-token piece of "
           f"a document); *smaller chunks*: the same documents in chunks {int(fig.get('packing_split', 0))}x "
           "smaller; *one continuation per row*: older caches' rule; *plain BFD*: best-fit decreasing of the "
           "same windows' pieces with no cap. Cut: a row sees the document (or token) without the document's "
           "beginning. Rates: real tokens per second (`num_tokens`), flat layout, batch 64, from opening the "
           "reader, alternating, best of the rounds; *training*: R*=16, {reader_num_workers} reader workers, as "
           "many tokens as the cache holds (a best-fit read decodes a stream's whole window when it enters it, as "
           "the window's first rows take documents from all of it); *eval*: a pass over a quarter of the cache in "
           "one process.", "",
           "| L | packing | padding | documents cut | tokens cut | training: real tokens/s | / concat | eval: real "
           "tokens/s | / concat |", "|---|---|---|---|---|---|---|---|---|"]
    for L in (256, 2048, 8192):
        if f"best_fit_padding_L{L}" not in fig:
            continue
        for label, p, tag in (("best fit", "best_fit", ""), ("best fit, smaller chunks", "best_fit", "_small"),
                              ("best fit, one continuation per row", "best_fit_one_continuation", ""),
                              ("plain BFD", "plain_bfd", ""), ("concat", "concat", ""), ("unpacked", "unpacked", "")):
            g = lambda k: fig.get(f"{p}_{k}_L{L}{tag}")  # noqa: E731
            cells = []
            for mode in ("", "_eval"):
                rated = not tag and p in ("best_fit", "concat")
                cells.append(_fmt(fig.get(f"{p}_real_tokens_per_s{mode}_L{L}"), "rate") if rated else "")
                vs = fig.get(f"best_fit_vs_concat{mode}_L{L}")
                cells.append(_fmt(vs, "ratio") if rated and p == "best_fit" else "")
            out.append(f"| {L} | {label} | {_fmt(g('padding'), 'pct')} | {_fmt(g('cut_documents'), 'ratio')} | "
                       f"{_fmt(g('cut_tokens'), 'ratio')} | " + " | ".join(cells) + " |")
    long = [L for L in (256, 2048, 8192) if f"long_docs_best_fit_padding_L{L}" in fig]
    if long:
        out += ["", f"Padding on synthetic long documents (lengths log-uniform in 200-5,000 tokens, "
                f"{fig.get('long_docs_tokens', 0) / 2**20:.0f} Mi tokens, the same windows): "
                + "; ".join(f"L={L}: best fit {_fmt(fig[f'long_docs_best_fit_padding_L{L}'], 'pct')}, one "
                            f"continuation per row {_fmt(fig.get(f'long_docs_best_fit_one_continuation_padding_L{L}'), 'pct')}, "
                            f"plain BFD {_fmt(fig.get(f'long_docs_plain_bfd_padding_L{L}'), 'pct')}" for L in long)
                + "."]
    return [_meaning(x, fig) if "{" in x else x for x in out]


def encoder_table(fig: dict) -> list[str]:
    """MB of text per CPU-second and agreement of each encoder alone, on the same documents."""
    if "encoder_fastokens_mb_per_cpu_s" not in fig:
        return []
    out = ["", "### The encoders alone", "",
           f"On the corpus's first {int(fig.get('encoder_docs', 0)):,} documents ({fig.get('encoder_mb', 0):.1f} MB of "
           "text), interleaved, one thread each, best of the repeats (`benchmarks/tokenizer_bench.py throughput`).", "",
           "| encoder | MB of text per CPU-second | documents identical to | agreement |", "|---|---|---|---|"]
    for label, key, against in ENCODER_ROWS:
        out.append(f"| {label} | {_fmt(fig.get(key + '_mb_per_cpu_s'), 'num')} | {against} | "
                   f"{_fmt(fig.get(key + '_agreement'), 'ratio')} |")
    return out


def auto_notes(fig: dict) -> dict[str, str]:
    """Why a pipeline target is missed and what would close it, from the figures of the run itself."""
    g = lambda k, d=0.0: fig.get(k) if isinstance(fig.get(k), (int, float)) else d  # noqa: E731
    notes = {}
    notes["pipeline_scaling_2_vs_1"] = (
        f"The encoder alone scales {g('limit_scaling_2_vs_1'):.2f} from 1 to 2 processes on this machine in the same "
        f"run (one core runs {g('limit_per_core_2p_vs_1p'):.2f} as fast when the other is busy); our build scales "
        f"{g('pipeline_scaling_vs_limit_scaling'):.2f} of that. The 1-worker build is not one core: it used "
        f"{g('pipeline_1w_cores'):.2f} cores on average (its worker's library threads and the launcher run on the "
        f"idle core), the 2-worker build {g('pipeline_2w_cores'):.2f} of the 2 there are, so the most 2 workers "
        f"can scale here is about {2 / max(g('pipeline_1w_cores'), 1e-9):.2f}; per CPU-second the 2-worker build "
        f"is {g('pipeline_cpu_efficiency_2_vs_1'):.2f} as efficient as the 1-worker one. The rest is the 2-worker "
        "build's fixed seconds (counted once per build, a larger share when the work is halved).")
    for key, peer in (("pipeline_vs_tiktoken_limit", "tiktoken's limit"), ("pipeline_vs_hf_datasets", "HF datasets"),
                      ("pipeline_hf_vs_raw_hf", "raw HF tokenizers")):
        notes[key] = (f"Against {peer}, measured minutes apart on a shared machine: check \"Contention\" and "
                      "\"Machine speed during the run\" for the two sides. The CPU-efficiency ratio (supporting "
                      "figures) is the contention-free view.")
    return notes


def write(fig: dict, details: dict, doc: Path, plots: Path, *, quick: bool = False) -> None:
    notes = dict(NOTES)
    notes.update(auto_notes(fig))
    notes.update(report_peers.peer_notes(fig))
    if NOTES_FILE.exists():
        notes.update(json.loads(NOTES_FILE.read_text()))
    targets = {k: tuple(v) for k, v in (details.get("targets") or {}).items()}
    plots.mkdir(parents=True, exist_ok=True)
    doc.parent.mkdir(parents=True, exist_ok=True)
    p_pipe = plots / "bench_pipeline.png"
    p_read = plots / "bench_reader_budget.png"
    has_pipe = plot_pipeline(details, p_pipe)
    has_read = plot_reader_budget(details, fig, p_read)

    def rel(p: Path) -> str:
        try:
            return str(p.resolve().relative_to(doc.parent.resolve()))
        except ValueError:
            return str(p)

    m = details.get("machine", {})
    c = details.get("corpus", {})
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `make bench` (benchmarks/run.py -> benchmarks/report.py). Do not edit by hand: "
        "edit benchmarks/notes.json (reasons for missed targets) and re-render with "
        "`.venv/bin/python -m benchmarks.report`. -->",
        "",
    ]
    if quick:
        lines += ["**QUICK RUN on tiny inputs: these numbers only prove the suite works; they measure start-up, "
                  "not throughput.**", ""]
    lines += [
        f"Run of {details.get('started', '?')} to {details.get('finished', '?')} "
        f"({fig.get('bench_total_s', 0) / 60:.1f} min), profile `{details.get('profile')}`. Every ratio is "
        "measured side by side in the same run, on the same texts: the machine is shared and noisy, so absolute "
        "rates move between runs. Ratios move less, but not always by less than the gap to a target, because "
        "the machine's speed also changes within a run (see \"Machine speed during the run\").",
        "",
        "## Figures against their targets",
        "",
        "| figure (key in `benchmarks/latest.json`) | meaning | corpus | value | target | met |",
        "|---|---|---|---|---|---|",
    ]
    missed = []
    for key, meaning, kind in MAIN_ROWS:
        v = fig.get(key)
        t = targets.get(key)
        tgt, ok = _target_text(t), _meets(v, t)
        mark = "" if ok is None else ("met" if ok else "**missed**")
        if ok is False:
            missed.append(key)
        corpus = report_peers.CORPUS_OF.get(key, "synthetic" if key.startswith("latency_") else report_peers.TODAY)
        lines.append(f"| `{key}` | {_meaning(meaning, fig)} | {corpus} | {_fmt(v, kind)} | {tgt} | {mark} |")
    lines += report_peers.peer_table(fig)
    lines += report_peers.both_corpora_table(fig)
    lines += encoder_table(fig)
    lines += report_peers.cold_encoder_table(fig)
    lines += stage_table(fig)
    lines += shuffle_table(fig, plots, rel)
    lines += packing_table(fig)
    lines += ["", "### Supporting figures", "", "| figure | meaning | value |", "|---|---|---|"]
    for key, meaning, kind in SECONDARY_ROWS:
        if key in fig:
            lines.append(f"| `{key}` | {_meaning(meaning, fig)} | {_fmt(fig[key], kind)} |")
    other = sorted(k for k in fig if k.startswith("other_cores_during_"))
    if other:
        lines += ["", "### Contention (the machine is shared)", "",
                  "Mean CPU cores used by *other* processes on the machine while each measurement ran "
                  "(2 cores in all). Ratios between runs with very different contention are less reliable.", "",
                  "| measurement | other cores |", "|---|---|"]
        lines += [f"| {k[len('other_cores_during_'):]} | {fig[k]:.2f} |" for k in other]
    probes = details.get("speed_probes") or []
    if probes:
        top_c = max(q["zstd_decompress_mb_s"] for q in probes)
        top_m = max(q["memcpy_gb_s"] for q in probes)
        lines += ["", "### Machine speed during the run", "",
                  "Before each measured command, the bench's own idle process times one core decompressing "
                  "zstd (compute, like the reader's decoding and like tokenizing) and copying 64 MB with numpy "
                  "(memory, like the memmap baseline), about 0.25 s each. Values are relative to the fastest "
                  f"probe of the run ({top_c:.0f} MB/s; {top_m:.1f} GB/s). A ratio whose two sides met "
                  "different speeds moves with them, and compute and memory do not always move together.", "",
                  "| time | before | compute | memory |", "|---|---|---|---|"]
        lines += [f"| {q['t']} | {q['label']} | {q['zstd_decompress_mb_s'] / top_c:.2f} | "
                  f"{q['memcpy_gb_s'] / top_m:.2f} |" for q in probes]
    lines += ["", "## Missed targets: why, and what would close them", ""]
    if not missed:
        lines.append("None.")
    for key in missed:
        lines.append(f"- **`{key}`** = {_fmt(fig.get(key), 'num')}. "
                     + notes.get(key, "No analysis recorded yet for this run."))
    if notes.get("_general"):
        lines += ["", notes["_general"]]
    lines += columnar_memory_section()
    lines += scale_section()
    lines += sft_section(fig)
    lines += latency_section(fig)
    lines += ["", "## Plots", ""]
    if has_pipe:
        lines += [f"![pipeline progress and CPU]({rel(p_pipe)})", "",
                  "Tokens in finished chunks (from the chunk sidecars as they appear) and CPU cores used by the "
                  "whole process tree, for each build of the run. The flat start is interpreter, planning and "
                  "Beam worker start-up.", ""]
    if has_read:
        lines += [f"![reader tokens/s against memory budget]({rel(p_read)})", ""]
    lines += [
        "## The corpus",
        "",
        f"{c.get('bytes', 0) / 1e6:.0f} MB of jsonl in {len(c.get('shard_bytes', []))} shards, "
        f"{c.get('docs', 0):,} documents, made on the fly by `benchmarks/corpus.py` from this machine's "
        "own documentation: Debian package docs (`/usr/share/doc`: changelogs, copyright and licence texts, "
        "READMEs), English man pages (troff stripped), GNU info manuals, and Python docstrings and READMEs "
        "of the standard library and installed packages. "
        f"Distinct text: {c.get('distinct_bytes', 0) / 1e6:.0f} MB "
        f"({', '.join(f'{k} {v / 1e6:.0f} MB' for k, v in (c.get('distinct_bytes_by_source') or {}).items())}); "
        f"it is **repeated {c.get('repeat_factor', 0):.2f} times** (each pass in a different document order) to "
        "reach the size where start-up is a small part of every timed build. Exact duplicates are removed "
        "before repeating; documents longer than 32,000 characters are cut at blank lines. "
        "Every build runs on the whole corpus. The slower baselines run on its first shards and are compared "
        "as rates (tokens per second of the same kind of text): tiktoken's limit and HF datasets with tiktoken on "
        f"the first {(details.get('corpus_prefix') or {}).get('shards', 0)} shards "
        f"({(details.get('corpus_prefix') or {}).get('bytes', 0) / 1e6:.0f} MB), raw HF tokenizers and HF datasets "
        f"with HF tokenizers on the first {(details.get('corpus_hf') or {}).get('shards', 0)} "
        f"({(details.get('corpus_hf') or {}).get('bytes', 0) / 1e6:.0f} MB); that keeps the suite under 30 "
        "minutes. Our builds' tokens on those shards are checked to equal the baselines' (and on the whole corpus, "
        "the limit's). The memory figure's small-shard build uses "
        f"{(details.get('corpus_small_shards') or {}).get('bytes', 0) / 1e6:.0f} MB of it in shards 4x smaller.",
        *report_peers.corpus_paragraph(details),
        "",
        "## Machine",
        "",
        f"- CPU: {m.get('cpu')} ({m.get('cores')} cores visible), {m.get('memory_gb')} GiB RAM; "
        f"{m.get('platform')}; Python {m.get('python')}.",
        f"- Load average when the run started: {m.get('loadavg_at_start')} (the machine is shared with other work).",
        f"- Versions: {', '.join(f'{k} {v}' for k, v in (m.get('versions') or {}).items())}.",
        "",
        "## How each figure is measured",
        "",
        "- **The limit**: 2 forked processes each load half of the corpus's shard files into memory, then "
        "encode their texts with fastokens exactly as our fast backend runs it (`FastEncoder.encode_many`, "
        "batches of 256, built from tiktoken's cl100k ranks; the fastest exact encoder we have); tokens / time "
        "of the slower process. Run before and after our builds; each ratio uses the faster run (conservative). "
        "**tiktoken's limit** (the reference row, and the ratio the issue asks for) is the same with tiktoken's "
        "`encode_ordinary`, on the corpus's first shards. Order of the suite: encoders alone, limit, our build "
        "(2 workers), tiktoken's limit, our build (1 worker), limit (1 process, first half), limit, HF datasets "
        "(tiktoken), our HF build, raw HF tokenizers, HF datasets (HF tokenizers), small-shard build, stages, "
        "the Parquet-input comparison (jsonl, Parquet, jsonl: the first shards, each also written as a Parquet "
        "file of the same texts), reader, mixture, shuffle.",
        "- **Raw HF tokenizers**: `Tokenizer.encode_batch_fast` over batches of 1024 documents, "
        "`RAYON_NUM_THREADS=2`, with cl100k converted offline to a `tokenizer.json` by transformers' "
        "`TikTokenConverter` using the **original** (non-possessive) cl100k pattern, special tokens at "
        "their tiktoken ids, among the added tokens only (the form fastokens loads, so our HF build runs on "
        "its fast backend as a user's would). Agreement with tiktoken is checked on a sample of real documents (documents "
        "containing special-token strings excluded: HF always matches added tokens) and the run fails if "
        "it is below 0.999.",
        "- **Our builds**: `python -m pipelines.build_cache` as a subprocess, DirectRunner "
        "`--direct_running_mode=multi_processing --direct_num_workers=2` (1 for the scaling baseline), "
        "default chunking and compression, the default tokenizer backend (`auto`: fastokens after its "
        "conformance check), into an empty directory. The local runner forks its workers from a warm process "
        "and hands out work units from a shared queue (pipelines/runners/local_workers.py, unit_queue.py). "
        "Whole command = wall time of the "
        "subprocess (interpreter start-up to exit). Steady state = tokens / the seconds the workers spent "
        "inside work units, from the build's own timeline (`CHUNKLEDGER_TRACE`, off by default; a traced "
        "build is byte-identical); start-up share = 1 - (tokens / steady rate) / whole command, itemized "
        "as before the first unit, the tail (one worker alone) and after the last unit. Peak RSS = the largest sum of RSS over the command's whole process tree "
        "(launcher, job service, workers), sampled every 0.25 s with psutil. The token count of every "
        "build is checked against the baseline's (same texts, same tokenizer).",
        "- **CPU efficiency** (supporting): tokens per CPU-second, from the CPU time of the whole process "
        "tree (builds, HF datasets) or of the encoding loop (limit, raw HF). Other work on the machine "
        "changes wall-time ratios a lot but CPU-time ratios little; idle time (start-up waits, an idle "
        "worker at the tail) costs no CPU, so these ratios are upper bounds of the quiet-machine wall ratios.",
        "- **HF datasets**: `load_dataset(\"json\", data_files=..., split=\"train\", cache_dir=<fresh>)` -> "
        "`.map(tokenize, batched=True, num_proc=2, remove_columns=[\"text\"])` -> `.to_parquet(...)`, as its "
        "documentation recommends; with tiktoken (`encode_ordinary` per text) or with the converted "
        "tokenizer through `transformers.PreTrainedTokenizerFast` (`return_attention_mask=False`). Whole "
        "command timed as a subprocess, with a fresh datasets cache (nothing reused between runs).",
        "- **Reader**: one reader (one host), warm page cache, `Reader.iter_batches` with "
        "`num_workers=2`: two worker processes each decode and assemble every other row of each batch into "
        "shared memory, and the reader hands out views of it (`reader/workers/pool.py`); `num_workers=0` (one "
        "process, background prefetch threads) is reported as `reader_*_1p`. Rates are the steady state, "
        "from the first batch to the last of each run; opening the cache and starting the workers are "
        "reported apart (`*_first_batch_s`, `*_from_open_tokens_per_s`) and by the seek figures. Default "
        "options: R*=16, 1 GiB budget (split between the workers), packed batches, seq_len 2048, batch 64, in the flat-tokens "
        "layout (`layout=\"flat\"`: one uint32 [64, 2049] array and two ints per row, what `JaxLoader` "
        "ships to the devices and expands there, equal bit for bit to the five arrays); the five-array "
        "layout is measured the same way (`reader_arrays_*`). The memmap baseline "
        "slices the very same windows (checked token for token on the first batches) out of a stream-major "
        "flat uint32 file with precomputed offsets, copying each batch into a fresh int32 array. Five rounds, "
        "each reader configuration once per round and the memmap timed three times per round right after "
        "the reader it is compared with; best of the rounds for the reader, best of all 15 timings for "
        "memmap. Shuffled: `shuffle_seed=0` with the default window options; the memmap "
        "baseline uses the same permutation (`reader.order.shuffle.shuffle_example_indices`), precomputed.",
        "- **Seek**: a fresh `Reader` then `batch(10**6)` against a fresh `Reader` then `batch(0)`, "
        "alternating, median of the repetitions.",
        "- **Ledger of 100k chunks**: a synthetic finished ledger (100 shards x 1000 chunks, real "
        "tokenizer/config block) opened with `Reader(...)` plus `stream_index()`; median of 3.",
        *report_peers.method_bullets(),
        "",
        "## Commands",
        "",
        "<!-- illustration: hours of measurement on gigabytes of corpus -->",
        "```console",
    ]
    for k, v in (details.get("commands") or {}).items():
        lines.append(f"# {k}")
        lines.append(f"$ {v}")
    lines += ["```", "", "Raw figures: `benchmarks/latest.json` (flat); per-build details, baselines' phase times and "
              "the sampled time series: `benchmarks/latest-details.json`.", ""]
    doc.write_text("\n".join(lines))


def sft_section(fig: dict) -> list[str]:
    """The loss mask's bytes per token and the supervised encoding rates (``benchmarks/sft_bench.py``)."""
    if "sft_mask_spans_bytes_per_token" not in fig:
        return []
    f = fig
    return ["", "## Loss masks: bytes per token", "",
            "A supervised cache stores each document's loss tokens as ranges (`loss_spans`, docs/FORMAT.md). "
            "`benchmarks/sft_bench.py` generates chat conversations (an optional system message, 1 to 6 turns, "
            "messages of log-normal length), renders them with a ChatML template with generation marks and "
            "tokenizes them with cl100k_base as the builder does, then writes the spans as a chunk does (zstd 3, "
            "PLAIN) and, in the same run, one bit per token (`np.packbits`, a `binary` column, zstd 3).", "",
            f"{f['sft_mask_tokens_per_record']:.0f} tokens and {f['sft_mask_spans_per_record']:.1f} spans per "
            f"record, {f['sft_mask_loss_share']:.0%} of the tokens loss tokens.", "",
            "| encoding | stored bytes per token | raw bytes per token |", "|---|---|---|",
            f"| spans (`loss_spans`) | {f['sft_mask_spans_bytes_per_token']:.4f} | "
            f"{f['sft_mask_spans_raw_bytes_per_token']:.4f} |",
            f"| one bit per token | {f['sft_mask_bits_bytes_per_token']:.4f} | "
            f"{f['sft_mask_bits_raw_bytes_per_token']:.4f} |", "",
            "Encoding supervised records (`Supervised.encode_many`, batches of 256, best of the rounds), records "
            "per CPU-second, the same records and the same bytes with either backend:", "",
            "| records | reference (tiktoken) | fast (fastokens) | fast / reference |", "|---|---|---|---|",
            f"| chat | {f['sft_chat_records_per_cpu_s_reference']:,.0f} | {f['sft_chat_records_per_cpu_s_fast']:,.0f} "
            f"| {f['sft_chat_fast_vs_reference']:.2f} |",
            f"| prompt/completion | {f['sft_pc_records_per_cpu_s_reference']:,.0f} | "
            f"{f['sft_pc_records_per_cpu_s_fast']:,.0f} | {f['sft_pc_fast_vs_reference']:.2f} |"] + mask_read_section(fig) \
        + view_read_section(fig)


MASK_READS = [("decode", "every row group through the chunk store, one thread"),
              ("train", "training read, flat layout, R*=16, 2 reader workers"),
              ("train_1p", "the same in one process"),
              ("best_fit_1p", "best-fit rows, one process")]


def mask_read_section(fig: dict) -> list[str]:
    """Read throughput with loss masks against without (``benchmarks/mask_cost.py``)."""
    return ratio_table("mask", "Loss masks: read throughput", fig, lambda f: (
        f"`benchmarks/mask_cost.py` writes the same {f['mask_cost_tokens'] / 2**20:.0f} Mi tokens of generated "
        f"chat-like documents twice, without and with `loss_spans` ({f['mask_loss_token_share']:.0%} of the tokens "
        f"loss tokens; the masked chunks take {f['mask_bytes_per_token']:.4f} more bytes per token), and reads each "
        f"the same way, alternating, best of {f['mask_cost_rounds']} rounds. Real tokens per second (and per "
        "CPU-second of the reading processes), masked / plain:"))


def view_read_section(fig: dict) -> list[str]:
    """Read throughput of a view against the whole cache (``benchmarks/view_cost.py``)."""
    return ratio_table("view", "Views: read throughput", fig, lambda f: (
        f"`benchmarks/view_cost.py` writes {f['view_cost_tokens'] / 2**20:.0f} Mi tokens of generated documents "
        f"with a kept field `language_score` and reads them whole and through `language_score >= 0.2` "
        f"({f['view_kept_docs_share']:.1%} of the documents, {f['view_kept_tokens_share']:.1%} of the tokens), "
        f"alternating, best of {f['view_cost_rounds']} rounds. Real tokens per second (and per CPU-second of the "
        "reading processes), view / whole:"))


def ratio_table(prefix: str, title: str, f: dict, intro) -> list[str]:
    """A section of paired reads' ratios (``benchmarks.mask_cost.ratios``), one row per read measured; none
    when the figures are absent. ``intro(f)``: its paragraph."""
    if f"{prefix}_train_ratio" not in f:
        return []
    out = ["", f"## {title}", "", intro(f), "", "| read | per second | per CPU-second |", "|---|---|---|"]
    return out + [f"| {what} | {f[f'{prefix}_{k}_ratio']:.3f} | {f[f'{prefix}_{k}_cpu_ratio']:.3f} |"
                  for k, what in MASK_READS if f"{prefix}_{k}_ratio" in f]


LATENCY_READS = [("packed", "packed, in order"), ("shuffled", "packed, `shuffle_seed=0`"),
                 ("mixture", "mixture of 4 caches (0.4/0.3/0.2/0.1), packed")]


def latency_section(fig: dict) -> list[str]:
    """Reading ``gs://`` through the latency proxy (``benchmarks/latency_bench.py``)."""
    if "latency_50ms_vs_0ms_min" not in fig:
        return []
    f = fig
    delays = sorted({int(k.split("_")[2][:-2]) for k in f if k.startswith("latency_packed_") and k.endswith("ms_steady")})
    share = f["latency_cache_tokens"] / f["latency_hosts"] * 4 / 1e6  # MB of the host's rows decoded (int32 tokens)
    out = ["", "## Reading from object storage", "",
           f"`benchmarks/latency_bench.py` uploads a synthetic cache of {f['latency_cache_tokens'] / 1e6:.1f} M tokens "
           f"({f['latency_cache_chunks']} chunks, 128 Ki-token row groups) four times to the GCS emulator and reads it "
           "through the project's latency proxy (`tests/support/latency_proxy.py`: every request held D ms on loopback, requests in flight "
           f"held together) as host 1 of {f['latency_hosts']} (`seq_len={f['latency_seq_len']}, batch_size="
           f"{f['latency_batch_size']}`, R* = 16, flat layout, one process, a budget of {f['latency_read_budget_mb']:.0f} MB: "
           f"the host's share of the cache decoded, {share:.0f} MB, is {share / f['latency_read_budget_mb']:.1f} times "
           f"that, so past a first pass nothing read is still decoded; the shuffled read "
           f"{f.get('latency_shuffled_read_budget_mb', f['latency_read_budget_mb']):.0f} MB, three of its mixes, as "
           f"READING.md asks of a shuffled read from object storage) from step {f['latency_start']}, best of {f['latency_rounds']} alternating rounds "
           f"(run of {f.get('latency_run', '?')}, load average {f.get('latency_load_average', '?')} on 2 cores). "
           f"Steady: tokens per second of the host's rows over {f['latency_seconds']:g} s of reading after "
           f"{f['latency_warmup_s']:g} s from the first batch (the best round's); the / 0 ms column: the median over the rounds of each round's steady rate over the 0 ms one "
           "run just before it. First batch: "
           "from opening the reader (the seek) to the first batch. Requests per million tokens read (a chunk opened "
           "is two: its sidecar and footer) and bytes fetched per token read (the cache holds about 1.3 bytes per "
           "token; a shuffled read also fetches the row groups at its blocks' ends, which it uses in part).", "",
           "| read | where | steady, M tok/s | / 0 ms | first batch, s | requests / M tokens | bytes / token | "
           "CPU ms / batch (reader; emulator) |", "|---|---|---|---|---|---|---|---|"]
    for kind, what in LATENCY_READS:
        for where in ["local"] + [f"{d}ms" for d in delays]:
            p = f"latency_{kind}_{where}_"
            ratio = f"{f[p + 'vs_0ms']:.2f}" if where != "local" else f"{1 / f[f'latency_{kind}_0ms_vs_local']:.2f}"
            label = "local disk" if where == "local" else f"gs://, {where[:-2]} ms"
            out.append(f"| {what} | {label} | {f[p + 'steady'] / 1e6:.1f} | {ratio} | {f[p + 'first_batch_s']:.2f} | "
                       f"{f[p + 'requests_per_mtoken']:.1f} | {f[p + 'bytes_per_token']:.3f} | "
                       f"{f[p + 'cpu_ms_per_batch']:.3f}; {f[p + 'emulator_cpu_ms_per_batch']:.3f} |")
    d, px = "latency_emulator_direct_", "latency_emulator_proxy_"
    lo, zo = "latency_packed_local_", "latency_packed_0ms_"
    gap = (f" Packed, local disk against gs:// at 0 ms: {f[lo + 'ms_per_batch']:.3f} against {f[zo + 'ms_per_batch']:.3f} "
           f"ms per batch; the reader's own CPU {f[lo + 'cpu_ms_per_batch']:.3f} against {f[zo + 'cpu_ms_per_batch']:.3f} "
           "ms (the difference: the HTTP client on the event loop, and bytes received rather than read from the page "
           f"cache), the emulator's {f[zo + 'emulator_cpu_ms_per_batch']:.3f} ms and the proxy's "
           f"{f[zo + 'proxy_cpu_ms_per_batch']:.3f} ms, on the same two cores, and each request waits its turn at "
           "the emulator (one at a time)." if zo + "proxy_cpu_ms_per_batch" in f else "")
    out += ["", "The emulator's own cost, measured apart: a plain client (`http.client`, a connection per request) asks "
            f"for each of the cache's {f['latency_row_group_requests']} row groups in turn: "
            f"{f[d + 'ms_per_request']:.2f} ms per request ({f[d + 'emulator_cpu_ms_per_request']:.2f} ms of the "
            f"emulator's CPU; {f[d + 'mb_per_s']:.0f} MB/s), through the proxy at 0 ms {f[px + 'ms_per_request']:.2f} ms. "
            "gs:// at 0 ms against local disk (the `/ 0 ms` column of the local rows is local / 0 ms): the reader "
            "itself spends the CPU per batch in the last column on both; the rest of the gap is the emulator and "
            "the proxy, Python servers on the same two cores, serving requests one at a time." + gap,
            f"Peak RSS of the bench process during a 50 ms read of each kind with the default budget: "
            f"{f['latency_reader_peak_rss_mb']:.0f} MB, "
            f"{f['latency_rss_before_mb']:.0f} MB before the first read (the interpreter, numpy, pyarrow, gcsfs and "
            f"the emulator's client), against a budget of {f['latency_memory_budget_mb']:.0f} MB."]
    return out


COLUMNAR_MEMORY = Path(__file__).with_name("columnar_memory.json")


def columnar_memory_section(path: Path = COLUMNAR_MEMORY) -> list[str]:
    """Peak memory of Parquet inputs of the same row groups at two file sizes, as saved by
    ``python -m benchmarks.columnar_memory --build --save benchmarks/columnar_memory.json`` (not part of ``make
    bench``: it writes and reads 2 GB)."""
    if not path.exists():
        return []
    m = json.loads(path.read_text())
    files = m["files"]
    rows = [f"| {f['file_mb']:.0f} MB | {f['chunks']} of {f['row_group_mb']} MB | {f['peak_rss'] / 2**20:.0f} MB "
            f"({f['base_rss'] / 2**20:.0f} MB after the imports) | {f['arrow_pool_peak'] / 2**20:.0f} MB | "
            + (f"{f['build_peak_rss_worker_mb']:.0f} MB |" if "build_peak_rss_worker_mb" in f else "not measured |")
            for f in files]
    build = m.get("columnar_build_peak_rss_ratio")
    return ["", "## Columnar inputs: peak memory", "",
            "A worker decodes one row group at a time, so its memory follows the largest row group, not the file. "
            "`benchmarks/columnar_memory.py` writes Parquet files of uncompressed text in row groups of the same "
            "size and reads every chunk of each (a chunk per row group) in a fresh process as a worker does "
            "(`ChunkReader`: only the text column, by byte ranges, every text turned into a Python string), "
            "then builds a cache of each (`python -m pipelines.build_cache`, one worker, tiktoken) and takes "
            "the largest process's peak RSS (the worker's, sampled every 0.25 s). Measured once, saved in "
            "`benchmarks/columnar_memory.json`; not part of `make bench`.", "",
            "| file | row groups | peak RSS, reading | pyarrow's allocations, peak | peak RSS, the build's worker |",
            "|---|---|---|---|---|", *rows, "",
            f"Largest file / smallest: {m['columnar_peak_rss_ratio']:.3f} reading"
            + (f", {build:.3f} building" if build is not None else "") + " (the bound: 1.25)."]


SCALE = Path(__file__).with_name("scale.json")
SCALE_ROWS = [
    ("open_s_1e6", "open a 10^6-chunk cache as host 3 of 64 (`Reader` and its stream index), seconds", "{:.2f} s"),
    ("open_rss_mb_1e6", "that process's peak RSS", "{:.0f} MB"),
    ("open_fetched_mb_1e6", "bytes it read to open (the ledger and the table's count columns)", "{:.1f} MB"),
    ("open_s_1e7", "open a 10^7-chunk cache, seconds", "{:.2f} s"),
    ("open_rss_mb_1e7", "its peak RSS", "{:.0f} MB"),
    ("finalize_rss_mb_1e6", "the finalize of a 10^6-unit build (the FnApiRunner process it runs in), peak RSS",
     "{:.0f} MB"),
    ("pipeline_mb_1e6", "the serialized job graph of a 10^6-unit plan over 25,000 shards", "{:.3f} MB"),
    ("first_batch_s_r4096_1e6", "first batch after the open: packed concat, L = 2048, B = 4096, R* = 4096, host 4095 "
     "of 4096, 10^6 chunks", "{:.2f} s"),
]


def scale_section(path: Path = SCALE) -> list[str]:
    """Caches, plans and a finalize at 10^5 to 10^7 chunks, as ``make bench-scale`` (benchmarks/scale_bench.py)
    saved them in ``benchmarks/scale.json`` (rendered by every ``make bench``, measured only by that target)."""
    if not path.exists():
        return []
    f = json.loads(path.read_text())
    targets = {k: tuple(v) for k, v in f.get("targets", {}).items()}
    rows = []
    for key, meaning, form in SCALE_ROWS:
        if key not in f:
            continue
        t = targets.get(key)
        ok = _meets(f[key], t)
        rows.append(f"| `{key}` | {meaning} | {form.format(f[key])} | {_target_text(t)} | "
                    f"{'' if ok is None else ('met' if ok else '**missed**')} |")
    sizes = "; ".join(f"10^{k[-1]}: ledger {f[f'ledger_mb_{k}']:.1f} MB, table {f[f'table_mb_{k}']:.0f} MB, open "
                      f"{f[f'open_s_{k}']:.2f} s, {f[f'open_rss_mb_{k}']:.0f} MB RSS, {f[f'open_fetched_mb_{k}']:.1f} MB read"
                      for k in ("1e5", "1e6", "1e7") if f"table_mb_{k}" in f)
    return ["", "## Scale", "",
            "`make bench-scale` (`benchmarks/scale_bench.py`, measured "
            f"{f.get('measured', '?')} in {f.get('scale_bench_s', 0) / 60:.1f} min) writes caches of 10^5, 10^6 and "
            "10^7 chunks in 25,000 shards with the project's own writers (the table, the finished ledger), "
            "chunk files and sidecars only for the chunks a measured read touches, and opens, reads and finalizes "
            "them as a job would; each open is the best of fresh processes. A 15T-token corpus at 64 MiB chunks is "
            "about 10^6 chunks. Raw figures: `benchmarks/scale.json`; the 10^6 cache stays at "
            "`benchmarks/work/scale-1e6/`.", "",
            "| figure (key in `benchmarks/scale.json`) | meaning | value | target | met |", "|---|---|---|---|---|",
            *rows, "",
            f"Per size: {sizes}. The finalize took {f.get('finalize_s_1e6', 0):.0f} s for 10^6 entries on this machine "
            f"(it reads each unit's entry, about 0.4 KB). The plan ledger of 25,000 inputs is "
            f"{f.get('plan_ledger_mb_1e6', 0):.1f} MB; the job graph holds its checksum and 1,024 ranges of the unit order "
            f"({', '.join(f'{k} {v:.3f} MB' for k, v in (f.get('pipeline_mb_1e6_by') or {}).items())}). Counting "
            f"one 64 MiB chunk for an index file (`python -m reader index`: its footer and lengths, warm local disk) "
            f"takes {f.get('index_ms_per_chunk_unpacked', 0):.1f} ms unpacked, "
            f"{f.get('index_ms_per_chunk_best_fit', 0):.1f} ms best fit."]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--figures", type=Path, default=REPO / "benchmarks" / "latest.json")
    ap.add_argument("--doc", type=Path, default=REPO / "docs" / "BENCHMARKS.md")
    ap.add_argument("--plots", type=Path, default=REPO / "docs")
    a = ap.parse_args(argv)
    fig = json.loads(a.figures.read_text())
    details_path = a.figures.with_name(a.figures.stem + "-details.json")
    details = json.loads(details_path.read_text()) if details_path.exists() else {}
    write(fig, details, a.doc, a.plots, quick=details.get("profile") == "quick")
    return 0


if __name__ == "__main__":
    sys.exit(main())
