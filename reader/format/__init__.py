"""The on-disk contract of a cache, shared with the builder: paths, schema, ledger, checksums, the chunk
writer and the tokenizer identity a ledger records."""
