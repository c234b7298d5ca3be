"""Mixtures of many components over a few caches: components naming one cache share its opened ledger
and reading machinery, so opening and reading cost memory per distinct cache, not per component; and
sharing changes no batch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mixgen import write_components, write_mixture
from reader import ReadOptions, Reader
from reader.batch.schema import BATCH_KEYS
from reader.mixture.mixture import Mixture

pytestmark = pytest.mark.timeout(600)

# Opens the mixture (inspect, then a Reader and its first batch) in a fresh process and prints the growth
# of its peak RSS over what the imports took.
MEASURE = r"""
import contextlib, io, json, resource, sys
from reader import ReadOptions, Reader
from reader.cli.main import main
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)
base = peak()
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["inspect", sys.argv[1]]) == 0
with Reader(sys.argv[1], ReadOptions(seq_len=8, batch_size=4)) as r:
    b = r.batch(0)
print(json.dumps({"growth": peak() - base, "components": sorted(set(b["components"].ravel().tolist()))}))
"""


def test_many_components_over_a_few_caches_open_in_memory_per_cache(tmp_path):
    """20,000 components over 3 caches: before, every component opened its own ledger, order, store and
    prefetcher (about 300 MB more here, and 10 s); now the 3 caches are opened once."""
    paths, _ = write_components(str(tmp_path), [8, 8, 8])
    n = 20_000
    comps = [(f"c{i}", f"c{i % 3}", 1) for i in range(n)]
    f = write_mixture(str(tmp_path / "many.json"), comps, block=1 << 15)  # (each weight 1/20000 >= 1/block)
    mix = Mixture(f)
    assert len(mix.distinct) == 3 and mix.caches[0] is mix.caches[3] is mix.distinct[0]
    assert mix.which[:4] == [0, 1, 2, 0]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", MEASURE, f], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["growth"] < 120 << 20, got  # the old code: about 300 MiB
    assert len(got["components"]) > 1


@pytest.mark.parametrize("packed,shuffle_seed,eval_mode", [(True, None, False), (False, None, False),
                                                           (True, 3, False), (True, None, True)])
def test_components_sharing_a_cache_read_as_components_with_their_own_copies(tmp_path, packed, shuffle_seed,
                                                                               eval_mode):
    """The same mixture, once with two components naming one cache and once with the second naming a
    byte-identical copy: the same batches (sharing a cache's machinery changes no row)."""
    write_components(str(tmp_path), [9, 5])
    shutil.copytree(tmp_path / "c0", tmp_path / "c0-copy")
    weights = [("a", "c0", 0.5), ("b", "c1", 0.2), ("c", "{}", 0.3)]
    shared = write_mixture(str(tmp_path / "shared.json"), [(n, p.format("c0"), w) for n, p, w in weights], block=16,
                           schedule=[(5, {"a": 0.1, "c": 0.9})])
    apart = write_mixture(str(tmp_path / "apart.json"), [(n, p.format("c0-copy"), w) for n, p, w in weights],
                          block=16, schedule=[(5, {"a": 0.1, "c": 0.9})])
    opts = ReadOptions(seq_len=8, batch_size=8, ideal_readers=4, packed=packed, shuffle_seed=shuffle_seed,
                       eval_mode=eval_mode)
    with Reader(shared, opts) as a, Reader(apart, opts) as b:
        assert len(a.store.stores) == 2 and len(b.store.stores) == 3
        count = None if eval_mode else 12  # (eval: the whole pass, every component once)
        got = [x for _, x in a.iter_batches(0, count)]
        want = [x for _, x in b.iter_batches(0, count)]
    assert len(got) == len(want) >= 12
    for x, y in zip(got, want):
        for k in BATCH_KEYS:
            assert np.array_equal(x[k], y[k]), k
    comp = np.concatenate([x["components"] for x in got])
    assert {0, 2} <= set(comp.ravel().tolist())  # both components of the shared cache were read
