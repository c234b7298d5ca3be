"""How far a build has got (reader/storage/progress.py): the arithmetic of bytes done, rate and ETA, the files
it is read from, and ``python -m reader inspect`` on a real build killed midway."""

import glob
import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from reader import Cache
from reader.format import spec as fmt
from reader.storage import progress as pg

import cachegen
from build_helpers import REPO, mixed_lines, write_shard


def test_rate_counts_the_work_of_this_run_from_its_start():
    times, amounts = [100.0, 105.0, 110.0, 120.0], [10, 20, 30, 40]
    assert pg.rate(times, amounts, start=100.0) == pytest.approx(100 / 20)  # all four, over 100..120
    assert pg.rate(times, amounts, start=108.0) == pytest.approx(70 / 12)  # an earlier run's two left out
    assert pg.rate([120.0, 100.0, 110.0], [40, 10, 30], start=None) == pytest.approx(70 / 20)  # first one's work
    assert pg.rate([100.0], [10], start=None) is None  # one file: no interval
    assert pg.rate(times, amounts, start=121.0) is None  # nothing written since the start
    assert pg.rate([], [], start=None) is None


def test_eta_is_what_is_left_at_the_rate():
    assert pg.eta(100, 4.0) == 25.0
    assert pg.eta(0, None) == 0.0 and pg.eta(-5, 2.0) == 0.0
    assert pg.eta(10, None) is None and pg.eta(10, 0.0) is None


def _sidecar(shard, k, lo, hi, tokens, docs=2, bad=None):
    return {"shard": shard, "index_in_shard": k, "byte_range": [lo, hi], "tokens": tokens, "docs": docs,
            "bad_records": sum((bad or {}).values()), "bad_reasons": bad or {}}


INPUTS = [{"size": 250, "compression": "none", "chunks": 3},  # chunks of 100, 100, 50 bytes
          {"size": 40, "compression": "gzip", "chunks": None},  # 40 bytes of gzip, finished below
          {"size": 30, "compression": "zstd", "chunks": None}]  # 30 bytes of zstd, still being read


def test_summarize_counts_plain_bytes_as_written_and_compressed_shards_when_done():
    written = [
        pg.Written(0, 50.0, entry=_sidecar(0, 0, 0, 100, 30)),  # an earlier run's chunk (before the lock)
        pg.Written(0, 104.0, entry=_sidecar(0, 2, 200, 250, 10, bad={"blank_line": 2})),
        pg.Written(1, 102.0, entry=_sidecar(1, 0, 0, 64, 20)),
        pg.Written(1, 106.0, entry=_sidecar(1, 1, 64, 90, 8, bad={"blank_line": 1, "invalid_json": 1})),
        pg.Written(1, 108.0, done={"chunks": 2, "uncompressed_bytes": 90}),
        pg.Written(2, 110.0, entry=_sidecar(2, 0, 0, 64, 12)),
    ]
    p = pg.summarize(INPUTS, written, start=100.0, now=130.0, running=True)
    assert (p.input_bytes_total, p.input_bytes_done) == (320, 100 + 50 + 40)
    assert p.fraction == pytest.approx(190 / 320)
    assert (p.shards_streaming, p.streaming_uncompressed_bytes) == (1, 64)
    assert (p.chunks_written, p.chunks_planned, p.chunks_planned_exact) == (5, 3 + 2 + 1, False)
    assert (p.documents, p.tokens, p.bad_records) == (10, 80, 4)
    assert p.bad_reasons == {"blank_line": 3, "invalid_json": 1}
    # this run (from 100 to the last file at 110): 50 plain bytes + the gzip shard's 40; 50 tokens; 4 chunks
    assert p.bytes_per_s == pytest.approx(90 / 10) and p.tokens_per_s == pytest.approx(50 / 10)
    assert p.chunks_per_s == pytest.approx(4 / 10) and p.rate_chunks == 4
    assert p.eta_s == pytest.approx((320 - 190) / 9.0)
    assert p.last_write_age_s == pytest.approx(20.0)
    assert [(e["shard"], e["index_in_shard"]) for e in p.entries] == [(0, 0), (0, 2), (1, 0), (1, 1), (2, 0)]
    text = pg.describe(p, readable=2)
    assert text[0] == ("input 190 B of 320 B (59.4%); 1 compressed shard(s) being read (64 B uncompressed so far) "
                       "count when they finish")
    assert text[1] == ("written 5 of at least 6 chunks (2 readable in global order): 10 documents, 80 tokens, 4 bad "
                       "records")
    assert text[2] == ("rate 9 B/s, 5 tokens/s, 0.40 chunks/s (over 4 chunks of this run); ETA 14 s; last file "
                       "written 20 s ago")


def test_without_a_running_builder_there_is_no_eta():
    written = [pg.Written(0, 10.0, entry=_sidecar(0, 0, 0, 100, 5)),
               pg.Written(0, 20.0, entry=_sidecar(0, 1, 100, 200, 5))]
    p = pg.summarize(INPUTS[:1], written, start=None, now=25.0)
    assert p.bytes_per_s == pytest.approx(100 / 10) and p.rate_chunks == 1  # the first file's work is before it
    p.stopped = "no builder holds the lock"
    assert pg.describe(p)[2].endswith("(over 1 chunk); ETA -: no builder holds the lock; last file written 5 s ago")


@pytest.mark.parametrize("seconds,text", [(0.4, "0 s"), (59, "59 s"), (61, "1 min 1 s"), (7322, "2 h 2 min")])
def test_format_seconds(seconds, text):
    assert pg.format_seconds(seconds) == text


