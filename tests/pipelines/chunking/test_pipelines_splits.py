"""The train/validation assignment of a split build (reader/format/splits.py, pipelines/chunking/split_router.py): pure properties, no Beam job.

End-to-end split builds are in tests/end_to_end/test_build_cache_splits.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from build_helpers import sample_texts
from pipelines.errors import BuildError
from pipelines.options import build_arg_parser, split_spec
from pipelines.chunking.split_router import SplitRouter
from reader.format.splits import SplitSpec, cache_roots, split_hash

BASE = ["--input", "x", "--output", "y", "--tokenizer", "tiktoken:cl100k_base"]


def distinct_texts(n: int) -> list[str]:
    """``n`` distinct documents, some non-ASCII (the hash is over the UTF-8 bytes)."""
    extras = ["", "caf\u00e9 ", "\u2603 \U0001F600 "]
    return [f"document {i}: {extras[i % 3]}text" for i in range(n)]


def test_hash_is_pinned_across_platforms_and_versions():
    """blake2b-64 of the UTF-8 text, keyed and salted by the seed: fixed values (docs/FORMAT.md gives the rule),
    so a cache split on one machine is split the same way on any other."""
    assert split_hash("hello world", 0) == 0x4E40CE82C68F0EF3
    assert split_hash("hello world", 1) == 0x190E1BBA40D28374
    assert split_hash("Caf\u00e9 \u2603 \U0001F600", 0) == 0xAE8445DCE116DC5C
    assert split_hash("lone \ud800", 0) == 0x86FBBB7D0CC2389F  # lone surrogates hash too (then fail to tokenize)


def test_threshold_is_the_fraction_of_the_64_bit_range():
    assert SplitSpec(0.5).threshold == 1 << 63
    assert SplitSpec(0.25).threshold == 1 << 62
    assert SplitSpec(0.01).threshold == int(0.01 * 2.0 ** 64)
    spec = SplitSpec(0.5)
    assert spec.is_validation("hello world") is (0x4E40CE82C68F0EF3 < (1 << 63))


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.3])
def test_fraction_is_honoured_on_a_large_corpus(fraction):
    n = 200_000
    spec = SplitSpec(fraction)
    got = sum(spec.is_validation(t) for t in distinct_texts(n))
    sd = math.sqrt(n * fraction * (1 - fraction))
    assert abs(got - n * fraction) < 6 * sd, (got, n * fraction)


def test_duplicates_share_a_split_and_seeds_draw_other_sets():
    texts = sample_texts(3000, seed=5)
    a, b = SplitSpec(0.2, seed=0), SplitSpec(0.2, seed=1)
    first = {t: a.is_validation(t) for t in texts}
    assert all(a.is_validation(t) == first[t] for t in reversed(texts))  # a pure function of the text
    val_a = {t for t in texts if a.is_validation(t)}
    val_b = {t for t in texts if b.is_validation(t)}
    assert val_a and val_b and val_a != val_b
    # nested fractions: what is validation at 10% is validation at 20% (same seed), so growing F adds only
    assert {t for t in texts if SplitSpec(0.1).is_validation(t)} <= val_a


def test_assignment_ignores_position_shard_and_chunking():
    """Only the text is hashed: the same text at any place of any shard goes to the same split."""
    spec = SplitSpec(0.3)
    texts = sample_texts(400, seed=2)
    router_a = SplitRouter({"row_group_tokens": 10, "compression": "zstd", "compression_level": 3}, 0, None, spec)
    router_b = SplitRouter({"row_group_tokens": 99, "compression": "none", "compression_level": None}, 7, 5, spec)
    routes = [router_a.route(t) for t in texts]
    assert routes == [router_b.route(t) for t in texts] == [int(spec.is_validation(t)) for t in texts]
    assert 0 < sum(routes) < len(routes)
    plain = SplitRouter({"row_group_tokens": 10, "compression": "zstd", "compression_level": 3}, 0, None, None)
    assert {plain.route(t) for t in texts} == {0} and len(plain.parts) == 1


def test_router_cuts_row_groups_per_split():
    spec = SplitSpec(0.5)
    r = SplitRouter({"row_group_tokens": 10, "compression": "none", "compression_level": None}, 3, None, spec)
    for i in range(7):
        r.add(i % 2, np.arange(4, dtype=np.int32), offset=i)
    train, val = r.finish()
    # train holds 4 documents of 4 tokens: row groups of 12 and 4; validation 3: one of 12
    assert train.row_group_tokens == [12, 4] and train.docs == 4
    assert val.row_group_tokens == [12] and val.docs == 3


def test_layout_of_the_caches():
    assert cache_roots("gs://b/c", None) == ("gs://b/c",)
    assert cache_roots("gs://b/c/", SplitSpec(0.1)) == ("gs://b/c/train", "gs://b/c/validation")


def test_options_make_the_spec_and_refuse_nonsense():
    parser = build_arg_parser()
    assert split_spec(parser.parse_args(BASE)) is None
    assert split_spec(parser.parse_args(BASE + ["--validation_fraction", "0"])) is None
    assert split_spec(parser.parse_args(BASE + ["--validation_fraction", "0.01", "--split_seed", "9"])) == \
        SplitSpec(0.01, 9)
    with pytest.raises(BuildError, match="--split_seed only applies with --validation_fraction"):
        split_spec(parser.parse_args(BASE + ["--split_seed", "3"]))
    for bad in ("1", "1.5", "-0.1", "nan", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(BASE + ["--validation_fraction", bad])
    with pytest.raises(SystemExit):
        parser.parse_args(BASE + ["--validation_fraction", "0.1", "--split_seed", "-1"])
    with pytest.raises(ValueError):
        SplitSpec(0.0)
    with pytest.raises(ValueError):
        SplitSpec(0.1, seed=1 << 64)
