"""What ``python -m reader inspect`` shows, as data: a cache's summary and a mixture's, shared by ``inspect`` and
the ``report`` page.

Counts come from the ledger (every chunk); document-length percentiles from the ``num_tokens`` column of at most
``max_chunks`` chunks spread evenly over the cache, so a summary never reads every chunk of a large cache.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Callable

import numpy as np

from reader.batch.examples import ExampleOrder
from reader.mixture.quotas import QuotaIndex
from reader.mixture.mixture import Mixture, MixtureOrder
from reader.options import ReadOptions
from reader.storage.cache import Cache
from reader.storage.validate import chunk_doc_lengths
from reader.storage.views import open_view

PERCENTILES = (0, 1, 10, 25, 50, 75, 90, 99, 100)
LengthReader = Callable[[Cache, int], np.ndarray]


def length_sample(num_chunks: int, max_chunks: int) -> list[int]:
    """The chunks whose document lengths are read: all of them, or ``max_chunks`` spread evenly (0 = all)."""
    if max_chunks and num_chunks > max_chunks:
        return np.unique(np.linspace(0, num_chunks - 1, max_chunks).astype(np.int64)).tolist()
    return list(range(num_chunks))


def doc_lengths(cache: Cache, indices, threads: int, read: LengthReader = chunk_doc_lengths) -> np.ndarray:
    """The document lengths of chunks ``indices`` (``read``: one chunk's ``num_tokens`` column)."""
    with cf.ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(lambda c: read(cache, c), indices))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def cache_summary(cache: Cache, path: str, *, max_chunks: int, threads: int, seq_len: int | None = None,
                  read: LengthReader = chunk_doc_lengths) -> tuple[dict, np.ndarray]:
    """``inspect``'s figures for ``cache`` (the chunks known so far, on a running build) and the document
    lengths it sampled; with ``seq_len``, the sampled documents longer than it (what
    ``ReadOptions(drop_long=True)`` skips)."""
    t = cache.table
    n = len(t)
    sample = length_sample(n, max_chunks)
    lengths = doc_lengths(cache, sample, threads, read)
    info = {
        "path": path,
        "finished": cache.complete,
        "chunks": n,
        "empty_chunks": int((t.docs == 0).sum()),
        "documents": int(t.docs.sum()),
        "tokens": int(t.tokens.sum()),
        "bytes": int(t.nbytes.sum()),
        "inputs": len(cache.ledger.inputs),
        "tokenizer": dict(cache.ledger.tokenizer),
        "config": dict(cache.ledger.config),
        "bad_records": dict(cache.ledger.raw.get("bad_records", {})),
        "doc_length_percentiles": {f"p{p}": (int(np.percentile(lengths, p)) if lengths.size else None)
                                   for p in PERCENTILES},
        "doc_length_mean": float(lengths.mean()) if lengths.size else None,
        "length_sample": f"{len(sample)} of {n} chunks",
        "tokens_per_chunk_percentiles": {f"p{p}": (int(np.percentile(t.tokens, p)) if n else None)
                                         for p in (0, 50, 100)},
    }
    if seq_len is not None:
        long = lengths > seq_len
        info["longer_than_seq_len"] = {"seq_len": seq_len, "documents": int(long.sum()),
                                       "tokens": int(lengths[long].sum())}
    if cache.ledger.masked:  # the loss tokens' share, from the ledger (the sidecars while the build runs)
        loss = None if t.loss_tokens is None else int(t.loss_tokens.sum())
        info["loss_tokens"] = loss
        info["loss_token_share"] = loss / info["tokens"] if loss is not None and info["tokens"] else None
    return info, lengths


def passes(order: ExampleOrder) -> dict:
    """How a training read covers a cache (docs/READING.md, "Passes"): its pass rule, ``E`` (the examples of a
    pass, in the chunks known so far on a running build) and, under ``"streams"``, about how many of a
    pass's rows repeat rows of the same pass."""
    return {"pass_rule": order.pass_rule, "rule_by_version": order.options.pass_rule is None,
            "format_version": order.cache.ledger.format_version, "examples_per_pass": order.pass_examples(),
            "repeated_rows": order.repeated_rows()}


def cache_passes(cache: Cache, opts: ReadOptions, steps: int | None) -> dict:
    """:func:`passes` of ``cache`` read with ``opts`` (through its view, if any) and, for ``steps`` global batches,
    the examples and passes they make."""
    info = passes(ExampleOrder(open_view(cache, opts.view, index_cache=opts.index_cache)[1], opts, None,
                               np.zeros(0, np.int64)))
    info.update(seq_len=opts.seq_len, packing=opts.packing, ideal_readers=opts.ideal_readers, batch_size=opts.batch_size)
    if steps is not None:
        E = info["examples_per_pass"]
        info.update(steps=steps, examples=steps * opts.batch_size, passes=steps * opts.batch_size / E if E else None)
    return info


def mixture_summary(path: str, opts: ReadOptions, steps: int | None, mix: Mixture | None = None) -> dict:
    """What ``inspect`` prints for a mixture file: each component's size, its weight per schedule
    segment, its pass rule and examples per pass and, for ``steps`` global batches of ``opts``, the
    examples, tokens and passes drawn from it (packed: ``seq_len`` tokens per example), and the first
    step a component's ``max_passes`` refuses, if any before ``steps``."""
    mix = Mixture(path) if mix is None else mix
    spec = mix.spec
    seen = [c for _, c in mix.open_views(opts)]  # (each read's cache as its view sees it)
    sizes = [(len(c.table), int(c.table.docs.sum()), int(c.table.tokens.sum())) for c in seen]
    order = MixtureOrder(mix, opts, [None] * len(mix.distinct), np.zeros(0, np.int64), caches=seen)
    per_cache = [passes(o) for o in order.orders]
    comps = []
    for c, cache, d in zip(spec.components, mix.caches, mix.which):
        chunks, docs, tokens = sizes[d]  # (once per distinct cache: components may share one)
        comps.append({"name": c.name, "path": c.url, "finished": cache.complete, "chunks": chunks,
                      "documents": docs, "tokens": tokens, **per_cache[d],
                      "max_passes": None if c.max_passes is None else float(c.max_passes)})
    segs = [{"start_batch": start, "weights": dict(zip(spec.names, spec.normalised(s)))}
            for s, (start, _) in enumerate(spec.segments)]
    info = {"path": path, "seed": spec.seed, "block": spec.block,
            "tokenizer": dict(mix.caches[0].ledger.tokenizer), "components": comps, "segments": segs}
    if steps is not None:
        drawn = QuotaIndex(spec.quotas(opts.effective_ideal_readers, opts.batch_size)).consumed(steps * opts.batch_size)
        info["steps"] = {"steps": steps, "seq_len": opts.seq_len, "batch_size": opts.batch_size,
                         "ideal_readers": opts.ideal_readers, "examples": steps * opts.batch_size}
        for comp, n in zip(comps, drawn.tolist()):
            comp["examples_drawn"] = n
            comp["tokens_drawn"] = n * opts.seq_len
            comp["passes"] = n / comp["examples_per_pass"] if comp["examples_per_pass"] else None
        limit = None if opts.eval_mode else order.pass_limit()
        if limit is not None and limit[0] < steps:
            info["steps"]["refused_from"] = {"step": limit[0], "error": str(limit[1])}
    return info
