"""Every pass covers the data once (docs/FORMAT.md, "Passes"): under the pass rule "spans" (the default of
format version 4) the first E examples of a training read, E the rows of an eval pass at the same
options, are the eval pass's rows, each as often as the eval pass serves it (by content: caches hold
duplicate documents), and no batch holds a row more often than the eval pass does; then the next E, and
so on. Caches of 1 to 200 chunks of unequal sizes, plain and with loss masks, and a mixture of a large
and a 1-chunk cache, read with R* from 1 to 64, packed, best fit and unpacked, shuffled or not. The
"streams" rule (older caches) fails the same checks whenever R* > 1, which is what its warning says.
"""

from __future__ import annotations

import json
import shutil
import tempfile

import numpy as np
import pytest

import cachegen
from cache_strategies import WINDOW
from passcheck import mixture_problems, pass_problems
from reader import EmptyStream, ReadOptions, Reader, RepeatedRowsWarning
from reader.order.shuffle import ShuffleConfig

L, B = 8, 16
SIZES = (1, 3, 8, 17, 200)
R_STARS = (1, 4, 16, 64)
KINDS = {"concat": {}, "best_fit": {"packing": "best_fit", "best_fit_window_tokens": WINDOW},
         "unpacked": {"packed": False}}


def unequal_chunks(n: int, seed: int) -> list[list[np.ndarray]]:
    """``n`` chunks of very unequal sizes (a few tiny, a few large), with some documents repeated across
    chunks, about 12,000 tokens in all whatever ``n``."""
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0, 1.2, n)
    docs_per_chunk = np.maximum(1, np.round(weights / weights.sum() * 600)).astype(int)
    chunks, pool = [], []
    for k in docs_per_chunk.tolist():
        docs = []
        for _ in range(k):
            if pool and rng.random() < 0.05:  # a duplicate document
                docs.append(pool[int(rng.integers(len(pool)))].copy())
            else:
                docs.append(rng.integers(1, 50_000, size=int(rng.integers(1, 3 * L + 5)), dtype=np.int32))
                pool.append(docs[-1])
        chunks.append(docs)
    return chunks


@pytest.fixture(scope="module")
def caches():
    """Synthetic caches as a build writes them now (format version 4): plain text of every size, and
    two with loss masks."""
    root = tempfile.mkdtemp(prefix="cl-passes-")
    out = {}
    for n in SIZES:
        out[("text", n)] = f"{root}/text-{n}"
        cachegen.write_synthetic_cache(out[("text", n)], unequal_chunks(n, seed=n), chunks_per_shard=[n],
                                       row_group_tokens=48, format_version=4)
    for n in (1, 8):
        chunks = unequal_chunks(n, seed=100 + n)
        masks = cachegen.random_masks(np.random.default_rng(n), chunks)
        out[("chat", n)] = f"{root}/chat-{n}"
        cachegen.write_synthetic_cache(out[("chat", n)], chunks, spans=cachegen.spans_of(masks),
                                       row_group_tokens=48, format_version=4)
    yield out
    shutil.rmtree(root, ignore_errors=True)


def shuffle_of(how: str | None, r_star: int) -> dict:
    if how is None:
        return {}
    if how == "seed":  # the default shuffle (one window: these passes are shorter than its first)
        return {"shuffle_seed": 3}
    return {"shuffle": ShuffleConfig(seed=5, first_window=4 * r_star, max_window=64 * r_star, block_size=2 * r_star,
                                     mix_size=8 * r_star, lanes=r_star)}  # several windows and mixes per pass


@pytest.mark.parametrize("shuffled", [None, "seed", "small"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("r_star", R_STARS)
@pytest.mark.parametrize("n", SIZES)
def test_every_pass_of_a_text_cache_is_a_permutation_of_the_eval_pass(caches, n, r_star, kind, shuffled):
    path = caches[("text", n)]
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=r_star, **KINDS[kind], **shuffle_of(shuffled, r_star))
    assert pass_problems(path, opts) == []


@pytest.mark.parametrize("shuffled", [None, "small"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("r_star", R_STARS)
@pytest.mark.parametrize("n", [1, 8])
def test_every_pass_of_a_cache_with_loss_masks_is_a_permutation_of_the_eval_pass(caches, n, r_star, kind, shuffled):
    path = caches[("chat", n)]
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=r_star, **KINDS[kind], **shuffle_of(shuffled, r_star))
    assert pass_problems(path, opts) == []


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("r_star", R_STARS)
@pytest.mark.parametrize("n", SIZES)
def test_the_streams_rule_serves_rows_twice_within_a_pass_when_r_star_is_above_one(caches, n, r_star, kind):
    """The checks above find the old rule's repeats (N < R* or unequal streams), and its warning says so."""
    path = caches[("text", n)]
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=r_star, pass_rule="streams", **KINDS[kind])
    with pytest.warns(RepeatedRowsWarning) if r_star > 1 else _no_warning():
        problems = pass_problems(path, opts)
    assert bool(problems) == (r_star > 1), problems


class _no_warning:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error", RepeatedRowsWarning)

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


@pytest.mark.parametrize("shuffled", [None, "small"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("r_star", R_STARS)
def test_each_component_of_a_mixture_is_covered_pass_by_pass(caches, tmp_path, r_star, kind, shuffled):
    """A mixture of a 200-chunk cache and a 1-chunk one: the first E_c examples each component serves (its
    own examples k < E_c) are its eval pass's rows, and no batch holds one of its rows twice."""
    f = tmp_path / "mix.json"
    f.write_text(json.dumps({"mixture": 1, "components": [
        {"name": "big", "path": caches[("text", 200)], "weight": 0.8},
        {"name": "small", "path": caches[("text", 1)], "weight": 0.2}]}))
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=r_star, **KINDS[kind], **shuffle_of(shuffled, r_star))
    assert mixture_problems(str(f), opts) == []


def test_tiny_data_fills_batches_from_the_next_passes(tmp_path):
    """5 conversations read unpacked with R* = 16: each span holds one row or none, so every pass serves the
    5 in order, and a batch of 8 holds pass 0 then the first 3 of pass 1 (epochs say which); shuffled, the
    same (a lane of one row has nothing to permute). No example at all is an EmptyStream."""
    docs = [np.arange(10 * d + 1, 10 * d + 6, dtype=np.int32) for d in range(5)]
    masks = [[np.arange(5) >= 2 for _ in docs]]
    cachegen.write_synthetic_cache(str(tmp_path / "five"), [docs], spans=cachegen.spans_of(masks), format_version=4)
    for extra in ({}, {"shuffle_seed": 1}):
        with Reader(str(tmp_path / "five"), ReadOptions(seq_len=8, batch_size=8, packed=False, **extra)) as r:
            assert r.examples_per_pass == 5
            batch = r.batch(0)
            assert batch["targets"][:, 0].tolist() == [1, 11, 21, 31, 41, 1, 11, 21]
            assert batch["epochs"].tolist() == [0] * 5 + [1] * 3 and batch["loss_mask"][:, 2].all()
            assert r.batch(1)["targets"][:, 0].tolist() == [31, 41, 1, 11, 21, 31, 41, 1]
    cachegen.write_synthetic_cache(str(tmp_path / "short"), [[np.arange(1, 4, dtype=np.int32)]], format_version=4)
    with Reader(str(tmp_path / "short"), ReadOptions(seq_len=8, batch_size=8)) as r:
        with pytest.raises(EmptyStream, match="3 tokens make no whole row of seq_len 8"):
            r.batch(0)
