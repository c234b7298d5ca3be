"""The reader's promises on caches built by the real pipeline (FnApiRunner, sample corpus), including
reading a cache while its build is running."""

import os
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from reader import Cache, ReadOptions, Reader
from reader.order import streams
from reader.format import spec as fmt
from reader.storage.pages import fast_plain_values

import cachegen
from cache_strategies import reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE = os.path.join(ROOT, "pipelines", "sample_corpus")
BUILD = ["--input", os.path.join(SAMPLE, "*"), "--tokenizer", "tiktoken:cl100k_base", "--append_eos",
         "--chunk_bytes", "16384", "--row_group_tokens", "500"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from pipelines import build_cache  # tests may import pipelines; reader/ never does
    out = str(tmp_path_factory.mktemp("real") / "cache")
    build_cache.run(BUILD + ["--output", out, "--runner=FnApiRunner"])
    return out


def chunks_of(root):
    """Every chunk's documents, straight from the Parquet files in ledger order (independent of Reader)."""
    c = Cache(root)
    out = []
    for p in c.table.paths:
        col = pq.read_table(os.path.join(root, p), columns=[fmt.TOKEN_COLUMN]).column(0).to_pylist()
        out.append([np.asarray(d, np.int32) for d in col])
    return out


def test_real_cache_uses_the_fast_decoder(built):
    with Reader(built, ReadOptions(seq_len=8, batch_size=1, ideal_readers=1)) as rd:
        m = rd.store.meta(0)
        off, length = (int(x) for x in m.rg_ranges[0])
        data = open(os.path.join(built, m.path), "rb").read()[off:off + length]
        assert fast_plain_values(data, m.file_meta.row_group(0).column(0), int(m.rg_token_starts[1]),
                                 base=off) is not None
        assert fast_plain_values(data, m.file_meta.row_group(0).column(1), int(m.rg_doc_starts[1]), base=off,
                                 column=fmt.LENGTH_COLUMN, levels=0) is not None


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("rule", ["spans", "streams"])
def test_real_cache_batches_equal_reference_for_every_R(built, packed, rule):
    chunks = chunks_of(built)
    L, r_star, B = 64, 4, 8
    ref = reference(rule, chunks, L, r_star, packed=packed)
    opts = ReadOptions(seq_len=L, batch_size=B, packed=packed, ideal_readers=r_star, pass_rule=rule)
    steps = [0, 1, 7, 150]
    with Reader(built, opts) as full:
        for b in steps:
            glob = full.rows(b, np.arange(B))
            for k in range(B):
                e = ref.example(b * B + k)
                for key in ("inputs", "targets", "segment_ids", "positions", "loss_mask"):
                    assert np.array_equal(glob[key][k], e[key]), (b, k, key)
                assert glob["epochs"][k] == e["epoch"]
            for R in (2, 4, 8):
                union = {}
                for r in range(R):
                    with Reader(built, opts, num_readers=R, reader_index=r) as rd:
                        mine = rd.batch(b)
                        for key, v in mine.items():
                            union.setdefault(key, np.zeros_like(glob[key]))[streams.reader_rows(B, R, r)] = v
                        if b == steps[-1] and rule == "streams":  # locality: R | R* or R* | R
                            own = streams.streams_of_reader(r_star, R, r)
                            n = len(chunks)
                            assert all(any((c - s) % r_star == (-e * n) % r_star for s in own
                                           for e in range(0, 64)) for c in rd.store.opened)
                for key in glob:
                    assert np.array_equal(union[key], glob[key]), (b, R, key)


def test_real_cache_seek_equals_iterate_and_eval_covers_everything(built):
    chunks = chunks_of(built)
    every = np.concatenate([np.concatenate(c) for c in chunks if c])
    opts = ReadOptions(seq_len=96, batch_size=6, ideal_readers=3, shuffle_seed=11)
    with Reader(built, opts, num_readers=3, reader_index=2) as a, \
            Reader(built, opts, num_readers=3, reader_index=2) as b:
        from_zero = [x for _, x in a.iter_batches(0, 25)]
        for (i, x) in b.iter_batches(20, 5):
            for k in x:
                assert np.array_equal(x[k], from_zero[i][k])
    for packed in (True, False):
        ev = ReadOptions(seq_len=96, batch_size=6, packed=packed, eval_mode=True)
        got = []
        for r in range(2):
            with Reader(built, ev, num_readers=2, reader_index=r) as rd:
                got.append(list(rd.iter_batches()))
                nb = rd.num_batches
        assert len(got[0]) == len(got[1]) == nb
        toks, ids = [], []
        for b in range(nb):
            batch = {}
            for r in range(2):
                for key, v in got[r][b][1].items():
                    batch.setdefault(key, np.zeros((6,) + v.shape[1:], v.dtype))[streams.reader_rows(6, 2, r)] = v
            toks.append(batch["targets"][batch["loss_mask"]])
            ids.append(batch["example_ids"][batch["valid"]])
        assert np.array_equal(np.concatenate(toks), every)  # every token of every document, once, in order
        ids = np.concatenate(ids)
        assert np.array_equal(ids, np.arange(ids.size))


@pytest.mark.slow
def test_reading_during_a_real_build_matches_reading_after(tmp_path):
    out = str(tmp_path / "live")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.build_cache", *BUILD, "--chunk_bytes", "8192",
                             "--output", out, "--runner=FnApiRunner"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(out, fmt.LEDGER_NAME)):
            assert proc.poll() is None or os.path.exists(os.path.join(out, fmt.LEDGER_NAME)), proc.stdout.read()
            assert time.time() < deadline, "the build never wrote its plan"
            time.sleep(0.02)
        runs = {}
        # "streams" follows the build; "spans" (the default of the version 4 cache) waits for it to finish
        specs = {"train": ReadOptions(seq_len=50, batch_size=4, ideal_readers=2, pass_rule="streams"),
                 "unpacked": ReadOptions(seq_len=50, batch_size=4, ideal_readers=2, packed=False,
                                         pass_rule="streams"),
                 "spans": ReadOptions(seq_len=50, batch_size=4, ideal_readers=2, shuffle_seed=3),
                 "eval": ReadOptions(seq_len=50, batch_size=4, eval_mode=True)}
        live = {name: Reader(out, o, num_readers=2, reader_index=1, wait_timeout_s=180, poll_interval_s=0.05)
                for name, o in specs.items()}
        opened_during_build = not live["train"].cache.complete
        for name, rd in live.items():
            runs[name] = list(rd.iter_batches(0, 60))
            rd.close()
        assert proc.wait(timeout=180) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert opened_during_build, "the build finished before the reader opened it; nothing was tested"
    for name, o in specs.items():
        with Reader(out, o, num_readers=2, reader_index=1) as after:
            want = list(after.iter_batches(0, 60))
        assert [b for b, _ in runs[name]] == [b for b, _ in want]
        for (_, x), (_, y) in zip(runs[name], want):
            for k in x:
                assert np.array_equal(x[k], y[k]), (name, k)
