"""Keyed bijections of ``[0, n)`` for the shuffle: uint64 hashing, a Feistel network and a stratified scramble.

Vectorized over numpy uint64 with wrapping arithmetic, so every platform computes the same values (the
shuffle's definition, docs/FORMAT.md "Shuffle", depends on them bit for bit). Each function takes
``x``, ``n`` and ``key`` broadcast together: one call permutes many indices of many domains.
"""

from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
FEISTEL_ROUNDS = 6


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _u64(x) -> np.ndarray:
    """int64 / Python int -> uint64 (two's complement, mod 2**64)."""
    if isinstance(x, (int, np.integer)):
        return np.array([int(x) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    return np.asarray(x, dtype=np.int64).astype(np.uint64)


def hash_key(*parts) -> np.ndarray:
    """Hash a tuple of ints / int arrays into uint64 keys (broadcasting)."""
    with np.errstate(over="ignore"):
        h = np.zeros(1, dtype=np.uint64)
        for p in parts:
            h = mix64(h * GOLDEN + _u64(p) + np.uint64(0x632BE59BD9B4E019))
    return h


def _ceil_log2(n: np.ndarray) -> np.ndarray:
    """Smallest ``k`` with ``2**k >= n`` for uint64 arrays of n >= 1."""
    v = n - np.uint64(1)
    k = np.zeros(v.shape, dtype=np.uint64)
    for s in (32, 16, 8, 4, 2, 1):
        big = v >= (np.uint64(1) << np.uint64(s))
        k = k + np.where(big, np.uint64(s), np.uint64(0))
        v = np.where(big, v >> np.uint64(s), v)
    return k + (v > 0).astype(np.uint64)


def _flat_domain(x, n, key, what: str):
    """Broadcast ``x`` (int64), ``n`` (int64) and ``key`` (uint64) and flatten them; check ``0 <= x < n``."""
    x, n, key = np.broadcast_arrays(np.asarray(x, np.int64), np.asarray(n, np.int64),
                                    np.asarray(key, np.uint64))
    shape = x.shape
    x, n, key = x.reshape(-1), n.reshape(-1), key.reshape(-1)
    if x.size and ((x < 0).any() or (x >= n).any()):
        raise ValueError(f"{what}: input outside [0, n)")
    return shape, x, n, key


def feistel(x, n, key, *, inverse: bool = False) -> np.ndarray:
    """A keyed bijection of ``[0, n)`` per element (``x``, ``n``, ``key`` broadcast; int64 out).

    Balanced Feistel network on ``2h`` bits (``4**h >= n``, so the domain is less than ``4n``) with
    cycle-walking back into ``[0, n)``. ``inverse=True`` gives the inverse permutation.
    """
    shape, x, n, key = _flat_domain(x, n, key, "feistel")
    if x.size == 0:
        return np.zeros(shape, dtype=np.int64)
    n_u = n.astype(np.uint64)
    h = np.maximum((_ceil_log2(n_u) + np.uint64(1)) >> np.uint64(1), np.uint64(1))
    mask = (np.uint64(1) << h) - np.uint64(1)
    with np.errstate(over="ignore"):
        rkeys = np.stack([mix64(key ^ (GOLDEN * np.uint64(r + 1))) for r in range(FEISTEL_ROUNDS)])
        y = x.astype(np.uint64)
        idx = np.arange(y.size)
        while idx.size:
            yy, hh, mm, rk = y[idx], h[idx], mask[idx], rkeys[:, idx]
            left, right = yy >> hh, yy & mm
            if inverse:  # undo (L, R) -> (R, L ^ F(R)) round by round
                for r in range(FEISTEL_ROUNDS - 1, -1, -1):
                    left, right = right ^ (mix64(left + rk[r]) & mm), left
            else:
                for r in range(FEISTEL_ROUNDS):
                    left, right = right, left ^ (mix64(right + rk[r]) & mm)
            y[idx] = (left << hh) | right
            idx = idx[y[idx] >= n_u[idx]]  # cycle-walk the ones that left [0, n)
    return y.astype(np.int64).reshape(shape)


def spread(x, n, key, *, inverse: bool = False) -> np.ndarray:
    """A keyed *stratified* bijection of ``[0, n)`` per element: ranks ``x`` in any aligned run of
    ``2**j`` consecutive values land in distinct strata of ``2**(m-j)`` positions (``2**m >= n``), so
    consecutive ranks are spread far apart, at random.

    It is a nested-uniform (Owen) scramble of the ``m``-bit reversal of ``x``: bit ``i`` of the output
    is bit ``i`` of ``reverse(x)`` XOR a keyed hash of the bits above ``i``; values ``>= n`` are
    cycle-walked back into ``[0, n)``. Vectorized; ``inverse=True`` gives the inverse permutation.
    """
    shape, x, n, key = _flat_domain(x, n, key, "spread")
    if x.size == 0:
        return np.zeros(shape, dtype=np.int64)
    n_u = n.astype(np.uint64)
    m = _ceil_log2(n_u)
    top = int(m.max())
    one = np.uint64(1)

    def flips(prefix_src, i, kk):  # keyed bit from the bits of prefix_src above i
        prefix = mix64((prefix_src >> np.uint64(i + 1)) + np.uint64(i))
        return mix64(kk ^ (GOLDEN * np.uint64(i + 1)) ^ prefix) & one

    def rev(v, mm):
        r = np.zeros_like(v)
        for i in range(top):
            act = np.uint64(i) < mm
            bit = (v >> np.uint64(i)) & one
            r = np.where(act, r | (bit << np.where(act, mm - np.uint64(i + 1), np.uint64(0))), r)
        return r

    def fwd(v, mm, kk):
        r = rev(v, mm)
        out = r.copy()
        for i in range(top):
            act = np.uint64(i) < mm
            out = np.where(act, out ^ (flips(r, i, kk) << np.uint64(i)), out)
        return out

    def inv(y, mm, kk):
        r = np.zeros_like(y)
        for i in range(top - 1, -1, -1):
            act = np.uint64(i) < mm
            bit = ((y >> np.uint64(i)) & one) ^ flips(r, i, kk)
            r = np.where(act, r | (bit << np.uint64(i)), r)
        return rev(r, mm)

    with np.errstate(over="ignore"):
        y = x.astype(np.uint64)
        idx = np.arange(y.size)
        while idx.size:
            step = inv if inverse else fwd
            y[idx] = step(y[idx], m[idx], key[idx])
            idx = idx[y[idx] >= n_u[idx]]  # cycle-walk the ones that left [0, n)
    return y.astype(np.int64).reshape(shape)
