"""Hypothesis strategies for synthetic caches (shared by the reader's property tests)."""

import math

import numpy as np
from hypothesis import strategies as st

from cachegen import Reference, SpansReference, best_fit_caps, best_fit_chunk
from reader.order.packing import WINDOW_TOKENS

# what an example is (ReadOptions.packing); "best_fit_capped": best fit with several continuation pieces per row
# and a cap on pieces per row
KINDS = ("concat", "best_fit", "unpacked", "best_fit_capped")
RULES = ("streams", "spans")  # ReadOptions.pass_rule
WINDOW = 16  # best fit's window target in these tests: the chunks drawn below have one to several windows
CAPS = {"best_fit_continuations": 3, "max_segments": 4}  # "best_fit_capped"


def kind_options(kind):
    """``ReadOptions`` keywords of an example kind."""
    if kind.startswith("best_fit"):
        return {"packed": True, "packing": "best_fit", "best_fit_window_tokens": WINDOW,
                **(CAPS if kind == "best_fit_capped" else {})}
    return {"packed": kind != "unpacked", "packing": kind}


def units_per_chunk(chunks, packed, L, packing="concat", best_fit_window_tokens=WINDOW_TOKENS, row_group_tokens=64,
                    best_fit_continuations=None, max_segments=None):
    """Stream units per chunk: tokens (packed), best-fit rows or unpacked examples."""
    if packed and packing == "best_fit":
        caps = best_fit_caps(best_fit_continuations, max_segments)
        return [len(best_fit_chunk(c, L, row_group_tokens, best_fit_window_tokens, **caps)) for c in chunks]
    return [sum(len(d) for d in c) if packed else sum(math.ceil(len(d) / L) for d in c) for c in chunks]


@st.composite
def caches(draw, max_chunks=10):
    """Chunks with uneven sizes, empty chunks, 1-token and huge documents; every token id is unique so
    tests can tell documents apart. Returns (chunks, chunks_per_shard)."""
    n = draw(st.integers(1, max_chunks))
    next_id = [1]
    chunks = []
    for _ in range(n):
        lengths = draw(st.lists(st.one_of(st.integers(1, 9), st.integers(1, 1), st.integers(30, 90)),
                                max_size=5))
        docs = []
        for length in lengths:
            docs.append(np.arange(next_id[0], next_id[0] + length, dtype=np.int32))
            next_id[0] += length
        chunks.append(docs)
    shards = draw(st.integers(1, min(3, n)))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=shards - 1, max_size=shards - 1)))
    cps = np.diff([0] + cuts + [n]).tolist()
    return chunks, cps


def has_empty_stream(chunks, r_star, packed, L, packing="concat", **kw):
    units = units_per_chunk(chunks, packed, L, packing, **kw)
    n = len(chunks)
    g = math.gcd(n, r_star)
    return any(sum(units[c] for c in range(n) if c % g == s % g) == 0 for s in range(r_star))


def has_no_pass(rule, chunks, r_star, packed, L, packing="concat", **kw):
    """What a read of ``rule`` cannot serve: ``"streams"``, a stream that never yields anything
    (:func:`has_empty_stream`); ``"spans"``, no row at all (``EmptyStream`` both)."""
    if rule == "streams":
        return has_empty_stream(chunks, r_star, packed, L, packing, **kw)
    units = sum(units_per_chunk(chunks, packed, L, packing, **kw))
    return (units // L if packed and packing == "concat" else units) == 0


def reference(rule, chunks, L, r_star, *, shuffle=None, **kw):
    """The naive reference of a read of ``rule`` (``shuffle``: spans only; the streams reference is
    unshuffled)."""
    if rule == "spans":
        return SpansReference(chunks, L, r_star, shuffle=shuffle, **kw)
    assert shuffle is None
    return Reference(chunks, L, r_star, **kw)
