"""The on-disk contract of a cache, shared with the builder: paths, schema, ledger, checksums, the chunk
writer and the tokenizer identity (and the one module that loads a tokenizer library)."""
