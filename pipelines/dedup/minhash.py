"""MinHash signatures of documents from their tokens, and their LSH band keys: pure numpy, no I/O.

The shingles of a document are its windows of ``SHINGLE`` (5) consecutive token ids; a document of fewer
tokens has none, and is never a near duplicate (an exact copy of it is the exact job's). A shingle's hash is
``mix64(sum_j ids[i + j] * MULTIPLIERS[j])`` in uint64 arithmetic (``mix64``: splitmix64's finalizer).
Token ids are a function of the text for the cache's one tokenizer, so signatures are the same whenever and
wherever they are computed, and no worker needs a tokenizer.

The signature is a one-permutation MinHash (Li, Owen and Zhang 2012) with rotation densification
(Shrivastava and Li 2014): the shingle hashes of a document fall into ``K`` bins by their top ``log2(K)``
bits, and a bin's value is the 32 bits below those of its smallest hash. An empty bin (a document of fewer
shingles than bins) takes the value of the nearest filled bin to its right (circularly), ``t`` bins away,
hashed with ``t``. Two documents agree in a bin with probability about their Jaccard similarity, as with
``K`` independent permutations, at the cost of one hash per shingle instead of ``K`` (docs/DESIGN.md has the
measured figures against datasketch and rensa).

Bands: the signature is cut into ``BANDS`` runs of ``ROWS`` bins; a band's key is a 64-bit hash of its
values and its index. Two documents share a band key with probability ``J ** ROWS`` per band.
"""

from __future__ import annotations

import numpy as np

SHINGLE = 5
K = 256  # bins of a signature (a power of two)
ROWS = 8  # bins per band
BANDS = K // ROWS  # 32: P(candidate) = 1 - (1 - J**8)**32 is 0.997 at J = 0.8, 0.42 at 0.6, 0.002 at 0.3
LOG2_K = K.bit_length() - 1
BLOCK_TOKENS = 1 << 18

_U = np.uint64
MULTIPLIERS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
                        0x27D4EB2F165667C5], dtype=_U)
BAND_MULTIPLIERS = np.array([0xD6E8FEB86659FD93, 0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3,
                             0x589965CC75374CC3, 0x1D8E4E27C47D124F, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB],
                            dtype=_U)
DENSIFY = _U(0xFF51AFD7ED558CCD)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (in place on ``z``, which it returns)."""
    z ^= z >> _U(30)
    z *= _U(0xBF58476D1CE4E5B9)
    z ^= z >> _U(27)
    z *= _U(0x94D049BB133111EB)
    z ^= z >> _U(31)
    return z


def shingle_hashes(values: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(hashes, doc)``: the uint64 hash of every shingle of the documents whose ``lengths`` token ids are
    concatenated in ``values``, and the document (0-based, int64) each belongs to, in document order."""
    n = len(values)
    if n < SHINGLE:
        return np.zeros(0, _U), np.zeros(0, np.int64)
    v = values.astype(_U)
    m = n - SHINGLE + 1
    h = v[:m] * MULTIPLIERS[0]
    for j in range(1, SHINGLE):
        h += v[j:j + m] * MULTIPLIERS[j]
    of = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)  # each token's document
    whole = of[:m] == of[SHINGLE - 1:]  # a window is whole iff it ends in the document it starts in
    return mix64(h[whole]), of[:m][whole]


def signatures(values: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sig, has)``: the ``[docs, K]`` uint32 signatures of the documents (see the module docstring), and
    whether each document has a shingle (those without have an all-zero row and no band keys)."""
    docs = len(lengths)
    # a bin's value: the smallest of the 32 bits below the bin bits (ufunc.at: 30x faster than sorting here),
    # computed a slice of about BLOCK_TOKENS at a time (the arrays stay in the CPU's caches)
    empty_value = _U(1 << 32)
    sig = np.full(docs * K, empty_value, _U)
    ends = np.cumsum(lengths, dtype=np.int64)
    lo = 0
    while lo < docs:
        start = int(ends[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, start + BLOCK_TOKENS, side="right")))
        h, doc = shingle_hashes(values[start:int(ends[hi - 1])], lengths[lo:hi])
        np.minimum.at(sig, ((doc + lo) << LOG2_K) | (h >> _U(64 - LOG2_K)).astype(np.int64),
                      (h >> _U(64 - LOG2_K - 32)) & _U(0xFFFFFFFF))
        lo = hi
    filled = sig != empty_value
    sig = sig.astype(np.uint32)
    sig, filled = sig.reshape(docs, K), filled.reshape(docs, K)
    has = filled.any(axis=1)
    empty = ~filled & has[:, None]
    if empty.any():
        rows = np.flatnonzero(empty.any(axis=1))
        f = filled[rows]
        # the nearest filled bin at or right of each bin, circularly: a reversed running minimum over two turns
        pos = np.where(np.concatenate([f, f], axis=1), np.arange(2 * K), 4 * K)
        nxt = np.minimum.accumulate(pos[:, ::-1], axis=1)[:, ::-1][:, :K]
        dist = (nxt - np.arange(K)).astype(_U)
        donor = np.take_along_axis(sig[rows], nxt % K, axis=1).astype(_U)
        moved = mix64((donor << _U(32)) ^ (dist * DENSIFY)) >> _U(32)
        sig[rows] = np.where(f, sig[rows], moved.astype(np.uint32))
    return sig, has


def band_keys(sig: np.ndarray) -> np.ndarray:
    """``[docs, BANDS]`` uint64: each band's key (its ``ROWS`` values and its index, hashed)."""
    s = sig.reshape(len(sig), BANDS, ROWS).astype(_U)
    h = s[:, :, 0] * BAND_MULTIPLIERS[0]
    for j in range(1, ROWS):
        h += s[:, :, j] * BAND_MULTIPLIERS[j]
    h += np.arange(BANDS, dtype=_U) * _U(0x9E3779B97F4A7C15)
    return mix64(h)


def jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Estimated Jaccard similarity of signature rows ``a[i]`` and ``b[i]``: the share of equal bins (float32,
    a multiple of 1/K, so exact)."""
    return (a == b).sum(axis=1, dtype=np.int64).astype(np.float32) / np.float32(K)
