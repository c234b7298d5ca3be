"""reader/batch/examples.py: what upcoming reads touch (``ExampleOrder.plan``), against a per-example reference."""

import shutil
import tempfile

import numpy as np
import pytest

from reader import ReadOptions, Reader

import cachegen


@pytest.fixture(scope="module")
def cache_dir():
    d = tempfile.mkdtemp(prefix="cl-order-")
    rng = np.random.default_rng(11)
    chunks = cachegen.random_chunks(rng, 9, empty_prob=0.0, max_docs=12, max_len=60)
    cachegen.write_synthetic_cache(d, chunks, row_group_tokens=16)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def reference_plan(order, exs, L: int) -> dict[int, list[int]]:
    """Each example's first and last token, located one at a time: ``{chunk: sorted token offsets}``."""
    idx = order.stream_index()
    R = order.options.effective_ideal_readers
    src = np.concatenate(order.sources(exs))
    out: dict[int, list[int]] = {}
    for e in src.tolist():
        s, j = e % R, e // R
        for pos in (j * L, j * L + L - 1):
            loc = idx.locate(s, pos)
            out.setdefault(loc.chunk, []).append(loc.offset)
    return {c: sorted(v) for c, v in out.items()}


@pytest.mark.parametrize("shuffle_seed", [None, 3])
def test_plan_names_every_chunk_once_in_order_with_every_window_end(cache_dir, shuffle_seed):
    L = 8
    with Reader(cache_dir, ReadOptions(seq_len=L, batch_size=6, ideal_readers=3, shuffle_seed=shuffle_seed)) as rd:
        order = rd.order
        for b in (0, 5, 17, 40):
            exs = [(b + i) * 6 + np.arange(6) for i in range(4)]
            plan = order.touched(exs)
            chunks = [c for c, _ in plan]
            assert chunks == sorted(set(chunks))  # chunk order, each once
            got = {c: sorted(offs.tolist()) for c, offs in plan}
            assert got == reference_plan(order, exs, L)


def test_num_streams_is_an_alias_of_effective_ideal_readers():
    for opts, r_star in ((ReadOptions(ideal_readers=8), 8), (ReadOptions(ideal_readers=8, eval_mode=True), 1)):
        assert opts.effective_ideal_readers == opts.num_streams == r_star
