"""Local SDK workers forked from a warm process (pipelines/runners/local_workers.py).

The forked workers must be used (not silently replaced by Beam's own), build byte-identical caches, and
leave no process behind, even when the launcher is killed.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from build_helpers import FNAPI, REPO, sample_texts, tree_bytes, write_shard
from pipelines.runners import local_workers
from build_helpers import build

pytestmark = pytest.mark.skipif(not local_workers.enabled(), reason="forked workers need Linux")


def corpus(root) -> list[str]:
    texts = sample_texts(400, seed=21, min_words=50, max_words=400)
    paths = [write_shard(str(root / "in" / f"{s}.jsonl"), [{"text": t} for t in texts[s::3]]) for s in range(2)]
    paths.append(write_shard(str(root / "in" / "2.jsonl.gz"), [{"text": t} for t in texts[2::3]] + [b"{broken"]))
    return paths


def cli_build(root, name: str, *extra: str, env: dict | None = None) -> tuple[str, list[dict], subprocess.Popen]:
    """``python -m pipelines.build_cache`` with 2 multi-process DirectRunner workers and a trace."""
    out, trace = str(root / name), str(root / f"{name}-trace.jsonl")
    cmd = [sys.executable, "-m", "pipelines.build_cache", "--input", str(root / "in" / "*"), "--output", out,
           "--tokenizer", "tiktoken:cl100k_base", "--chunk_bytes", "20000", "--max_bad_fraction", "1.0",
           "--direct_num_workers=2", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(env or os.environ, CHUNKLEDGER_TRACE=trace),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return out, trace, proc


def events(trace: str) -> list[dict]:
    with open(trace) as f:
        return [json.loads(line) for line in f]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def traced_build(tmp_path, name, *extra, env=None):
    """Run the CLI build, require success, and return its output and its trace events."""
    out, trace, proc = cli_build(tmp_path, name, *extra, env=env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out, events(trace)


def assert_units_once(ev, workers: int | None = 2) -> None:
    """Every unit built exactly once (the shared queue), by ``workers`` distinct processes if given."""
    done = [(e["shard"], e["index"]) for e in ev if e["event"] == "unit_done"]
    assert len(done) == len(set(done)) >= 6
    if workers is not None:
        assert len({e["pid"] for e in ev if e["event"] == "unit_done"}) == workers


@pytest.mark.slow
def test_workers_are_forked_and_build_the_same_bytes(tmp_path):
    corpus(tmp_path)
    ref, _ = build(tmp_path, [str(tmp_path / "in" / "*")], name="fnapi", runner=FNAPI, chunk_bytes=20000,
                   max_bad_fraction=1.0)
    # the default runner (no --runner) and the explicit multi-process DirectRunner both fork
    for name, extra in (("default", ()), ("explicit", ("--runner=DirectRunner", "--direct_running_mode=multi_processing"))):
        out, ev = traced_build(tmp_path, name, *extra)
        setups = [e for e in ev if e["event"] == "setup_start"]
        assert len({e["pid"] for e in setups}) == 2 and all(e.get("forked") for e in setups), setups
        # the warm process loaded the tokenizer (on its loading thread) before forking: a worker inherits it,
        # so its CPU up to its first unit is the harness's start only (loading cl100k alone costs ~0.8 CPU-s)
        assert [e["event"] for e in ev if e["event"].startswith("warm_")] == ["warm_process_started", "warm_imported",
                                                                            "warm_loaded"]
        assert max(e["cpu"] for e in ev if e["event"] == "setup_done") < 0.5, setups
        assert_units_once(ev)  # the shared queue: every unit once, by both workers (pipelines/chunking/unit_queue.py)
        warm = [e["warm_pid"] for e in ev if e["event"] == "warm_process_started"]
        assert len(warm) == 1 and not alive(warm[0])  # stopped with the launcher
        assert not any(alive(e["pid"]) for e in setups)
        assert tree_bytes(out) == tree_bytes(ref)
    # switched off: Beam's own worker processes, the same bytes
    out, ev = traced_build(tmp_path, "off", env=dict(os.environ, CHUNKLEDGER_FORK_WORKERS="0"))
    setups = [e for e in ev if e["event"] == "setup_start"]
    assert len(setups) == 2 and not any(e.get("forked") for e in setups)
    assert_units_once(ev, workers=None)  # the queue does not depend on forking
    assert not any(e["event"] == "warm_process_started" for e in ev)
    assert tree_bytes(out) == tree_bytes(ref)


@pytest.mark.slow
def test_a_split_build_on_forked_workers_and_the_queue_writes_both_caches_like_fnapi(tmp_path):
    """Each claimed unit returns one result per cache (train, validation): both ledgers finish and every byte
    of both caches equals the one-process build's."""
    corpus(tmp_path)
    split = ("--validation_fraction", "0.3", "--split_seed", "7")
    ref, _ = build(tmp_path, [str(tmp_path / "in" / "*")], name="fnapi", runner=FNAPI, chunk_bytes=20000,
                   max_bad_fraction=1.0, validation_fraction=0.3, split_seed=7)
    out, ev = traced_build(tmp_path, "split", *split)
    setups = [e for e in ev if e["event"] == "setup_start"]
    assert len({e["pid"] for e in setups}) == 2 and all(e.get("forked") for e in setups), setups
    assert_units_once(ev)
    got = tree_bytes(out)
    for name in ("train", "validation"):
        with open(os.path.join(out, name, "ledger.json")) as f:
            led = json.load(f)
        assert led["finished"] and led["totals"]["docs"] > 0, name
    assert got == tree_bytes(ref)


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_worker_behind_and_a_rerun_finishes(tmp_path):
    texts = sample_texts(1500, seed=22, min_words=200, max_words=600)
    for s in range(2):
        write_shard(str(tmp_path / "in" / f"{s}.jsonl"), [{"text": t} for t in texts[s::2]])
    ref, _ = build(tmp_path, [str(tmp_path / "in" / "*")], name="fnapi", runner=FNAPI, chunk_bytes=20000,
                   max_bad_fraction=1.0)
    out, trace, proc = cli_build(tmp_path, "killed")
    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline and len(glob.glob(os.path.join(out, "chunks", "*",
                                                                                          "*.json"))) < 2:
        time.sleep(0.02)
    if proc.poll() is not None:
        pytest.skip("the build finished before the launcher could be killed")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    ev = events(trace)
    pids = {e["warm_pid"] for e in ev if e["event"] == "warm_process_started"}
    pids |= {e["pid"] for e in ev if e.get("forked")}
    assert len(pids) == 3  # the warm process and its two workers
    deadline = time.time() + 30
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]
    out2, _, proc2 = cli_build(tmp_path, "killed")
    _, err = proc2.communicate(timeout=300)
    assert proc2.returncode == 0, err[-3000:]
    assert tree_bytes(out2) == tree_bytes(ref)


