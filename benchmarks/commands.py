"""The command behind each measurement of the suite, as the report lists them (paths relative to the repo)."""

from __future__ import annotations

import os

from benchmarks.common import REPO


def build_commands(inputs, cache_tt, tokenizer_json, corpus, P, distinct) -> dict:
    """``corpus``: today's corpus; ``distinct``: the distinct corpus (benchmarks/peer_suite.py)."""
    rel = lambda p: os.path.relpath(p, REPO)  # noqa: E731
    size = "" if P.get("distinct_size_mb") is None else f" --size_mb {P['distinct_size_mb']:g}"
    common = "--runner DirectRunner --direct_running_mode=multi_processing"
    return {
        "suite": "make bench   (= .venv/bin/python -m benchmarks.run)",
        "quick": "make bench-quick   (= .venv/bin/python -m benchmarks.run --quick)",
        "corpus": f".venv/bin/python -m benchmarks.corpus --size_mb {P['size_mb']:g} --shards {P['shards']} "
                  f"--out {rel(corpus)}",
        "encoders": f".venv/bin/python -m benchmarks.tokenizer_bench throughput --corpus {rel(corpus)} --docs "
                    f"{P['encoder_docs']} --repeats {P['encoder_repeats']}",
        "pipeline_tiktoken": f".venv/bin/python -m pipelines.build_cache --input '{rel(inputs[0])}' --output "
                             f"{rel(cache_tt)} --tokenizer tiktoken:cl100k_base {common} --direct_num_workers=2",
        "pipeline_hf": f".venv/bin/python -m pipelines.build_cache --input '{rel(inputs[0])}' --output OUT "
                       f"--tokenizer {rel(tokenizer_json)} {common} --direct_num_workers=2",
        "pipeline_1_worker": "the tiktoken build with --direct_num_workers=1",
        "limit": f".venv/bin/python -m benchmarks.baselines limit --corpus {rel(corpus)}",
        "limit_1p": f".venv/bin/python -m benchmarks.baselines limit --corpus {rel(corpus)} --processes 1 --first_half",
        "tiktoken_limit": f".venv/bin/python -m benchmarks.baselines limit --corpus {rel(corpus)} --encoder tiktoken "
                          f"--shards {P['prefix_shards']}",
        "raw_hf": f"RAYON_NUM_THREADS=2 .venv/bin/python -m benchmarks.baselines raw_hf --corpus {rel(corpus)} "
                  f"--shards {P['hf_shards']} --tokenizer_json {rel(tokenizer_json)}",
        "hf_datasets_tiktoken": f".venv/bin/python -m benchmarks.baselines hf_datasets --backend tiktoken --corpus "
                                f"{rel(corpus)} --shards {P['prefix_shards']} --out OUT --cache_dir FRESH_DIR",
        "hf_datasets_hf": f".venv/bin/python -m benchmarks.baselines hf_datasets --backend hf --corpus "
                          f"{rel(corpus)} --shards {P['hf_shards']} --out OUT --cache_dir FRESH_DIR "
                          f"--tokenizer_json {rel(tokenizer_json)}",
        "stages": f".venv/bin/python -m benchmarks.stages --corpus {rel(corpus)} --shards 1",
        "reader": f".venv/bin/python -m benchmarks.reader_bench --cache {rel(cache_tt)} --work benchmarks/work/reader",
        "mixture": f".venv/bin/python -m benchmarks.mixture_bench --cache {rel(cache_tt)} --work benchmarks/work/mixture",
        "distinct_corpus": f".venv/bin/python -m benchmarks.distinct_corpus --shards {P['distinct_shards']}{size} "
                           f"--out {rel(distinct)}",
        "encoders_cold": f".venv/bin/python -m benchmarks.encoders_cold --corpus CORPUS --mb {P['cold_mb']:g} "
                         f"--repeats {P['cold_repeats']}   (CORPUS: {rel(corpus)}, then {rel(distinct)})",
        "pipeline_distinct": f".venv/bin/python -m pipelines.build_cache --input '{rel(distinct)}/shard-*.jsonl' "
                             f"--output OUT --tokenizer tiktoken:cl100k_base {common} --direct_num_workers=2",
        "megatron_fast": f"RAYON_NUM_THREADS=2 .venv/bin/python -m benchmarks.megatron_peer fast --corpus "
                         f"{rel(distinct)} --out OUT/corpus",
        "parse_encode_limit": f"RAYON_NUM_THREADS=2 .venv/bin/python -m benchmarks.megatron_peer limit --corpus "
                              f"{rel(distinct)}",
        "megatron_classic": f".venv/bin/python -m benchmarks.megatron_peer classic --corpus {rel(distinct)} "
                            "--out OUT/corpus --workers 2",
        "distinct_limit": f".venv/bin/python -m benchmarks.baselines limit --corpus {rel(distinct)}",
        "distinct_tiktoken_limit": f".venv/bin/python -m benchmarks.baselines limit --corpus {rel(distinct)} "
                                   f"--encoder tiktoken --shards {P['distinct_tiktoken_shards']}",
        "distinct_stages": f".venv/bin/python -m benchmarks.stages --corpus {rel(distinct)} --shards 1",
    }
