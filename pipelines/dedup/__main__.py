"""``python -m pipelines.dedup``: duplicate marks of a finished cache (see :mod:`pipelines.dedup.job`)."""

from pipelines.dedup.job import main

main()
