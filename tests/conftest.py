"""Test-wide settings.

Tests build caches from corpora of a few kilobytes and need several chunks per shard, so they lower the
builder's floor on ``--chunk_bytes`` (64 KiB for real builds; see ``pipelines/options.py``). Subprocess
builds inherit the setting.
"""

import os

os.environ.setdefault("CHUNKLEDGER_MIN_CHUNK_BYTES", "1024")
