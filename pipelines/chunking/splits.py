"""Train/validation splits at build time: which split a document goes to, where each split lives, and the
router that sends a chunk's documents to the Parquet file of their split.

With ``--validation_fraction F`` > 0 the build writes two complete caches, ``OUTPUT/train`` and
``OUTPUT/validation``, with the same chunk structure (chunk k of shard s of each is built from the same
input byte range), plus the manifest ``OUTPUT/splits.json``. A document goes to validation iff

    int.from_bytes(blake2b(utf8(text), digest_size=8, key=SPLIT_KEY, salt=seed as 16 bytes big-endian), "big")
        < floor(F * 2**64)

a keyed hash of its text alone: exact duplicates share a split, and the assignment does not depend on
the shard, offset, chunk size or the other inputs. Bad lines are not documents: their dead letters and
counts stay in the train cache only. Both chunks built from one byte range record the same input span
and checksum, so a rerun checks each cache against the input, and rebuilds a chunk in both caches when
either is damaged or its input changed. Without the option (F = 0) there is one cache, ``OUTPUT`` itself,
byte-identical to a build that never heard of splits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Mapping

import numpy as np

from reader.format import spec as fmt
from reader.format.chunk_file import ChunkParquet, row_group_table

SPLIT_KEY = b"chunkledger-split"
SPLIT_HASH = "blake2b-64"  # recorded in the manifest and each cache's config: names the rule above
MAX_SEED = (1 << 64) - 1
TRAIN, VALIDATION = fmt.SPLIT_NAMES


def split_hash(text: str, seed: int) -> int:
    """The 64-bit keyed hash of a document's text (stable across platforms and Python versions)."""
    # surrogatepass: a text with lone surrogates still hashes (it then fails tokenization as invalid_unicode)
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=SPLIT_KEY,
                        salt=seed.to_bytes(16, "big"))
    return int.from_bytes(h.digest(), "big")


@dataclasses.dataclass(frozen=True)
class SplitSpec:
    """How a split build assigns documents: ``validation_fraction`` in (0, 1) and the hash ``seed``."""

    validation_fraction: float
    seed: int = 0

    def __post_init__(self):
        f = self.validation_fraction
        if not (isinstance(f, float) and math.isfinite(f) and 0.0 < f < 1.0):
            raise ValueError(f"validation_fraction must be a float in (0, 1), got {f!r}")
        if not (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"split seed must be an integer in [0, 2**64), got {self.seed!r}")

    @property
    def threshold(self) -> int:
        """Hashes below this go to validation (exact: F times a power of two is exact in binary floating point)."""
        return int(self.validation_fraction * float(1 << 64))

    def is_validation(self, text: str) -> bool:
        return split_hash(text, self.seed) < self.threshold

    def identity(self, name: str) -> dict[str, Any]:
        """The ``config.split`` of cache ``name``: part of its configuration fingerprint (resume refuses a change)."""
        return {"name": name, "validation_fraction": self.validation_fraction, "seed": self.seed,
                "hash": SPLIT_HASH}

    def manifest(self) -> dict[str, Any]:
        """``OUTPUT/splits.json``: written once when the build is planned, never changed."""
        return {"format": fmt.SPLITS_FORMAT_NAME, "format_version": fmt.SPLITS_FORMAT_VERSION,
                "splits": list(fmt.SPLIT_NAMES), "dead_letters": TRAIN,
                "validation_fraction": self.validation_fraction, "seed": self.seed, "hash": SPLIT_HASH}


def cache_names(spec: SplitSpec | None) -> tuple[str | None, ...]:
    """The caches a build writes: ``(None,)`` (OUTPUT itself) or ``("train", "validation")``."""
    return (None,) if spec is None else fmt.SPLIT_NAMES


def cache_root(output: str, name: str | None) -> str:
    """The root of cache ``name`` of a build into ``output`` (``output`` itself for a plain build)."""
    return output if name is None else fmt.join(output, name)


def cache_roots(output: str, spec: SplitSpec | None) -> tuple[str, ...]:
    """Every cache root of the build; the first holds the dead letters."""
    return tuple(cache_root(output, n) for n in cache_names(spec))


class _Part:
    """One cache's share of a chunk: documents in file order, cut into row groups, then one Parquet file."""

    def __init__(self, config: Mapping[str, Any], shard: int, eos_id: int | None, row_group_tokens: int):
        self.shard, self.eos_id, self.row_group_tokens = shard, eos_id, row_group_tokens
        self.keep_fields = tuple(config.get("keep_fields") or ())
        self.extra = 1 if eos_id is not None else 0
        self.arrays: list[np.ndarray] = []
        self.offsets: list[int] = []
        self.fields: list[tuple] = []  # each document's kept fields, in config.keep_fields order
        self.spans: list[np.ndarray] | None = [] if fmt.is_masked(config) else None  # each one's loss_spans
        self.tokens = 0
        self.parquet = ChunkParquet(config)

    def add(self, array: np.ndarray, offset: int, fields: tuple = (), spans: np.ndarray | None = None) -> None:
        self.arrays.append(array)
        self.offsets.append(offset)
        self.fields.append(fields)
        if self.spans is not None:
            self.spans.append(spans)
        self.tokens += len(array) + self.extra
        if self.tokens >= self.row_group_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.arrays:
            return
        kept = {name: [f[i] for f in self.fields] for i, name in enumerate(self.keep_fields)} or None
        self.parquet.write(row_group_table(self.arrays, self.shard, self.offsets, self.eos_id, fields=kept,
                                           loss_spans=self.spans),
                           self.tokens)
        self.arrays, self.offsets, self.fields, self.tokens = [], [], [], 0
        if self.spans is not None:
            self.spans = []


class SplitRouter:
    """A chunk's tokenized documents -> one Parquet writer per cache of the build.

    Without splits there is one writer (the chunk of the cache); with splits, train and validation, and
    :meth:`route` picks a document's writer from its text. Each writer cuts its own row groups.

    Args:
      config: the ledger's chunking configuration (``row_group_tokens``, compression).
      shard: the chunk's input shard (the ``shard`` column).
      eos_id: appended to every document when not None.
      spec: the split, or None for a plain build.
    """

    def __init__(self, config: Mapping[str, Any], shard: int, eos_id: int | None, spec: SplitSpec | None):
        self.spec = spec
        self.names = cache_names(spec)
        rgt = int(config["row_group_tokens"])
        self.parts = [_Part(config, shard, eos_id, rgt) for _ in self.names]

    def route(self, text: str) -> int:
        """Index of the cache (in :func:`cache_names` order) that the document ``text`` belongs to (a supervised
        record's canonical form, pipelines/chunking/supervised.py)."""
        return 0 if self.spec is None else int(self.spec.is_validation(text))

    def add(self, part: int, array: np.ndarray, offset: int, fields: tuple = (),
            spans: np.ndarray | None = None) -> None:
        self.parts[part].add(array, offset, fields, spans)

    def finish(self) -> list[ChunkParquet]:
        """Flush the last row groups; the Parquet writers, one per cache, ready for ``finish()``."""
        for p in self.parts:
            p.flush()
        return [p.parquet for p in self.parts]
