"""Shuffle quality and I/O cost of four example orders on the same cache.

Orders, all served at the same batch size from the same packed streams (``R*`` ideal readers):

* ``none``  : no shuffle (the round-robin stream order);
* ``eras``  : fixed-size windows ("eras", Levanter style), each a full random permutation of its examples;
* ``ours``  : the growing-window shuffle of ``reader.order.shuffle`` (``ShuffleConfig``), ``lanes = R*``;
* ``ours_lanes1``: the same with ``lanes = 1`` (what a reader gets if it leaves ``lanes`` at its default);
* ``full``  : a full random permutation of one pass over all examples.

Figures (keys of the returned flat dict are ``<order>_<figure>``):

* ``displacement_mean/p50/p90/max``: ``|pi(i) - i| / N`` (N = examples in one pass);
* ``within_doc``: fraction of batches holding two examples that share a document;
  ``within_chunk``: ... two examples from the same chunk; ``within_shard``: ... from the same source
  shard; ``shard_pair_rate``: fraction of example pairs in a batch from the same shard;
* ``between_doc``: fraction of the documents seen in batch b that reappear in batch b+1;
* ``io_rg`` / ``io_chunk``: bytes read from chunk files per byte of tokens served (int32), with an LRU
  of ``memory_budget`` bytes, when reading Parquet row groups by byte range (``rg``) or when fetching
  whole chunk files and decoding row groups from them (``chunk``, what ``reader.storage.store.ChunkStore``
  did before byte-range reads; ``rg`` is what it does now); ``io_rg_amp`` / ``io_chunk_amp``: the same divided by ``none``'s (the cost of streaming);
  ``io_*_r4``: the same for host 0 of 4 reader hosts;
* ``entropy``: entropy (bits) of ``|storage index difference|`` between neighbouring samples, where the
  storage index is the example's first token in the concatenated global chunk order, as in MosaicML
  Streaming's shuffle-quality simulator (``chunk_entropy``: the same over chunk indices);
* ``*_steady``: the figure over the batches after ``ours`` reached its maximum window;
* ``ours_io_chunk_half_mix_budget_amp``: ``ours`` with an LRU of half a mix (the thrashing cliff);
* ``*_reader_fetch`` (full mode): bytes the real ``reader.Reader`` fetched per token byte over one
  maximum window, unshuffled and shuffled, next to the simulation's ``*_sim_rg_window``.

    python -m benchmarks.shuffle_quality            # real text: builds a cache with the pipeline
    python -m benchmarks.shuffle_quality --quick    # tiny synthetic cache, seconds
    python -m benchmarks.shuffle_quality --cache DIR  # an existing cache

``run(quick=...)`` returns the flat dict (``make bench`` calls it).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from reader.format import spec as fmt
from reader.order import shuffle
from reader.order import streams

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "benchmarks" / "work"
ORDERS = ("none", "eras", "ours", "ours_lanes1", "full")
PLOT_ORDERS = ("none", "eras", "ours", "full")
NEAR_BATCHES = 8


# --------------------------------------------------------------------------------------------------
# The cache as the simulation sees it: token counts of documents, row groups and chunks, in global order


@dataclasses.dataclass
class Layout:
    chunk_tokens: np.ndarray  # int64 [N]
    chunk_shard: np.ndarray  # int64 [N]
    chunk_bytes: np.ndarray  # int64 [N] file bytes
    doc_len: np.ndarray  # int64 [D] all documents, global order
    rg_tokens: np.ndarray  # int64 [G] all row groups, global order
    rg_bytes: np.ndarray  # int64 [G] file bytes of each row group (compressed column chunks)
    rg_chunk: np.ndarray  # int64 [G]
    source: str

    def __post_init__(self):
        self.tok_off = np.concatenate([[0], np.cumsum(self.chunk_tokens)])
        self.doc_start = np.concatenate([[0], np.cumsum(self.doc_len)])
        self.rg_start = np.concatenate([[0], np.cumsum(self.rg_tokens)])
        assert self.doc_start[-1] == self.tok_off[-1] == self.rg_start[-1], "inconsistent layout"
        # first/last document and row group of each chunk (empty chunks: lo > hi)
        self.chunk_doc_lo = np.searchsorted(self.doc_start, self.tok_off[:-1], side="right") - 1
        self.chunk_doc_hi = np.searchsorted(self.doc_start, self.tok_off[1:] - 1, side="right") - 1
        first = np.searchsorted(self.rg_chunk, np.arange(self.chunk_tokens.size), side="left")
        last = np.searchsorted(self.rg_chunk, np.arange(self.chunk_tokens.size), side="right") - 1
        self.chunk_rg_lo, self.chunk_rg_hi = first, last

    @property
    def total_tokens(self) -> int:
        return int(self.tok_off[-1])

    def describe(self) -> dict:
        return {"chunks": int(self.chunk_tokens.size), "docs": int(self.doc_len.size),
                "tokens": self.total_tokens, "row_groups": int(self.rg_tokens.size),
                "shards": int(np.unique(self.chunk_shard).size), "file_bytes": int(self.chunk_bytes.sum()),
                "mean_doc_tokens": round(float(self.doc_len.mean()), 1),
                "p99_doc_tokens": int(np.percentile(self.doc_len, 99)), "source": self.source}


def synthetic_layout(*, shards: int, tokens: int, chunk_tokens: int, rg_tokens: int, seed: int = 0,
                     bytes_per_token: float = 1.2) -> Layout:
    """Documents with a realistic, heavy-tailed length distribution (lognormal, median ~430 tokens,
    mean ~900, 1% above ~9k), split per shard into chunks of ~chunk_tokens and row groups.

    Chunk K of a shard holds the documents whose first token lies in ``[K*chunk_tokens, (K+1)*chunk_tokens)``;
    row groups are cut the same way inside a chunk (by first token, every ``rg_tokens``), which is close to
    the pipeline's "close once it holds >= row_group_tokens". File bytes: ``bytes_per_token`` per token
    (1.17 was measured on the real-text cache with zstd)."""
    rng = np.random.default_rng(seed)
    sizes = rng.uniform(0.6, 1.4, shards)
    sizes = (sizes / sizes.sum() * tokens).astype(np.int64)
    per_shard = []  # per shard: (doc lengths, chunk start indices into them, number of chunks)
    for s in range(shards):
        lens = np.maximum(1, rng.lognormal(6.06, 1.25, int(sizes[s] / 900) + 10).astype(np.int64))
        lens = lens[np.cumsum(lens) <= sizes[s]]
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        nchunks = int(starts[-1] // chunk_tokens) + 1 if lens.size else 0
        cuts = np.searchsorted(starts, np.arange(nchunks + 1) * chunk_tokens)
        per_shard.append((lens, starts, cuts))
    rr = streams.round_robin_order([c.size - 1 for _, _, c in per_shard])
    chunk_tok, chunk_shard, docs, rgs, rg_chunk = [], [], [], [], []
    for g, (s, kk) in enumerate(rr.tolist()):
        lens, starts, cuts = per_shard[s]
        a, b = int(cuts[kk]), int(cuts[kk + 1])
        d = lens[a:b]
        chunk_tok.append(int(d.sum()))
        chunk_shard.append(s)
        docs.append(d)
        if d.size:
            rel = starts[a:b] - starts[a]
            r = np.bincount(rel // rg_tokens, weights=d).astype(np.int64)
            r = r[r > 0]
            rgs.append(r)
            rg_chunk.append(np.full(r.size, g, np.int64))
    rg_t = np.concatenate(rgs)
    rg_b = (rg_t * bytes_per_token).astype(np.int64) + 200
    rg_c = np.concatenate(rg_chunk)
    cb = np.bincount(rg_c, weights=rg_b, minlength=len(chunk_tok)).astype(np.int64) + 1000
    return Layout(np.asarray(chunk_tok, np.int64), np.asarray(chunk_shard, np.int64), cb,
                  np.concatenate(docs).astype(np.int64), rg_t, rg_b, rg_c,
                  source=f"synthetic lognormal docs, {shards} shards")


def cache_layout(root: str) -> Layout:
    """The layout of a finished local cache: ledger + Parquet footers + the num_tokens column."""
    import pyarrow.parquet as pq

    root = str(root)
    ledger = json.loads(Path(root, fmt.LEDGER_NAME).read_text())
    if not ledger.get("finished"):
        raise SystemExit(f"{root}/{fmt.LEDGER_NAME}: the build is not finished; rerun the build first")
    ct, cs, cb, docs, rgt, rgb, rgc = [], [], [], [], [], [], []
    from reader.storage.cache import Cache

    table = Cache(root).table
    for g, rel in enumerate(table.paths):  # (every version: a table's paths are derived)
        path = Path(root, rel)
        pf = pq.ParquetFile(path)
        md = pf.metadata
        lens = pf.read(columns=[fmt.LENGTH_COLUMN]).column(0).to_numpy().astype(np.int64)
        kv = md.metadata or {}
        toks = json.loads(kv[fmt.ROW_GROUP_TOKENS_KEY]) if fmt.ROW_GROUP_TOKENS_KEY in kv else []
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            rgb.append(sum(rg.column(c).total_compressed_size for c in range(rg.num_columns)))
            rgt.append(int(toks[i]) if i < len(toks) else 0)
            rgc.append(g)
        ct.append(int(lens.sum()))
        cs.append(int(table.shard[g]))
        cb.append(int(table.nbytes[g]))
        docs.append(lens)
    doc_len = np.concatenate(docs) if docs else np.zeros(0, np.int64)
    rg_t = np.asarray(rgt, np.int64)
    keep = rg_t > 0  # empty chunks have an empty row group
    return Layout(np.asarray(ct, np.int64), np.asarray(cs, np.int64), np.asarray(cb, np.int64),
                  doc_len[doc_len > 0] if (doc_len == 0).any() else doc_len,
                  rg_t[keep], np.asarray(rgb, np.int64)[keep], np.asarray(rgc, np.int64)[keep],
                  source=f"cache {root}")


# --------------------------------------------------------------------------------------------------
# Examples: what each packed example touches


@dataclasses.dataclass
class Examples:
    storage: np.ndarray  # int64 [X] first token in (epoch, global token) order // L
    chunk_key: np.ndarray  # int64 [X] chunk + N * epoch of the first token
    shard: np.ndarray  # int64 [X]
    doc_ptr: np.ndarray  # CSR over docs touched: int64 [X+1]
    doc_key: np.ndarray  # doc + D * epoch
    rg_ptr: np.ndarray  # CSR over row groups touched (global rg index)
    rg_idx: np.ndarray


def _expand(lo: np.ndarray, hi: np.ndarray):
    """Concatenate ranges [lo, hi] (inclusive; empty if hi < lo): returns (owner, values)."""
    n = np.maximum(hi - lo + 1, 0)
    owner = np.repeat(np.arange(lo.size), n)
    base = np.repeat(lo - np.concatenate([[0], np.cumsum(n)[:-1]]), n)
    return owner, base + np.arange(int(n.sum()))


def compute_examples(lay: Layout, num_examples: int, seq_len: int, ideal_readers: int) -> Examples:
    idx = streams.StreamIndex(lay.chunk_tokens, ideal_readers, loop=True)
    x = np.arange(num_examples, dtype=np.int64)
    s, j = streams.stream_position(x, ideal_readers)
    e1, c1, o1, e2, c2, o2 = (np.zeros(num_examples, np.int64) for _ in range(6))
    for st in range(ideal_readers):
        m = s == st
        a = idx.locate_many(st, j[m] * seq_len)
        b = idx.locate_many(st, j[m] * seq_len + seq_len - 1)
        e1[m], c1[m], o1[m] = a
        e2[m], c2[m], o2[m] = b
    g1, g2 = lay.tok_off[c1] + o1, lay.tok_off[c2] + o2
    D, N, T = lay.doc_len.size, lay.chunk_tokens.size, lay.total_tokens
    d1 = np.searchsorted(lay.doc_start, g1, side="right") - 1
    d2 = np.searchsorted(lay.doc_start, g2, side="right") - 1
    r1 = np.searchsorted(lay.rg_start, g1, side="right") - 1
    r2 = np.searchsorted(lay.rg_start, g2, side="right") - 1
    same = (c1 == c2) & (e1 == e2)
    # one range when the example lies in one chunk, else tail of chunk c1 + head of chunk c2
    # (chunks wholly inside one example are ignored: they only occur when chunks are shorter than L)
    lo_a, hi_a = d1, np.where(same, d2, lay.chunk_doc_hi[c1])
    lo_b, hi_b = np.where(same, 0, lay.chunk_doc_lo[c2]), np.where(same, -1, d2)
    own_a, val_a = _expand(lo_a, hi_a)
    own_b, val_b = _expand(lo_b, hi_b)
    owner = np.concatenate([own_a, own_b])
    key = np.concatenate([val_a + D * e1[own_a], val_b + D * e2[own_b]])
    o = np.argsort(owner, kind="stable")
    doc_ptr = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=num_examples))])
    rlo_a, rhi_a = r1, np.where(same, r2, lay.chunk_rg_hi[c1])
    rlo_b, rhi_b = np.where(same, 0, lay.chunk_rg_lo[c2]), np.where(same, -1, r2)
    rown_a, rval_a = _expand(rlo_a, rhi_a)
    rown_b, rval_b = _expand(rlo_b, rhi_b)
    rown = np.concatenate([rown_a, rown_b])
    rval = np.concatenate([rval_a, rval_b])
    ro = np.argsort(rown, kind="stable")
    rg_ptr = np.concatenate([[0], np.cumsum(np.bincount(rown, minlength=num_examples))])
    return Examples(storage=(e1 * T + g1) // seq_len, chunk_key=c1 + N * e1, shard=lay.chunk_shard[c1],
                    doc_ptr=doc_ptr, doc_key=key[o], rg_ptr=rg_ptr, rg_idx=rval[ro])


# --------------------------------------------------------------------------------------------------
# Figures of one order


def _per_batch_dups(batch: np.ndarray, key: np.ndarray, nb: int) -> np.ndarray:
    """Per batch: whether some key occurs twice (keys of one example must be distinct)."""
    k = np.lexsort((key, batch))
    b, kk = batch[k], key[k]
    dup = (b[1:] == b[:-1]) & (kk[1:] == kk[:-1])
    out = np.zeros(nb, bool)
    out[b[1:][dup]] = True
    return out


def entropy_bits(values: np.ndarray) -> float:
    d = np.abs(np.diff(values))
    _, counts = np.unique(d, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def order_figures(ex: Examples, perm: np.ndarray, n_pass: int, batch_size: int) -> dict[str, Any]:
    """Per-batch series and scalar figures for the served sequence ``perm`` (example indices)."""
    n = perm.size
    nb = n // batch_size
    perm = perm[: nb * batch_size]
    t = np.arange(perm.size)
    batch_of = t // batch_size
    disp = np.abs(perm - t) / n_pass
    # documents per served example
    cnt = ex.doc_ptr[perm + 1] - ex.doc_ptr[perm]
    owner = np.repeat(np.arange(perm.size), cnt)
    starts = np.repeat(ex.doc_ptr[perm] - np.concatenate([[0], np.cumsum(cnt)[:-1]]), cnt)
    docs = ex.doc_key[starts + np.arange(int(cnt.sum()))]
    dbatch = batch_of[owner]
    within_doc = _per_batch_dups(dbatch, docs, nb)
    within_chunk = _per_batch_dups(batch_of, ex.chunk_key[perm], nb)
    within_shard = _per_batch_dups(batch_of, ex.shard[perm], nb)
    # pairs from the same shard
    pair_key = batch_of * (int(ex.shard.max()) + 1) + ex.shard[perm]
    _, c = np.unique(pair_key, return_counts=True)
    same_pairs = np.bincount(np.unique(pair_key) // (int(ex.shard.max()) + 1), weights=c * (c - 1) / 2,
                             minlength=nb)
    shard_pair_rate = same_pairs / (batch_size * (batch_size - 1) / 2)
    # between batches: unique (batch, doc) pairs sorted by (doc, batch); the next pair of the same doc
    # tells in which later batch it shows up next
    u = np.unique(np.stack([docs, dbatch], axis=1), axis=0) if docs.size else np.zeros((0, 2), np.int64)
    ud, ub = u[:, 0], u[:, 1]
    gap = np.full(ub.size, np.iinfo(np.int64).max)
    same = ud[1:] == ud[:-1]
    gap[:-1][same] = (ub[1:] - ub[:-1])[same]
    docs_per_b = np.bincount(ub, minlength=nb)
    nxt1 = np.bincount(ub, weights=gap == 1, minlength=nb)
    near = np.bincount(ub, weights=gap <= NEAR_BATCHES, minlength=nb)
    den = np.maximum(docs_per_b[:-1], 1)
    between = nxt1[:-1] / den
    near_doc = near[:-1] / den
    return {
        "series": {"within_doc": within_doc, "between_doc": between, "near_doc": near_doc},
        "within_doc": within_doc, "within_chunk": within_chunk, "within_shard": within_shard,
        "shard_pair_rate": shard_pair_rate, "between_doc": between, "near_doc": near_doc, "disp": disp,
        "entropy": entropy_bits(ex.storage[perm]), "chunk_entropy": entropy_bits(ex.chunk_key[perm]),
    }


def simulate_io(ex: Examples, lay: Layout, perm: np.ndarray, *, seq_len: int, budget: int,
                whole_chunks: bool, hosts: int = 1, host: int = 0) -> float:
    """Bytes read from chunk files per byte of (int32) tokens served, for one reader host.

    The host serves positions ``t ≡ host (mod hosts)`` (rows ``k ≡ r (mod R)`` of every batch). An LRU
    holds decoded row groups (``DECODED_BYTES_PER_TOKEN * tokens`` bytes, as ``reader.storage.store`` keeps
    them) and, with ``whole_chunks``, the fetched chunk files; like ``ChunkStore.tokens``, every access
    touches the chunk's bytes first (so an evicted chunk is fetched again even if the row group is
    still cached).
    """
    served = perm[host::hosts]
    cache: collections.OrderedDict = collections.OrderedDict()
    used = 0
    read = 0
    rg_dec = (lay.rg_tokens * shuffle.DECODED_BYTES_PER_TOKEN).tolist()
    rg_b = lay.rg_bytes.tolist()
    ch_b = lay.chunk_bytes.tolist()
    rg_ch = lay.rg_chunk.tolist()
    ptr, idx = ex.rg_ptr, ex.rg_idx

    def put(key, size):
        nonlocal used
        cache[key] = size
        used += size
        while used > budget and len(cache) > 1:
            _, sz = cache.popitem(last=False)
            used -= sz

    for x in served.tolist():
        for g in idx[ptr[x]:ptr[x + 1]].tolist():
            if whole_chunks:
                ck = ("c", rg_ch[g])
                if ck in cache:
                    cache.move_to_end(ck)
                else:
                    read += ch_b[rg_ch[g]]
                    put(ck, ch_b[rg_ch[g]])
            rk = ("r", g)
            if rk in cache:
                cache.move_to_end(rk)
            else:
                if not whole_chunks:
                    read += rg_b[g]
                put(rk, rg_dec[g])
    return read / (served.size * seq_len * 4)


# --------------------------------------------------------------------------------------------------
# The benchmark


@dataclasses.dataclass(frozen=True)
class Params:
    seq_len: int
    ideal_readers: int
    batch_size: int
    row_group_tokens: int  # of the cache: ours derives its block size from it (ShuffleConfig.for_reader)
    max_window: int  # ours' maximum window, scaled down to the benchmark cache; also the eras' size
    budget_mixes: float = 2.0  # LRU budget = budget_mixes * mix_size * seq_len * 8 bytes (decoded)
    seed: int = 1234


QUICK = Params(seq_len=128, ideal_readers=8, batch_size=32, row_group_tokens=1024, max_window=8192)
FULL = Params(seq_len=512, ideal_readers=16, batch_size=64, row_group_tokens=32768, max_window=65536)


def shuffle_config(p: Params, lanes: int) -> shuffle.ShuffleConfig:
    cfg = shuffle.ShuffleConfig.for_reader(p.seed, seq_len=p.seq_len, ideal_readers=p.ideal_readers,
                                         batch_size=p.batch_size, row_group_tokens=p.row_group_tokens,
                                         max_window=p.max_window)
    if lanes == 1:  # same sizes in examples, examples free to change stream
        cfg = dataclasses.replace(cfg, lanes=1)
    return cfg


def orders(p: Params, n: int) -> dict[str, np.ndarray]:
    t = np.arange(n, dtype=np.int64)
    eras = shuffle.ShuffleConfig(seed=p.seed, first_window=p.max_window, growth=1.0, max_window=p.max_window,
                               block_size=1, mix_size=p.max_window)
    return {
        "none": t,
        "eras": shuffle.shuffle_example_indices(t, eras),
        "ours": shuffle.shuffle_example_indices(t, shuffle_config(p, p.ideal_readers)),
        "ours_lanes1": shuffle.shuffle_example_indices(t, shuffle_config(p, 1)),
        "full": np.random.default_rng(p.seed).permutation(n).astype(np.int64),
    }


def steady_batch(p: Params) -> int:
    """First batch index lying wholly in a maximum-size window of ``ours``."""
    starts, _ = shuffle_config(p, p.ideal_readers).window_table
    return -(-int(starts[-1]) * p.ideal_readers // p.batch_size)


def measure(lay: Layout, p: Params, *, plot: str | None = None, check_root: str | None = None,
            log=print) -> dict[str, Any]:
    t0 = time.time()
    n_pass = lay.total_tokens // p.seq_len
    n = (n_pass // p.batch_size) * p.batch_size
    ords = orders(p, n)
    span = max(int(v.max()) for v in ords.values()) + 1
    ex = compute_examples(lay, span, p.seq_len, p.ideal_readers)
    cfg = shuffle_config(p, p.ideal_readers)
    budget = int(p.budget_mixes * cfg.mix_size * p.seq_len * shuffle.DECODED_BYTES_PER_TOKEN)
    sb = steady_batch(p)
    out: dict[str, Any] = {
        "examples_per_pass": n_pass, "batches": n // p.batch_size, "batch_size": p.batch_size,
        "seq_len": p.seq_len, "ideal_readers": p.ideal_readers, "steady_from_batch": sb,
        "memory_budget_bytes": budget, **{f"cache_{k}": v for k, v in lay.describe().items()},
        **{f"cfg_{k}": v for k, v in dataclasses.asdict(p).items()},
        **{f"ours_cfg_{k}": v for k, v in dataclasses.asdict(cfg).items() if k != "seed"},
    }
    series = {}
    for name, perm in ords.items():
        f = order_figures(ex, perm, n_pass, p.batch_size)
        series[name] = f["series"]
        d = f["disp"]
        out[f"{name}_displacement_mean"] = float(d.mean())
        out[f"{name}_displacement_p50"] = float(np.median(d))
        out[f"{name}_displacement_p90"] = float(np.percentile(d, 90))
        out[f"{name}_displacement_max"] = float(d.max())
        for k in ("within_doc", "within_chunk", "within_shard", "shard_pair_rate", "between_doc", "near_doc"):
            v = np.asarray(f[k], dtype=float)
            out[f"{name}_{k}"] = float(v.mean())
            out[f"{name}_{k}_steady"] = float(v[sb:].mean()) if v[sb:].size else float("nan")
        out[f"{name}_entropy"] = f["entropy"]
        out[f"{name}_chunk_entropy"] = f["chunk_entropy"]
        out[f"{name}_entropy_steady"] = entropy_bits(ex.storage[perm[sb * p.batch_size:]])
        for model, whole in (("rg", False), ("chunk", True)):
            out[f"{name}_io_{model}"] = simulate_io(ex, lay, perm, seq_len=p.seq_len, budget=budget,
                                                    whole_chunks=whole)
            out[f"{name}_io_{model}_r4"] = simulate_io(ex, lay, perm, seq_len=p.seq_len, budget=budget,
                                                       whole_chunks=whole, hosts=4)
        log(f"shuffle_quality: {name} done ({time.time() - t0:.1f}s)")
    # the cliff: an LRU smaller than one mix's working set re-reads on nearly every access
    out["ours_io_chunk_half_mix_budget_amp"] = simulate_io(
        ex, lay, ords["ours"], seq_len=p.seq_len, budget=budget // int(2 * p.budget_mixes),
        whole_chunks=True) / out["none_io_chunk"]
    for name in ords:
        for model in ("rg", "chunk"):
            for sfx in ("", "_r4"):
                base = out[f"none_io_{model}{sfx}"]
                out[f"{name}_io_{model}{sfx}_amp"] = out[f"{name}_io_{model}{sfx}"] / base if base else float("nan")
    # the target: within 10% of the full shuffle, checked on the steady state
    tol = []
    for k in ("within_doc", "within_shard", "between_doc"):
        ours, full = out[f"ours_{k}_steady"], out[f"full_{k}_steady"]
        tol.append(ours <= full + 0.1 * max(full, 0.01))  # within 10% of the full shuffle's (or better)
    out["target_correlation_within_10pct"] = bool(all(tol))
    out["target_io_rg_amp_le_1_5"] = bool(out["ours_io_rg_amp"] <= 1.5)
    out["target_io_chunk_amp_le_1_5"] = bool(out["ours_io_chunk_amp"] <= 1.5)
    if check_root:
        out.update(reader_check(check_root, lay, p, budget, log=log))
    out["seconds"] = round(time.time() - t0, 2)
    if plot:
        _plot(series, p, sb, plot)
        out["plot"] = plot
    return out


def reader_check(root: str, lay: Layout, p: Params, budget: int, *, log=print) -> dict[str, Any]:
    """Cross-check of the I/O simulation with the real ``reader.Reader`` (row groups by byte range, its
    own LRU): read one maximum window of ``ours`` and the same batches unshuffled; report bytes fetched
    per token byte served (sidecars and footers included), and the simulation's row-group figure for the
    same batches (``*_sim_rg_window``)."""
    from reader import ReadOptions, Reader

    cfg = shuffle_config(p, p.ideal_readers)
    b0 = steady_batch(p)
    nb = max(1, cfg.max_window // p.batch_size)
    t = np.arange(b0 * p.batch_size, (b0 + nb) * p.batch_size, dtype=np.int64)
    perms = {"none": t, "ours": shuffle.shuffle_example_indices(t, cfg)}
    ex = compute_examples(lay, int(max(v.max() for v in perms.values())) + 1, p.seq_len, p.ideal_readers)
    out: dict[str, Any] = {"reader_check_batches": nb, "reader_check_from_batch": b0}
    for name, sh in (("none", None), ("ours", cfg)):
        t0 = time.time()
        opts = ReadOptions(seq_len=p.seq_len, batch_size=p.batch_size, ideal_readers=p.ideal_readers, shuffle=sh,
                           memory_budget_bytes=budget)
        with Reader(root, opts) as rd:
            for _ in rd.iter_batches(b0, nb):
                pass
            fetched = rd.store.bytes_fetched
        out[f"{name}_reader_fetch"] = fetched / (nb * p.batch_size * p.seq_len * 4)
        out[f"{name}_reader_seconds"] = round(time.time() - t0, 2)
        out[f"{name}_sim_rg_window"] = simulate_io(ex, lay, perms[name], seq_len=p.seq_len, budget=budget,
                                                   whole_chunks=False)
        log(f"shuffle_quality: reader check {name} ({time.time() - t0:.1f}s)")
    out["ours_reader_fetch_amp"] = out["ours_reader_fetch"] / out["none_reader_fetch"]
    out["ours_sim_rg_window_amp"] = out["ours_sim_rg_window"] / out["none_sim_rg_window"]
    return out


def _plot(series: dict, p: Params, steady: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    titles = {"within_doc": "batches with two examples of one document",
              "between_doc": "documents of batch b reappearing in b+1",
              "near_doc": f"documents of batch b reappearing in b+1..b+{NEAR_BATCHES}"}
    colors = {"none": "tab:gray", "eras": "tab:orange", "ours": "tab:blue", "full": "tab:green"}
    for ax, key in zip(axes, titles):
        for name in PLOT_ORDERS:
            v = np.asarray(series[name][key], dtype=float)
            w = max(1, v.size // 60)
            k = v.size // w
            xs = (np.arange(k) + 0.5) * w
            ax.plot(xs, v[: k * w].reshape(k, w).mean(1), label=name, color=colors[name], lw=1.6)
        starts, _ = shuffle_config(p, p.ideal_readers).window_table
        for s in starts[1:]:
            ax.axvline(s * p.ideal_readers / p.batch_size, color="tab:blue", alpha=0.15, lw=0.8)
        ax.axvline(steady, color="tab:blue", ls="--", lw=1)
        ax.set_title(titles[key], fontsize=10)
        ax.set_xlabel("training position (batch)")
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("fraction (binned)")
    axes[0].legend(loc="upper right")
    fig.suptitle(f"Shuffle correlation vs training position (batch {p.batch_size}, seq_len {p.seq_len}, "
                 f"R*={p.ideal_readers}; ours: windows {shuffle_config(p, 1).first_window}..{p.max_window} examples, dashed = max "
                 f"window reached)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# A cache from real text, built with the pipeline


REAL_CORPUS_BYTES = 640_000_000  # benchmarks.corpus "corpus-full": 8 shards of real English text
REAL_CHUNK_BYTES = 2 << 20
REAL_ROW_GROUP_TOKENS = 32768


def real_cache(log=print) -> Path:
    """Build (or reuse) a cache of real English text with the pipeline (FnApiRunner)."""
    from benchmarks import corpus as corpus_mod

    src = WORK / "corpus-full"
    corpus_mod.build_corpus(src, REAL_CORPUS_BYTES, 8, log=log)
    out = WORK / f"shuffle-cache-{REAL_CORPUS_BYTES // 1_000_000}mb-{REAL_CHUNK_BYTES}-{REAL_ROW_GROUP_TOKENS}"
    ledger = out / fmt.LEDGER_NAME
    if ledger.exists():
        got = json.loads(ledger.read_text())
        if got.get("finished") and ("table" in got or all("sidecar_checksum" in c for c in got["chunks"][:1])):
            return out
        if got.get("finished"):  # built before sidecars carried the row-group index: the reader would
            import shutil        # fetch whole files, so rebuild for byte-range reads
            log(f"shuffle_quality: {out} predates row-group byte ranges; rebuilding it")
            shutil.rmtree(out)
    from pipelines import build_cache

    log(f"shuffle_quality: building a cache of {REAL_CORPUS_BYTES / 1e6:.0f} MB of real text -> {out}")
    build_cache.run(["--input", str(src / "shard-*.jsonl"), "--output", str(out),
                     "--tokenizer", "tiktoken:cl100k_base", "--append_eos",
                     "--chunk_bytes", str(REAL_CHUNK_BYTES), "--row_group_tokens", str(REAL_ROW_GROUP_TOKENS),
                     "--runner=FnApiRunner"])
    return out


def run(quick: bool = False, *, cache: str | None = None, plot: str | None = None, reader_check_on: bool = True,
        log=print) -> dict[str, Any]:
    """Measure the four orders; returns a flat dict of figures (see the module docstring). Full mode also
    reads one window with the real Reader (``reader_check_on``) to check the I/O simulation."""
    if quick:
        lay = synthetic_layout(shards=4, tokens=3_000_000, chunk_tokens=40_000, rg_tokens=QUICK.row_group_tokens)
        p = QUICK
    else:
        p = FULL
        root = str(cache) if cache else str(real_cache(log=log))
        lay = cache_layout(root)
        return measure(lay, p, plot=plot, check_root=root if reader_check_on else None, log=log)
    return measure(lay, p, plot=plot, log=log)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny synthetic cache (seconds)")
    ap.add_argument("--cache", help="an existing finished local cache to measure instead of building one")
    ap.add_argument("--synthetic", action="store_true",
                    help="full-size synthetic cache (lognormal document lengths) instead of real text")
    ap.add_argument("--plot", default=None, help="write the correlation plot here (PNG); `make bench` writes docs/bench_shuffle_quality.png")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    a = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if a.synthetic:
        lay = synthetic_layout(shards=8, tokens=160_000_000, chunk_tokens=500_000, rg_tokens=REAL_ROW_GROUP_TOKENS)
        res = measure(lay, FULL, plot=a.plot, log=log)
    else:
        res = run(quick=a.quick, cache=a.cache, plot=a.plot, log=log)
    text = json.dumps(res, indent=1, sort_keys=True)
    if a.json:
        Path(a.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
