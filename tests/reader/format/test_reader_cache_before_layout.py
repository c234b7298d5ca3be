"""A cache built, and its batches read, by the tree before the subpackages (commit b081004), committed as a
fixture: today's reader serves exactly the same batches from it (every key, dtype and value), for packed,
shuffled flat, unpacked and eval reads, and for one host of two. tests/fixtures/cache_before_layout/: the
cache (the sample corpus, ``--chunk_bytes 32KiB --row_group_tokens 4096``, 16 chunks), ``cases.json`` (the
read options and batches) and ``batches.npz`` (what the old reader returned); ``best_fit_cases.json`` and
``best_fit_batches.npz``: best-fit reads of the same cache by the tree before best fit's caps (commit
6b38922)."""

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


def assert_served(got: dict, old: dict, name: str, b: int) -> None:
    """Batch ``b`` of case ``name`` is what the old tree served (``old``: its saved arrays), key for key."""
    want = {k.split("/", 2)[2]: v for k, v in old.items() if k.startswith(f"{name}/{b}/")}
    assert want and sorted(got) == sorted(want), (name, b)
    for k, v in want.items():
        g = np.asarray(got[k])
        assert g.dtype == v.dtype and np.array_equal(g, v), (name, b, k)


@pytest.mark.parametrize("name", sorted(CASES))
def test_todays_reader_serves_the_batches_the_old_tree_served(cache, old, name):
    case = CASES[name]
    R, r = case.get("readers", (1, 0))
    with Reader(str(cache), ReadOptions(**case["opts"]), num_readers=R, reader_index=r) as rd:
        for b in case["batches"]:
            assert_served(rd.batch(b), old, name, b)


# Best-fit batches of the same cache read by the tree before best fit's caps (commit 6b38922): a cache of
# format version 2 keeps one continuation piece per row, so its best-fit rows stay what they were.
BEST_FIT_CASES = json.load(open(os.path.join(FIXTURE, "best_fit_cases.json")))


@pytest.fixture(scope="module")
def old_best_fit():
    with np.load(os.path.join(FIXTURE, "best_fit_batches.npz")) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("name", sorted(BEST_FIT_CASES))
def test_an_older_cache_keeps_its_best_fit_rows(cache, old_best_fit, name):
    case = BEST_FIT_CASES[name]
    with Reader(str(cache), ReadOptions(**case["opts"])) as rd, \
            Reader(str(cache), ReadOptions(**case["opts"], best_fit_continuations=4)) as tighter:
        changed = False
        for b in case["batches"]:
            got = rd.batch(b)
            assert_served(got, old_best_fit, name, b)
            other = tighter.batch(b)
            changed |= not np.array_equal(other.get("targets", other.get("tokens")), got.get("targets", got.get("tokens")))
        assert changed, "the explicit option packs this cache the same: the fixture does not tell the rules apart"
