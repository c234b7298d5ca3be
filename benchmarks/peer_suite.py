"""The suite's distinct-text part: our build against Megatron's GigaToken path and the parse-and-encode limit.

On the distinct corpus (benchmarks/distinct_corpus.py: every document once), side by side, 2 cores:

- our build (``pipelines.build_cache``, 2 workers): whole command, and its steady state (the seconds its
  workers spent inside work units, from the build's trace; see benchmarks/pipeline_bench.py);
- the Megatron-fast peer (benchmarks/megatron_peer.py ``fast``: GigaToken ``encode_files`` on 2 threads, EOD
  appended, megatron-core's ``IndexedDatasetBuilder``): whole command, and the whole command less its
  imports (timed inside its process);
- the parse-and-encode limit (``megatron_peer.py limit``): the fastest exact encoder's file path, writing
  nothing, on 2 cores: GigaToken's own (``encode_files`` on 2 threads, the time of that call) or orjson and
  fastokens in 2 processes (as fast per CPU-second on this corpus). Each runs before and after the rounds; the
  fastest run is the limit;
- the classic Megatron path (``megatron_peer.py classic``: a pool of 2 tiktoken workers), once.

Alternating rounds of our build and the peer; each side's fastest round is used. Also on the distinct corpus:
the figures of today's corpus that are cheap to repeat (fastokens' limit in memory, tiktoken's limit on the
first shards, start-up share, bytes per token, the stage table), and the encoders alone, cold, on both corpora
(benchmarks/encoders_cold.py).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import pipeline_bench
from benchmarks.common import log
from benchmarks.distinct_corpus import build_distinct_corpus
from benchmarks.measured import (run_baseline_limit, run_encoders_cold, run_megatron_classic, run_megatron_fast,
                                 run_parse_encode_limit, run_stages)


def peer_figures(builds: list[dict], peers: list[dict], limits: list[dict], classic: dict | None = None) -> dict:
    """Our build against the peer and the limit: ratios of seconds on the same corpus (ours faster: > 1).

    Each side's best round: ``builds`` are pipeline_bench.build results (``wall_s``; ``busy_s`` = tokens / its
    steady rate, the seconds its workers spent in work units); ``peers`` the Megatron-fast peer's (``wall_s``;
    ``imports_s``, timed inside it: its steady state is the whole command less them); ``limits`` the
    parse-and-encode limit's (``seconds`` of its call); ``classic`` the classic path's (``wall_s``).
    """
    ours, ours_steady = min(b["wall_s"] for b in builds), min(b["busy_s"] for b in builds)
    peer, peer_steady = min(p["wall_s"] for p in peers), min(p["wall_s"] - p["imports_s"] for p in peers)
    limit = min(r["seconds"] for r in limits)
    out = {
        "pipeline_vs_megatron_fast": peer / ours,
        "pipeline_steady_vs_megatron_fast": peer_steady / ours_steady,
        "pipeline_vs_parse_encode_limit": limit / ours,
        "pipeline_steady_vs_parse_encode_limit": limit / ours_steady,
        "megatron_fast_wall_s": peer,
        "megatron_fast_steady_s": peer_steady,
        "parse_encode_limit_s": limit,
        "distinct_pipeline_wall_s": ours,
        "distinct_pipeline_busy_s": ours_steady,
    }
    if classic is not None:
        out["pipeline_vs_megatron_classic"] = classic["wall_s"] / ours
        out["megatron_classic_wall_s"] = classic["wall_s"]
    return out


def measure(work: Path, profile: str, P: dict, today: Path) -> tuple[dict, dict]:
    """The distinct-text figures (flat) and their details; ``today``: today's corpus (the encoders' second row)."""
    corpus = work / f"corpus-distinct-{profile}"
    size = P.get("distinct_size_mb")
    cm = build_distinct_corpus(corpus, P["distinct_shards"], None if size is None else int(size * 1e6), log=log)
    fig: dict = {"distinct_corpus_mb": cm["bytes"] / 1e6, "distinct_corpus_docs": cm["docs"],
                 "distinct_corpus_repeat_factor": cm["repeat_factor"],
                 "distinct_corpus_generated_share": cm["generated_share"]}
    details: dict = {"corpus_distinct": {k: v for k, v in cm.items() if k != "files"}}
    for label, c in (("today", today), ("distinct", corpus)):
        fig.update(run_encoders_cold(c, label, P["cold_mb"], P["cold_repeats"], work))

    inputs = [str(corpus / "shard-*.jsonl")]
    cache = work / f"cache-{profile}-distinct"
    encoders = ("gigatoken", "fastokens")
    limits = [run_parse_encode_limit(corpus, e) for e in encoders]
    builds, peers = [], []
    for _ in range(P["peer_rounds"]):
        builds.append(pipeline_bench.build(inputs, cache, "tiktoken:cl100k_base", workers=2))
        peers.append(run_megatron_fast(corpus, work / f"megatron-fast-{profile}"))
    limits += [run_parse_encode_limit(corpus, e) for e in encoders]
    fastokens = run_baseline_limit(corpus)
    k = P["distinct_tiktoken_shards"]
    tiktoken = run_baseline_limit(corpus, "tiktoken", k)
    classic = run_megatron_classic(corpus, work / f"megatron-classic-{profile}")
    stages = {f"distinct_{key}": v for key, v in run_stages(corpus).items()}

    build = min(builds, key=lambda b: b["wall_s"])
    steady = min(builds, key=lambda b: b["busy_s"])
    fast = min(peers, key=lambda p: p["wall_s"])
    limit = min(limits, key=lambda r: r["seconds"])
    tokens = build["tokens"]
    # every measurement encoded the same texts: exact encoders give our tokens; the peer's GigaToken
    # recognizes special-token strings (fewer tokens), and both Megatron paths add one EOD per document
    for name, b in (("our build", build), ("our build (steady)", steady)):
        if b["docs"] != cm["docs"] or b["bad_records"] or b["tokens"] != tokens:
            raise AssertionError(f"{name}: {b['docs']} documents, {b['bad_records']} bad records, {b['tokens']} "
                                 f"tokens; the corpus has {cm['docs']} documents")
    exact = [(f"the parse-and-encode limit ({r['encoder']})", r) for r in limits] + [("fastokens' limit", fastokens)]
    for name, r in exact:
        if r["tokens"] != tokens:
            raise AssertionError(f"{name} encoded {r['tokens']} tokens, our build holds {tokens}")
    if classic["tokens"] != tokens or classic["docs"] != cm["docs"] or fast["docs"] != cm["docs"]:
        raise AssertionError(f"Megatron classic: {classic['tokens']} tokens in {classic['docs']} documents, fast: "
                             f"{fast['docs']} documents; our build holds {tokens} tokens in {cm['docs']} documents")
    if stages["distinct_stage_tokens"] != build["tokens_by_shard"][0]:
        raise AssertionError(f"the stage measurement encoded {stages['distinct_stage_tokens']} tokens of the first "
                             f"shard, our build holds {build['tokens_by_shard'][0]}")
    prefix = sum(build["tokens_by_shard"][:k])
    if tiktoken["tokens"] != prefix:
        raise AssertionError(f"tiktoken's limit encoded {tiktoken['tokens']} tokens, our build holds {prefix} "
                             f"in the same {k} shards")

    fig.update(peer_figures(builds, peers, limits, classic))
    fig.update({
        "megatron_fast_imports_s": fast["imports_s"], "megatron_fast_load_s": fast["load_s"],
        "megatron_fast_encode_s": fast["encode_s"], "megatron_fast_eod_write_s": fast["eod_write_s"],
        "megatron_fast_finalize_s": fast["finalize_s"], "megatron_fast_exit_s": fast["exit_s"],
        "megatron_fast_cpu_s": fast["cpu_s"],
        "megatron_fast_peak_rss_mb": fast["peak_rss_tree_mb"],
        "megatron_fast_tokens_minus_ours": fast["tokens"] - tokens,
        "megatron_classic_imports_s": classic["imports_s"], "megatron_classic_cpu_s": classic["cpu_s"],
        "parse_encode_limit_encoder": limit["encoder"],
        "parse_encode_limit_gigatoken_s": min(r["seconds"] for r in limits if r["encoder"].startswith("gigatoken")),
        "parse_encode_limit_fastokens_s": min(r["seconds"] for r in limits if "fastokens" in r["encoder"]),
        "parse_encode_limit_mb_per_s": limit["mb_per_s"], "parse_encode_limit_mb_per_cpu_s": limit["mb_per_cpu_s"],
        "parse_encode_limit_cpu_s": limit["cpu_s"],
        "distinct_tokens": tokens,
        "distinct_pipeline_tokens_per_s": build["tokens_per_s"],
        "distinct_pipeline_steady_tokens_per_s": steady["steady_tokens_per_s"],
        "distinct_pipeline_cpu_s": build["cpu_s"],
        "distinct_pipeline_startup_fraction": build["startup_fraction"],
        "distinct_pipeline_peak_rss_mb": build["peak_rss_tree_mb"],
        "distinct_bytes_per_token": build["cache_bytes"] / tokens,
        "distinct_limit_tokens_per_s": fastokens["tokens_per_s"],
        "distinct_pipeline_vs_limit": build["tokens_per_s"] / fastokens["tokens_per_s"],
        "distinct_pipeline_steady_vs_limit": steady["steady_tokens_per_s"] / fastokens["tokens_per_s"],
        "distinct_tiktoken_limit_tokens_per_s": tiktoken["tokens_per_s"],
        "distinct_pipeline_vs_tiktoken_limit": build["tokens_per_s"] / tiktoken["tokens_per_s"],
        "distinct_corpus_prefix_mb": sum(cm["shard_bytes"][:k]) / 1e6,
        "other_cores_during_megatron_fast": fast["other_cores"], "other_cores_during_parse_encode_limit":
            limit["other_cores"], "other_cores_during_pipeline_distinct": build["other_cores"],
        "other_cores_during_megatron_classic": classic["other_cores"],
    })
    fig.update({key: v for key, v in stages.items() if isinstance(v, (int, float))})
    details.update({"distinct_builds": [{kk: vv for kk, vv in b.items() if kk != "samples"} for b in builds],
                    "megatron_fast": peers, "megatron_classic": classic, "parse_encode_limit": limits,
                    "distinct_fastokens_limit": fastokens, "distinct_tiktoken_limit": tiktoken,
                    "distinct_stages": stages})
    return fig, details
