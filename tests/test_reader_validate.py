"""reader.validate: every problem of a chunk (file, checksum, layout, sidecar) is reported, naming it."""

import os
import shutil
import tempfile

import numpy as np
import pytest

from reader import format as fmt
from reader.cache import Cache
from reader.validate import validate_chunk

import cachegen


@pytest.fixture
def cache_dir():
    d = tempfile.mkdtemp(prefix="cl-validate-")
    rng = np.random.default_rng(5)
    chunks = cachegen.random_chunks(rng, 6, empty_prob=0.0, max_docs=8, max_len=50)
    entries = cachegen.write_synthetic_cache(d, chunks, row_group_tokens=16)
    yield d, chunks, entries
    shutil.rmtree(d, ignore_errors=True)


def _flip(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))


def test_validate_chunk_reports_every_problem(cache_dir):
    root, _, entries = cache_dir
    c = Cache(root)
    assert all(validate_chunk(c, i) == [] for i in range(len(entries)))
    _flip(os.path.join(root, entries[1]["path"]))
    os.remove(os.path.join(root, fmt.sidecar_path(0, 3)))
    assert "checksum mismatch" in " ".join(validate_chunk(c, 1))
    assert "sidecar missing" in " ".join(validate_chunk(c, 3))
