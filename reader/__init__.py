"""chunkledger reader: deterministic sharded reads of a chunkledger cache, or of a weighted mixture of caches.

Light by design: numpy, pyarrow and fsspec only (gcsfs for gs://; jax optional in reader.jax, torch in
reader.torch).

    from reader import ReadOptions, Reader
    r = Reader("gs://bucket/cache", ReadOptions(seq_len=2048, batch_size=64), num_readers=8, reader_index=3)
    for step, batch in r.iter_batches(start=step):
        ...
"""

from reader.storage.cache import Cache, CacheNotReady
from reader.format.spec import DamagedCache, FormatError
from reader.mixture.mixture import MaxPassesReached
from reader.mixture.mixture_file import MixtureError
from reader.options import ReadOptions
from reader.reader import Reader
from reader.storage.remote import StorageError
from reader.batch.readahead import ReaderStalled
from reader.batch.schema import BATCH_KEYS, FLAT_KEYS, expand_flat
from reader.order.passes import RepeatedRowsWarning
from reader.order.streams import EmptyStream, EndOfStream, NotYetAvailable
from reader.storage.validate import ChunkError
from reader.storage.whatis import NotACache

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
    "MaxPassesReached",
    "MixtureError",
    "NotACache",
    "NotYetAvailable",
    "ReadOptions",
    "Reader",
    "ReaderStalled",
    "RepeatedRowsWarning",
    "StorageError",
    "expand_flat",
]
