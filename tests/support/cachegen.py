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

import hashlib
import io
import json
import os
import random
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import fsspec
import numpy as np

from reader.format import chunk_file
from reader.format import spec as fmt
from reader.format import table as chunk_table
from reader.format.sidecar import ledger_entry, row_group_index, sidecar_bytes
from reader.order import streams
from reader.order.packing import WINDOW_TOKENS

from packing_ref import reference_chunk_best_fit

DEFAULT_TOKENIZER = {"spec": "synthetic", "kind": "synthetic", "name": "synthetic", "vocab_size": 1 << 20,
                     "eos_id": 0, "hash": "synthetic"}



def old_hash_tiktoken(enc) -> str:
    """A tiktoken encoding's identity hash as releases before the public-data adapter computed it (format
    version 1, from tiktoken's private fields): ledgers written then must still verify."""
    h = hashlib.sha256()
    h.update(enc._pat_str.encode())
    h.update(json.dumps(sorted(enc._special_tokens.items())).encode())
    for token, rank in sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
        h.update(rank.to_bytes(4, "little"))
        h.update(len(token).to_bytes(2, "little"))
        h.update(token)
    return "sha256:" + h.hexdigest()

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


# Chunks are written with the builder's Parquet options (reader.format.chunk_file); tests may pass others.
MASKED_RECORD_FORMAT = "chat"  # config.record_format of a cache written with loss spans


def _config(chunk_bytes: int, row_group_tokens: int, masked: bool, keep_fields: Sequence[str] = ()) -> dict[str, Any]:
    config = {"text_key": "text", "append_eos": True, "chunk_bytes": chunk_bytes,
              "row_group_tokens": row_group_tokens, "compression": "zstd", "compression_level": 3}
    if keep_fields:
        config["keep_fields"] = list(keep_fields)
    if masked:
        config["record_format"] = MASKED_RECORD_FORMAT
    return config


def best_fit_caps(best_fit_continuations: int | None = None, max_segments: int | None = None,
                  masked: bool = False, format_version: int | None = None) -> dict:
    """``best_fit_chunk``'s caps for these read options on a synthetic cache (``masked``: one with loss
    masks; ``format_version``: its ledger's, default :func:`default_version`): unless the options say, one
    continuation piece per row below format version 4, four from it (docs/FORMAT.md, "Best-fit packing"),
    and at most ``max_segments``."""
    version = default_version(masked) if format_version is None else format_version
    cont = best_fit_continuations or (4 if version >= 4 else 1)
    return {"continuations": cont if max_segments is None else min(cont, max_segments), "max_segments": max_segments}


def best_fit_chunk(docs, L: int, row_group_tokens: int, window_tokens: int, continuations: int | None = 1,
                   max_segments: int | None = None) -> list:
    """A synthetic chunk's best-fit rows by the brute-force packer, over the row groups it is written with
    (``continuations``, ``max_segments``: the caps per row)."""
    lengths = [len(d) for d in docs]
    rg_docs = [hi - lo for lo, hi in row_groups(lengths, row_group_tokens)]
    return reference_chunk_best_fit(lengths, rg_docs, L, window_tokens, continuations, max_segments)


def chunk_bytes_of(docs: Sequence[Sequence[int]], *, shard: int = 0, first_offset: int = 0,
                   row_group_tokens: int = 64, writer_options: Mapping[str, Any] | None = None,
                   spans: Sequence[Sequence[int]] | None = None,
                   fields: Mapping[str, Sequence[str | None]] | None = None) -> tuple[bytes, list[int], int | None]:
    """The Parquet bytes of one chunk (written by ``reader.format.chunk_file``, the builder's writer), its
    token count per row group and, with ``spans`` (one flattened loss-span list per document: a masked
    cache), its loss tokens. ``fields``: kept fields, name -> one value per document."""
    lengths = [len(d) for d in docs]
    groups = row_groups(lengths, row_group_tokens)
    config = _config(1000, row_group_tokens, spans is not None, tuple(fields or ()))
    out = chunk_file.ChunkParquet(config, writer_options=writer_options)  # (None: the builder's options)
    for lo, hi in groups:
        part = [np.asarray(d, dtype=np.int32) for d in docs[lo:hi]]
        values = np.concatenate(part) if part else np.zeros(0, np.int32)
        table = chunk_file.flat_row_group_table(values, np.asarray(lengths[lo:hi], np.int32), shard,
                                                [first_offset + k for k in range(lo, hi)],
                                                loss_spans=None if spans is None else spans[lo:hi],
                                                fields=None if not fields else {n: v[lo:hi] for n, v in fields.items()})
        out.write(table, int(values.size))
    data, _, _ = out.finish()
    return data, out.row_group_tokens, out.loss_tokens if spans is not None else None


