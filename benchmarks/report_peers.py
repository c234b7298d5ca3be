"""The report's parts about the distinct corpus (benchmarks/peer_suite.py): the Megatron peers, the
parse-and-encode limit, the encoders alone cold on both corpora, and the stage table on both corpora."""

from __future__ import annotations

import math

TODAY, DISTINCT = "today's (repeated)", "distinct"

# The targeted figures measured on the distinct corpus (benchmarks.report puts them first in its main table).
PEER_MAIN_ROWS = [
    ("pipeline_vs_megatron_fast", "Megatron-LM's GigaToken path (`preprocess_data_fast.py`: `encode_files` on 2 "
     "threads, EOD appended, `IndexedDatasetBuilder`) / our build, 2 workers; whole commands, seconds", "ratio"),
    ("pipeline_steady_vs_megatron_fast", "the same peer less its imports (megatron-core pulls torch) / our build's "
     "seconds in its work units", "ratio"),
    ("pipeline_vs_parse_encode_limit", "the parse-and-encode limit (the fastest exact encoder's file path alone on 2 "
     "cores: GigaToken `encode_files`, or orjson and fastokens; reads, parses and encodes the jsonl, writes "
     "nothing) / our build, whole command; seconds", "ratio"),
    ("pipeline_steady_vs_parse_encode_limit", "the same limit / our build's seconds in its work units", "ratio"),
]

# the corpus of every main-table figure measured on the distinct corpus; the others are on today's
CORPUS_OF = {key: DISTINCT for key, _, _ in PEER_MAIN_ROWS}
CORPUS_OF.update({key: DISTINCT for key in ("dedup_exact_mb_per_cpu_s", "dedup_near_mb_per_cpu_s",  # dedup_bench.py
                                            "dedup_signature_tokens_per_cpu_s", "dedup_planted_recall",
                                            "dedup_marked_false_share")})

COLD_ROWS = [
    ("tiktoken", "orjson + tiktoken `encode_ordinary` (the reference)"),
    ("fastokens", "orjson + fastokens `encode_batch_flat` (our fast backend, batches of 256)"),
    ("gigatoken_list", "orjson + GigaToken `encode_batch_list` (batches of 256)"),
    ("gigatoken_files", "GigaToken `encode_files` (reads and parses the jsonl in Rust)"),
    ("gigatoken_files_exact", "GigaToken `encode_files`, cl100k loaded without special tokens"),
]

STAGE_ROWS = [("read_hash", "reading the lines and hashing them (the input checksum)"),
              ("parse", "parsing the JSON lines (`parse_line`: orjson, the standard parser for the rest)"),
              ("encode", "encoding (the fast backend, batches of 256)"),
              ("parquet", "writing Parquet (`row_group_table`, zstd-3 `ParquetWriter`, row-group index, checksums)"),
              ("other", "the rest (batching, dead letters, sidecars, file writes)")]

# (key on today's corpus, key on the distinct one, meaning, format)
BOTH_ROWS = [
    ("corpus_mb", "distinct_corpus_mb", "corpus size (MB of jsonl)", "mb"),
    ("corpus_repeat_factor", "distinct_corpus_repeat_factor", "times its distinct text is repeated", "num"),
    ("corpus_docs", "distinct_corpus_docs", "documents", "int"),
    ("tokens", "distinct_tokens", "tokens (cl100k)", "int"),
    ("pipeline_tokens_per_s", "distinct_pipeline_tokens_per_s", "our build, 2 workers, whole command", "rate"),
    ("pipeline_steady_tokens_per_s", "distinct_pipeline_steady_tokens_per_s", "its steady state", "rate"),
    ("pipeline_startup_fraction", "distinct_pipeline_startup_fraction", "its share of start-up and tail", "ratio"),
    ("limit_tokens_per_s", "distinct_limit_tokens_per_s", "fastokens alone, 2 processes, texts in memory", "rate"),
    ("pipeline_vs_limit", "distinct_pipeline_vs_limit", "our build / that", "ratio"),
    ("pipeline_steady_vs_limit", "distinct_pipeline_steady_vs_limit", "its steady state / that", "ratio"),
    ("tiktoken_limit_tokens_per_s", "distinct_tiktoken_limit_tokens_per_s", "tiktoken alone, 2 processes, the "
     "first shards' texts in memory", "rate"),
    ("pipeline_vs_tiktoken_limit", "distinct_pipeline_vs_tiktoken_limit", "our build / that", "ratio"),
    ("bytes_per_token", "distinct_bytes_per_token", "cache bytes per token", "num"),
    ("pipeline_peak_rss_mb", "distinct_pipeline_peak_rss_mb", "our build's peak RSS, process tree (MB)", "mb"),
]


