"""``Reader(path)`` on a path that is not a cache says what the path is and what to pass instead.

The paths are the mistakes people make: a typo, an empty directory, an input shard, a chunk file or
the chunks/ directory of a cache, the ledger itself, the top directory of a split build, a directory of
caches, a flat-tokens zarr or Megatron dataset, a cache whose ledger was deleted.
"""

import os
import re

import numpy as np
import pytest

from reader import NotACache, Reader
from reader.format import spec as fmt
from reader.format.splits import SPLITS_MANIFEST_NAME
from reader.interop.export import split_caches

import cachegen

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    d = tmp_path_factory.mktemp("paths")
    chunks = cachegen.random_chunks(np.random.default_rng(3), 2, empty_prob=0.0)
    for sub in ("cache", "split/train", "split/validation", "many/a", "many/b"):
        cachegen.write_synthetic_cache(str(d / sub), chunks)
    (d / "empty").mkdir()
    (d / "built").mkdir()  # the top of a split build (its manifest), before or after its caches
    (d / "built" / SPLITS_MANIFEST_NAME).write_text('{"format": "chunkledger-splits"}')
    (d / "shards").mkdir()
    (d / "shards" / "part-00.jsonl").write_text('{"text": "hello"}\n')
    (d / "data.zarr").mkdir()
    (d / "data.zarr" / ".zgroup").write_text('{"zarr_format": 2}')
    (d / "megatron").mkdir()
    (d / "megatron" / "web_text_document.bin").write_bytes(b"\0" * 8)
    (d / "megatron" / "web_text_document.idx").write_bytes(b"MMIDIDX\0\0")
    (d / "notes").mkdir()
    (d / "notes" / "readme.txt").write_text("x")
    cachegen.write_synthetic_cache(str(d / "noledger"), chunks)
    os.remove(d / "noledger" / fmt.LEDGER_NAME)
    return d


def _message(path: str) -> str:
    with pytest.raises(NotACache) as e:
        Reader(path)
    assert isinstance(e.value, FileNotFoundError)  # what callers caught before
    text = str(e.value)
    assert text.startswith(path + ": ")
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.mark.parametrize("rel,said", [
    ("empty", r"not a chunkledger cache \(no ledger.json here\): the directory is empty\. Pass the --output "
              r"directory of a build \(python -m pipelines.build_cache"),
    ("split", r"it holds the train and validation caches of a split build; pass {d}/split/train or "
              r"{d}/split/validation$"),
    ("many", r"it holds caches; pass one of {d}/many/a, {d}/many/b$"),
    ("built", r"it is a split build \(its splits.json names two caches\); use {d}/built/train or "
              r"{d}/built/validation, each a complete cache$"),
    ("built/splits.json", r"this is the manifest of a split build; use {d}/built/train or {d}/built/validation"),
    ("cache/chunks", r"this directory is inside the cache {d}/cache; pass {d}/cache$"),
    ("cache/chunks/shard-00000", r"this directory is inside the cache {d}/cache; pass {d}/cache$"),
    ("cache/chunks/shard-00000/chunk-000001.parquet", r"\(a cache is a directory\): this is a file of the cache "
                                                      r"{d}/cache; pass {d}/cache$"),
    ("cache/chunks/shard-00000/chunk-000001.json", r"this is a file of the cache {d}/cache; pass {d}/cache$"),
    ("cache/ledger.json", r"this is the ledger file itself; pass its directory {d}/cache$"),
    ("shards/part-00.jsonl", r"this is a jsonl file \(an input shard\?\)\. Build a cache from it \(python -m "
                             r"pipelines.build_cache --input '{d}/shards/part-00.jsonl' --output CACHE"),
    ("shards", r"it holds jsonl files \(input shards\?\)\. Build a cache from them \(python -m "
               r"pipelines.build_cache --input '{d}/shards/\*.jsonl\*'"),
    ("data.zarr", r"this is a zarr group \(a flat-tokens dataset\?\)\. Import it \(python -m reader "
                  r"import-flat-tokens {d}/data.zarr"),
    ("megatron", r"it holds Megatron .bin/.idx files\. Import them \(python -m reader import-megatron"),
    ("megatron/web_text_document.bin", r"this is half of a Megatron dataset\. Import it"),
    ("noledger", r"it holds chunks/ but no ledger.json: the ledger was deleted or never written\. Rerun the build "
                 r"command that wrote here"),
    ("notes", r"it holds readme.txt\. Pass the --output directory of a build"),
    ("cahce", r"does not exist\. Did you mean {d}/cache\?$"),
    ("nowhere/cache", r"does not exist \(nor does its directory {d}/nowhere\)$"),
])
def test_reader_says_what_the_path_is(tree, rel, said):
    d = str(tree)
    text = _message(f"{d}/{rel}")
    assert re.search(said.format(d=re.escape(d)), text), text


def test_a_cache_inside_still_opens(tree):
    with Reader(str(tree / "split" / "train")) as r:  # what the message says to pass works
        assert r.cache.complete


def test_export_says_the_same(tree):
    with pytest.raises(NotACache, match="the directory is empty"):
        split_caches(str(tree / "empty"))
    assert split_caches(str(tree / "split")) == {"train": f"{tree}/split/train",
                                                 "validation": f"{tree}/split/validation"}