def write_chunk(root: str, shard: int, index_in_shard: int, docs: Sequence[Sequence[int]], *,
                chunk_bytes: int = 1000, row_group_tokens: int = 64, sidecar: bool = True,
                writer_options: Mapping[str, Any] | None = None,
                spans: Sequence[Sequence[int]] | None = None, entry_file: bool = False,
                fields: Mapping[str, Sequence[str | None]] | None = None) -> dict[str, Any]:
    """Write one chunk's parquet (then its sidecar) atomically; return the sidecar dict. ``spans``: each
    document's loss spans (a masked cache's chunk). ``entry_file``: then its entry, as a version 4 build does."""
    fs, base = _fs(root)
    lo = index_in_shard * chunk_bytes
    data, _, loss = chunk_bytes_of(docs, shard=shard, first_offset=lo, row_group_tokens=row_group_tokens,
                                   writer_options=writer_options, spans=spans, fields=fields)
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
    if loss is not None:
        entry["loss_tokens"] = loss
    entry["row_group_index"], entry["footer"] = row_group_index(data)
    if sidecar:
        _atomic_write(fs, base + "/" + fmt.sidecar_path(shard, index_in_shard), sidecar_bytes(entry))
        if entry_file:
            _atomic_write(fs, base + "/" + chunk_table.entry_path(shard, index_in_shard), chunk_table.entry_bytes(entry))
    return entry


# The format version a synthetic cache has by default: what builds wrote before version 4 (3 with loss
# masks, else 2), whose default pass rule is "streams" (the rule most reader tests check against
# ``Reference``); ``format_version=4`` writes what a build writes now (the "spans" rule by default).
def default_version(masked: bool) -> int:
    return 3 if masked else fmt.BASE_FORMAT_VERSION


