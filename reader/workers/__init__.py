"""Reader worker processes (``ReadOptions(num_workers=W)``): the parent's pool and the worker's process."""
