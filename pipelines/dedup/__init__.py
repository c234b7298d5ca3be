"""Duplicate marks over a finished cache (``python -m pipelines.dedup``), written as attribute sets."""
