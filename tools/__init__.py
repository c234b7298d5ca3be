"""Developer tools, run from the repository root: ``python -m tools.<name> --help``.

``make_sample_corpus`` regenerates pipelines/sample_corpus/; ``measure_encodings`` and ``profile_builder``
measure the chunk format and the builder's hot path (the figures are in docs/DESIGN.md).
"""