@pytest.mark.slow
def test_a_worker_command_without_a_warm_process_starts_beams_own_worker(tmp_path):
    """Nothing listens on the socket: the command becomes Beam's standard worker (which, without a runner's
    addresses in its environment, stops at once saying so)."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_SERVICE_DESCRIPTOR")}
    proc = subprocess.run([sys.executable, "-m", "pipelines.runners.local_workers", "connect", str(tmp_path / "none.sock")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "CONTROL_API_SERVICE_DESCRIPTOR" in proc.stderr, proc.stderr[-2000:]


def test_a_joined_thread_is_waited_for_before_forking():
    baseline = local_workers._threads()
    t = threading.Thread(target=time.sleep, args=(0.05,))
    t.start()
    assert not local_workers._settled(baseline, timeout_s=0.01)  # a thread still running: never fork
    t.join()
    assert local_workers._settled(baseline)


def test_which_command_lines_use_local_workers():
    yes = [[], ["--direct_num_workers=4"], ["--runner=DirectRunner", "--direct_running_mode=multi_processing"],
           ["--runner", "DirectRunner", "--direct_running_mode", "multi_processing"]]
    no = [["--runner=FnApiRunner"], ["--runner=DirectRunner"], ["--direct_running_mode=multi_threading"],
          ["--runner=DataflowRunner"], ["--runner=DaskRunner"],
          ["--runner=DirectRunner", "--direct_running_mode=in_memory"]]
    assert all(local_workers.wants_local_workers(a) for a in yes)
    assert not any(local_workers.wants_local_workers(a) for a in no)
    assert local_workers.preload_hint(["--tokenizer=tiktoken:cl100k_base", "--verify_every", "7"]) == {
        "tokenizer": "tiktoken:cl100k_base", "backend": "auto", "verify_every": "7"}


def _claim_all(directory: str, n: int, out) -> None:
    from pipelines.chunking.unit_queue import ClaimQueue

    got = []
    for i in ClaimQueue(directory, n):
        got.append(i)
        time.sleep(0.001)  # a unit takes a while: the other process claims meanwhile
    out.put(got)


def test_the_claim_queue_gives_every_unit_to_exactly_one_process(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(str(tmp_path), 500, out)) for _ in range(3)]
    for p in procs:
        p.start()
    claimed = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert sorted(i for c in claimed for i in c) == list(range(500))
    assert all(c == sorted(c) and c for c in claimed)  # each in the plan's order, each took some
