"""The build plan: frozen values computed from the matched input files and the options, without I/O.

The launcher matches the input files (:mod:`pipelines.launcher`, the I/O), then :func:`make_plan` turns
them and the chunking configuration into a :class:`BuildPlan`: the shards in path order, and
:meth:`BuildPlan.ledger` is the plan ``ledger.json`` written before any worker starts. Workers build
:class:`WorkUnit` values and return :class:`UnitResult` values; the ledger builder
(:mod:`pipelines.ledger`) turns those into the finished ledger.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from reader import format as fmt

from .errors import BuildError

# Uncompressed / compressed bytes of jsonl text: only orders work units by size, never changes a byte.
COMPRESSION_RATIO_GUESS = 4


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """The chunking configuration: the ledger's ``config`` object, part of the resume fingerprint."""

    text_key: str
    append_eos: bool
    chunk_bytes: int
    row_group_tokens: int
    compression: str  # Parquet codec of the chunks ("none" for uncompressed)
    compression_level: int | None  # None for codecs without levels
    token_encoding: str
    piece_chars: int  # long-document splitting (pipelines/tokenizer.py)
    max_piece_chars: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class InputFile:
    """A matched input file: shard ``shard`` of the cache (its position in path order)."""

    shard: int
    path: str
    size: int  # bytes of the file as stored (compressed for .gz / .zst)
    compression: str  # "none", "gzip" or "zstd"
    chunks: int | None  # from the size if uncompressed; None until a compressed file has been read

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class WorkUnit:
    """What one worker call builds.

    Chunk ``index`` of an uncompressed shard (the lines starting in ``[lo, hi)``), or, with ``index`` None,
    every chunk of a compressed shard (streamed once from the start, cut by uncompressed offset).
    """

    shard: int
    path: str
    compression: str
    size: int  # the input file's size when planned: a file that changes is an error
    index: int | None
    lo: int
    hi: int | None
    estimate: int  # uncompressed bytes (guessed for compressed shards): larger units start first

    @property
    def streamed(self) -> bool:
        return self.index is None


@dataclasses.dataclass(frozen=True)
class UnitResult:
    """What a work unit leaves: the sidecars of its chunks and, for a compressed shard, its ``_DONE.json``."""

    shard: int
    sidecars: tuple[dict[str, Any], ...]
    done: dict[str, int] | None  # {"chunks": n, "uncompressed_bytes": U} of a streamed shard


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """Everything the job needs to know before it starts; equal plans build byte-identical caches."""

    tokenizer: dict[str, Any]  # the ledger's tokenizer identity (TokenizerSpec.identity())
    config: ChunkConfig
    inputs: tuple[InputFile, ...]

    def ledger(self) -> dict[str, Any]:
        """The plan ``ledger.json``: ``finished`` false, no chunks yet (see docs/FORMAT.md)."""
        return {
            "format": fmt.FORMAT_NAME,
            "format_version": fmt.FORMAT_VERSION,
            "finished": False,
            "tokenizer": dict(self.tokenizer),
            "config": self.config.to_json(),
            "inputs": [inp.to_json() for inp in self.inputs],
            "chunks": [],
            "totals": {},
            "bad_records": {},
        }


def make_plan(tokenizer: Mapping[str, Any], config: ChunkConfig, files: Sequence[tuple[str, int]]) -> BuildPlan:
    """The plan for ``files`` (``(path, size)`` pairs): sorted by path, the shards ``0..K-1``.

    Args:
      tokenizer: the tokenizer identity recorded in the ledger.
      config: the chunking configuration.
      files: every matched input file with its size in bytes.
    """
    inputs = []
    for shard, (path, size) in enumerate(sorted(files)):
        compression = fmt.compression_of(path)
        chunks = fmt.num_chunks(size, config.chunk_bytes) if compression == "none" else None
        inputs.append(InputFile(shard=shard, path=path, size=size, compression=compression, chunks=chunks))
    return BuildPlan(tokenizer=dict(tokenizer), config=config, inputs=tuple(inputs))


def work_units(plan: BuildPlan) -> list[WorkUnit]:
    """Work units, largest (estimated) first: one per chunk of an uncompressed shard, one per compressed shard.

    The order changes no output byte. Largest-first keeps static partitioning (the local DirectRunner
    deals units round-robin to its workers) balanced, and starts compressed shards (the longest units,
    whose chunk counts gate the order a reader can follow mid-build) early.
    """
    chunk_bytes = plan.config.chunk_bytes
    units = []
    for inp in plan.inputs:
        if inp.compression == "none":
            for k in range(inp.chunks):
                lo, hi = k * chunk_bytes, min((k + 1) * chunk_bytes, inp.size)
                units.append(WorkUnit(shard=inp.shard, path=inp.path, compression="none", size=inp.size,
                                      index=k, lo=lo, hi=hi, estimate=hi - lo))
        else:
            units.append(WorkUnit(shard=inp.shard, path=inp.path, compression=inp.compression, size=inp.size,
                                  index=None, lo=0, hi=None, estimate=inp.size * COMPRESSION_RATIO_GUESS))
    units.sort(key=lambda u: (-u.estimate, u.shard, u.index or 0))
    return units


def _differing_keys(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_resumable(plan: BuildPlan, existing: Mapping[str, Any], output: str) -> None:
    """Refuse (BuildError) unless the ``existing`` ledger in ``output`` was planned from the same build.

    Same tokenizer and chunking configuration (the fingerprint) and the same input files (paths, sizes,
    compression); operational options such as the runner or ``--max_bad_fraction`` may differ.
    """
    config = plan.config.to_json()
    if fmt.config_fingerprint(plan.tokenizer, config) != fmt.config_fingerprint(existing["tokenizer"],
                                                                                existing["config"]):
        what = [f"tokenizer.{k}" for k in _differing_keys(existing["tokenizer"], plan.tokenizer)]
        what += [f"config.{k}" for k in _differing_keys(existing["config"], config)]
        raise BuildError(
            f"{output} already holds a cache built with a different tokenizer or chunking configuration "
            f"(differs: {', '.join(what)}). Refusing to mix them: use another --output, or delete {output} to "
            "rebuild, or rerun with the original options to resume.")
    planned = [(inp.path, inp.size, inp.compression) for inp in plan.inputs]
    if [(i["path"], i["size"], i["compression"]) for i in existing["inputs"]] != planned:
        raise BuildError(
            f"{output} already holds a cache built from different input files (paths or sizes differ from "
            f"its ledger). Use another --output, or delete {output} to rebuild.")
