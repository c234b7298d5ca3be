"""Test-wide settings.

Tests build caches from corpora of a few kilobytes and need several chunks per shard, so they lower the
builder's floor on ``--chunk_bytes`` (64 KiB for real builds; see ``pipelines/options.py``). Subprocess
builds inherit the setting.

Resolved ``tokenizer.json`` files are remembered in a directory of this test session only (never the user's
``~/.cache``), so no result from outside the session can stand in for a resolution a test expects to run.
"""

import atexit
import os
import shutil
import sys
import tempfile

# Test helpers (cache generators, the GCS emulator, build helpers) live in tests/support/; tests in any
# folder import them by their module names.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

os.environ.setdefault("CHUNKLEDGER_MIN_CHUNK_BYTES", "1024")
_CACHE_DIR = tempfile.mkdtemp(prefix="chunkledger-test-cache-")
os.environ["CHUNKLEDGER_CACHE_DIR"] = _CACHE_DIR
atexit.register(shutil.rmtree, _CACHE_DIR, True)
