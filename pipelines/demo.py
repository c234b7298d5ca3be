"""Demo: build a cache from the embedded sample corpus with cl100k_base (offline), then decode documents back.

    python -m pipelines.demo --output demo-cache [Beam options, default --runner=FnApiRunner]

Rerunnable: a second run finds the cache complete (or resumes an interrupted one) and checks it again.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

import pyarrow.parquet as pq

from reader.format import spec as fmt

SAMPLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_corpus")
TOKENIZER = "tiktoken:cl100k_base"


def _line_at(path: str, offset: int) -> bytes:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        f.seek(offset)
        return f.readline().rstrip(b"\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--output", default="demo-cache", help="cache directory (default demo-cache)")
    ap.add_argument("--show", type=int, default=4, help="documents to decode and show (default 4)")
    args, beam_args = ap.parse_known_args(argv)
    from pipelines import build_cache
    if not any(a.startswith("--runner") for a in beam_args):
        beam_args.append("--runner=FnApiRunner")
    inputs = [os.path.join(SAMPLE_DIR, "*.jsonl"), os.path.join(SAMPLE_DIR, "*.jsonl.gz")]
    argv_build = [a for p in inputs for a in ("--input", p)]
    argv_build += ["--output", args.output, "--tokenizer", TOKENIZER, "--append_eos",
                   "--chunk_bytes", "64KiB", *beam_args]
    print("$ python -m pipelines.build_cache " + " ".join(argv_build))
    res = build_cache.run(argv_build)
    ledger = res["ledger"]
    root = os.path.abspath(args.output)
    t = ledger["totals"]
    print(f"\ncache: {root}")
    print(f"  inputs: {len(ledger['inputs'])} shards ({', '.join(os.path.basename(i['path']) for i in ledger['inputs'])})")
    print(f"  {t['chunks']} chunks in round-robin order, {t['docs']} documents, {t['tokens']} tokens, "
          f"{t['bytes']} bytes of Parquet ({t['bytes'] / max(t['tokens'], 1):.2f} bytes/token: tiny chunks "
          "compress less well than 64 MiB ones), "
          f"{t['bad_records']} bad records")
    from reader.storage.cache import Cache
    from reader.tokenizers import tokenizer_lib

    cache = Cache(root)  # its chunks in global order (the ledger's table), as any reader opens them
    chunks = cache.table
    print("  first chunks: " + ", ".join(f"{chunks.paths[c].split('/', 1)[1]}[{int(chunks.docs[c])} docs]"
                                         for c in range(min(5, len(chunks)))) + ", ...")
    tok = tokenizer_lib.for_cache(cache)  # the tokenizer the cache records, as any reader decodes
    eos = ledger["tokenizer"]["eos_id"]
    inputs_by_shard = {i["shard"]: i["path"] for i in ledger["inputs"]}
    n_chunks = len(chunks)
    picks = sorted({0, n_chunks // 3, (2 * n_chunks) // 3, n_chunks - 1})[: args.show]
    ok = True
    print(f"\ndecoding {len(picks)} documents back from the cache and comparing with the input:")
    for ci in picks:
        table = pq.read_table(os.path.join(root, chunks.paths[ci]))
        if table.num_rows == 0:
            continue
        row = table.slice(0, 1).to_pylist()[0]
        ids = row[fmt.TOKEN_COLUMN]
        if ledger["config"]["append_eos"]:
            assert ids[-1] == eos
            ids = ids[:-1]
        text = tok.decode(ids)
        original = json.loads(_line_at(inputs_by_shard[row[fmt.SHARD_COLUMN]], row[fmt.OFFSET_COLUMN]))["text"]
        same = text == original
        ok &= same
        preview = text[:110].replace("\n", " ")
        print(f"  document {int(chunks.doc_offsets[ci])} (chunk {ci}, shard {row[fmt.SHARD_COLUMN]} offset "
              f"{row[fmt.OFFSET_COLUMN]}, {row[fmt.LENGTH_COLUMN]} tokens): {'OK' if same else 'MISMATCH'}")
        print(f"    {preview!r}...")
    if not ok:
        print("demo: decoded text differs from the input", file=sys.stderr)
        return 1
    print("\ndemo: all decoded documents match their input text. Rerun this command: it finds the cache complete.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