def _fmt(v, kind: str) -> str:
    from benchmarks.report import _fmt as fmt

    return fmt(v, kind)


def _num(fig: dict, key: str, default: float = 0.0) -> float:
    v = fig.get(key)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else default


def peer_table(fig: dict) -> list[str]:
    """Seconds of our build, the Megatron peers and the limit on the distinct corpus."""
    if "pipeline_vs_megatron_fast" not in fig:
        return []
    s = lambda k: _fmt(fig.get(k), "s")  # noqa: E731
    rows = [
        ("our build, 2 workers, whole command", s("distinct_pipeline_wall_s")),
        ("our build, seconds in its work units (tokens / steady rate)", s("distinct_pipeline_busy_s")),
        ("Megatron-fast peer, whole command", s("megatron_fast_wall_s")),
        ("... less its imports (its steady state)", s("megatron_fast_steady_s")),
        ("... of which: imports (megatron-core and torch, GigaToken, awkward)", s("megatron_fast_imports_s")),
        ("... loading cl100k into GigaToken", s("megatron_fast_load_s")),
        ("... `encode_files` (2 threads)", s("megatron_fast_encode_s")),
        ("... appending EOD and writing the `.bin`", s("megatron_fast_eod_write_s")),
        ("... writing the `.idx`", s("megatron_fast_finalize_s")),
        ("... after its last line (the interpreter's exit: torch's teardown)", s("megatron_fast_exit_s")),
        ("Megatron classic (`preprocess_data.py`: 2 tiktoken worker processes), whole command",
         s("megatron_classic_wall_s")),
        ("the parse-and-encode limit: the fastest of the runs below", s("parse_encode_limit_s")),
        ("... GigaToken `encode_files`, 2 threads, nothing written (faster of 2 runs)",
         s("parse_encode_limit_gigatoken_s")),
        ("... orjson and fastokens (our fast backend's encoder), 2 processes, nothing written (faster of 2 runs)",
         s("parse_encode_limit_fastokens_s")),
    ]
    out = ["", "### Against Megatron's GigaToken path and the parse-and-encode limit (distinct corpus)", "",
           f"The distinct corpus ({_num(fig, 'distinct_corpus_mb'):.0f} MB, every document once), 2 cores, side by "
           "side (`benchmarks/peer_suite.py`; alternating rounds, each side's best). The peer's tokens differ from "
           f"ours by {int(_num(fig, 'megatron_fast_tokens_minus_ours')):+,} (GigaToken loaded as Megatron loads it "
           "turns special-token strings inside text into special tokens); the limit's equal ours exactly (cl100k "
           f"loaded without special tokens). The limit ({fig.get('parse_encode_limit_encoder', '?')}) parses and "
           f"encodes {_num(fig, 'parse_encode_limit_mb_per_cpu_s'):.0f} MB of jsonl per CPU-second.", "",
           "| measurement | seconds |", "|---|---|"]
    out += [f"| {label} | {v} |" for label, v in rows]
    out += ["", f"Ours against classic Megatron: {_fmt(fig.get('pipeline_vs_megatron_classic'), 'ratio')} (whole "
                "commands)."]
    return out


