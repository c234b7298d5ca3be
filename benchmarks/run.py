"""The benchmark suite: pipeline and reader against the limits and against peers, in one run.

Two corpora. Today's (benchmarks/corpus.py: the machine's distinct text repeated to 4 GB) carries today's
targets; its limit is fastokens (as the builder's fast backend runs it) in 2 processes on texts in memory, with
tiktoken's own limit as a reference row. The distinct corpus (benchmarks/distinct_corpus.py: every document
once) carries our build against Megatron-LM's GigaToken path and against the parse-and-encode limit, the
fastest exact encoder's own file path (benchmarks/peer_suite.py); both report the encoders alone, cold.

    make bench          # = python -m benchmarks.run          -> benchmarks/latest.json, docs/BENCHMARKS.md
    make bench-quick    # = python -m benchmarks.run --quick  -> benchmarks/work/quick.json (tiny inputs)

Every ratio is measured side by side in the same run on the same texts (this machine is shared and
noisy). Baselines run as their own documentation recommends; none is tuned down. The corpus is real
English text gathered from this machine (see benchmarks/corpus.py) and cached under benchmarks/work/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks import common, hf_tokenizer, peer_suite, pipeline_bench, sft_bench
from benchmarks.commands import build_commands
from benchmarks.common import REPO, log, machine_description, run_monitored
from benchmarks.corpus import build_corpus, load_texts
from benchmarks.measured import run_encoders, run_stages

PROFILES = {
    # Full run: 4000 MB of text in 50 shards of 80 MB (each one 64 MiB work unit plus a 13 MB one: 100 units).
    # Sized so that start-up and tail stay under 10% of every timed build: with the fast tokenizer a 2-worker
    # build runs at 15-25 M tokens/s, so its fixed seconds (about 3.5-4 s on a quiet machine: the launcher's
    # Python and Beam imports, planning, the job service, forking the workers, the finalize step; itemized in
    # each build's details) need about 40 s of work around them. The distinct text is 252 MB, repeated.
    # The slower baselines run on a prefix of the same corpus (its first shards), as rates: tiktoken's limit and
    # HF datasets with tiktoken on the first 10 shards (800 MB), raw HF tokenizers and HF datasets with HF
    # tokenizers (20x slower than fastokens) on the first 4 (320 MB). The builds' tokens on those shards are
    # checked against the baselines'. The small-shard build for the memory figure uses 8 shards of 20 MB.
    # The suite stays under 30 minutes (about 15 on a quiet machine).
    "full": dict(size_mb=4000, shards=50, corpus_name="corpus-full-4000mb", prefix_shards=10, hf_shards=4,
                 small_size_mb=160, small_shards=8, agreement_docs=1000, encoder_docs=3000, encoder_repeats=2,
                 reader_batches=1000, reader_rounds=5, seek_reps=5, budgets="0.125,0.25,0.5,1,2", shuffle_quick=False,
                 # the distinct corpus (benchmarks/peer_suite.py): all the distinct text there is (about 300 MB here), in 8
                 # shards of one work unit each; the encoders alone on 32 MB of each corpus
                 distinct_shards=8, distinct_size_mb=None, distinct_tiktoken_shards=2, cold_mb=32, cold_repeats=2,
                 peer_rounds=2),
    "quick": dict(size_mb=1.6, shards=4, prefix_shards=2, hf_shards=2, small_size_mb=0.4, agreement_docs=100,
                  encoder_docs=100, encoder_repeats=1, reader_batches=6, reader_rounds=1, seek_reps=1, budgets="1",
                  shuffle_quick=True, distinct_shards=4, distinct_size_mb=1.6, distinct_tiktoken_shards=2, cold_mb=0.3,
                  cold_repeats=1, peer_rounds=1),
}

# key: (target, direction) -- direction ">=" or "<="; a figure without one is reported only (as are
# pipeline_vs_limit and pipeline_startup_fraction_max: a build that reads and writes files cannot reach 0.7 of
# an encoder on texts in memory). The first four are measured on the distinct corpus, the rest on today's.
TARGETS = {
    "pipeline_vs_megatron_fast": (3.0, ">="),
    "pipeline_steady_vs_megatron_fast": (2.5, ">="),
    "pipeline_vs_parse_encode_limit": (0.45, ">="),
    "pipeline_steady_vs_parse_encode_limit": (0.65, ">="),
    "pipeline_vs_tiktoken_limit": (2.5, ">="),
    "pipeline_vs_hf_datasets": (3.0, ">="),
    "pipeline_hf_vs_raw_hf": (5.0, ">="),
    "pipeline_scaling_2_vs_1": (1.7, ">="),
    "pipeline_parquet_vs_jsonl_input": (0.9, ">="),
    "reader_vs_memmap": (0.25, ">="),
    "reader_tokens_per_s": (1e8, ">="),
    "reader_shuffled_vs_memmap": (0.2, ">="),
    "reader_mixture_vs_single": (0.9, ">="),
    "seek_far_vs_near": (1.5, "<="),
    "ledger_open_s_100k": (1.0, "<="),
    "bytes_per_token": (1.5, "<="),
    "pipeline_peak_rss_ratio_4x_shards": (1.25, "<="),
    "reader_rss_growth_vs_budget": (1.0, "<="),
    "best_fit_padding_L2048": (0.02, "<="),
    "long_docs_best_fit_padding_L256": (0.01, "<="),
    "long_docs_best_fit_padding_over_plain_bfd_L256": (0.01, "<="),
    "best_fit_short_documents_cut_L2048": (0, "<="),
    "best_fit_short_documents_cut_L8192": (0, "<="),
    "best_fit_vs_concat_L2048": (0.8, ">="),
    "best_fit_vs_concat_L8192": (0.8, ">="),
    "mask_train_ratio": (0.9, ">="),
    "view_train_ratio": (0.8, ">="),
    "latency_50ms_vs_0ms_min": (0.7, ">="),
    "latency_first_batch_s_50ms_max": (1.0, "<="),
    "latency_rss_growth_vs_budget": (1.0, "<="),
    "dedup_exact_mb_per_cpu_s": (20.0, ">="),
    "dedup_signature_tokens_per_cpu_s": (5e6, ">="),
    "dedup_planted_recall": (0.9, ">="),
    "dedup_marked_false_share": (0.05, "<="),
}


def _py() -> str:
    return sys.executable


def _env_offline() -> dict:
    return {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONWARNINGS": "ignore"}


def run_limit(corpus: Path, encoder: str = "fastokens", one_core: bool = False, shards: int | None = None) -> dict:
    """The encoder alone in 2 processes on texts in memory; ``one_core``: 1 process on the first half."""
    extra = ["--processes", "1", "--first_half"] if one_core else []
    extra += ["--shards", str(shards)] if shards else []
    m = run_monitored([_py(), "-m", "benchmarks.baselines", "limit", "--corpus", str(corpus), "--encoder", encoder]
                      + extra)
    r = dict(m.result, other_cores=m.other_cores)
    what = "1 process, first half of the texts" if one_core else "2 processes"
    log(f"limit ({encoder}, {what}, {r['shards']} shards, in memory): {r['tokens_per_s'] / 1e6:.2f} M tok/s "
        f"(other processes used {m.other_cores:.2f} cores meanwhile)")
    return r


def run_raw_hf(corpus: Path, tokenizer_json: Path, shards: int | None) -> dict:
    m = run_monitored([_py(), "-m", "benchmarks.baselines", "raw_hf", "--corpus", str(corpus),
                       "--tokenizer_json", str(tokenizer_json)] + (["--shards", str(shards)] if shards else []),
                      env={"RAYON_NUM_THREADS": "2"})
    r = dict(m.result, other_cores=m.other_cores)
    log(f"raw HF tokenizers ({r['method']}, 2 threads): {r['tokens_per_s'] / 1e6:.2f} M tok/s")
    return r


def run_hf_datasets(corpus: Path, backend: str, work: Path, tokenizer_json: Path, tokens: int,
                    shards: int | None) -> dict:
    base = work / f"hf-datasets-{backend}"
    if base.exists():
        shutil.rmtree(base)
    cmd = [_py(), "-m", "benchmarks.baselines", "hf_datasets", "--backend", backend, "--corpus", str(corpus),
           "--out", str(base / "out"), "--cache_dir", str(base / "cache"), "--tokenizer_json", str(tokenizer_json)]
    m = run_monitored(cmd + (["--shards", str(shards)] if shards else []), env=_env_offline())
    r = dict(m.result)
    r.update(wall_s=m.wall_s, tokens=tokens, other_cores=m.other_cores, cpu_s=m.cpu_s, tokens_per_cpu_s=tokens / m.cpu_s,
             tokens_per_s=tokens / m.wall_s, peak_rss_tree_mb=m.peak_rss_tree_mb,
             bytes_per_token=r["parquet_bytes"] / tokens, map_tokens_per_s=tokens / r["map_s"])
    log(f"HF datasets ({backend}): {r['tokens_per_s'] / 1e6:.2f} M tok/s whole command "
        f"({r['wall_s']:.1f} s; map {r['map_s']:.1f} s)")
    shutil.rmtree(base, ignore_errors=True)
    return r


def shuffle_quality(plot: Path, quick: bool) -> dict:
    """The shuffle figures (benchmarks/shuffle_quality.py: its own cache of real text with small
    chunks in full mode, a synthetic layout in quick mode)."""
    try:
        from benchmarks import shuffle_quality as sq
    except ImportError:
        log("shuffle quality: benchmarks/shuffle_quality.py not present; skipped")
        return {}
    fn = None
    for name in ("run", "measure", "shuffle_quality", "figures"):
        if callable(getattr(sq, name, None)):
            fn = getattr(sq, name)
            break
    if fn is None:
        log("shuffle quality: no run()/measure() in benchmarks/shuffle_quality.py; skipped")
        return {}
    import inspect

    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in (("quick", quick), ("plot", str(plot)), ("log", log)) if k in params}
    t = time.perf_counter()
    out = fn(**kwargs)
    log(f"shuffle quality: {len(out)} figures in {time.perf_counter() - t:.1f} s")
    repo = str(Path(__file__).resolve().parents[1]) + os.sep  # figures name no paths of this machine
    return {(k if k.startswith("shuffle") else f"shuffle_{k}"): (v.replace(repo, "") if isinstance(v, str) else v)
            for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny inputs, same code (< 1 minute)")
    ap.add_argument("--work", type=Path, default=REPO / "benchmarks" / "work",
                    help="scratch directory (corpus cache, builds); default benchmarks/work")
    ap.add_argument("--out", type=Path, help="figures JSON (default benchmarks/latest.json, "
                                             "or benchmarks/work/quick.json with --quick)")
    ap.add_argument("--doc", type=Path, help="report Markdown (default docs/BENCHMARKS.md, or "
                                             "WORK/quick-BENCHMARKS.md with --quick)")
    ap.add_argument("--plots", type=Path, help="directory for PNG plots (default docs/, or WORK with --quick)")
    ap.add_argument("--keep", action="store_true", help="keep the built caches under WORK")
    a = ap.parse_args(argv)
    profile = "quick" if a.quick else "full"
    P = PROFILES[profile]
    work: Path = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = a.out or (work / "quick.json" if a.quick else REPO / "benchmarks" / "latest.json")
    doc = a.doc or (work / "quick-BENCHMARKS.md" if a.quick else REPO / "docs" / "BENCHMARKS.md")
    plots = a.plots or (work if a.quick else REPO / "docs")
    t_all = time.perf_counter()
    details: dict = {"profile": profile, "machine": machine_description(), "started": time.strftime(
        "%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    fig: dict = {}
    common.PROBING = True  # a machine-speed probe before every measured command (see common.probe)
    common.PROBES.clear()

    # -- corpora ------------------------------------------------------------------------------------------
    corpus_name = P.get("corpus_name", f"corpus-{profile}")
    corpus = work / corpus_name
    cm = build_corpus(corpus, int(P["size_mb"] * 1e6), P["shards"], log=log)
    small = work / f"{corpus_name}-small-shards"
    sm = build_corpus(small, int(P["small_size_mb"] * 1e6), P.get("small_shards", P["shards"]), log=log,
                      from_corpus=corpus)
    k_tt, k_hf = P["prefix_shards"], P["hf_shards"]
    details["corpus"] = {k: v for k, v in cm.items() if k not in ("files",)}
    details["corpus_prefix"] = {"shards": k_tt, "bytes": sum(cm["shard_bytes"][:k_tt])}
    details["corpus_hf"] = {"shards": k_hf, "bytes": sum(cm["shard_bytes"][:k_hf])}
    details["corpus_small_shards"] = {k: sm[k] for k in ("bytes", "docs", "shard_bytes", "repeat_factor")}
    fig["corpus_mb"] = cm["bytes"] / 1e6
    fig["corpus_distinct_mb"] = cm["distinct_line_bytes"] / 1e6
    fig["corpus_repeat_factor"] = cm["repeat_factor"]
    fig["corpus_docs"] = cm["docs"]
    fig["corpus_prefix_mb"] = details["corpus_prefix"]["bytes"] / 1e6
    fig["hf_corpus_mb"] = details["corpus_hf"]["bytes"] / 1e6

    # -- the HF tokenizer (special tokens as added tokens only, so fastokens loads it), checked against tiktoken --
    texts = load_texts(corpus, cm["files"][:1])[: P["agreement_docs"]]
    ver = hf_tokenizer.verify(REPO / "benchmarks" / "work", texts)  # converted once, shared by every run
    tokenizer_json = Path(ver["hf_tokenizer_json"])
    fig["hf_tiktoken_agreement"] = ver["hf_tiktoken_agreement"]
    fig["hf_tiktoken_agreement_docs"] = ver["hf_tiktoken_agreement_docs"]
    fig["hf_tiktoken_agreement_with_014_pattern"] = ver["hf_tiktoken_agreement_with_014_pattern"]
    log(f"HF tokenizer agrees with tiktoken on {ver['hf_tiktoken_agreement']:.4f} of "
        f"{ver['hf_tiktoken_agreement_docs']} documents (tiktoken 0.14's possessive pattern: "
        f"{ver['hf_tiktoken_agreement_with_014_pattern']:.4f})")
    del texts

    # -- each encoder alone: MB per CPU-second and agreement on the same documents ------------------------------
    fig.update(run_encoders(corpus, P["encoder_docs"], P["encoder_repeats"]))

    inputs = [str(corpus / "shard-*.jsonl")]
    builds: dict = {}
    cache_tt = work / f"cache-{profile}-tiktoken"
    cache_hf = work / f"cache-{profile}-hf"

    # -- side by side. Pairs that form a ratio run back to back; the limit runs before and after the builds it is
    # compared with, and the faster of the two is used (conservative). ----------------------------------------
    limit_a = run_limit(corpus)
    builds["tiktoken_2w"] = pipeline_bench.build(inputs, cache_tt, "tiktoken:cl100k_base", workers=2)
    tt_limit = run_limit(corpus, "tiktoken", shards=k_tt)  # the reference row: tiktoken itself
    builds["tiktoken_1w"] = pipeline_bench.build(inputs, work / f"cache-{profile}-tiktoken-1w", "tiktoken:cl100k_base",
                                                 workers=1)
    limit_1p = run_limit(corpus, one_core=True)  # the machine's own 2-vs-1 scaling, next to the 1-worker build
    limit_b = run_limit(corpus)
    tokens_tt = builds["tiktoken_2w"]["tokens"]
    prefix_tokens = sum(builds["tiktoken_2w"]["tokens_by_shard"][:k_tt])
    hfd_tt = run_hf_datasets(corpus, "tiktoken", work, tokenizer_json, prefix_tokens, k_tt)
    builds["hf_2w"] = pipeline_bench.build(inputs, cache_hf, str(tokenizer_json), workers=2)
    raw_hf = run_raw_hf(corpus, tokenizer_json, k_hf)
    hf_prefix_tokens = sum(builds["hf_2w"]["tokens_by_shard"][:k_hf])
    hfd_hf = run_hf_datasets(corpus, "hf", work, tokenizer_json, hf_prefix_tokens, k_hf)
    builds["tiktoken_2w_small_shards"] = pipeline_bench.build(
        [str(small / "shard-*.jsonl")], work / f"cache-{profile}-small-shards", "tiktoken:cl100k_base", workers=2)
    stages = run_stages(corpus)
    fig.update(pipeline_bench.parquet_vs_jsonl(corpus, cm["files"][:k_tt], work))  # the same texts as Parquet
    best = lambda *ls: max(ls, key=lambda r: r["tokens_per_s"])  # noqa: E731
    limit = best(limit_a, limit_b)  # around our builds

    for name, b, m_ in (("tiktoken_2w", builds["tiktoken_2w"], cm), ("hf_2w", builds["hf_2w"], cm),
                        ("tiktoken_1w", builds["tiktoken_1w"], cm), ("tiktoken_2w_small_shards",
                                                                     builds["tiktoken_2w_small_shards"], sm)):
        if b["docs"] != m_["docs"] or b["bad_records"]:
            raise AssertionError(f"build {name}: {b['docs']} documents and {b['bad_records']} bad records; its corpus "
                                 f"has {m_['docs']} documents (was the corpus rewritten during the run?)")
    # exactly the encoders' tokens: the whole corpus (fastokens), its prefix (tiktoken, raw HF tokenizers)
    if tokens_tt != limit["tokens"] or builds["tiktoken_1w"]["tokens"] != tokens_tt:
        raise AssertionError(f"our builds hold {tokens_tt} and {builds['tiktoken_1w']['tokens']} tokens, fastokens "
                             f"on the same texts gives {limit['tokens']}")
    if prefix_tokens != tt_limit["tokens"]:
        raise AssertionError(f"our build holds {prefix_tokens} tokens in its first {k_tt} shards, tiktoken on the "
                             f"same texts gives {tt_limit['tokens']}")
    if stages["stage_tokens"] != builds["tiktoken_2w"]["tokens_by_shard"][0]:
        raise AssertionError(f"the stage measurement encoded {stages['stage_tokens']} tokens of the first shard, our "
                             f"build holds {builds['tiktoken_2w']['tokens_by_shard'][0]}")
    if hf_prefix_tokens != raw_hf["tokens"]:
        raise AssertionError(f"our HF build holds {hf_prefix_tokens} tokens in its first {k_hf} shards, raw HF "
                             f"tokenizers gives {raw_hf['tokens']}")

    b2, b1, bh, bs = builds["tiktoken_2w"], builds["tiktoken_1w"], builds["hf_2w"], builds["tiktoken_2w_small_shards"]
    fig.update({
        "tokens": tokens_tt,
        "limit_tokens_per_s": limit["tokens_per_s"],
        "limit_tokens_per_s_a": limit_a["tokens_per_s"],
        "limit_tokens_per_s_b": limit_b["tokens_per_s"],
        "tiktoken_limit_tokens_per_s": tt_limit["tokens_per_s"],
        "tiktoken_limit_vs_limit": tt_limit["tokens_per_s"] / limit["tokens_per_s"],
        "raw_hf_tokens_per_s": raw_hf["tokens_per_s"],
        "pipeline_tokens_per_s": b2["tokens_per_s"],
        "pipeline_wall_s": b2["wall_s"],
        "pipeline_steady_tokens_per_s": b2["steady_tokens_per_s"],
        # Start-up: the share of each timed build's whole command outside its steady state (before the first
        # unit, the tail, after the last unit); the fixed seconds of every build are itemized in the details.
        "pipeline_startup_fraction": b2["startup_fraction"],
        "pipeline_1w_startup_fraction": b1["startup_fraction"],
        "pipeline_hf_startup_fraction": bh["startup_fraction"],
        "pipeline_startup_fraction_max": max(b2["startup_fraction"], b1["startup_fraction"], bh["startup_fraction"]),
        "pipeline_vs_limit": b2["tokens_per_s"] / limit["tokens_per_s"],
        "pipeline_vs_tiktoken_limit": b2["tokens_per_s"] / tt_limit["tokens_per_s"],
        "pipeline_steady_vs_limit": (b2["steady_tokens_per_s"] or 0) / limit["tokens_per_s"],
        "pipeline_hf_tokens_per_s": bh["tokens_per_s"],
        "pipeline_hf_steady_tokens_per_s": bh["steady_tokens_per_s"],
        "pipeline_hf_vs_raw_hf": bh["tokens_per_s"] / raw_hf["tokens_per_s"],
        "pipeline_hf_steady_vs_raw_hf": (bh["steady_tokens_per_s"] or 0) / raw_hf["tokens_per_s"],
        "hf_datasets_tokens_per_s": hfd_tt["tokens_per_s"],
        "hf_datasets_hf_tokens_per_s": hfd_hf["tokens_per_s"],
        "hf_datasets_map_tokens_per_s": hfd_tt["map_tokens_per_s"],
        "hf_datasets_hf_map_tokens_per_s": hfd_hf["map_tokens_per_s"],
        "hf_datasets_bytes_per_token": hfd_tt["bytes_per_token"],
        "hf_datasets_vs_tiktoken_limit": hfd_tt["tokens_per_s"] / tt_limit["tokens_per_s"],
        "hf_datasets_hf_vs_raw_hf": hfd_hf["tokens_per_s"] / raw_hf["tokens_per_s"],
        "hf_tokens": bh["tokens"],
        "raw_hf_vs_limit": raw_hf["tokens_per_s"] / limit["tokens_per_s"],
        "pipeline_vs_hf_datasets": b2["tokens_per_s"] / hfd_tt["tokens_per_s"],
        "pipeline_hf_vs_hf_datasets": bh["tokens_per_s"] / hfd_hf["tokens_per_s"],
        "pipeline_1w_tokens_per_s": b1["tokens_per_s"],
        "pipeline_1w_steady_tokens_per_s": b1["steady_tokens_per_s"],
        "pipeline_scaling_2_vs_1": b2["tokens_per_s"] / b1["tokens_per_s"],
        # how far 2 busy cores beat 1 on this machine for the encoder itself: process 0's half of the texts
        # alone, against the 2-process limit (each core slows down when both are busy)
        "limit_1p_tokens_per_s": limit_1p["tokens_per_s"],
        "limit_scaling_2_vs_1": limit["tokens_per_s"] / limit_1p["tokens_per_s"],
        "limit_per_core_2p_vs_1p": limit["per_process_tokens_per_s"][0] / limit_1p["tokens_per_s"],
        "pipeline_scaling_vs_limit_scaling": (b2["tokens_per_s"] / b1["tokens_per_s"])
                                             / (limit["tokens_per_s"] / limit_1p["tokens_per_s"]),
        "pipeline_steady_scaling_2_vs_1": (b2["steady_tokens_per_s"] or 0) / (b1["steady_tokens_per_s"] or math.inf),
        # the 1-worker build is not one core: its worker's library threads and the launcher use the idle one
        "pipeline_1w_cores": b1["cpu_s"] / b1["wall_s"],
        "pipeline_2w_cores": b2["cpu_s"] / b2["wall_s"],
        "pipeline_cpu_efficiency_2_vs_1": (b2["tokens_per_cpu_s"] or 0) / (b1["tokens_per_cpu_s"] or math.inf),
        "bytes_per_token": b2["cache_bytes"] / tokens_tt,
        "parquet_bytes_per_token": b2["parquet_bytes"] / tokens_tt,
        "pipeline_peak_rss_mb": b2["peak_rss_tree_mb"],
        "pipeline_peak_rss_mb_small_shards": bs["peak_rss_tree_mb"],
        "pipeline_peak_rss_proc_mb": b2["peak_rss_proc_mb"],
        "pipeline_peak_rss_proc_mb_small_shards": bs["peak_rss_proc_mb"],
        "pipeline_shard_mb": cm["shard_bytes"][0] / 1e6,
        "pipeline_shard_mb_small": sm["shard_bytes"][0] / 1e6,
        "pipeline_peak_rss_ratio_4x_shards": b2["peak_rss_tree_mb"] / bs["peak_rss_tree_mb"],
        "pipeline_chunks": b2["chunks"],
        "pipeline_chunk_mb": (b2["chunk_bytes"] or 0) / 1e6,
    })
    fig.update({k: v for k, v in stages.items() if isinstance(v, (int, float))})
    for prefix, b in (("pipeline", b2), ("pipeline_1w", b1), ("pipeline_hf", bh)):
        fx, fc = b.get("fixed") or {}, b.get("fixed_cpu") or {}
        for key, item in (("fixed_before_s", "before_first_unit_s"), ("fixed_after_s", "after_last_unit_s"),
                          ("tail_s", "tail_s")):
            if fx.get(item) is not None:  # from the build's trace (pipelines/trace.py)
                fig[f"{prefix}_{key}"] = fx[item]
        for key in ("launcher_to_run_cpu_s", "worker_to_first_unit_cpu_s", "workers_forked"):
            if fc.get(key) is not None:
                fig[f"{prefix}_{key}"] = fc[key]
    # CPU efficiency: tokens per CPU-second (whole command for builds and HF datasets; the encoding loop for
    # the limits and raw HF). Robust to contention on a shared machine; ignores idle time, so it is an upper
    # bound of the wall-time ratio on a quiet machine.
    cpu_limit = max(r["tokens_per_cpu_s"] for r in (limit_a, limit_b))
    fig.update({
        "limit_tokens_per_cpu_s": cpu_limit,
        "tiktoken_limit_tokens_per_cpu_s": tt_limit["tokens_per_cpu_s"],
        "raw_hf_tokens_per_cpu_s": raw_hf["tokens_per_cpu_s"],
        "pipeline_tokens_per_cpu_s": b2["tokens_per_cpu_s"],
        "pipeline_hf_tokens_per_cpu_s": bh["tokens_per_cpu_s"],
        "hf_datasets_tokens_per_cpu_s": hfd_tt["tokens_per_cpu_s"],
        "hf_datasets_hf_tokens_per_cpu_s": hfd_hf["tokens_per_cpu_s"],
        "pipeline_cpu_vs_limit": b2["tokens_per_cpu_s"] / cpu_limit,
        "pipeline_cpu_vs_tiktoken_limit": b2["tokens_per_cpu_s"] / tt_limit["tokens_per_cpu_s"],
        "pipeline_hf_cpu_vs_raw_hf": bh["tokens_per_cpu_s"] / raw_hf["tokens_per_cpu_s"],
        "pipeline_cpu_vs_hf_datasets": b2["tokens_per_cpu_s"] / hfd_tt["tokens_per_cpu_s"],
        "pipeline_hf_cpu_vs_hf_datasets": bh["tokens_per_cpu_s"] / hfd_hf["tokens_per_cpu_s"],
    })
    # Contention: mean cores used by other processes on this shared machine during each measurement.
    for name, r in (("limit_a", limit_a), ("limit_b", limit_b), ("limit_1p", limit_1p), ("tiktoken_limit", tt_limit),
                    ("raw_hf", raw_hf), ("hf_datasets", hfd_tt), ("hf_datasets_hf", hfd_hf)):
        fig[f"other_cores_during_{name}"] = r["other_cores"]
    for name, b in builds.items():
        fig[f"other_cores_during_pipeline_{name}"] = b["other_cores"]
    details["builds"] = {k: {kk: vv for kk, vv in v.items() if kk != "samples"} for k, v in builds.items()}
    details["samples"] = {k: v["samples"] for k, v in builds.items()}
    details["baselines"] = {"limit": [limit_a, limit_b], "limit_1p": limit_1p, "tiktoken_limit": tt_limit,
                            "raw_hf": raw_hf, "hf_datasets_tiktoken": hfd_tt, "hf_datasets_hf": hfd_hf}
    details["stages"] = stages

    # -- the distinct corpus: our build against Megatron's GigaToken path and the parse-and-encode limit ----------
    fig_d, details_d = peer_suite.measure(work, profile, P, corpus)
    fig.update(fig_d)
    details.update(details_d)
    details["commands"] = build_commands(inputs, cache_tt, tokenizer_json, corpus, P, work / f"corpus-distinct-{profile}")

    # -- duplicate marks on the distinct corpus's cache (benchmarks/dedup_bench.py) ------------------------------
    m = run_monitored([_py(), "-m", "benchmarks.dedup_bench", "--cache", str(work / f"cache-{profile}-distinct"),
                       "--corpus", str(work / f"corpus-distinct-{profile}"), "--work", str(work / f"dedup-{profile}")]
                      + (["--quick"] if a.quick else []))
    fig.update(m.result)

    # -- reader -----------------------------------------------------------------------------------------------------
    m = run_monitored([_py(), "-m", "benchmarks.reader_bench", "--cache", str(cache_tt), "--work",
                       str(work / f"reader-{profile}"), "--batches", str(P["reader_batches"]), "--rounds",
                       str(P["reader_rounds"]), "--seek_reps", str(P["seek_reps"]), "--budgets", P["budgets"]])
    rb = dict(m.result)
    details["reader_budget_curve"] = rb.pop("reader_budget_curve")
    details["reader_shuffle_config"] = rb.pop("reader_shuffle_config")
    fig.update(rb)
    fig["reader_rss_growth_vs_budget"] = rb["reader_rss_growth_mb"] / rb["reader_memory_budget_mb"]
    log(f"reader: {rb['reader_tokens_per_s'] / 1e6:.1f} M tok/s = {rb['reader_vs_memmap']:.3f} of memmap; "
        f"shuffled {rb['reader_shuffled_vs_memmap']:.3f}; seek far/near {rb['seek_far_vs_near']:.2f}; "
        f"ledger 100k open {rb['ledger_open_s_100k']:.2f} s")

    # -- a mixture of 4 components against the cache alone (benchmarks/mixture_bench.py) -------------------------
    m = run_monitored([_py(), "-m", "benchmarks.mixture_bench", "--cache", str(cache_tt), "--work",
                       str(work / f"reader-{profile}" / "mixture"), "--batches", str(P["reader_batches"]),
                       "--rounds", str(P["reader_rounds"])] + (["--quick"] if a.quick else []))
    fig.update(m.result)
    log(f"mixture of 4 / single cache: {fig['reader_mixture_vs_single']:.3f} (shuffled "
        f"{fig['reader_mixture_shuffled_vs_single']:.3f}); opening {fig['mixture_open_vs_ledgers']:.2f} x its ledgers")

    # -- best-fit packing against concatenation and unpacked reading (benchmarks/packing_cost.py) ----------------
    m = run_monitored([_py(), "-m", "benchmarks.packing_cost", "--cache", str(cache_tt), "--rounds",
                       str(min(2, P["reader_rounds"]))] + (["--quick"] if a.quick else []))
    fig.update(m.result)

    # -- what loss masks cost a read: the same documents with and without (benchmarks/mask_cost.py) -------------
    m = run_monitored([_py(), "-m", "benchmarks.mask_cost", "--work", str(work / f"mask-{profile}")]
                      + (["--quick"] if a.quick else []))
    fig.update(m.result)
    log(f"loss masks: reads at {fig['mask_train_ratio']:.3f} of the same cache without (2 workers), "
        f"{fig['mask_train_1p_ratio']:.3f} in one process, {fig['mask_best_fit_1p_ratio']:.3f} best fit")

    # -- what a view costs a read: 80% of the documents against all of them (benchmarks/view_cost.py) -----------
    m = run_monitored([_py(), "-m", "benchmarks.view_cost", "--work", str(work / f"view-{profile}")]
                      + (["--quick"] if a.quick else []))
    fig.update(m.result)
    log(f"views: 80% of the documents read at {fig['view_train_ratio']:.3f} of the whole cache (2 workers), "
        f"{fig['view_train_1p_ratio']:.3f} in one process, {fig['view_best_fit_1p_ratio']:.3f} best fit")

    # -- reading gs:// when every request takes 0-100 ms: a latency proxy before the GCS emulator -----------------
    m = run_monitored([_py(), "-m", "benchmarks.latency_bench", "--work", str(work / f"latency-{profile}")]
                      + (["--quick"] if a.quick else []))
    fig.update(m.result)
    log(f"gs:// at 50 ms per request / at 0 ms, steady: packed {fig['latency_packed_50ms_vs_0ms']:.2f}, shuffled "
        f"{fig['latency_shuffled_50ms_vs_0ms']:.2f}, mixture {fig['latency_mixture_50ms_vs_0ms']:.2f}; first batch at "
        f"50 ms at most {fig['latency_first_batch_s_50ms_max']:.2f} s")

    # -- supervised records: the loss mask's bytes per token, encoding rates (benchmarks/sft_bench.py) ------------
    fig.update(sft_bench.figures(a.quick))

    # -- shuffle quality -----------------------------------------------------------------------------------------
    fig.update(shuffle_quality(plots / "bench_shuffle_quality.png", P["shuffle_quick"]))

    probes = list(common.PROBES)
    details["speed_probes"] = probes
    if probes:  # how far the machine moved during the run: slowest probe / fastest
        for key, name in (("zstd_decompress_mb_s", "compute"), ("memcpy_gb_s", "memory")):
            vals = [p[key] for p in probes]
            fig[f"probe_{name}_min_vs_max"] = min(vals) / max(vals)
    fig["bench_total_s"] = time.perf_counter() - t_all
    details["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    details["targets"] = {k: list(v) for k, v in TARGETS.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fig, indent=1, sort_keys=True) + "\n")
    details_path = out.with_name(out.stem + "-details.json")
    details_path.write_text(json.dumps(details, indent=1, sort_keys=True, default=str) + "\n")
    from benchmarks import report

    report.write(fig, details, doc, plots, quick=a.quick)
    if not a.keep:
        for d in (cache_hf, work / f"cache-{profile}-tiktoken-1w", work / f"cache-{profile}-small-shards", work / f"reader-{profile}",
                  work / f"cache-{profile}-distinct", work / f"mask-{profile}", work / f"latency-{profile}",
                  work / f"dedup-{profile}"):
            shutil.rmtree(d, ignore_errors=True)
    log(f"done in {fig['bench_total_s']:.0f} s: {out} and {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
