"""Shared by the in-process and multi-process reader.jax tests: a row-counting reader proxy, the toy
jit-ed step, spec (de)serialization and checksums."""

from __future__ import annotations

import hashlib
import os
import threading

import numpy as np


def force_cpu_devices(count: int = 8) -> None:
    """Run jax on the CPU with ``count`` virtual devices (unless XLA_FLAGS already sets a count): call it
    before the first ``import jax``."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={count}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


class CountingReader:
    """Wraps a reader.Reader and records every ``rows(b, rows)`` call (rows as a list)."""

    def __init__(self, reader):
        self.reader = reader
        self.options = reader.options
        self.calls: list[tuple[int, list[int]]] = []
        self.hints: list[tuple[int, list[int]]] = []
        self._lock = threading.Lock()

    @property
    def num_batches(self):
        return self.reader.num_batches

    def rows(self, b, rows):
        with self._lock:
            self.calls.append((int(b), [int(r) for r in rows]))
        return self.reader.rows(b, rows)

    # read-ahead hints (Reader.prefetch): recorded separately, they load only the rows they are given
    def lookahead_batches(self):
        return self.reader.lookahead_batches()

    def prefetch(self, b, rows):
        with self._lock:
            self.hints.append((int(b), [int(r) for r in rows]))
        return self.reader.prefetch(b, rows)


def spec_from_json(items):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*[tuple(x) if isinstance(x, list) else x for x in items])


def sha(a) -> str:
    a = np.ascontiguousarray(np.asarray(a))
    return hashlib.sha256(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes()).hexdigest()[:16]


def index_to_json(index) -> list:
    return [[s.start, s.stop] for s in index]


def index_from_json(items) -> tuple:
    return tuple(slice(lo, hi) for lo, hi in items)


def make_toy_step(seq_len: int):
    """A jit-ed toy "training step": per row, the sum of target token ids of each segment (loss-masked),
    plus a scalar that depends on the carried state, so results chain from step to step."""
    import jax
    import jax.numpy as jnp

    num_segments = seq_len + 1

    @jax.jit
    def step(state, batch):
        tok = jnp.where(batch["loss_mask"], batch["targets"], 0).astype(jnp.int32)
        onehot = batch["segment_ids"][:, :, None] == jnp.arange(num_segments, dtype=jnp.int32)
        per_segment = jnp.sum(jnp.where(onehot, tok[:, :, None], 0), axis=1)  # [B, S]
        valid_rows = jnp.sum(batch["valid"].astype(jnp.int32))
        new_state = (state * 31 + jnp.sum(per_segment) + valid_rows) % 1000003
        return new_state, per_segment

    return step


def toy_reference(batches, seq_len: int):
    """numpy twin of :func:`make_toy_step`: [(state, sha(per_segment))] for consecutive batches from state 0."""
    state, out = 0, []
    for bt in batches:
        tok = np.where(bt["loss_mask"], bt["targets"], 0).astype(np.int64)
        seg = bt["segment_ids"]
        per_segment = np.zeros((tok.shape[0], seq_len + 1), np.int64)
        for s in range(seq_len + 1):
            per_segment[:, s] = np.where(seg == s, tok, 0).sum(axis=1)
        state = (state * 31 + int(per_segment.sum()) + int(bt["valid"].sum())) % 1000003
        out.append((state, sha(per_segment.astype(np.int32))))
    return out


def expected_device_rows(mesh_shape, axis_names, spec, batch_size) -> list[list[int]]:
    """Rows of a [B, L] batch held by each device of a mesh (devices in row-major mesh order), derived
    independently of jax: a device's batch shard index is the mixed-radix number of its coordinates
    along the batch axes of ``spec`` (first axis most significant); shard i holds rows [i*B/n, (i+1)*B/n)."""
    spec = list(spec)
    first = spec[0] if spec else None
    batch_axes = [] if first is None else ([first] if isinstance(first, str) else list(first))
    n_shards = int(np.prod([mesh_shape[list(axis_names).index(a)] for a in batch_axes])) if batch_axes else 1
    per = batch_size // n_shards
    out = []
    for coords in np.ndindex(*mesh_shape):
        shard = 0
        for a in batch_axes:
            i = list(axis_names).index(a)
            shard = shard * mesh_shape[i] + coords[i]
        out.append(list(range(shard * per, (shard + 1) * per)))
    return out
