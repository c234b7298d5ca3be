"""A cache built, and its batches read, by the tree before the subpackages (commit b081004), committed as a
fixture: today's reader serves exactly the same batches from it (every key, dtype and value), for packed,
shuffled flat, unpacked and eval reads, and for one host of two. tests/fixtures/cache_before_layout/: the
cache (the sample corpus, ``--chunk_bytes 32KiB --row_group_tokens 4096``, 16 chunks), ``cases.json`` (the
read options and batches) and ``batches.npz`` (what the old reader returned)."""

import json
import os
import shutil

import numpy as np
import pytest

from reader import Reader, ReadOptions

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "cache_before_layout")
CASES = json.load(open(os.path.join(FIXTURE, "cases.json")))


@pytest.fixture(scope="module")
def old():
    with np.load(os.path.join(FIXTURE, "batches.npz")) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # a copy: reading may write derived index files into the cache
    return shutil.copytree(os.path.join(FIXTURE, "cache"), tmp_path_factory.mktemp("fixture") / "cache")


@pytest.mark.parametrize("name", sorted(CASES))
def test_todays_reader_serves_the_batches_the_old_tree_served(cache, old, name):
    case = CASES[name]
    R, r = case.get("readers", (1, 0))
    with Reader(str(cache), ReadOptions(**case["opts"]), num_readers=R, reader_index=r) as rd:
        for b in case["batches"]:
            got = rd.batch(b)
            want = {k.split("/", 2)[2]: v for k, v in old.items() if k.startswith(f"{name}/{b}/")}
            assert want and sorted(got) == sorted(want), (name, b)
            for k, v in want.items():
                g = np.asarray(got[k])
                assert g.dtype == v.dtype and np.array_equal(g, v), (name, b, k)
