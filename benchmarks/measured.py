"""Measured commands of the suite, each run as a monitored subprocess (benchmarks.common.run_monitored), with
its log line: the encoders alone, the stage table, and the distinct corpus's peers and limits."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from benchmarks.common import REPO, log, run_monitored

TWO_CORES = {"RAYON_NUM_THREADS": "2"}


def _py() -> str:
    return sys.executable


def run_encoders(corpus: Path, docs: int, repeats: int) -> dict:
    """Each encoder alone on the same documents: MB per CPU-second and agreement (benchmarks/tokenizer_bench.py)."""
    m = run_monitored([_py(), "-m", "benchmarks.tokenizer_bench", "throughput", "--corpus", str(corpus), "--docs",
                       str(docs), "--repeats", str(repeats), "--work", str(REPO / "benchmarks" / "work"), "--emit"])
    r = m.result
    agree = lambda a: a["same"] / max(1, a["docs"])  # noqa: E731
    out = {
        "encoder_docs": r["docs"], "encoder_mb": r["mb"],
        "encoder_tiktoken_mb_per_cpu_s": r["tiktoken-reference"]["mb_per_cpu_s_best"],
        "encoder_fastokens_mb_per_cpu_s": r["tiktoken-fast"]["mb_per_cpu_s_best"],
        "encoder_hf_tokenizers_mb_per_cpu_s": r["hf-reference"]["mb_per_cpu_s_best"],
        "encoder_fastokens_hf_json_mb_per_cpu_s": r["hf-fast"]["mb_per_cpu_s_best"],
        "encoder_tiktoken_agreement": 1.0,  # the definition
        "encoder_fastokens_agreement": agree(r["tiktoken_agreement"]),
        "encoder_hf_tokenizers_agreement": agree(r["hf_vs_tiktoken_agreement"]),
        "encoder_hf_tokenizers_agreement_docs": r["hf_vs_tiktoken_agreement"]["docs"],
        "encoder_fastokens_hf_json_agreement": agree(r["hf_agreement"]),
        "fastokens_load_cpu_s": r["tiktoken_startup"]["fast_load_cpu_s"],
        "fastokens_hf_json_load_cpu_s": r["hf_startup"]["fast_load_cpu_s"],
        "conformance_check_cpu_s": r["tiktoken_startup"]["conformance_cpu_s"],
        "verify_every_1000_share": r["verify_every_1000"]["fraction_of_fast_encoding"],
    }
    log(f"encoders on {r['docs']} documents ({r['mb']:.1f} MB): tiktoken {out['encoder_tiktoken_mb_per_cpu_s']:.1f}, "
        f"fastokens {out['encoder_fastokens_mb_per_cpu_s']:.1f}, HF tokenizers "
        f"{out['encoder_hf_tokenizers_mb_per_cpu_s']:.1f} MB/CPU-s; fastokens agrees with tiktoken on "
        f"{out['encoder_fastokens_agreement']:.4f}")
    return out


def run_stages(corpus: Path) -> dict:
    m = run_monitored([_py(), "-m", "benchmarks.stages", "--corpus", str(corpus), "--shards", "1"])
    r = dict(m.result)
    log("a worker's CPU by stage: " + ", ".join(f"{k} {r[f'stage_{k}_share']:.2f}" for k in
                                               ("read_hash", "parse", "encode", "parquet", "other")))
    return r


def run_parse_encode_limit(corpus: Path, encoder: str = "gigatoken") -> dict:
    """An exact encoder's file path on 2 cores, nothing written (benchmarks/megatron_peer.py limit)."""
    m = run_monitored([_py(), "-m", "benchmarks.megatron_peer", "limit", "--corpus", str(corpus), "--encoder",
                       encoder], env=TWO_CORES)
    r = dict(m.result, other_cores=m.other_cores, whole_command_s=m.wall_s)
    log(f"parse-and-encode limit ({r['encoder']}, 2 cores, nothing written): {r['seconds']:.2f} s, "
        f"{r['mb_per_s']:.1f} MB/s, {r['mb_per_cpu_s']:.1f} MB per CPU-second")
    return r


def run_megatron_fast(corpus: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    m = run_monitored([_py(), "-m", "benchmarks.megatron_peer", "fast", "--corpus", str(corpus), "--out",
                       str(out / "corpus")], env={**TWO_CORES, "PYTHONWARNINGS": "ignore"})
    r = dict(m.result)
    r.update(wall_s=m.wall_s, cpu_s=m.cpu_s, other_cores=m.other_cores, peak_rss_tree_mb=m.peak_rss_tree_mb,
             steady_s=m.wall_s - r["imports_s"], launch_to_first_line_s=r["t_first_line"] - m.started_at)
    r["exit_s"] = m.wall_s - r["launch_to_first_line_s"] - r["in_process_s"]  # after its last line (torch's teardown)
    shutil.rmtree(out, ignore_errors=True)
    log(f"Megatron-fast peer: {r['wall_s']:.1f} s whole command, {r['steady_s']:.1f} s less its imports "
        f"({r['imports_s']:.1f} s); encode_files {r['encode_s']:.1f} s, EOD and .bin {r['eod_write_s']:.1f} s")
    return r


def run_megatron_classic(corpus: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    m = run_monitored([_py(), "-m", "benchmarks.megatron_peer", "classic", "--corpus", str(corpus), "--out",
                       str(out / "corpus"), "--workers", "2"], env={"PYTHONWARNINGS": "ignore"})
    r = dict(m.result)
    r.update(wall_s=m.wall_s, cpu_s=m.cpu_s, other_cores=m.other_cores, peak_rss_tree_mb=m.peak_rss_tree_mb)
    shutil.rmtree(out, ignore_errors=True)
    log(f"Megatron classic (tiktoken, 2 worker processes): {r['wall_s']:.1f} s whole command")
    return r


def run_encoders_cold(corpus: Path, label: str, mb: float, repeats: int, work: Path) -> dict:
    m = run_monitored([_py(), "-m", "benchmarks.encoders_cold", "--corpus", str(corpus), "--mb", str(mb),
                       "--repeats", str(repeats), "--work", str(work), "--emit"])
    r = m.result
    out = {f"encoder_cold_{label}_mb": r["jsonl_mb"], f"encoder_cold_{label}_docs": r["docs"],
           f"encoder_cold_{label}_docs_with_special_strings": r["docs_with_special_strings"]}
    for name, row in r["rows"].items():
        out[f"encoder_cold_{name}_{label}_mb_per_cpu_s"] = row["mb_per_cpu_s"]
        out[f"encoder_cold_{name}_{label}_agreement"] = row["agreement"]
    log(f"encoders alone, cold, {r['jsonl_mb']:.1f} MB of {label} jsonl: " + ", ".join(
        f"{n} {row['mb_per_cpu_s']:.1f}" for n, row in r["rows"].items()) + " MB per CPU-second")
    return out


def run_baseline_limit(corpus: Path, encoder: str = "fastokens", shards: int | None = None) -> dict:
    """benchmarks/baselines.py's limit (the encoder alone, 2 processes, texts in memory) on ``corpus``."""
    m = run_monitored([_py(), "-m", "benchmarks.baselines", "limit", "--corpus", str(corpus), "--encoder", encoder]
                      + (["--shards", str(shards)] if shards else []))
    return dict(m.result, other_cores=m.other_cores)