def ledger_chunks(sidecars: Iterable[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The finished ledger's ``chunks`` (with ``doc_offset``/``token_offset``) from the sidecars in global
    order, and the bad-record counts by reason over all of them."""
    chunks, docs, tokens = [], 0, 0
    bad: dict[str, int] = {}
    for sc in sidecars:
        entry = ledger_entry(sc)  # without the row-group index; with the sidecar's checksum
        entry["doc_offset"] = docs
        entry["token_offset"] = tokens
        docs += sc["docs"]
        tokens += sc["tokens"]
        for reason, n in sc["bad_reasons"].items():
            bad[reason] = bad.get(reason, 0) + n
        chunks.append(entry)
    return chunks, dict(sorted(bad.items()))


def _ledger(inputs, entries, *, finished: bool, chunk_bytes: int, row_group_tokens: int,
            tokenizer: Mapping[str, Any], masked: bool = False, format_version: int | None = None,
            fs=None, base: str = "", keep_fields: Sequence[str] = ()) -> dict[str, Any]:
    """The ledger of a cache of ``format_version`` (default :func:`default_version`); a finished version 4
    ledger's table is written into ``base`` (on ``fs``) by the format's writer."""
    version = default_version(masked) if format_version is None else format_version
    chunks = []
    doc_off = tok_off = 0
    for e in entries if finished else []:
        chunks.append(dict(ledger_entry(e), doc_offset=doc_off, token_offset=tok_off))
        doc_off += e["docs"]
        tok_off += e["tokens"]
    if finished and version < fmt.TABLE_VERSION:  # inputs as builders before version 3 recorded them
        inputs = [{k: v for k, v in i.items() if k not in ("format", "rows")} if version < 3 else i for i in inputs]
    ledger = {
        "format": fmt.FORMAT_NAME,
        "format_version": version,
        "finished": finished,
        "tokenizer": dict(tokenizer),
        "config": _config(chunk_bytes, row_group_tokens, masked, keep_fields),
        "inputs": inputs,
        "chunks": chunks,
    }
    if finished:
        ledger["totals"] = {"docs": doc_off, "tokens": tok_off, "chunks": len(chunks),
                            "bytes": int(sum(e["bytes"] for e in entries)),
                            "input_bytes": int(sum(i["size"] for i in inputs)), "bad_records": 0}
        if masked:
            ledger["totals"]["loss_tokens"] = int(sum(e["loss_tokens"] for e in entries))
        ledger["bad_records"] = {}
    if finished and version >= fmt.TABLE_VERSION:
        for inp in ledger["inputs"]:
            inp.setdefault("uncompressed_bytes", inp["size"])
            if inp["chunks"] is None:
                inp["chunks"] = int(sum(1 for e in entries if e["shard"] == inp["shard"]))
        ledger["totals"]["uncompressed_bytes"] = int(sum(i["uncompressed_bytes"] for i in ledger["inputs"]))
        del ledger["chunks"]
        ledger["table"] = write_table(fs, base, chunks, masked)
    return ledger


def write_table(fs, base: str, entries: Sequence[Mapping[str, Any]], masked: bool,
                block_rows: int = chunk_table.BLOCK_ROWS) -> dict[str, Any]:
    """The table of ``entries`` (global order, with ``sidecar_checksum``) written into ``base`` by the format's
    writer; returns the ledger's ``table`` object."""
    out = io.BytesIO()
    w = chunk_table.TableWriter(out, len(entries), masked, block_rows=block_rows)
    for lo in range(0, len(entries), block_rows):
        w.add(chunk_table.block_values(entries[lo:lo + block_rows], masked))
    desc = w.finish()
    _atomic_write(fs, base + "/" + desc["path"], out.getvalue())
    return desc


def write_synthetic_cache(root: str, chunks: list[list[Sequence[int]]], *, finished: bool = True,
                          chunks_per_shard: Sequence[int] | None = None,
                          compressed: Sequence[bool] | None = None,
                          written: Iterable[int] | None = None,
                          done_shards: Iterable[int] | None = None,
                          chunk_bytes: int = 1000, row_group_tokens: int = 64,
                          tokenizer: Mapping[str, Any] = DEFAULT_TOKENIZER,
                          writer_options: Mapping[str, Any] | None = None,
                          spans: Sequence[Sequence[Sequence[int]]] | None = None,
                          format_version: int | None = None,
                          fields: Sequence[Mapping[str, Sequence[str | None]]] | None = None) -> list[dict[str, Any]]:
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
      writer_options: ``pq.ParquetWriter`` keyword arguments (default: the builder's).
      spans: a masked (supervised) cache: per chunk, per document, its flattened loss spans
        ``[s0, e0, s1, e1, ...]`` (:func:`spans_of_mask` makes them from a per-token mask).
      format_version: the ledger's (default :func:`default_version`; 4: the chunks in a table, and each
        chunk's entry beside its sidecar).
      fields: kept fields (``config.keep_fields``): per chunk, name -> one value (a string or None) per document.
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
                                       row_group_tokens=row_group_tokens, writer_options=writer_options,
                                       spans=None if spans is None else spans[i],
                                       fields=None if fields is None else fields[i],
                                       entry_file=not finished and (format_version or 0) >= fmt.TABLE_VERSION))
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
    ledger = _ledger(inputs, entries, finished=finished, chunk_bytes=chunk_bytes, row_group_tokens=row_group_tokens,
                     tokenizer=tokenizer, masked=spans is not None, format_version=format_version, fs=fs, base=base,
                     keep_fields=tuple(fields[0]) if fields else ())
    _atomic_write(fs, base + "/" + fmt.LEDGER_NAME, fmt.dumps_ledger(ledger).encode())
    return entries


def table_rows(root: str) -> list[dict[str, Any]]:
    """Every row of a version 4 cache's table, as the entries it was written from (a test edits and rewrites
    them with :func:`write_table`)."""
    from reader.storage.cache import Cache

    c = Cache(root)
    rows = chunk_table.recorded_rows(c.table, c.ledger.raw, range(len(c.table)))
    return [rows[i] for i in range(len(rows))]


def finish_cache(root: str, entries: Sequence[Mapping[str, Any]]) -> None:
    """Rewrite the plan ledger at ``root`` as finished with ``entries`` (global order), as the launcher does."""
    fs, base = _fs(root)
    plan = json.loads(fs.cat_file(base + "/" + fmt.LEDGER_NAME))
    ledger = _ledger(plan["inputs"], list(entries), finished=True,
                     chunk_bytes=plan["config"]["chunk_bytes"],
                     row_group_tokens=plan["config"]["row_group_tokens"], tokenizer=plan["tokenizer"],
                     masked=fmt.is_masked(plan["config"]), format_version=plan["format_version"], fs=fs, base=base)
    ledger["config"] = plan["config"]
    _atomic_write(fs, base + "/" + fmt.LEDGER_NAME, fmt.dumps_ledger(ledger).encode())


def finish_build_from(live: str, done: str, entries: Sequence[Mapping[str, Any]]) -> None:
    """The build at ``live`` goes on and finishes: every chunk file of the finished copy ``done`` that
    ``live`` lacks appears (written aside, then renamed, as the builder does), then the ledger lists
    ``entries``."""
    import glob
    import shutil

    for src in sorted(glob.glob(os.path.join(done, "chunks", "*", "*"))):
        dst = os.path.join(live, os.path.relpath(src, done))
        if not os.path.exists(dst):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst + ".tmp")
            os.replace(dst + ".tmp", dst)
    finish_cache(live, entries)


