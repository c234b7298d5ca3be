"""``python -m pipelines.export``: the Beam export to Megatron (see :mod:`pipelines.export.job`)."""

import sys

from pipelines.export.job import main

sys.exit(main())
