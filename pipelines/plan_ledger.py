"""The plan as the job's steps see it: the ledger the launcher left in the output, found by its path and checked by
its checksum (:class:`PlanRef`), never the plan itself, whose size grows with the inputs (a job graph holding it
would too). A step reads the ledger once per worker process and rebuilds the inputs from it."""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Mapping

import numpy as np

from reader.format import spec as fmt

from pipelines.errors import BuildError
from pipelines import filesystem
from pipelines.plan import JSONL, InputFile


def plan_checksum(root: str) -> str | None:
    """``"sha256:"`` of the ledger in ``root`` as it is now (what the job's steps check it against), None if none."""
    raw = filesystem.read_or_none(fmt.join(root, fmt.LEDGER_NAME))
    return None if raw is None else fmt.checksum(raw)


def read_plan(root: str, checksum: str) -> dict[str, Any]:
    """The ledger in ``root``, which must be the one the launcher wrote (its checksum): else another build
    replaced it while this one ran. Raises BuildError."""
    path = fmt.join(root, fmt.LEDGER_NAME)
    raw = filesystem.read_or_none(path)
    if raw is None or fmt.checksum(raw) != checksum:
        raise BuildError(f"{path} was replaced by another build while this one ran; its chunks may be mixed. "
                         "Delete the output and build again (one build at a time).")
    return fmt.Ledger.parse(raw, where=path).raw


def inputs_from_ledger(ledger: Mapping[str, Any]) -> tuple[InputFile, ...]:
    """The inputs of a plan (or finished) ledger, as the plan had them (columnar layouts are not in a ledger)."""
    return tuple(InputFile(shard=int(i["shard"]), path=i["path"], size=int(i["size"]), compression=i["compression"],
                           chunks=i.get("chunks"), crc32c=i.get("crc32c"), format=i.get("format", JSONL),
                           rows=i.get("rows")) for i in ledger["inputs"])


@dataclasses.dataclass(frozen=True)
class PlanRef:
    """How the job's steps find the plan: the ledger(s) the launcher left in the output, by path and checksum,
    never the plan itself (its size grows with the inputs; a job graph holding it would too). A step reads the
    ledger, checks its checksum (another build replacing it is an error) and rebuilds what it needs.

    Attributes:
      output: the build's output (the parent of a split build's caches).
      checksums: ``(cache name, "sha256:" of its ledger as the launcher left it)`` per cache of the build.
      trusted: the shards whose input is known unchanged (same Cloud Storage CRC32C), a bitmap (``np.packbits``).
      shards: the number of inputs.
    """

    output: str
    checksums: tuple[tuple[str | None, str], ...]
    trusted: bytes = b""
    shards: int = 0

    def checksum(self, name: str | None) -> str:
        return dict(self.checksums)[name]

    def trusted_shards(self) -> frozenset[int]:
        bits = np.unpackbits(np.frombuffer(self.trusted, np.uint8))[:self.shards] if self.trusted else []
        return frozenset(np.flatnonzero(bits).tolist())

    @staticmethod
    def packed(shards: Collection[int], n: int) -> bytes:
        bits = np.zeros(n, np.uint8)
        bits[list(shards)] = 1
        return np.packbits(bits).tobytes()