def waits_then_finishes(read: Callable[[], None], wait_s: float, live: str, done: str,
                        entries: Sequence[Mapping[str, Any]], *, join_s: float = 150) -> None:
    """Run ``read`` (which reads the unfinished cache ``live``) on a thread; assert that it is still waiting
    after ``wait_s`` (the time that passes is the test), then let the build finish from ``done``
    (:func:`finish_build_from`) and re-raise whatever ``read`` raised."""
    failed, finished = [], threading.Event()

    def run():
        try:
            read()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            failed.append(e)
        finally:
            finished.set()

    t = threading.Thread(target=run)
    t.start()
    try:
        assert not finished.wait(wait_s), f"the read did not wait for the build: {failed}"
    finally:
        finish_build_from(live, done, entries)
        t.join(join_s)
    assert not t.is_alive(), f"the read did not end within {join_s} s of the build's end"
    if failed:
        raise failed[0]


def build_in_background(root: str, chunks: list[list[Sequence[int]]], chunks_per_shard: Sequence[int], *,
                        compressed: Sequence[bool] | None = None, first: Sequence[int] = (0,), seed: int = 0,
                        delay: float = 0.005, row_group_tokens: int = 9,
                        format_version: int | None = None,
                        fields: Sequence[Mapping[str, Sequence[str | None]]] | None = None) -> threading.Thread:
    """Simulate a running build of a local cache: the plan and chunks ``first`` now, the other chunks
    (global indices) in a seeded random order on a thread, then ``_DONE.json`` of compressed shards and
    the finished ledger (of ``format_version``: see :func:`write_synthetic_cache`). Returns the started thread (join it)."""
    entry_file = (format_version or 0) >= fmt.TABLE_VERSION
    rr = streams.round_robin_order(chunks_per_shard)
    comp = list(compressed) if compressed is not None else [False] * len(chunks_per_shard)
    write_synthetic_cache(root, chunks, finished=False, chunks_per_shard=chunks_per_shard, compressed=comp,
                          written=list(first), row_group_tokens=row_group_tokens, format_version=format_version,
                          fields=fields)
    rest = [i for i in range(len(chunks)) if i not in set(first)]
    random.Random(seed).shuffle(rest)

    def run():
        for i in rest:
            time.sleep(delay)
            write_chunk(root, int(rr[i][0]), int(rr[i][1]), chunks[i], row_group_tokens=row_group_tokens,
                        entry_file=entry_file, fields=None if fields is None else fields[i])
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
                                   reader_index: int = 1, format_version: int | None = None, fields=None):
    """``(got, want)``: batches ``0..count-1`` read while :func:`build_in_background` writes the cache,
    and the same batches read from a finished twin. Asserts the reader really saw the build running."""
    from reader import Reader

    done, live = os.path.join(tmp, "done"), os.path.join(tmp, "live")
    write_synthetic_cache(done, chunks, chunks_per_shard=chunks_per_shard, compressed=compressed,
                          row_group_tokens=9, format_version=format_version, fields=fields)
    with Reader(done, options, num_readers=num_readers, reader_index=reader_index) as ref:
        want = list(ref.iter_batches(0, count))
    t = build_in_background(live, chunks, chunks_per_shard, compressed=compressed, first=first, seed=seed,
                            format_version=format_version, fields=fields)
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


