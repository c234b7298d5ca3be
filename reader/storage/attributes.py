"""Opening an attribute set of a finished cache (``reader/format/attributes.py`` defines the files): its
manifest checked against the cache's ledger, and each chunk's columns read and verified."""

from __future__ import annotations

import numpy as np

from reader.format import attributes as attrs
from reader.format import spec as fmt
from reader.storage.cache import Cache


class AttributeSet:
    """The attribute set ``name`` of ``cache`` (finished). Raises ``FileNotFoundError`` naming the manifest
    when the set is absent or unfinished (its manifest is written last), ``DamagedCache`` when it does not
    match the cache.

    Attributes:
      manifest: the parsed :class:`reader.format.attributes.Manifest` (per-chunk counts, params).
    """

    def __init__(self, cache: Cache, name: str):
        if not cache.complete:
            raise fmt.FormatError(f"{cache.display(fmt.LEDGER_NAME)}: the build has not finished; attribute sets "
                                  "belong to finished caches")
        self.cache, self.name = cache, attrs.check_name(name)
        rel = attrs.manifest_path(name)
        try:
            text = cache.cat(rel)
        except FileNotFoundError:
            raise FileNotFoundError(f"{cache.display(rel)}: no attribute set {name!r} in this cache (or its job has "
                                    "not finished); compute it with python -m pipelines.dedup") from None
        self.manifest = attrs.Manifest.parse(text, where=cache.display(rel))
        self.manifest.check_cache(cache.table, where=cache.display(rel))

    def path(self, c: int) -> str:
        """The attribute file of global chunk ``c``, relative to the cache root."""
        t = self.cache.table
        return attrs.file_path(self.name, int(t.shard[c]), int(t.index_in_shard[c]))

    def chunk(self, c: int) -> dict[str, np.ndarray]:
        """The verified columns of global chunk ``c`` (one value per document, in the chunk's order)."""
        rel = self.path(c)
        try:
            data = self.cache.cat(rel)
        except FileNotFoundError:
            raise fmt.DamagedCache(f"{self.cache.display(rel)}: missing (listed in {attrs.MANIFEST_NAME}); compute "
                                   "the set again") from None
        return attrs.read_chunk(data, self.manifest, self.cache.table, c, where=self.cache.display(rel))