def cold_encoder_table(fig: dict) -> list[str]:
    if not any(k.startswith("encoder_cold_") for k in fig):
        return []
    out = ["", "### The encoders alone, cold, from jsonl (both corpora)", "",
           f"The first {_num(fig, 'encoder_cold_today_mb'):.3g} MB of jsonl of each corpus "
           f"({int(_num(fig, 'encoder_cold_today_docs')):,} and {int(_num(fig, 'encoder_cold_distinct_docs')):,} "
           "documents), one thread, every encoder made anew before each run (both fast encoders cache the pieces "
           "they have seen), timing reading, parsing and encoding (`benchmarks/encoders_cold.py`). Agreement: "
           "documents whose tokens equal tiktoken's `encode_ordinary` ones "
           f"({int(_num(fig, 'encoder_cold_today_docs_with_special_strings'))} and "
           f"{int(_num(fig, 'encoder_cold_distinct_docs_with_special_strings'))} of the documents hold a "
           "special-token string).", "",
           f"| encoder | MB of jsonl per CPU-second, {TODAY} | agreement | MB per CPU-second, {DISTINCT} | "
           "agreement |", "|---|---|---|---|---|"]
    for key, label in COLD_ROWS:
        cells = []
        for corpus in ("today", "distinct"):
            cells += [_fmt(fig.get(f"encoder_cold_{key}_{corpus}_mb_per_cpu_s"), "num"),
                      _fmt(fig.get(f"encoder_cold_{key}_{corpus}_agreement"), "ratio")]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def both_corpora_table(fig: dict) -> list[str]:
    if "distinct_tokens" not in fig:
        return []
    out = ["", "### Today's figures on both corpora", "",
           "Today's targets are judged on today's corpus (its distinct text repeated); the distinct corpus reports "
           "the ones that are cheap to repeat.", "",
           f"| figure | {TODAY} | {DISTINCT} |", "|---|---|---|"]
    out += [f"| {meaning} | {_fmt(fig.get(a), kind)} | {_fmt(fig.get(b), kind)} |" for a, b, meaning, kind in BOTH_ROWS]
    return out


def stage_table(fig: dict) -> list[str]:
    """Where a worker's CPU goes, on each corpus, against the parse-and-encode limit's path."""
    if "stage_whole_cpu_s" not in fig:
        return []
    corpora = [("", TODAY)] + ([("distinct_", DISTINCT)] if "distinct_stage_whole_cpu_s" in fig else [])
    out = ["", "### Where a worker's CPU goes", "",
           "One process, the builder's own code, each stage alone over the corpus's first shard, encoders made "
           "anew before each run, best of 2 (`benchmarks/stages.py`). " + "; ".join(
               f"{name}: {_num(fig, p + 'stage_input_mb'):.1f} MB, {int(_num(fig, p + 'stage_tokens')):,} tokens, the "
               f"whole `ChunkBuilder` at {_num(fig, p + 'stage_whole_tokens_per_cpu_s') / 1e6:.1f} M tokens per "
               "CPU-second" for p, name in corpora) + ". The last rows set it against the parse-and-encode limit's "
           "path on one core (GigaToken `encode_files` on the same file).", "",
           "| stage | " + " | ".join(f"share of the whole, {n} | M tokens per CPU-second alone, {n}" for _, n in corpora)
           + " |", "|---|" + "---|---|" * len(corpora)]

    def cells(key: str) -> str:
        parts = []
        for p, _ in corpora:
            rate = fig.get(f"{p}stage_{key}_tokens_per_cpu_s")
            parts += [_fmt(fig.get(f"{p}stage_{key}_share"), "ratio"), "" if rate is None else f"{rate / 1e6:.1f}"]
        return " | ".join(parts)

    out += [f"| {label} | {cells(key)} |" for key, label in STAGE_ROWS]
    lim = []
    for p, _ in corpora:
        rate = fig.get(f"{p}stage_parse_encode_limit_tokens_per_cpu_s")
        lim += [_fmt(fig.get(f"{p}stage_whole_vs_parse_encode_limit"), "ratio"),
                "" if rate is None else f"{rate / 1e6:.1f}"]
    out.append("| the parse-and-encode limit's path alone (GigaToken `encode_files`, one core): its CPU / the whole's | "
               + " | ".join(lim) + " |")
    beyond = []
    for p, _ in corpora:
        beyond += [f"{_num(fig, p + 'stage_beyond_limit_cpu_s_per_mb'):.4f}", ""]
    out.append("| CPU-seconds per MB of jsonl a worker spends beyond the limit's path | " + " | ".join(beyond) + " |")
    return out


