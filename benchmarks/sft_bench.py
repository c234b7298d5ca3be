"""Supervised records: the loss mask's bytes per token (spans against one bit per token), and the builder's
encoding rate with the reference and the fast tokenizer backend, on generated chat data.

    python -m benchmarks.sft_bench [--records 4000] [--rounds 2] [--quick]

The conversations are generated (seeded): an optional system message, 1 to 6 user/assistant turns, messages
of log-normally distributed length (user about 60 words, assistant about 150) drawn from a fixed vocabulary
with punctuation, digits, code and non-Latin text. They are rendered with a ChatML template that marks the
assistant's answers with ``{% generation %}`` and tokenized with cl100k_base, as the builder does
(``pipelines.chunking.supervised.Supervised``).

Mask bytes (:func:`mask_figures`): the ``loss_spans`` column as the builder writes it (a chunk's Parquet
file, zstd level 3, PLAIN), against one bit per token (each document's mask packed with ``np.packbits`` in a
``binary`` column of the same file options), both per token of the same documents, in the same run; and
the same two as raw (decoded) bytes: 8 bytes per span, 1/8 byte per token.

Encoding rate (:func:`rate_figures`): records per CPU-second of ``Supervised.encode_many`` over batches of
256 records (the builder's), chat and prompt/completion (a user message and the answer), with the reference
backend (tiktoken) and the fast one (fastokens, checked against the reference on 1 record in 1000, as in a
build); best of ``--rounds``. Prints one ``BENCH_RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import io
import random
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
          "{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}")
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who its now find long down day did get "
         "come made may part model data train loss token batch step learn answer question because example result "
         "function value return list string error file").split()
EXTRA = ("3.14", "2024", "x = f(y)", "`code`", "naïve", "café", "数据", "日本語", "😀", "—", "(see above)", "e.g.")
BATCH = 256  # the builder's encoding batch (pipelines.chunking.chunk_writer.ENCODE_BATCH_DOCS)


def _text(rng: random.Random, median_words: float) -> str:
    n = max(1, int(rng.lognormvariate(np.log(median_words), 0.8)))
    out = []
    for i in range(n):
        w = rng.choice(EXTRA) if rng.random() < 0.05 else rng.choice(WORDS)
        out.append(w + (rng.choice([".", ",", "?", ".\n", ":\n"]) if rng.random() < 0.08 else ""))
    return " ".join(out)


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` generated conversations (see the module doc)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": _text(rng, 20)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 6)):
            msgs += [{"role": "user", "content": _text(rng, 60)}, {"role": "assistant", "content": _text(rng, 150)}]
        out.append(msgs)
    return out


def _supervised(record_format: str, backend: str):
    from pipelines.chunking.supervised import Supervised
    from pipelines.tokenize.fast_tokenizer import load_encoder
    from pipelines.tokenize.tokenizer import resolve

    spec = resolve("tiktoken:cl100k_base").with_backend(backend)
    config = {"record_format": record_format, "prompt_key": "prompt", "completion_key": "completion",
              "messages_key": "messages", "append_eos": record_format == "prompt_completion",
              "chat_template": {"bos_token": None, "eos_token": spec.eos_token}}
    return Supervised(config, load_encoder(spec), spec.eos_id, CHATML if record_format == "chat" else "")


def _records(record_format: str, convs: list[list[dict]]) -> list[dict]:
    if record_format == "chat":
        return [{"messages": m} for m in convs]
    out = []
    for m in convs:
        turns = [x for x in m if x["role"] != "system"]
        out.append({"prompt": turns[0]["content"], "completion": turns[1]["content"]})
    return out


def _encoded(sup, records: list[dict]) -> list:
    out = []
    for a in range(0, len(records), BATCH):
        out += sup.encode_many(records[a:a + BATCH], list(range(a, a + len(records[a:a + BATCH]))), "bench")
    return out


def _column_bytes(table: pa.Table, column: str, **options) -> int:
    """Stored bytes of ``column`` in a Parquet file of ``table`` written with ``options``."""
    sink = io.BytesIO()
    pq.write_table(table, sink, **options)
    meta = pq.ParquetFile(io.BytesIO(sink.getvalue())).metadata
    i = [meta.schema.column(c).path.split(".")[0] for c in range(meta.num_columns)].index(column)
    return sum(meta.row_group(g).column(i).total_compressed_size for g in range(meta.num_row_groups))


def mask_figures(n: int = 4000, seed: int = 0) -> dict[str, float]:
    """The loss mask's stored and raw bytes per token, as spans and as bits (see the module doc)."""
    from reader.format.chunk_file import ChunkParquet, row_group_table

    sup = _supervised("chat", "reference")
    encoded = [e for e in _encoded(sup, _records("chat", conversations(n, seed))) if not isinstance(e, Exception)]
    ids = [e[0] for e in encoded]
    spans = [e[1] for e in encoded]
    tokens = sum(len(a) for a in ids)
    config = {"compression": "zstd", "compression_level": 3, "token_encoding": "PLAIN", "record_format": "chat"}
    writer = ChunkParquet(config)
    per_group = 128 << 10  # the builder's row groups (about 128 Ki tokens)
    start = acc = 0
    for i, a in enumerate(ids):
        acc += len(a)
        if acc >= per_group or i == len(ids) - 1:
            writer.write(row_group_table(ids[start:i + 1], 0, list(range(start, i + 1)), None,
                                         loss_spans=spans[start:i + 1]), acc)
            start, acc = i + 1, 0
    data, _, _ = writer.finish()
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    col = [meta.schema.column(c).path for c in range(meta.num_columns)].index("loss_spans.list.element")
    span_bytes = sum(meta.row_group(g).column(col).total_compressed_size for g in range(meta.num_row_groups))
    masks = []
    for a, s in zip(ids, spans):
        m = np.zeros(len(a), dtype=bool)
        for lo, hi in s.reshape(-1, 2):
            m[lo:hi] = True
        masks.append(np.packbits(m).tobytes())
    bits = pa.table({"loss_bits": pa.array(masks, pa.binary())})
    bit_bytes = _column_bytes(bits, "loss_bits", compression="zstd", compression_level=3, use_dictionary=False,
                              write_statistics=False, row_group_size=max(1, len(ids) * per_group // max(1, tokens)))
    runs = sum(len(s) // 2 for s in spans)
    loss = sum(int((s[1::2] - s[0::2]).sum()) for s in spans)
    return {
        "sft_mask_spans_bytes_per_token": span_bytes / tokens,
        "sft_mask_bits_bytes_per_token": bit_bytes / tokens,
        "sft_mask_spans_raw_bytes_per_token": 8 * runs / tokens,
        "sft_mask_bits_raw_bytes_per_token": sum(len(m) for m in masks) / tokens,
        "sft_mask_tokens_per_record": tokens / len(ids),
        "sft_mask_spans_per_record": runs / len(ids),
        "sft_mask_loss_share": loss / tokens,
    }


def rate_figures(n: int = 4000, seed: int = 0, rounds: int = 2) -> dict[str, float]:
    """Records per CPU-second of the builder's encoding, both formats, both backends (see the module doc)."""
    convs = conversations(n, seed)
    out = {}
    for record_format in ("chat", "prompt_completion"):
        records = _records(record_format, convs)
        results = {}
        for backend in ("reference", "fast"):
            sup = _supervised(record_format, backend)
            best = float("inf")
            for _ in range(rounds):
                t = time.process_time()
                got = _encoded(sup, records)
                best = min(best, time.process_time() - t)
            results[backend] = got
            key = "chat" if record_format == "chat" else "pc"
            out[f"sft_{key}_records_per_cpu_s_{backend}"] = len(records) / best
        same = all(type(a) is type(b) and (isinstance(a, Exception) or
                                          (np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])))
                   for a, b in zip(results["reference"], results["fast"]))
        if not same:
            raise AssertionError(f"{record_format}: the fast backend's records differ from the reference's")
    out["sft_chat_fast_vs_reference"] = out["sft_chat_records_per_cpu_s_fast"] / out["sft_chat_records_per_cpu_s_reference"]
    out["sft_pc_fast_vs_reference"] = out["sft_pc_records_per_cpu_s_fast"] / out["sft_pc_records_per_cpu_s_reference"]
    return out


def figures(quick: bool = False) -> dict[str, float]:
    """Every figure of this module (``quick``: a few hundred records)."""
    n = 300 if quick else 4000
    return {**mask_figures(n), **rate_figures(n, rounds=1 if quick else 2)}


def main(argv=None) -> int:
    from benchmarks.common import emit_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    n = 300 if a.quick else a.records
    emit_result({**mask_figures(n), **rate_figures(n, rounds=a.rounds)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
