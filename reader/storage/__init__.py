"""Reading a cache's files: opening a ledger (finished or running), range reads of row groups verified and
decoded into an LRU, validation, the derived index files, atomic writes."""