def long_document_chunks(rng: np.random.Generator, num_chunks: int, seq_len: int, *, max_docs: int = 10,
                         vocab: int = 1000) -> list[list[np.ndarray]]:
    """Chunks where most documents are longer than ``seq_len`` (tails of every length, so best fit's
    continuation pieces share rows) and the rest at most ``seq_len`` tokens."""
    out = []
    for _ in range(num_chunks):
        lengths = [int(rng.integers(seq_len + 1, 4 * seq_len)) if rng.random() < 0.7 else int(rng.integers(1, seq_len + 1))
                   for _ in range(int(rng.integers(1, max_docs + 1)))]
        out.append([rng.integers(1, vocab, size=n, dtype=np.int32) for n in lengths])
    return out


# How the varlen loader tests read their cache: best fit, 4 continuation pieces and 5 pieces per row at most
VARLEN_LOADER_OPTIONS = dict(seq_len=16, batch_size=8, ideal_readers=4, packing="best_fit", best_fit_continuations=4,
                             max_segments=5, varlen=True)


def write_varlen_loader_cache(root: str, seed: int) -> str:
    """The cache the varlen loader tests read (reader.jax and reader.torch alike): 10 chunks of
    :func:`long_document_chunks` in 2 shards, with loss masks, row groups of 40 tokens."""
    chunks = long_document_chunks(np.random.default_rng(seed), 10, VARLEN_LOADER_OPTIONS["seq_len"])
    masks = random_masks(np.random.default_rng(seed + 1), chunks)
    write_synthetic_cache(root, chunks, chunks_per_shard=[5, 5], row_group_tokens=40, spans=spans_of(masks))
    return root


def write_best_fit_loader_cache(root: str) -> str:
    """The cache the best-fit loader tests read (reader.jax and reader.torch alike): 10 chunks in 2 shards,
    short documents and some of 50 tokens (longer than their L = 16), row groups of 20 tokens."""
    rng = np.random.default_rng(31)
    chunks = random_chunks(rng, 10, max_docs=8, max_len=12, huge_len=50, huge_prob=0.2)
    write_synthetic_cache(root, chunks, chunks_per_shard=[5, 5], row_group_tokens=20)
    return root


def spans_of_mask(mask) -> list[int]:
    """A document's flattened loss spans from its per-token mask: the maximal runs of True."""
    m = np.concatenate([[False], np.asarray(mask, bool), [False]])
    return np.flatnonzero(m[1:] != m[:-1]).astype(int).tolist()


def random_masks(rng: np.random.Generator, chunks, *, none_prob: float = 0.1) -> list[list[np.ndarray]]:
    """A per-token loss mask for every document of ``chunks``: a few runs each (chat-like turns), some
    documents with none, some all loss."""
    out = []
    for docs in chunks:
        masks = []
        for d in docs:
            n = len(d)
            u = rng.random()
            if u < none_prob or n == 0:
                m = np.zeros(n, bool)
            elif u < 2 * none_prob:
                m = np.ones(n, bool)
            else:  # alternating runs of random lengths
                cuts = np.sort(rng.integers(0, n + 1, size=int(rng.integers(1, 6))))
                m = (np.searchsorted(cuts, np.arange(n), side="right") % 2).astype(bool)
            masks.append(m)
        out.append(masks)
    return out


