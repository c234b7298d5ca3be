"""chunkledger reader: deterministic sharded reads of a chunkledger cache.

Light by design: numpy, pyarrow and fsspec only (gcsfs for gs://, jax optional in reader.jax).
"""
