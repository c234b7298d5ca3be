"""The distinct-text benchmark corpus: every document once (repeat factor 1).

Today's bench corpus (benchmarks/corpus.py) repeats the machine's distinct text to reach its size, and an
encoder that caches the pieces it has seen (fastokens, gigatoken) runs faster on a repeated corpus than on
new text. This one holds all the distinct text :func:`benchmarks.corpus.collect_docs` finds on this machine
(Debian documentation, man and info pages, Python docstrings and READMEs), plus about ``GENERATED_SHARE`` of
generated multilingual, unicode-heavy text (the conformance set's generator,
:func:`pipelines.conformance._random_text`: many scripts, digits of many systems, emoji sequences,
combining and directional marks, unusual whitespace). Every document appears once; the manifest records
the repeat factor (1.0) and checks it: the documents are deduplicated by their exact text.

U+180E (MONGOLIAN VOWEL SEPARATOR) is dropped from the generated documents: the generator puts it between
about one part in thirty (it hunts a pre-tokenizer corner), so nearly every generated document would hold
it, and our fast backend sends every document holding it to the reference encoder
(pipelines/fast_tokenizer.py, REFERENCE_ONLY_CHARS). Real text almost never holds it (it is Mongolian
script punctuation); the manifest counts the documents it was removed from.

    python -m benchmarks.distinct_corpus --out benchmarks/work/corpus-distinct [--shards 8] [--size_mb N]

Without ``--size_mb``: all the distinct text there is (the suite's full profile); with it, about that many
MB (the quick profile), read from the same cache of extracted documents as benchmarks/corpus.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from pathlib import Path

from benchmarks import corpus as corpus_mod

VERSION = 1  # bump when the recipe changes, so cached corpora are rebuilt
GENERATED_SHARE = 0.10  # of the corpus's text bytes
GENERATED_PARTS = (50, 1500)  # generator parts per document: about 0.2 to 25 KB of text
DROPPED_FROM_GENERATED = "\u180e"


def generated_docs(total_bytes: int, seed: int = 33) -> tuple[list[str], int]:
    """Generated unicode-heavy documents of about ``total_bytes`` of UTF-8 text (fixed seed), and how many
    had U+180E removed."""
    from pipelines.tokenize import conformance

    rng = random.Random(seed)
    docs, size, stripped = [], 0, 0
    while size < total_bytes:
        text = conformance._random_text(rng, rng.randint(*GENERATED_PARTS))
        if DROPPED_FROM_GENERATED in text:
            text = text.replace(DROPPED_FROM_GENERATED, "")
            stripped += 1
        if not text.strip():
            continue
        docs.append(text)
        size += len(text.encode("utf-8"))
    return docs, stripped


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def build_distinct_corpus(out_dir: Path, shards: int, size_bytes: int | None = None, *, real: list[str] | None = None,
                          processes: int = 2, log=print) -> dict:
    """Write (or reuse) the distinct corpus in ``shards`` jsonl shards of about equal bytes under ``out_dir``.

    ``size_bytes``: about that many bytes of text in all (None: every distinct document there is).
    ``real``: the real documents to use instead of this machine's (tests).
    """
    out_dir = Path(out_dir)
    manifest_path = out_dir / "manifest.json"
    params = {"version": VERSION, "size_bytes": size_bytes, "shards": shards, "generated_share": GENERATED_SHARE,
              "given_docs": None if real is None else hashlib.sha256(
                  b"".join(_digest(d) for d in real)).hexdigest()}
    if manifest_path.exists():
        m = json.loads(manifest_path.read_text())
        if m.get("params") == params and all((out_dir / f).exists() for f in m["files"]):
            return m
    stats: dict = {}
    if real is None:
        # the same extraction cache as benchmarks/corpus.py's (the full corpus reads everything there is)
        limit = None if size_bytes is None else int(size_bytes * 1.2) + 100_000
        real, stats = corpus_mod._cached_docs(
            out_dir.parent / f"distinct-v{corpus_mod.CORPUS_VERSION}-{limit or 'all'}.jsonl", limit, processes, log)
    if size_bytes is not None:
        want, kept, total = size_bytes * (1 - GENERATED_SHARE), [], 0
        for d in real:
            if total >= want:
                break
            kept.append(d)
            total += len(d.encode("utf-8"))
        real = kept
    real_bytes = sum(len(d.encode("utf-8")) for d in real)
    gen, stripped = generated_docs(int(real_bytes * GENERATED_SHARE / (1 - GENERATED_SHARE)))
    seen: set[bytes] = set()
    docs: list[tuple[str, str]] = []
    for kind, group in (("real", real), ("generated", gen)):
        for d in group:
            h = _digest(d)
            if h not in seen:
                seen.add(h)
                docs.append((kind, d))
    random.Random(99).shuffle(docs)
    lines = [(kind, corpus_mod._line(d)) for kind, d in docs]
    total = sum(len(x) for _, x in lines)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("shard-*.jsonl"):
        old.unlink()
    files, shard_bytes, shard_docs = [], [], []
    by_kind = {"real": [0, 0], "generated": [0, 0]}  # [documents, jsonl bytes]
    i = 0
    for s in range(shards):
        name = f"shard-{s:05d}.jsonl"
        end_bytes = total * (s + 1) / shards
        written = sum(shard_bytes)
        with open(out_dir / (name + ".tmp"), "wb") as f:
            n = b = 0
            while i < len(lines) and (written + b < end_bytes or s == shards - 1):
                kind, line = lines[i]
                f.write(line)
                by_kind[kind][0] += 1
                by_kind[kind][1] += len(line)
                n, b, i = n + 1, b + len(line), i + 1
        os.replace(out_dir / (name + ".tmp"), out_dir / name)
        if n:
            files.append(name)
            shard_bytes.append(b)
            shard_docs.append(n)
        else:
            (out_dir / name).unlink()
    m = {
        "params": params,
        "files": files,
        "bytes": total,
        "docs": len(lines),
        "shard_bytes": shard_bytes,
        "shard_docs": shard_docs,
        "distinct_line_bytes": total,
        "distinct_docs": len(seen),
        "repeat_factor": round(len(lines) / max(1, len(seen)), 3),  # each document written once: 1.0
        "passes": 1,
        "real_docs": by_kind["real"][0],
        "real_line_bytes": by_kind["real"][1],
        "generated_docs": by_kind["generated"][0],
        "generated_line_bytes": by_kind["generated"][1],
        "generated_share": by_kind["generated"][1] / total if total else 0.0,
        "generated_text_bytes": sum(len(d.encode("utf-8")) for k, d in docs if k == "generated"),
        "generated_docs_u180e_removed": stripped,
        "distinct_bytes": real_bytes + sum(len(d.encode("utf-8")) for k, d in docs if k == "generated"),
        "distinct_bytes_by_source": {**stats.get("distinct_bytes_by_source", {}),
                                     "generated": sum(len(d.encode("utf-8")) for k, d in docs if k == "generated")},
        "source_files": stats.get("source_files"),
    }
    tmp = manifest_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(m, indent=1) + "\n")
    os.replace(tmp, manifest_path)
    log(f"distinct corpus: wrote {len(files)} shards, {total / 1e6:.1f} MB, {m['docs']} documents "
        f"({m['generated_docs']} generated, {m['generated_share']:.1%} of the bytes), repeat factor 1 -> {out_dir}")
    return m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/work/corpus-distinct", help="output directory")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--size_mb", type=float, default=None, help="about this many MB (default: all there is)")
    a = ap.parse_args(argv)
    m = build_distinct_corpus(Path(a.out), a.shards, None if a.size_mb is None else int(a.size_mb * 1e6))
    print(json.dumps({k: v for k, v in m.items() if k not in ("shard_bytes", "shard_docs")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
