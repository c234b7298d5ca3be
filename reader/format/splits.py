"""Train/validation splits (a split build, ``--validation_fraction``): which split a document goes to, where
each split's cache lives, and the manifest that names them. The format's rule: the builder routes documents
by it (``pipelines/chunking/split_router.py``), and ``docs/FORMAT.md`` ("Split builds") gives it in prose.

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
from typing import Any

from reader.format import spec as fmt

# ``OUTPUT/splits.json`` names the two caches, each a complete cache in its own directory. The manifest has
# its own format version.
SPLITS_MANIFEST_NAME = "splits.json"
SPLITS_FORMAT_NAME = "chunkledger-splits"
SPLITS_FORMAT_VERSION = 1
SPLIT_NAMES = ("train", "validation")
SPLIT_KEY = b"chunkledger-split"
SPLIT_HASH = "blake2b-64"  # recorded in the manifest and each cache's config: names the rule above
MAX_SEED = (1 << 64) - 1
TRAIN, VALIDATION = SPLIT_NAMES


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
        return {"format": SPLITS_FORMAT_NAME, "format_version": SPLITS_FORMAT_VERSION,
                "splits": list(SPLIT_NAMES), "dead_letters": TRAIN,
                "validation_fraction": self.validation_fraction, "seed": self.seed, "hash": SPLIT_HASH}


def cache_names(spec: SplitSpec | None) -> tuple[str | None, ...]:
    """The caches a build writes: ``(None,)`` (OUTPUT itself) or ``("train", "validation")``."""
    return (None,) if spec is None else SPLIT_NAMES


def cache_root(output: str, name: str | None) -> str:
    """The root of cache ``name`` of a build into ``output`` (``output`` itself for a plain build)."""
    return output if name is None else fmt.join(output, name)


def cache_roots(output: str, spec: SplitSpec | None) -> tuple[str, ...]:
    """Every cache root of the build; the first holds the dead letters."""
    return tuple(cache_root(output, n) for n in cache_names(spec))
