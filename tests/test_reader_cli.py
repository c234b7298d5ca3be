"""`python -m reader inspect|validate|batches`."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from reader import BATCH_KEYS, ReadOptions, Reader
from reader.cli import main

import cachegen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache_dir():
    d = tempfile.mkdtemp(prefix="cl-cli-")
    rng = np.random.default_rng(9)
    chunks = cachegen.random_chunks(rng, 8, empty_prob=0.2)
    cachegen.write_synthetic_cache(os.path.join(d, "c"), chunks, chunks_per_shard=[5, 3], row_group_tokens=10)
    yield os.path.join(d, "c"), chunks, d
    shutil.rmtree(d, ignore_errors=True)


def test_inspect_reports_counts_and_percentiles(cache_dir, capsys):
    root, chunks, _ = cache_dir
    assert main(["inspect", root, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    lengths = [len(d) for c in chunks for d in c]
    assert info["documents"] == len(lengths)
    assert info["tokens"] == sum(lengths)
    assert info["chunks"] == 8 and info["finished"] is True
    assert info["doc_length_percentiles"]["p50"] == int(np.percentile(lengths, 50))
    assert info["doc_length_percentiles"]["p100"] == max(lengths)
    assert info["tokenizer"]["spec"] == "synthetic"
    assert main(["inspect", root]) == 0
    text = capsys.readouterr().out
    assert f"documents   {len(lengths):,}" in text and "p99=" in text


def test_validate_ok_then_nonzero_on_a_damaged_chunk(cache_dir, capsys):
    root, _, _ = cache_dir
    assert main(["validate", root]) == 0
    assert "OK: 8 chunks" in capsys.readouterr().out
    victim = "chunks/shard-00001/chunk-000001.parquet"
    path = os.path.join(root, victim)
    data = bytearray(open(path, "rb").read())
    data[100] ^= 1
    open(path, "wb").write(bytes(data))
    assert main(["validate", root]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM" in out and victim in out and "checksum mismatch" in out


def test_validate_as_a_subprocess_exits_nonzero(cache_dir):
    root, _, _ = cache_dir
    os.truncate(os.path.join(root, "chunks/shard-00000/chunk-000002.parquet"), 10)
    p = subprocess.run([sys.executable, "-m", "reader", "validate", root], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 1
    assert "chunk-000002.parquet: truncated" in p.stdout


@pytest.mark.parametrize("extra,kw", [
    (["--ideal_readers", "3"], dict(ideal_readers=3)),
    (["--unpacked", "--ideal_readers", "4", "--num_readers", "2", "--reader_index", "1"],
     dict(packed=False, ideal_readers=4)),
    (["--eval", "--start", "1", "--count", "50"], dict(eval_mode=True)),
    (["--eval", "--start", "1", "--count", "0", "--unpacked"], dict(eval_mode=True, packed=False)),
    (["--shuffle_seed", "4", "--ideal_readers", "2", "--num_readers", "2", "--reader_index", "0"],
     dict(shuffle_seed=4, ideal_readers=2)),
])
def test_batches_npz_equals_reader_batch(cache_dir, extra, kw):
    root, _, d = cache_dir
    out = os.path.join(d, "b.npz")
    args = ["batches", root, "--seq_len", "6", "--batch_size", "4", "--start", "2", "--count", "3",
            "--out", out] + extra
    assert main(args) == 0
    got = np.load(out)
    R = int(extra[extra.index("--num_readers") + 1]) if "--num_readers" in extra else 1
    r = int(extra[extra.index("--reader_index") + 1]) if "--reader_index" in extra else 0
    kw.setdefault("ideal_readers", 16)
    opts = ReadOptions(seq_len=6, batch_size=4, **kw)
    with Reader(root, opts, num_readers=R, reader_index=r) as rd:
        bs = got["batch_index"].tolist()
        if kw.get("eval_mode"):
            assert bs == list(range(1, rd.num_batches))  # --start 1, stops at the end of the pass
        else:
            assert bs == [2, 3, 4]
        for i, b in enumerate(bs):
            want = rd.batch(b)
            for k in BATCH_KEYS:
                assert np.array_equal(got[k][i], want[k]), k
    assert got["targets"].shape[1:] == (4 // R, 6)


def test_help_explains_every_command():
    p = subprocess.run([sys.executable, "-m", "reader", "batches", "--help"], cwd=ROOT, capture_output=True,
                       text=True)
    assert p.returncode == 0
    for flag in ("--seq_len", "--batch_size", "--unpacked", "--ideal_readers", "--num_readers", "--reader_index",
                 "--start", "--count", "--eval", "--shuffle_seed", "--out"):
        assert flag in p.stdout


def test_errors_are_one_line_and_nonzero(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a chunkledger cache" in capsys.readouterr().err
