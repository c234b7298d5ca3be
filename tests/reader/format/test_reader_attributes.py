"""Attribute sets (reader/format/attributes.py): a file is used only if it is the one the manifest records,
belongs to its chunk, set and computation, and holds values in range; a manifest only for the cache it was
computed from."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cachegen import write_attribute_set, write_synthetic_cache
from reader.format import attributes as attrs
from reader.format import spec as fmt
from reader.storage.attributes import AttributeSet
from reader.storage.cache import Cache

NAME = "near_duplicates"
PARAMS = {"threshold": 0.75}


def write_set(root: str, keeper: list[np.ndarray], jac: list[np.ndarray], *, meta_chunk=None) -> None:
    """A near-duplicate set over the cache at ``root`` (as pipelines/dedup writes one)."""
    write_attribute_set(root, NAME, attrs.NEAR, [{"keeper": k, "jaccard": j} for k, j in zip(keeper, jac)], PARAMS,
                        meta_chunk=meta_chunk)


@pytest.fixture
def cache(tmp_path):
    root = str(tmp_path / "c")
    write_synthetic_cache(root, [[[1, 2, 3], [4, 5]], [[1, 2, 3]], [[6], [7, 8], [4, 5]]], chunks_per_shard=[2, 1])
    return root


def good(root: str):
    keeper = [np.array([-1, -1]), np.array([0]), np.array([-1, -1, 1])]
    jac = [np.zeros(2, np.float32), np.array([1.0], np.float32), np.array([0, 0, 0.8], np.float32)]
    return keeper, jac


def test_a_written_set_reads_back_with_its_counts(cache):
    write_set(cache, *good(cache))
    s = AttributeSet(Cache(cache), NAME)
    assert s.chunk(1)["keeper"].tolist() == [0] and s.chunk(2)["jaccard"].tolist() == pytest.approx([0, 0, 0.8])
    assert s.manifest.marked.tolist() == [0, 1, 1] and s.manifest.raw["totals"]["marked"] == 2
    assert s.path(2) == "attributes/near_duplicates/shard-00000/chunk-000001.parquet"


def test_an_edited_file_is_refused_naming_it(cache):
    write_set(cache, *good(cache))
    s = AttributeSet(Cache(cache), NAME)
    path = os.path.join(cache, s.path(1))
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(fmt.DamagedCache, match=r"chunk-000000\.parquet: its size or sha256 is not the one"):
        s.chunk(1)
    os.remove(path)
    with pytest.raises(fmt.DamagedCache, match="missing"):
        s.chunk(1)


def test_a_file_of_another_chunk_or_with_bad_values_is_refused(cache):
    keeper, jac = good(cache)
    write_set(cache, keeper, jac, meta_chunk=0)  # every file claims chunk 0's checksum
    s = AttributeSet(Cache(cache), NAME)
    s.chunk(0)
    with pytest.raises(fmt.DamagedCache, match="belongs to another chunk.*chunk_checksum"):
        s.chunk(1)
    keeper[2] = np.array([-1, -1, 5])  # a keeper after its own document
    write_set(cache, keeper, jac)
    with pytest.raises(fmt.DamagedCache, match=r"row 2 \(document 5\) has keeper 5"):
        AttributeSet(Cache(cache), NAME).chunk(2)


def test_a_manifest_of_another_cache_or_edited_is_refused(cache, tmp_path):
    write_set(cache, *good(cache))
    other = str(tmp_path / "other")
    write_synthetic_cache(other, [[[1, 2, 3], [4, 5]], [[1, 2, 9]], [[6], [7, 8], [4, 5]]], chunks_per_shard=[2, 1])
    os.makedirs(os.path.join(other, attrs.set_dir(NAME)))
    path = os.path.join(cache, attrs.manifest_path(NAME))
    text = open(path).read()
    open(os.path.join(other, attrs.manifest_path(NAME)), "w").write(text)
    with pytest.raises(fmt.DamagedCache, match="computed from another build of this cache"):
        AttributeSet(Cache(other), NAME)
    open(path, "w").write(text.replace('"threshold": 0.75', '"threshold": 0.5'))
    with pytest.raises(fmt.DamagedCache, match="params_hash is not the hash of params"):
        AttributeSet(Cache(cache), NAME)
    with pytest.raises(FileNotFoundError, match="no attribute set 'duplicates'"):
        AttributeSet(Cache(cache), "duplicates")


def test_a_version_4_set_is_checked_against_the_table_without_fetching_checksums(tmp_path):
    # the table's own checksum covers every chunk's, so opening a set on a cache of many chunks reads no
    # checksum block; a chunk's file is then verified against its own row only
    root = str(tmp_path / "v4")
    write_synthetic_cache(root, [[[1, 2, 3], [4, 5]], [[1, 2, 3]], [[6], [7, 8], [4, 5]]], chunks_per_shard=[2, 1],
                          format_version=4)
    write_set(root, *good(root))
    c = Cache(root)
    assert c.ledger.raw["format_version"] == 4 and c.table.checksums._blocks == {}
    s = AttributeSet(c, NAME)
    assert c.table.checksums._blocks == {}
    assert s.manifest.raw["cache"]["fingerprint"] == c.table.checksums.table.fingerprint()
    assert s.chunk(1)["keeper"].tolist() == [0]
