"""The worked example of docs/FORMAT.md (reading-order) is what the reader returns; reader/ stays light."""

import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from reader import ReadOptions, Reader

import cachegen

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHUNKS = [[[11, 12, 13], [21, 22]], [[31, 32, 33, 34]], [], [[41], [51, 52, 53]], [[61, 62]]]


def test_worked_example_of_format_md():
    d = tempfile.mkdtemp(prefix="cl-doc-")
    try:
        cachegen.write_synthetic_cache(d, CHUNKS, chunks_per_shard=[3, 2])
        with Reader(d, ReadOptions(seq_len=4, batch_size=4, ideal_readers=2)) as r:
            x = r.rows(0, np.arange(4))
            assert x["targets"].tolist() == [[11, 12, 13, 21], [31, 32, 33, 34], [22, 61, 62, 31], [41, 51, 52, 53]]
            assert x["inputs"].tolist() == [[0, 11, 12, 0], [0, 31, 32, 33], [21, 0, 61, 0], [0, 0, 51, 52]]
            assert x["segment_ids"].tolist() == [[1, 1, 1, 2], [1, 1, 1, 1], [1, 2, 2, 3], [1, 2, 2, 2]]
            assert x["positions"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [1, 0, 1, 0], [0, 0, 1, 2]]
            assert x["epochs"].tolist() == [0, 0, 0, 0]
            y = r.rows(1, np.arange(4))
            assert y["targets"].tolist() == [[32, 33, 34, 41], [11, 12, 13, 21], [51, 52, 53, 11], [22, 61, 62, 31]]
            assert y["epochs"].tolist() == [1, 1, 1, 1]
        for rd in range(2):
            with Reader(d, ReadOptions(seq_len=4, batch_size=4, ideal_readers=2), num_readers=2, reader_index=rd) as r:
                assert r.batch(0)["targets"].tolist() == x["targets"][rd::2].tolist()
                assert r.store.opened == ({0, 1, 4} if rd == 0 else {1, 3})
        with Reader(d, ReadOptions(seq_len=4, batch_size=4, ideal_readers=2, packed=False)) as r:
            u = r.rows(0, np.arange(4))
            assert u["targets"].tolist() == [[11, 12, 13, 0], [31, 32, 33, 34], [21, 22, 0, 0], [41, 0, 0, 0]]
            assert u["loss_mask"].sum(1).tolist() == [3, 4, 2, 1]
        with Reader(d, ReadOptions(seq_len=4, batch_size=3, eval_mode=True)) as r:
            got = list(r.iter_batches())
            assert [b for b, _ in got] == [0, 1] and r.num_batches == 2
            assert got[1][1]["targets"].tolist() == [[53, 61, 62, 0], [0] * 4, [0] * 4]
            assert got[1][1]["valid"].tolist() == [True, False, False]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_reader_imports_no_beam_transformers_tokenizers_or_pipelines():
    """Every module of reader/ but the jax and torch ones imports numpy, pyarrow and fsspec only (and the
    stdlib); test_reader_torch checks that the torch ones leave jax alone."""
    mods = sorted(m.name for m in pkgutil.walk_packages([os.path.join(ROOT, "reader")], "reader.")
                  if not m.name.startswith(("reader.jax", "reader.torch")) and not m.name.endswith("__main__"))
    assert {"reader.reader", "reader.batch.examples", "reader.storage.store", "reader.batch.assemble",
            "reader.workers.pool"} <= set(mods)
    code = ("import importlib, sys;"
            f"[importlib.import_module(m) for m in {mods!r}];"
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('apache_beam', 'transformers', 'tokenizers', 'pipelines', 'pandas', 'tiktoken', 'jax', 'torch')];"
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
