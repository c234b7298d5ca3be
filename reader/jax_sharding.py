"""Where a global batch lives on a JAX mesh, and the flat layout's expansion in jax.numpy.

Part of the optional ``jax`` extra, with :mod:`reader.jax` (the loader), which re-exports these.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


# --------------------------------------------------------------------------------------------------
# Which rows live where


def batch_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes a partition spec splits the batch axis (its first entry) over."""
    if len(spec) == 0 or spec[0] is None:
        return ()
    first = spec[0]
    return tuple(first) if isinstance(first, (tuple, list)) else (first,)


def batch_shardings(mesh: Mesh, spec: PartitionSpec | None = None) -> tuple[NamedSharding, NamedSharding]:
    """``(token_sharding, row_sharding)`` for ``[B, L]`` and ``[B]`` arrays.

    ``spec`` partitions ``[B, L]``; its first entry (one mesh axis name, a tuple of names, or None) is the
    batch axis. Default: the batch axis spans every mesh axis (pure data parallelism), ``L`` unsharded.
    Per-row arrays (``valid``, ``epochs``, ``example_ids``) use the same batch partitioning.
    """
    if spec is None:
        spec = PartitionSpec(tuple(mesh.axis_names), None)
    if not isinstance(spec, PartitionSpec):
        spec = PartitionSpec(*spec)
    if len(spec) > 2:
        raise ValueError(f"spec {spec} has {len(spec)} entries; a batch is [batch, seq_len] (2 at most)")
    for name in batch_axes(spec) + ((spec[1],) if len(spec) > 1 and isinstance(spec[1], str) else ()):
        if name not in mesh.axis_names:
            raise ValueError(f"spec {spec} names mesh axis {name!r}; the mesh has axes {mesh.axis_names}")
    token_spec = PartitionSpec(spec[0] if len(spec) else None, spec[1] if len(spec) > 1 else None)
    row_spec = PartitionSpec(token_spec[0])
    return NamedSharding(mesh, token_spec), NamedSharding(mesh, row_spec)


def slice_rows(index, batch_size: int) -> np.ndarray:
    """The global rows of a device's index (a tuple of slices) into a ``[B, ...]`` array."""
    return np.arange(batch_size, dtype=np.int64)[index[0]]


def device_rows(sharding: jax.sharding.Sharding, batch_size: int, seq_len: int) -> dict:
    """``{device: global rows}`` for every device of this process that holds part of a ``[B, L]`` batch."""
    imap = sharding.addressable_devices_indices_map((batch_size, seq_len))
    return {d: slice_rows(idx, batch_size) for d, idx in imap.items()}


def process_rows(sharding: jax.sharding.Sharding, batch_size: int, seq_len: int) -> np.ndarray:
    """Sorted, unique global rows of a ``[B, L]`` batch that this process's devices hold.

    The only rows this process reads. Rows replicated over several local devices appear once.
    """
    per = device_rows(sharding, batch_size, seq_len)
    if not per:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate(list(per.values())))


# --------------------------------------------------------------------------------------------------
# layout="flat" on the devices

def expand_flat(batch: Mapping[str, Any]) -> dict[str, jax.Array]:
    """``reader.expand_flat`` in jax.numpy (jit-able): the five ``[B, L]`` token fields of a
    ``layout="flat"`` batch (``tokens`` uint32 ``[B, L+1]``, ``first_positions``, ``num_tokens``)."""
    import jax.numpy as jnp

    tok = jnp.asarray(batch["tokens"]).astype(jnp.uint32)
    L = tok.shape[1] - 1
    start = (tok[:, 1:] & 1).astype(bool)
    t = jnp.arange(L, dtype=jnp.int32)[None, :]
    real = t < jnp.asarray(batch["num_tokens"]).astype(jnp.int32)[:, None]
    targets = (tok[:, 1:] >> 1).astype(jnp.int32)
    inputs = jnp.where(start, 0, (tok[:, :-1] >> 1).astype(jnp.int32))
    segment_ids = jnp.cumsum(start.astype(jnp.int32), axis=1) + (~start[:, :1]).astype(jnp.int32)
    last = jax.lax.cummax(jnp.where(start, t, -1), axis=1)
    first = jnp.asarray(batch["first_positions"]).astype(jnp.int32)[:, None]
    positions = jnp.where(last >= 0, t - last, first + t)
    zero = jnp.zeros_like(targets)
    return {"inputs": jnp.where(real, inputs, zero), "targets": jnp.where(real, targets, zero),
            "segment_ids": jnp.where(real, segment_ids, zero), "positions": jnp.where(real, positions, zero),
            "loss_mask": real}
