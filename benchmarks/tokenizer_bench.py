"""Tokenizer backends side by side: MB of text per CPU-second, agreement, start-up and check costs.

    python -m benchmarks.tokenizer_bench throughput --corpus benchmarks/work/corpus-48 [--repeats 3]
    python -m benchmarks.tokenizer_bench builds --corpus benchmarks/work/corpus-48 [--repeats 3]
    python -m benchmarks.tokenizer_bench scan [--own_pattern]  # every code point in 14 contexts vs tiktoken
    python benchmarks/tokenizer_bench.py json --corpus benchmarks/work/corpus-48   # json / orjson / msgspec

``throughput`` encodes the corpus's documents in batches of 256 (as ``ChunkBuilder`` does) with tiktoken,
fastokens on the tiktoken ranks, HF ``tokenizers`` and fastokens on the same cl100k ``tokenizer.json``
(converted offline, special tokens as added tokens only: fastokens 0.3.5 cannot load them in the model's
vocabulary), interleaved, and reports MB per CPU-second (all threads of the process; helper threads are
off, as in workers), the documents on which each fast backend equals its reference, the start-up costs
(loading, the conformance check) and the cost of ``--verify_every``'s re-encoding.

``builds`` times whole builds (``--tokenizer_backend reference`` / ``fast`` / ``fast --verify_every 0``),
interleaved, with ``benchmarks.pipeline_bench.build`` (2 DirectRunner workers): wall and CPU seconds.

``json`` needs only the standard library, plus orjson and msgspec when installed (run it with any Python).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _texts(corpus: Path, limit: int | None) -> list[str]:
    out = []
    for f in sorted(corpus.glob("shard-*.jsonl")):
        with open(f, "rb") as fh:
            for line in fh:
                if line.strip():
                    out.append(json.loads(line)["text"])
                    if limit and len(out) >= limit:
                        return out
    return out


def _cl100k_tokenizer_json(work: Path) -> Path:
    """cl100k as tokenizer.json (original pattern), special tokens only among the added tokens."""
    from benchmarks import hf_tokenizer

    return hf_tokenizer.convert_added_specials(work)


def _cpu(fn) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def throughput(a) -> dict:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")
    from pipelines.tokenize import conformance
    from pipelines.tokenize import fast_tokenizer as ft
    from pipelines.tokenize import tokenizer as tk

    texts = _texts(Path(a.corpus), a.docs)
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    print(f"{len(texts)} documents, {mb:.1f} MB of text from {a.corpus}")
    res: dict = {"docs": len(texts), "mb": mb}
    specs = {"tiktoken": tk.resolve("tiktoken:cl100k_base"),
             "hf": tk.resolve(str(_cl100k_tokenizer_json(Path(a.work))))}
    encoders = {}
    for kind, spec in specs.items():
        c_ref, w_ref = _cpu(lambda: encoders.__setitem__(f"{kind}-reference", spec.load_reference()))
        ref = encoders[f"{kind}-reference"]
        c_make, w_make = _cpu(lambda: encoders.__setitem__(f"{kind}-fast", ft.make_fast(spec, ref)))
        fast = encoders[f"{kind}-fast"]
        held: dict = {}

        def check():
            held["texts"] = conformance.conformance_texts(ft._special_strings(ref))
            held["diff"] = conformance.check(fast, ref, held["texts"])

        c_check, w_check = _cpu(check)  # as in a worker: right after loading, generation included
        assert held["diff"] is None, f"{kind}: the fast backend fails the conformance set: {held['diff']}"
        texts_c = held["texts"]
        res[f"{kind}_startup"] = {"reference_load_cpu_s": c_ref, "fast_load_cpu_s": c_make, "fast_load_wall_s": w_make,
                                  "conformance_cpu_s": c_check, "conformance_wall_s": w_check,
                                  "conformance_mb": sum(len(t.encode()) for _, t in texts_c) / 1e6}
        print(f"{kind}: reference load {c_ref:.2f} CPU-s; fast load {c_make:.2f} CPU-s ({w_make:.2f} s); "
              f"conformance check {c_check:.2f} CPU-s ({w_check:.2f} s) on "
              f"{res[f'{kind}_startup']['conformance_mb']:.2f} MB")
    batches = [texts[i:i + 256] for i in range(0, len(texts), 256)]
    runs: dict[str, list[float]] = {k: [] for k in encoders}
    outputs: dict[str, list] = {}
    for r in range(a.repeats):
        # fresh encoders each repeat: fastokens and HF tokenizers cache the pieces they have encoded, so a
        # second pass over the same texts would time the cache, not the encoder (tiktoken has no cache)
        if r:
            for kind, spec in specs.items():
                encoders[f"{kind}-reference"] = spec.load_reference()
                encoders[f"{kind}-fast"] = ft.make_fast(spec, encoders[f"{kind}-reference"])
        for name, enc in encoders.items():
            got: list = []
            c, w = _cpu(lambda: [got.extend(enc.encode_many(b)) for b in batches])
            runs[name].append(c)
            outputs[name] = got
            print(f"  repeat {r}: {name:20s} {mb / c:6.1f} MB/CPU-s ({c:.2f} CPU-s, {w:.2f} s wall)")
    for name, cs in runs.items():
        res[name] = {"mb_per_cpu_s_best": mb / min(cs), "mb_per_cpu_s_median": mb / statistics.median(cs),
                     "cpu_s": cs}
    for kind in specs:
        f, r = outputs[f"{kind}-fast"], outputs[f"{kind}-reference"]
        same = sum(len(x) == len(y) and bool((x == y).all()) for x, y in zip(f, r))
        res[f"{kind}_agreement"] = {"same": same, "docs": len(texts)}
        print(f"{kind}: fast equals the reference on {same} of {len(texts)} documents; speed-up "
              f"{statistics.median(runs[f'{kind}-reference']) / statistics.median(runs[f'{kind}-fast']):.2f}x (median)")
    specials = ("<|endoftext|>", "<|fim_", "<|endofprompt|>")  # HF matches them, tiktoken here does not
    no_special = [i for i, t in enumerate(texts) if not any(s in t for s in specials)]
    same_hf_tt = sum(outputs["hf-reference"][i].tolist() == outputs["tiktoken-reference"][i].tolist()
                     for i in no_special)
    res["hf_vs_tiktoken_agreement"] = {"same": same_hf_tt, "docs": len(no_special)}
    print(f"HF tokenizer.json equals tiktoken on {same_hf_tt} of {len(no_special)} documents without special-token text")
    # --verify_every 1000: the re-encoding share, on the build's own batches and offsets
    fast = encoders["tiktoken-fast"]
    fast.verify_every = 1000
    offsets = []
    pos = 0
    for t in texts:
        offsets.append(pos)
        pos += len(json.dumps({"text": t}, ensure_ascii=False).encode()) + 1
    arrays = outputs["tiktoken-fast"]
    checked = 0

    def verify_all():
        nonlocal checked
        for i in range(0, len(texts), 256):
            checked += fast.verify(texts[i:i + 256], offsets[i:i + 256], arrays[i:i + 256], "corpus")

    c_ver = min(_cpu(verify_all)[0] for _ in range(3))
    checked //= 3
    c_fast = statistics.median(runs["tiktoken-fast"])
    res["verify_every_1000"] = {"docs_checked": checked, "cpu_s": c_ver, "fraction_of_fast_encoding": c_ver / c_fast}
    print(f"--verify_every 1000: {checked} documents re-encoded, {c_ver:.3f} CPU-s = {c_ver / c_fast:.2%} of the "
          f"fast backend's encoding CPU")
    return res


def builds(a) -> dict:
    from benchmarks import pipeline_bench

    inputs = [str(Path(a.corpus).resolve() / "shard-*.jsonl")]
    work = Path(a.work)
    variants = {"reference": ["--tokenizer_backend", "reference"], "fast": ["--tokenizer_backend", "fast"],
                "fast_verify0": ["--tokenizer_backend", "fast", "--verify_every", "0"]}
    res: dict = {k: [] for k in variants}
    digests = {}
    for r in range(a.repeats):
        for name, extra in variants.items():
            out = work / f"tokbench-cache-{name}"
            b = pipeline_bench.build(inputs, out, "tiktoken:cl100k_base", workers=2, extra=extra)
            res[name].append({k: b.get(k) for k in ("wall_s", "cpu_s", "tokens", "steady_tokens_per_s", "busy_s",
                                                     "startup_fraction", "peak_rss_tree_mb", "other_cores")})
            print(f"repeat {r} {name:13s}: wall {b['wall_s']:.1f} s, CPU {b['cpu_s']:.1f} s, steady "
                  f"{(b.get('steady_tokens_per_s') or 0) / 1e6:.2f} M tokens/s, peak RSS {b['peak_rss_tree_mb']:.0f} MB, "
                  f"other processes {b['other_cores']:.2f} cores, {b['tokens']} tokens")
            from pipelines.testing import tree_digest

            digests[name] = tree_digest(str(out))
    same = digests["reference"] == digests["fast"] == digests["fast_verify0"]
    print(f"caches byte-identical across the three variants: {same}")
    for name, rs in res.items():
        print(f"{name:13s}: wall median {statistics.median(r['wall_s'] for r in rs):.1f} s, "
              f"CPU median {statistics.median(r['cpu_s'] for r in rs):.1f} s, steady median "
              f"{statistics.median((r['steady_tokens_per_s'] or 0) for r in rs) / 1e6:.2f} M tokens/s")
    res["identical"] = same
    return res


def scan(a) -> dict:
    """Every code point (not surrogates) in each context: which ones does fastokens encode differently?"""
    from pipelines.tokenize import fast_tokenizer as ft
    from pipelines.tokenize import tokenizer as tk

    spec = tk.resolve("tiktoken:cl100k_base")
    ref = spec.load_reference()
    if a.own_pattern:  # the Encoding's own (possessive) pattern instead of the faster equivalent one
        ft.EQUIVALENT_PATTERNS = {}
    fast = ft.make_fast(spec, ref)
    fast_raw = ft.FastEncoder(fast.tok, ref, cut_long=True, verify_every=0)
    contexts = ["x{c}\u094d\u0937", "a{c}b", "{c}{c}a", "1{c}2", " {c}x", "'{c}s", "{c}\n", "\n{c}", "x {c}",
                "{c}  a", ".{c}.", "{c}'S", "a\n{c} ", "{c}"]
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    bad: dict[int, list[str]] = {}
    saved = ft.REFERENCE_ONLY_CHARS
    ft.REFERENCE_ONLY_CHARS = ""  # the raw library, without the workaround
    try:
        for ctx in contexts:
            texts = [ctx.format(c=chr(c)) for c in cps]
            for i in range(0, len(texts), 4096):
                for j, (x, y) in enumerate(zip(fast_raw.encode_many(texts[i:i + 4096]),
                                               ref.encode_many(texts[i:i + 4096]))):
                    if x.tolist() != y.tolist():
                        bad.setdefault(cps[i + j], []).append(ctx)
    finally:
        ft.REFERENCE_ONLY_CHARS = saved
    for c, ctxs in sorted(bad.items()):
        print(f"U+{c:04X} differs in {len(ctxs)} of {len(contexts)} contexts: {ctxs}")
    print(f"{len(bad)} of {len(cps)} code points differ in some context; REFERENCE_ONLY_CHARS covers "
          f"{sorted(f'U+{ord(c):04X}' for c in saved)}")
    return {"differing": {f"U+{c:04X}": v for c, v in bad.items()}}


def json_parse(a) -> dict:
    """json.loads(bytes.decode) (what parse_line does) vs orjson.loads vs msgspec (generic and typed)."""
    lines = []
    for f in sorted(Path(a.corpus).glob("shard-*.jsonl")):
        with open(f, "rb") as fh:
            lines.extend(line.rstrip(b"\n") for line in fh if line.strip())
    mb = sum(len(x) for x in lines) / 1e6
    parsers = {"json": lambda b: json.loads(b.decode("utf-8"))["text"]}
    try:
        import orjson

        parsers["orjson"] = lambda b: orjson.loads(b)["text"]
    except ImportError:
        print("orjson is not installed")
    try:
        import msgspec

        class Doc(msgspec.Struct):
            text: str

        dec_any, dec_doc = msgspec.json.Decoder(), msgspec.json.Decoder(Doc)
        parsers["msgspec"] = lambda b: dec_any.decode(b)["text"]
        parsers["msgspec_struct"] = lambda b: dec_doc.decode(b).text
    except ImportError:
        print("msgspec is not installed")
    want = [parsers["json"](b) for b in lines]
    res: dict = {"lines": len(lines), "mb": mb}
    times: dict[str, list[float]] = {k: [] for k in parsers}
    for _ in range(a.repeats):
        for name, p in parsers.items():
            times[name].append(_cpu(lambda: [p(b) for b in lines])[0])
    base = statistics.median(times["json"])
    for name, ts in times.items():
        same = sum(parsers[name](b) == w for b, w in zip(lines, want))
        med = statistics.median(ts)
        res[name] = {"mb_per_cpu_s": mb / med, "vs_json": base / med, "same_text": same}
        print(f"{name:15s} {mb / med:7.1f} MB/CPU-s ({base / med:.2f}x json), same text on {same} of {len(lines)} lines")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["throughput", "builds", "scan", "json"])
    ap.add_argument("--corpus", default="benchmarks/work/corpus-48", help="directory of shard-*.jsonl")
    ap.add_argument("--work", default="benchmarks/work", help="where converted tokenizers and caches go")
    ap.add_argument("--docs", type=int, default=None, help="use only the first N documents")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--own_pattern", action="store_true",
                    help="scan: fastokens with the Encoding's own pattern, not the faster equivalent one")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--emit", action="store_true", help="print them as one BENCH_RESULT line (benchmarks.run)")
    a = ap.parse_args(argv)
    res = {"throughput": throughput, "builds": builds, "scan": scan, "json": json_parse}[a.what](a)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    if a.emit:
        from benchmarks.common import emit_result

        emit_result(json.loads(json.dumps(res, default=str)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
