"""The optional build timeline (pipelines/trace.py): off by default, complete when on, never in the cache."""

from __future__ import annotations

import glob
import os

import pytest

from build_helpers import FNAPI, REPO, SAMPLE_DIR as SAMPLE, load_ledger, tree_digest, work_units
from pipelines import build_cache, trace
from pipelines.plan import ChunkConfig, MatchedFile, make_plan


def _build(out: str) -> dict:
    argv = ["--input", os.path.join(SAMPLE, "*"), "--output", out, "--tokenizer", "tiktoken:cl100k_base",
            "--chunk_bytes", "40000", *FNAPI]
    return build_cache.run(argv)


def test_event_writes_nothing_unless_enabled(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    monkeypatch.delenv(trace.ENV, raising=False)
    trace.event("unit_start", shard=0)
    assert not trace.enabled() and not path.exists()
    monkeypatch.setenv(trace.ENV, str(path))
    trace.event("unit_start", shard=0, index=1)
    trace.event("unit_done", shard=0, index=1, tokens=5)
    ev = trace.read(str(path))
    assert [e["event"] for e in ev] == ["unit_start", "unit_done"]
    assert ev[1]["tokens"] == 5 and ev[0]["pid"] == os.getpid() and ev[0]["t"] <= ev[1]["t"]


def test_traced_build_records_every_unit_and_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.delenv(trace.ENV, raising=False)
    plain = str(tmp_path / "plain")
    _build(plain)
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(trace.ENV, str(path))
    traced = str(tmp_path / "traced")
    _build(traced)
    # The trace is written outside the cache and changes no byte of it.
    assert tree_digest(plain) == tree_digest(traced)
    ledger = load_ledger(traced)
    files = [MatchedFile(i["path"], i["size"]) for i in ledger["inputs"]]
    units = work_units(make_plan(ledger["tokenizer"], ChunkConfig(**ledger["config"]), files))
    ev = trace.read(str(path))
    done = [e for e in ev if e["event"] == "unit_done"]
    assert sorted((e["shard"], e["index"]) for e in done) == sorted((u.shard, u.index) for u in units)
    assert len([e for e in ev if e["event"] == "unit_start"]) == len(units)
    assert sum(e["tokens"] for e in done) == ledger["totals"]["tokens"]
    names = [e["event"] for e in ev]
    assert names.index("planned") < names.index("run_start") < names.index("setup_start")
    assert names.index("finalize_start") < names.index("finalize_done") < names.index("run_done")
    assert max(e["t"] for e in done) <= min(e["t"] for e in ev if e["event"] == "finalize_start")
    assert all(abs(e["proc_start"] - e["t"]) < 3600 for e in ev if e["event"] == "setup_start")
    assert not glob.glob(os.path.join(traced, "**", "*trace*"), recursive=True)


@pytest.mark.slow
def test_cli_build_with_two_worker_processes_is_traced_and_identical(tmp_path):
    """The command line with 2 DirectRunner worker processes: launcher and both workers trace, the garbage
    collector is back on after the launcher's imports, and the cache equals an in-process build."""
    import subprocess
    import sys

    from build_helpers import DIRECT_MP2

    ref = str(tmp_path / "ref")
    _build(ref)
    out, path = str(tmp_path / "cli"), tmp_path / "cli-trace.jsonl"
    env = dict(os.environ, **{trace.ENV: str(path)})
    cmd = [sys.executable, "-m", "pipelines.build_cache", "--input", os.path.join(SAMPLE, "*"), "--output", out,
           "--tokenizer", "tiktoken:cl100k_base", "--chunk_bytes", "40000", *DIRECT_MP2]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree_digest(out) == tree_digest(ref)
    ev = trace.read(str(path))
    launcher = {e["pid"] for e in ev if e["event"] == "launcher_start"}
    assert len(launcher) == 1 and launcher != {os.getpid()}
    imported = next(e for e in ev if e["event"] == "launcher_imported")
    assert imported["gc_enabled"] is True and imported["gc_frozen"] > 0
    workers = {e["pid"] for e in ev if e["event"] == "unit_done"}
    assert len(workers) == 2 and not workers & launcher
    assert [e["event"] for e in ev][-2:] == ["run_done", "launcher_exit"]
