"""Write small, valid chunkledger caches directly (no Beam), for reader / shuffle / jax tests.

``write_synthetic_cache(root, chunks)`` writes every chunk in ``chunks`` (given in GLOBAL order; each
chunk is a list of documents, each document a sequence of token ids) as a Parquet file with
``format.CHUNK_SCHEMA`` and ``ROW_GROUP_TOKENS_KEY`` metadata, its sidecar, and a ledger whose chunk
list is that order. Shard numbers are assigned so that ``streams.round_robin_order`` reproduces the
given order: by default one shard holds every chunk; pass ``chunks_per_shard`` to spread them
(chunk ``i`` of the given list then becomes ``round_robin_order(chunks_per_shard)[i]``).

``finished=False`` writes the ledger as the launcher's *plan* (``finished: false``, ``chunks: []``) and
only the chunks listed in ``written`` (default: all), which is what a reader sees while a build runs.
``write_chunk`` / ``finish_cache`` let a test continue such a "build" step by step.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from typing import Any, Iterable, Mapping, Sequence

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reader.format import spec as fmt
from reader.order import streams
from reader.order.packing import WINDOW_TOKENS

from packing_ref import reference_chunk_best_fit

DEFAULT_TOKENIZER = {"spec": "synthetic", "kind": "synthetic", "name": "synthetic", "vocab_size": 1 << 20,
                     "eos_id": 0, "hash": "synthetic"}


def _fs(root: str):
    fs, path = fsspec.core.url_to_fs(root)
    return fs, path.rstrip("/")


def _atomic_write(fs, path: str, data: bytes) -> None:
    tmp = path + ".tmp-cachegen"
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(tmp, data)
    try:
        fs.mv(tmp, path)
    except Exception:  # some object stores: copy + remove
        fs.copy(tmp, path)
        fs.rm(tmp)


def row_groups(lengths: Sequence[int], row_group_tokens: int) -> list[tuple[int, int]]:
    """Split documents into row groups of about ``row_group_tokens`` tokens: a group is closed as soon
    as it holds at least that many tokens (documents never span row groups)."""
    groups, lo, acc = [], 0, 0
    for i, n in enumerate(lengths):
        acc += int(n)
        if acc >= row_group_tokens:
            groups.append((lo, i + 1))
            lo, acc = i + 1, 0
    if lo < len(lengths):
        groups.append((lo, len(lengths)))
    return groups


def best_fit_chunk(docs, L: int, row_group_tokens: int, window_tokens: int) -> list:
    """A synthetic chunk's best-fit rows by the brute-force packer, over the row groups it is written with."""
    lengths = [len(d) for d in docs]
    rg_docs = [hi - lo for lo, hi in row_groups(lengths, row_group_tokens)]
    return reference_chunk_best_fit(lengths, rg_docs, L, window_tokens)


# Like the pipeline's writer (PLAIN int32 tokens, zstd, no statistics); tests may pass other options.
WRITER_OPTIONS = {"compression": "zstd", "use_dictionary": [fmt.SHARD_COLUMN], "write_statistics": False,
                  "data_page_size": 1 << 20}


def chunk_bytes_of(docs: Sequence[Sequence[int]], *, shard: int = 0, first_offset: int = 0,
                   row_group_tokens: int = 64, writer_options: Mapping[str, Any] | None = None
                   ) -> tuple[bytes, list[int]]:
    """The Parquet bytes of one chunk, and its token count per row group."""
    lengths = [len(d) for d in docs]
    groups = row_groups(lengths, row_group_tokens)
    rg_tokens = [int(sum(lengths[lo:hi])) for lo, hi in groups]
    schema = fmt.CHUNK_SCHEMA.with_metadata({fmt.ROW_GROUP_TOKENS_KEY: json.dumps(rg_tokens).encode()})
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, schema, **dict(writer_options or WRITER_OPTIONS)) as w:
        for lo, hi in groups:
            part = docs[lo:hi]
            table = pa.table(
                {
                    fmt.TOKEN_COLUMN: pa.array([np.asarray(d, dtype=np.int32) for d in part],
                                               type=fmt.CHUNK_SCHEMA.field(fmt.TOKEN_COLUMN).type),
                    fmt.LENGTH_COLUMN: pa.array(lengths[lo:hi], type=pa.int32()),
                    fmt.SHARD_COLUMN: pa.array([shard] * (hi - lo), type=pa.int32()),
                    fmt.OFFSET_COLUMN: pa.array([first_offset + k for k in range(lo, hi)], type=pa.int64()),
                },
                schema=schema,
            )
            w.write_table(table, row_group_size=max(1, hi - lo))
    return sink.getvalue().to_pybytes(), rg_tokens