def peer_notes(fig: dict) -> dict[str, str]:
    """Why a distinct-corpus target is missed, from the run's own figures."""
    g = lambda k: _num(fig, k)  # noqa: E731
    limit_room = (f"Per CPU-second a worker's whole path costs {1 / max(g('distinct_stage_whole_vs_parse_encode_limit'), 1e-9):.2f}x "
                  f"the limit's path on the distinct corpus (\"Where a worker's CPU goes\": "
                  f"{g('distinct_stage_beyond_limit_cpu_s_per_mb'):.4f} CPU-s per MB beyond it; writing Parquet "
                  f"{g('distinct_stage_parquet_share'):.0%} of a worker, encoding {g('distinct_stage_encode_share'):.0%}, "
                  f"parsing {g('distinct_stage_parse_share'):.0%}, reading and hashing "
                  f"{g('distinct_stage_read_hash_share'):.0%}). ")
    notes = {
        "pipeline_vs_parse_encode_limit": limit_room + (
            f"Our whole command took {g('distinct_pipeline_wall_s'):.1f} s, {g('distinct_pipeline_busy_s'):.1f} s of it "
            f"in work units; the limit's call {g('parse_encode_limit_s'):.2f} s."),
        "pipeline_steady_vs_parse_encode_limit": limit_room + (
            f"In work units our build ran {g('distinct_pipeline_busy_s'):.1f} s against the limit's "
            f"{g('parse_encode_limit_s'):.2f} s."),
        "pipeline_vs_megatron_fast": (
            f"The peer took {g('megatron_fast_wall_s'):.1f} s: imports {g('megatron_fast_imports_s'):.1f} s, "
            f"encode_files {g('megatron_fast_encode_s'):.1f} s, EOD and .bin {g('megatron_fast_eod_write_s'):.1f} s; "
            f"ours {g('distinct_pipeline_wall_s'):.1f} s."),
        "pipeline_steady_vs_megatron_fast": (
            f"The peer less its imports took {g('megatron_fast_steady_s'):.1f} s, of which encode_files "
            f"{g('megatron_fast_encode_s'):.1f} s; ours in work units {g('distinct_pipeline_busy_s'):.1f} s."),
    }
    return notes


def corpus_paragraph(details: dict) -> list[str]:
    c = details.get("corpus_distinct") or {}
    if not c:
        return []
    by = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in (c.get("distinct_bytes_by_source") or {}).items())
    return ["", f"**The distinct corpus** (`benchmarks/distinct_corpus.py`): {c.get('bytes', 0) / 1e6:.0f} MB of jsonl "
            f"in {len(c.get('shard_bytes', []))} shards, {c.get('docs', 0):,} documents, each once (repeat factor "
            f"{c.get('repeat_factor', 0):g}): all the distinct text the machine has ({by}), "
            f"{c.get('generated_share', 0):.1%} of the bytes generated multilingual, unicode-heavy text (the conformance "
            "set's generator, U+180E removed: it would send nearly every generated document to the reference "
            "encoder). The Megatron peers, the parse-and-encode limit and the first four targets are measured on it."]


def method_bullets() -> list[str]:
    return [
        "- **The Megatron-fast peer** (`benchmarks/megatron_peer.py fast`): what "
        "`Megatron-LM/tools/preprocess_data_fast.py` does, with cl100k: `gigatoken.Tokenizer.from_tiktoken(path)` (its special "
        "tokens included, as Megatron loads a tokenizer), `encode_files(JsonlFileSource(files), parallel=True)` on "
        "`RAYON_NUM_THREADS=2`, EOD appended to every document and the tokens written per slice of a million "
        "documents as `IndexedDatasetBuilder.add_documents(docs, eod_token=...)` does (megatron-core 0.16.1 predates "
        "that method; the same steps run on its builder), then `finalize`. Whole command = the subprocess's wall "
        "time; its steady state = that less its imports, timed in the process from its first line.",
        "- **The parse-and-encode limit** (`benchmarks/megatron_peer.py limit`): the fastest exact encoder's file "
        "path on 2 cores, writing nothing: GigaToken's `encode_files` on the corpus (2 threads, cl100k loaded "
        "without special tokens: exactly tiktoken's `encode_ordinary` tokens), the time of that one call; and "
        "orjson with fastokens as our fast backend runs it, 2 forked processes each reading, parsing and encoding "
        "half of the shards, from a common start to the last one's end. Each runs before and after the rounds; the "
        "fastest run is the limit, and every run's tokens are checked to equal our build's. Our build's steady "
        "state: tokens / the sum of its workers' rates inside work units (its trace).",
        "- **Megatron classic** (`benchmarks/megatron_peer.py classic`): `Megatron-LM/tools/preprocess_data.py`'s shape with "
        "tiktoken: a `multiprocessing.Pool(2)` whose workers `json.loads` each line and encode it, lines sent 32 "
        "at a time, the main process adding each document to an `IndexedDatasetBuilder`.",
    ]