def spans_of(masks) -> list[list[list[int]]]:
    """``write_synthetic_cache(spans=...)`` from per-chunk, per-document masks."""
    return [[spans_of_mask(m) for m in docs] for docs in masks]


# --------------------------------------------------------------------------------------------------
# Brute-force reference of the reading order (docs/FORMAT.md), straight from the definitions, for tests.


class Reference:
    """Examples of a synthetic cache computed naively: ``loop(chunks)[s::R*]`` walked position by position.
    ``packing="best_fit"`` (packed): each chunk's rows from the brute-force packer (``packing_ref``), per
    window of ``best_fit_window_tokens`` over the row groups ``row_group_tokens`` makes (as the cache's),
    ``best_fit_continuations`` continuation pieces per row (None: as the cache's format version says,
    :func:`best_fit_caps`) and ``max_segments`` pieces per row at most.
    ``masks``: per chunk, per document, its per-token loss mask (a masked cache); ``loss_mask`` is then
    that mask on real tokens."""

    def __init__(self, chunks: Sequence[Sequence[Sequence[int]]], seq_len: int, ideal_readers: int, *,
                 packed: bool = True, loop: bool = True, packing: str = "concat", masks=None,
                 best_fit_window_tokens: int = WINDOW_TOKENS, row_group_tokens: int = 64,
                 best_fit_continuations: int | None = None, max_segments: int | None = None,
                 format_version: int | None = None):
        self.chunks = [[np.asarray(d, dtype=np.int64) for d in c] for c in chunks]
        self.masks = [[np.ones(len(d), bool) for d in c] for c in self.chunks] if masks is None else \
            [[np.asarray(m, bool) for m in c] for c in masks]
        self.L, self.R, self.packed, self.loop = seq_len, ideal_readers, packed, loop
        self.best_fit = packed and packing == "best_fit"
        self.window, self.rgt = best_fit_window_tokens, row_group_tokens
        self.caps = best_fit_caps(best_fit_continuations, max_segments, masked=masks is not None,
                                  format_version=format_version)
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
                docs, masks = self.chunks[c], self.masks[c]
                for row in best_fit_chunk(docs, self.L, self.rgt, self.window, **self.caps):
                    units.append({"pieces": [(docs[d], a, m, masks[d]) for d, a, m in row], "epoch": e})
            for d, mk in zip(self.chunks[c], self.masks[c]) if not self.best_fit else ():
                if self.packed:
                    units += [(int(t), k, int(d[k - 1]) if k else 0, e, bool(mk[k])) for k, t in enumerate(d)]
                else:
                    for k in range(0, len(d), self.L):
                        units.append({"tokens": d[k:k + self.L], "start": k, "mask": mk[k:k + self.L],
                                      "prev": int(d[k - 1]) if k else 0, "doc": d, "epoch": e})
            p += self.R
            empty_run = empty_run + 1 if len(units) == before else 0
            if empty_run > n * self.R + 1:
                raise ValueError("empty stream")
        self._pos[s] = p
        return units

    def num_examples(self, whole: bool = False) -> int:
        """Single pass (R* = 1) only; ``whole``: packed by concatenation, only the rows of ``L`` tokens."""
        assert not self.loop and self.R == 1
        units = self._stream_units(0, 1 << 62)
        if self.packed and not self.best_fit:
            return len(units) // self.L if whole else -(-len(units) // self.L)
        return len(units)

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
            for seg, (d, a, m, mk) in enumerate(units[j]["pieces"], start=1):
                out["targets"][t:t + m] = d[a:a + m]
                out["positions"][t:t + m] = np.arange(a, a + m)
                out["inputs"][t:t + m] = np.concatenate([[d[a - 1] if a else 0], d[a:a + m - 1]])
                out["segment_ids"][t:t + m] = seg
                out["loss_mask"][t:t + m] = mk[a:a + m]
                t += m
            out["epoch"], out["valid"] = units[j]["epoch"], True
        elif self.packed:
            units = self._stream_units(s, (j + 1) * L)[j * L:(j + 1) * L]
            seg = 0
            for t, (tok, k, prev, e, mk) in enumerate(units):
                if t == 0 or k == 0:
                    seg += 1
                out["targets"][t], out["positions"][t], out["segment_ids"][t] = tok, k, seg
                out["inputs"][t] = prev if k else 0
                out["loss_mask"][t] = mk
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
                out["loss_mask"][:m] = u["mask"]
                out["epoch"], out["valid"] = u["epoch"], True
            else:
                out["epoch"], out["valid"] = -1, False
        return out