def write_chunk(root: str, shard: int, index_in_shard: int, docs: Sequence[Sequence[int]], *,
                chunk_bytes: int = 1000, row_group_tokens: int = 64, sidecar: bool = True,
                writer_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write one chunk's parquet (then its sidecar) atomically; return the sidecar dict."""
    fs, base = _fs(root)
    lo = index_in_shard * chunk_bytes
    data, _ = chunk_bytes_of(docs, shard=shard, first_offset=lo, row_group_tokens=row_group_tokens,
                             writer_options=writer_options)
    rel = fmt.chunk_path(shard, index_in_shard)
    _atomic_write(fs, base + "/" + rel, data)
    entry = {
        "path": rel,
        "shard": shard,
        "index_in_shard": index_in_shard,
        "byte_range": [lo, lo + chunk_bytes],
        "docs": len(docs),
        "tokens": int(sum(len(d) for d in docs)),
        "bytes": len(data),
        "checksum": fmt.checksum(data),
        "bad_records": 0,
    }
    entry["row_group_index"], entry["footer"] = fmt.row_group_index(data)
    if sidecar:
        _atomic_write(fs, base + "/" + fmt.sidecar_path(shard, index_in_shard), fmt.sidecar_bytes(entry))
    return entry


def _ledger(inputs, entries, *, finished: bool, chunk_bytes: int, row_group_tokens: int,
            tokenizer: Mapping[str, Any]) -> dict[str, Any]:
    chunks = []
    doc_off = tok_off = 0
    for e in entries if finished else []:
        chunks.append(dict(fmt.ledger_entry(e), doc_offset=doc_off, token_offset=tok_off))
        doc_off += e["docs"]
        tok_off += e["tokens"]
    ledger = {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "finished": finished,
        "tokenizer": dict(tokenizer),
        "config": {"text_key": "text", "append_eos": True, "chunk_bytes": chunk_bytes,
                   "row_group_tokens": row_group_tokens, "compression": "zstd", "compression_level": 3},
        "inputs": inputs,
        "chunks": chunks,
    }
    if finished:
        ledger["totals"] = {"docs": doc_off, "tokens": tok_off, "chunks": len(chunks),
                            "bytes": int(sum(e["bytes"] for e in entries)),
                            "input_bytes": int(sum(i["size"] for i in inputs)), "bad_records": 0}
        ledger["bad_records"] = {}
    return ledger


def write_synthetic_cache(root: str, chunks: list[list[Sequence[int]]], *, finished: bool = True,
                          chunks_per_shard: Sequence[int] | None = None,
                          compressed: Sequence[bool] | None = None,
                          written: Iterable[int] | None = None,
                          done_shards: Iterable[int] | None = None,
                          chunk_bytes: int = 1000, row_group_tokens: int = 64,
                          tokenizer: Mapping[str, Any] = DEFAULT_TOKENIZER,
                          writer_options: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Write a valid cache at ``root``; return the chunk entries in global order.

    Args:
      chunks: chunks in global order; each a list of documents (sequences of token ids).
      finished: write the final ledger (True) or only the plan (False; a build "in progress").
      chunks_per_shard: how many chunks each input shard has (sum == len(chunks)); default one shard.
      compressed: per shard, whether it is "compressed" (its chunk count is then unknown in the plan
        and announced by ``_DONE.json``). Default: none compressed.
      written: global indices of the chunks whose files exist (only with ``finished=False``; default all).
      done_shards: compressed shards whose ``_DONE.json`` exists (default: all of them if finished,
        none otherwise).
      chunk_bytes, row_group_tokens: recorded in the ledger config; row groups follow row_group_tokens.
      writer_options: ``pq.ParquetWriter`` keyword arguments (default ``WRITER_OPTIONS``).
    """
    cps = list(chunks_per_shard) if chunks_per_shard is not None else [len(chunks)]
    if sum(cps) != len(chunks):
        raise ValueError(f"chunks_per_shard sums to {sum(cps)} but {len(chunks)} chunks were given")
    comp = list(compressed) if compressed is not None else [False] * len(cps)
    rr = streams.round_robin_order(cps)
    fs, base = _fs(root)
    fs.makedirs(base, exist_ok=True)
    todo = set(range(len(chunks))) if (finished or written is None) else set(written)
    entries = []
    for i, docs in enumerate(chunks):
        shard, k = int(rr[i][0]), int(rr[i][1])
        if i in todo:
            entries.append(write_chunk(root, shard, k, docs, chunk_bytes=chunk_bytes,
                                       row_group_tokens=row_group_tokens, writer_options=writer_options))
        else:
            entries.append(None)
    if done_shards is None:
        done_shards = [s for s in range(len(cps)) if comp[s]] if finished else []
    for s in done_shards:
        _atomic_write(fs, base + "/" + fmt.shard_done_path(s),
                      fmt.dumps({"chunks": cps[s], "uncompressed_bytes": cps[s] * chunk_bytes}).encode())
    inputs = [{"shard": s, "path": f"/synthetic/shard-{s:05d}.jsonl" + (".gz" if comp[s] else ""),
               "size": cps[s] * chunk_bytes, "compression": "gzip" if comp[s] else "none",
               "chunks": None if comp[s] else cps[s]} for s in range(len(cps))]
    ledger = _ledger(inputs, entries, finished=finished, chunk_bytes=chunk_bytes,
                     row_group_tokens=row_group_tokens, tokenizer=tokenizer)
    _atomic_write(fs, base + "/" + fmt.LEDGER_NAME, fmt.dumps_ledger(ledger).encode())
    return entries


def finish_cache(root: str, entries: Sequence[Mapping[str, Any]]) -> None:
    """Rewrite the plan ledger at ``root`` as finished with ``entries`` (global order), as the launcher does."""
    fs, base = _fs(root)
    plan = json.loads(fs.cat_file(base + "/" + fmt.LEDGER_NAME))
    ledger = _ledger(plan["inputs"], list(entries), finished=True,
                     chunk_bytes=plan["config"]["chunk_bytes"],
                     row_group_tokens=plan["config"]["row_group_tokens"], tokenizer=plan["tokenizer"])
    ledger["config"] = plan["config"]
    _atomic_write(fs, base + "/" + fmt.LEDGER_NAME, fmt.dumps_ledger(ledger).encode())


def build_in_background(root: str, chunks: list[list[Sequence[int]]], chunks_per_shard: Sequence[int], *,
                        compressed: Sequence[bool] | None = None, first: Sequence[int] = (0,), seed: int = 0,
                        delay: float = 0.005, row_group_tokens: int = 9) -> threading.Thread:
    """Simulate a running build of a local cache: the plan and chunks ``first`` now, the other chunks
    (global indices) in a seeded random order on a thread, then ``_DONE.json`` of compressed shards and
    the finished ledger. Returns the started thread (join it)."""
    rr = streams.round_robin_order(chunks_per_shard)
    comp = list(compressed) if compressed is not None else [False] * len(chunks_per_shard)
    write_synthetic_cache(root, chunks, finished=False, chunks_per_shard=chunks_per_shard, compressed=comp,
                          written=list(first), row_group_tokens=row_group_tokens)
    rest = [i for i in range(len(chunks)) if i not in set(first)]
    random.Random(seed).shuffle(rest)

    def run():
        for i in rest:
            time.sleep(delay)
            write_chunk(root, int(rr[i][0]), int(rr[i][1]), chunks[i], row_group_tokens=row_group_tokens)
        for s, is_comp in enumerate(comp):
            if is_comp:
                done = os.path.join(root, fmt.shard_done_path(s))
                with open(done + ".tmp", "w") as f:
                    f.write(fmt.dumps({"chunks": int(chunks_per_shard[s]),
                                       "uncompressed_bytes": int(chunks_per_shard[s]) * 1000}))
                os.replace(done + ".tmp", done)
        time.sleep(delay)
        entries = []
        for s, k in rr:
            with open(os.path.join(root, fmt.sidecar_path(int(s), int(k)))) as f:
                entries.append(json.load(f))
        finish_cache(root, entries)

    t = threading.Thread(target=run)
    t.start()
    return t


def batches_during_and_after_build(tmp: str, chunks, chunks_per_shard, options, count: int, *,
                                   compressed=None, first=(0,), seed: int = 0, num_readers: int = 2,
                                   reader_index: int = 1):
    """``(got, want)``: batches ``0..count-1`` read while :func:`build_in_background` writes the cache,
    and the same batches read from a finished twin. Asserts the reader really saw the build running."""
    from reader import Reader

    done, live = os.path.join(tmp, "done"), os.path.join(tmp, "live")
    write_synthetic_cache(done, chunks, chunks_per_shard=chunks_per_shard, compressed=compressed,
                          row_group_tokens=9)
    with Reader(done, options, num_readers=num_readers, reader_index=reader_index) as ref:
        want = list(ref.iter_batches(0, count))
    t = build_in_background(live, chunks, chunks_per_shard, compressed=compressed, first=first, seed=seed)
    try:
        with Reader(live, options, num_readers=num_readers, reader_index=reader_index, wait_timeout_s=60,
                    poll_interval_s=0.01) as rd:
            assert not rd.cache.complete
            got = list(rd.iter_batches(0, count))
    finally:
        t.join()
    return got, want


def random_chunks(rng: np.random.Generator, num_chunks: int, *, max_docs: int = 6, max_len: int = 40,
                  vocab: int = 1000, empty_prob: float = 0.15, huge_prob: float = 0.05,
                  huge_len: int = 300) -> list[list[np.ndarray]]:
    """Random chunks with uneven sizes, empty chunks, tiny (1-token) and huge documents."""
    out = []
    for _ in range(num_chunks):
        if rng.random() < empty_prob:
            out.append([])
            continue
        docs = []
        for _ in range(int(rng.integers(1, max_docs + 1))):
            n = huge_len if rng.random() < huge_prob else int(rng.integers(1, max_len + 1))
            docs.append(rng.integers(1, vocab, size=n, dtype=np.int32))
        out.append(docs)
    return out


# --------------------------------------------------------------------------------------------------
# Brute-force reference of the reading order (docs/FORMAT.md), straight from the definitions, for tests.


class Reference:
    """Examples of a synthetic cache computed naively: ``loop(chunks)[s::R*]`` walked position by position.
    ``packing="best_fit"`` (packed): each chunk's rows from the brute-force packer (``packing_ref``), per
    window of ``best_fit_window_tokens`` over the row groups ``row_group_tokens`` makes (as the cache's)."""

    def __init__(self, chunks: Sequence[Sequence[Sequence[int]]], seq_len: int, num_streams: int, *,
                 packed: bool = True, loop: bool = True, packing: str = "concat",
                 best_fit_window_tokens: int = WINDOW_TOKENS, row_group_tokens: int = 64):
        self.chunks = [[np.asarray(d, dtype=np.int64) for d in c] for c in chunks]
        self.L, self.R, self.packed, self.loop = seq_len, num_streams, packed, loop
        self.best_fit = packed and packing == "best_fit"
        self.window, self.rgt = best_fit_window_tokens, row_group_tokens
        self._units: dict[int, list] = {}  # stream -> list of units (token tuples or piece dicts)
        self._pos: dict[int, int] = {}  # stream -> next looped-chunk position

    def _stream_units(self, s: int, need: int) -> list:
        units = self._units.setdefault(s, [])
        p = self._pos.get(s, s)
        n = len(self.chunks)
        empty_run = 0
        while len(units) < need:
            if n == 0 or (not self.loop and p >= n):
                break
            e, c = divmod(p, n)
            before = len(units)
            if self.best_fit:
                docs = self.chunks[c]
                for row in best_fit_chunk(docs, self.L, self.rgt, self.window):
                    units.append({"pieces": [(docs[d], a, m) for d, a, m in row], "epoch": e})
            for d in self.chunks[c] if not self.best_fit else ():
                if self.packed:
                    units += [(int(t), k, int(d[k - 1]) if k else 0, e) for k, t in enumerate(d)]
                else:
                    for k in range(0, len(d), self.L):
                        units.append({"tokens": d[k:k + self.L], "start": k,
                                      "prev": int(d[k - 1]) if k else 0, "doc": d, "epoch": e})
            p += self.R
            empty_run = empty_run + 1 if len(units) == before else 0
            if empty_run > n * self.R + 1:
                raise ValueError("empty stream")
        self._pos[s] = p
        return units

    def num_examples(self) -> int:
        """Single pass (R* = 1) only."""
        assert not self.loop and self.R == 1
        units = self._stream_units(0, 1 << 62)
        return -(-len(units) // self.L) if self.packed and not self.best_fit else len(units)

    def example(self, i: int) -> dict[str, Any]:
        s, j = i % self.R, i // self.R
        L = self.L
        out = {k: np.zeros(L, np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
        out["loss_mask"] = np.zeros(L, bool)
        if self.best_fit:
            units = self._stream_units(s, j + 1)
            if j >= len(units):
                out["epoch"], out["valid"] = -1, False
                return out
            t = 0
            for seg, (d, a, m) in enumerate(units[j]["pieces"], start=1):
                out["targets"][t:t + m] = d[a:a + m]
                out["positions"][t:t + m] = np.arange(a, a + m)
                out["inputs"][t:t + m] = np.concatenate([[d[a - 1] if a else 0], d[a:a + m - 1]])
                out["segment_ids"][t:t + m] = seg
                out["loss_mask"][t:t + m] = True
                t += m
            out["epoch"], out["valid"] = units[j]["epoch"], True
        elif self.packed:
            units = self._stream_units(s, (j + 1) * L)[j * L:(j + 1) * L]
            seg = 0
            for t, (tok, k, prev, e) in enumerate(units):
                if t == 0 or k == 0:
                    seg += 1
                out["targets"][t], out["positions"][t], out["segment_ids"][t] = tok, k, seg
                out["inputs"][t] = prev if k else 0
                out["loss_mask"][t] = True
            out["epoch"] = units[0][3] if units else -1
            out["valid"] = bool(units)
        else:
            units = self._stream_units(s, j + 1)
            if j < len(units):
                u = units[j]
                m = len(u["tokens"])
                out["targets"][:m] = u["tokens"]
                out["positions"][:m] = np.arange(u["start"], u["start"] + m)
                out["inputs"][:m] = np.concatenate([[u["prev"]], u["tokens"][:-1]])
                if u["start"] == 0:
                    out["inputs"][0] = 0
                out["segment_ids"][:m] = 1
                out["loss_mask"][:m] = True
                out["epoch"], out["valid"] = u["epoch"], True
            else:
                out["epoch"], out["valid"] = -1, False
        return out