def _set_time(path, t):
    os.utime(path, (t, t))


def test_read_progress_from_a_running_builds_files(tmp_path):
    root = str(tmp_path / "c")
    rng = np.random.default_rng(1)
    chunks = cachegen.random_chunks(rng, 5, empty_prob=0)
    entries = cachegen.write_synthetic_cache(root, chunks, finished=False, chunks_per_shard=[3, 2],
                                             compressed=[False, True], written=[0, 1, 2, 4])
    base = 1_700_000_000.0
    lock = os.path.join(root, fmt.LOCK_NAME)
    with open(lock, "w") as f:  # held by this (live) process
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": None}, f)
    _set_time(lock, base)
    written = [e for e in entries if e is not None]
    for i, e in enumerate(written):
        _set_time(os.path.join(root, fmt.sidecar_path(e["shard"], e["index_in_shard"])), base + 10 * (i + 1))
    cache = Cache(root)
    p = pg.read_progress(cache, now=base + 60)
    assert p.running and p.stopped is None and not p.finished
    plain = [e for e in written if e["shard"] == 0]  # shard 0's chunks of 1000 bytes; shard 1 is "gzip"
    assert p.input_bytes_done == 1000 * len(plain) and p.input_bytes_total == 5000
    assert p.chunks_written == 4 and p.tokens == sum(e["tokens"] for e in written)
    assert p.bytes_per_s == pytest.approx(1000 * len(plain) / 40)
    assert p.last_write_age_s == pytest.approx(20)
    # the same lock held by a process that is gone (this pid, another start time): no ETA, and it says why
    with open(lock, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": -1}, f)
    gone = pg.read_progress(cache, now=base + 60)
    assert not gone.running and f"process {os.getpid()} on {socket.gethostname()}, is gone" in gone.stopped
    os.remove(lock)
    assert "no builder holds the lock" in pg.read_progress(cache).stopped
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=[3, 2], compressed=[False, True])  # finished
    done = pg.read_progress(Cache(root))
    assert done.finished and done.input_bytes_done == done.input_bytes_total and done.chunks_written == 5


@pytest.mark.slow
def test_inspect_on_a_build_killed_midway(tmp_path):
    """A real build of a plain, a gzip and a zstd shard, SIGKILLed after its 100th file (both compressed shards and
    some chunks of the plain one written: FnApiRunner builds the largest work units first), then inspected: its
    figures are the chunks' entries' (a chunk's entry is written after its sidecar)."""
    inp = tmp_path / "in"
    for shard, name in enumerate(["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]):
        lines, _ = mixed_lines(shard + 20, n_good=45 - 10 * shard)
        write_shard(str(inp / name), lines)
    out = str(tmp_path / "killed")
    argv = ["--input", str(inp / "*"), "--output", out, "--tokenizer", "tiktoken:cl100k_base", "--chunk_bytes", "4000",
            "--max_bad_fraction", "1.0", "--runner=FnApiRunner"]
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "support", "kill_at.py"), "100:after_rename",
                           *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    sidecars = glob.glob(os.path.join(out, "chunks", "*", "chunk-*.entry"))
    assert glob.glob(os.path.join(out, "chunks", "shard-00000", "chunk-*.json")), "no chunk of the plain shard yet"
    assert glob.glob(os.path.join(out, "chunks", "*", "_DONE.json")), "no compressed shard finished yet"
    got = subprocess.run([sys.executable, "-m", "reader", "inspect", out, "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    info = json.loads(got.stdout)
    p = info["progress"]
    plan = json.load(open(os.path.join(out, "ledger.json")))
    sides = [json.load(open(s)) for s in sidecars]
    done_shards = {int(d.split("shard-")[1][:5]) for d in glob.glob(os.path.join(out, "chunks", "*", "_DONE.json"))}
    want_done = sum(s["byte_range"][1] - s["byte_range"][0] for s in sides if s["shard"] == 0)
    want_done += sum(plan["inputs"][s]["size"] for s in done_shards)
    assert info["finished"] is False and p["finished"] is False
    assert p["chunks_written"] == len(sides) and p["tokens"] == sum(s["tokens"] for s in sides)
    assert p["input_bytes_done"] == want_done and p["input_bytes_total"] == sum(i["size"] for i in plan["inputs"])
    assert p["bad_records"] == sum(s["bad_records"] for s in sides)
    assert p["running"] is False and "is gone: rerun the build command to resume" in p["stopped"]
    text = subprocess.run([sys.executable, "-m", "reader", "inspect", out], cwd=REPO, capture_output=True, text=True,
                          timeout=120).stdout
    assert f"written {len(sides)} of " in text and "ETA -: the builder holding the lock" in text
    pct = f"({100 * want_done / p['input_bytes_total']:.1f}%)"
    assert pct in text.splitlines()[-3], text


def test_a_zombie_lock_holder_is_not_a_running_build():
    """``inspect`` and the builder's lock share one liveness rule: a holder killed but not yet reaped (a
    zombie, as under a PID 1 that reaps late) will never write again."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        assert pg.process_stat(proc.pid)[0] == "Z"
        holder = {"host": socket.gethostname(), "pid": proc.pid, "start_ticks": pg.start_ticks(proc.pid)}
        assert pg.holder_alive(holder) is False
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": pg.start_ticks(os.getpid())}
        assert pg.holder_alive(me) is True
        assert pg.holder_alive(dict(me, start_ticks=me["start_ticks"] + 1)) is False  # a reused pid
        assert pg.holder_alive(dict(me, host="another-host")) is None
    finally:
        proc.wait()
