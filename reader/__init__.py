"""chunkledger reader: deterministic sharded reads of a chunkledger cache, or of a weighted mixture of caches.

Light by design: numpy, pyarrow and fsspec only (gcsfs for gs://; jax optional in reader.jax, torch in
reader.torch).

    from reader import ReadOptions, Reader
    r = Reader("gs://bucket/cache", ReadOptions(seq_len=2048, batch_size=64), num_readers=8, reader_index=3)
    for step, batch in r.iter_batches(start=step):
        ...
"""

from .cache import Cache, CacheNotReady
from .format import DamagedCache, FormatError
from .mixture_file import MixtureError
from .options import ReadOptions
from .reader import Reader
from .remote import StorageError
from .schema import BATCH_KEYS, FLAT_KEYS, expand_flat
from .streams import EmptyStream, EndOfStream, NotYetAvailable
from .validate import ChunkError
from .whatis import NotACache

__all__ = [
    "BATCH_KEYS",
    "FLAT_KEYS",
    "Cache",
    "CacheNotReady",
    "ChunkError",
    "DamagedCache",
    "EmptyStream",
    "EndOfStream",
    "FormatError",
    "MixtureError",
    "NotACache",
    "NotYetAvailable",
    "ReadOptions",
    "Reader",
    "StorageError",
    "expand_flat",
]
