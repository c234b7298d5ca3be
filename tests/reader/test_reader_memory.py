"""memory_budget_bytes covers what the reader holds: decoded row groups and the batches iter_batches
assembles ahead. A budget too small for the batches is a warning that names it and
what is over it; ``Reader.memory()`` and ``python -m reader inspect --read_batches`` report the parts."""

import json
import shutil
import tempfile
import warnings

import numpy as np
import pytest

import cachegen
from reader import ReadOptions, Reader, RepeatedRowsWarning
from reader.cli.main import main

L, B = 64, 32
BATCH = B * (L * 17 + 21)  # bytes of one batch ("arrays": four int32 and one bool [B, L]; four [B] arrays)


@pytest.fixture(scope="module")
def cache():
    rng = np.random.default_rng(2)
    chunks = [[rng.integers(1, 1000, int(n)).astype(np.int32) for n in rng.integers(20, 400, 60)] for _ in range(8)]
    d = tempfile.mkdtemp(prefix="cl-memory-")
    cachegen.write_synthetic_cache(d, chunks, chunks_per_shard=[4, 4], row_group_tokens=512)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def read(cache, opts, count=60):
    """Read ``count`` batches; the peak of each part of ``Reader.memory()`` meanwhile, and the store's budget."""
    peak: dict[str, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an adequate budget warns of nothing
        warnings.simplefilter("ignore", RepeatedRowsWarning)  # (the "streams" rule on these 8 chunks)
        with Reader(cache, opts) as rd:
            for _ in rd.iter_batches(0, count):
                now = rd.memory()
                peak = {k: max(v, peak.get(k, 0)) for k, v in now.items()}
            return peak, rd.store.budget, rd.slab


@pytest.mark.parametrize("shuffle_seed", [None, 4])
@pytest.mark.parametrize("rule", ["spans", "streams"])
def test_the_reader_holds_what_its_budget_says(cache, shuffle_seed, rule):
    budget = 4 * (2 + 3 * 2) * BATCH  # a quarter of it: two batches ahead and three slabs of two
    peak, data_budget, slab = read(cache, ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, shuffle_seed=shuffle_seed,
                                                      memory_budget_bytes=budget, pass_rule=rule))
    assert slab == 2 and peak["ahead_limit"] == budget // 4 and data_budget == budget - budget // 4
    assert peak["decoded"] <= data_budget
    assert peak["budget"] == budget and peak["rss"] > 0


def test_the_default_budget_keeps_full_slabs(cache):
    _, data_budget, slab = read(cache, ReadOptions(seq_len=L, batch_size=B, ideal_readers=4))
    assert slab == 16 and data_budget == (1 << 30) - (2 + 3 * 16) * BATCH


def test_a_budget_too_small_for_the_batches_warns_naming_it_and_the_fix(cache):
    opts = ReadOptions(seq_len=L, batch_size=B, ideal_readers=4, memory_budget_bytes=8 * BATCH)
    with Reader(cache, opts) as rd:
        with pytest.warns(RuntimeWarning, match=r"^memory_budget_bytes=0\.271 MiB is too small for batches of 0\.0338 "
                                                r"MiB: reading ahead holds up to 0\.169 MiB .* Raise memory_budget_bytes "
                                                r"to 0\.677 MiB or more"):
            next(rd.iter_batches(0, 2))
        assert rd.slab == 1 and rd.ahead_bytes == 5 * BATCH


def test_inspect_shows_the_readers_memory(cache, capsys):
    assert main(["inspect", cache, "--read_batches", "20", "--seq_len", str(L), "--batch_size", str(B),
                 "--ideal_readers", "4", "--memory_budget_bytes", str(1 << 22)]) == 0
    out = capsys.readouterr().out
    assert "memory      reading 20 batches, at most: budget 4 MiB: decoded row groups" in out
    assert main(["inspect", cache, "--json", "--read_batches", "5", "--seq_len", str(L), "--batch_size", str(B),
                 "--ideal_readers", "4"]) == 0
    got = json.loads(capsys.readouterr().out)["memory"]
    assert set(got) == {"budget", "decoded", "ahead_limit", "rss"} and got["budget"] == 1 << 30
