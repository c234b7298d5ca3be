"""Reader batches as torch tensors, and ``expand_flat`` in torch ops (for :mod:`reader.torch`).

Tensors share the reader's memory (``torch.from_numpy``). The ``uint32`` ``tokens`` of ``layout="flat"``
become an ``int32`` view of the same bits (torch has few uint32 kernels); :func:`expand_flat` reads the
bits, so it is exact for every value.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from .schema import FLAT_FIELDS

__all__ = ["OneBuffer", "as_tensors", "expand_flat", "from_buffer"]


def as_tensors(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A reader batch (numpy arrays) as CPU tensors sharing its memory.

    Dtypes are kept, except ``uint32`` (the ``tokens`` of ``layout="flat"``), which becomes an ``int32``
    view of the same bits (see :func:`expand_flat`). A read-only array is copied (torch tensors are
    writable).
    """
    out = {}
    for k, v in batch.items():
        a = np.asarray(v)
        if a.dtype == np.uint32:
            a = a.view(np.int32)
        if not a.flags.writeable:
            a = a.copy()
        out[k] = torch.from_numpy(a)
    return out


class OneBuffer(dict):
    """An item made in a DataLoader worker. It pickles (on its way to the training process) as ONE
    buffer with every tensor a view of it: torch sends each tensor through its own shared-memory segment
    and file descriptor, a fixed cost per tensor that exceeds copying a batch. The training process gets
    a plain dict."""

    def __copy__(self):  # the worker's default_convert copies the item: keep the type
        return OneBuffer(self)

    def __reduce__(self):
        layout, extra, size = [], {}, 0
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                n = v.numel() * v.element_size()
                layout.append((k, v.dtype, tuple(v.shape), size, n))
                size += -(-n // 64) * 64  # aligned for every dtype's view
            else:
                extra[k] = v
        buf = torch.empty(size, dtype=torch.uint8)
        for k, dtype, shape, off, n in layout:
            buf[off:off + n].view(dtype).view(shape).copy_(self[k])
        return from_buffer, (buf, layout, extra)


def from_buffer(buf: torch.Tensor, layout: list, extra: dict) -> dict[str, Any]:
    out: dict[str, Any] = {k: buf[off:off + n].view(dtype).view(shape) for k, dtype, shape, off, n in layout}
    out.update(extra)
    return out


def bits32(x) -> torch.Tensor:
    """flat-tokens values (uint32 numpy, torch uint32/int32 bits, or int64 values) as int32 bits."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x).view(np.int32) if x.dtype == np.uint32 else x)
    x = torch.as_tensor(x)
    if x.dtype == torch.int32:
        return x
    if x.dtype == torch.uint32:
        return x.view(torch.int32)
    if x.dtype in (torch.int64, torch.uint64):
        x = x.to(torch.int64) & 0xFFFFFFFF
        return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)
    raise TypeError(f"tokens must hold flat-tokens values (uint32, or int32 bits, or int64), got {x.dtype}")


def expand_flat(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``reader.expand_flat`` in torch ops: the ``layout="arrays"`` fields of a ``layout="flat"`` batch.

    Args:
      batch: ``tokens`` ``[B, L+1]`` (int32 bits as :class:`TokenBatches` yields them, uint32, or int64
        values; numpy or torch, any device), ``first_positions`` and ``num_tokens`` ``[B]``.

    Returns ``inputs``, ``targets``, ``segment_ids``, ``positions`` (int32 ``[B, L]``) and ``loss_mask``
    (bool ``[B, L]``) on the device of ``tokens``, equal to ``reader.expand_flat`` of the same rows;
    every other key of ``batch`` (``example_ids``, ``epochs``, ``valid``, ``step``) is passed through.
    Move the flat batch to the GPU first and expand it there: a quarter of the bytes cross the bus.
    """
    tok = bits32(batch["tokens"])
    if tok.dim() != 2 or tok.shape[1] < 2:
        raise ValueError(f"tokens must be [B, L+1] with L >= 1, got shape {tuple(tok.shape)}")
    dev, L = tok.device, tok.shape[1] - 1
    body = tok[:, 1:]
    start = (body & 1).bool()
    t = torch.arange(L, dtype=torch.int32, device=dev)
    num = torch.as_tensor(batch["num_tokens"], device=dev).to(torch.int32)
    real = t[None, :] < num[:, None]
    targets = (body >> 1) & 0x7FFFFFFF  # a logical shift of the uint32 bits
    inputs = torch.where(start, 0, (tok[:, :-1] >> 1) & 0x7FFFFFFF)
    segment_ids = torch.cumsum(start, dim=1, dtype=torch.int32) + (~start[:, :1]).to(torch.int32)
    last = torch.cummax(torch.where(start, t, -1), dim=1).values  # the latest document start so far
    first = torch.as_tensor(batch["first_positions"], device=dev).to(torch.int32)[:, None]
    positions = torch.where(last >= 0, t - last, first + t)
    out: dict[str, Any] = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
                           for k, v in batch.items() if k not in FLAT_FIELDS}
    out.update({k: torch.where(real, v, 0) for k, v in (("inputs", inputs), ("targets", targets),
                                                        ("segment_ids", segment_ids), ("positions", positions))})
    out["loss_mask"] = real
    return out