def shuffled_sources(rule: str, ex, cfg, E: int | None = None) -> np.ndarray:
    """The unshuffled example each shuffled example ``ex`` is, by definition: ``pi(i)`` under
    ``"streams"``; ``p E + pi_p(k)`` for example ``k`` of pass ``p`` under ``"spans"`` (``E`` examples per pass)."""
    from reader.order.shuffle import shuffle_example_indices

    ex = np.asarray(ex, dtype=np.int64)
    if rule == "streams":
        return shuffle_example_indices(ex, cfg)
    p, k = np.divmod(ex, E)
    return p * E + shuffle_example_indices(k, cfg, epoch_length=E, passes=p)


class SpansReference:
    """Examples under the ``"spans"`` pass rule, computed naively: the eval pass's rows (a one-stream
    :class:`Reference`), ``E`` of them (concat: the whole rows), cut into ``R*`` runs by ``np.array_split``;
    pass ``p``'s example ``k`` is row ``runs[k' % R*][k' // R*]`` with ``k'`` = ``shuffle`` of ``k`` over
    ``[0, E)`` in pass ``p`` (``shuffle_example_indices(..., epoch_length=E, passes=p)``; ``k`` itself without
    one). ``epoch`` is the pass."""

    def __init__(self, chunks, seq_len: int, ideal_readers: int, *, shuffle=None, **kw):
        self.eval = Reference(chunks, seq_len, 1, loop=False, **kw)
        self.E = self.eval.num_examples(whole=True)
        self.R, self.shuffle = ideal_readers, shuffle
        self.runs = np.array_split(np.arange(self.E), ideal_readers)

    def row(self, i: int) -> tuple[int, int]:
        """``(pass, eval row)`` of global example ``i``."""
        p = int(i) // self.E
        k = int(i) - p * self.E
        if self.shuffle is not None:
            k = int(shuffled_sources("spans", [i], self.shuffle, self.E)[0]) - p * self.E
        return p, int(self.runs[k % self.R][k // self.R])

    def example(self, i: int) -> dict[str, Any]:
        p, row = self.row(i)
        return dict(self.eval.example(row), epoch=p)


def write_attribute_set(root: str, name: str, kind: str, columns: Sequence[Mapping[str, np.ndarray]],
                        params: Mapping[str, Any], *, meta_chunk: int | None = None) -> None:
    """An attribute set over the finished cache at ``root``, written by the format's own writer as
    ``pipelines/dedup`` writes one: ``columns`` per chunk in global order (``kind``'s columns, one value per
    document). ``meta_chunk``: every file claims that chunk's checksum (a file of another chunk)."""
    from reader.format import attributes as attrs
    from reader.storage.cache import Cache

    t = Cache(root).table
    entries = []
    for c in range(len(t)):
        meta = attrs.file_meta(name, kind, attrs.params_hash(params),
                               t.checksums[c if meta_chunk is None else meta_chunk], int(t.docs[c]))
        data = attrs.file_bytes(kind, columns[c], meta)
        path = os.path.join(root, attrs.file_path(name, int(t.shard[c]), int(t.index_in_shard[c])))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        marked = np.asarray(columns[c]["keeper"]) >= 0
        entries.append([len(data), fmt.checksum(data), int(marked.sum()), 0])
    m = attrs.manifest(name, kind, params, t, entries)
    with open(os.path.join(root, attrs.manifest_path(name)), "wb") as f:
        f.write(attrs.manifest_bytes(m))
