"""Same bytes on every runner: FnApiRunner, DirectRunner (2 processes) and PortableRunner (LOOPBACK)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from build_helpers import DIRECT_MP2, FNAPI, tree_bytes, write_shard
from build_helpers import build, check_cache
from build_helpers import mixed_lines

CHUNK = 2500


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def job_service():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "apache_beam.runners.portability.local_job_service_main", f"--port={port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("localhost", port)) == 0:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"job service exited: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        yield f"localhost:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_identical_bytes_across_runners(tmp_path, job_service):
    paths = []
    for shard, name in enumerate(["a.jsonl", "b.jsonl", "c.jsonl.gz", "d.jsonl.zst"]):
        lines, _ = mixed_lines(shard + 20, n_good=30)
        paths.append(write_shard(str(tmp_path / "in" / name), lines))
    inputs = [str(tmp_path / "in" / "*")]
    common = dict(chunk_bytes=CHUNK, max_bad_fraction=1.0, append_eos=True, row_group_tokens=3000)
    fn_out, _ = build(tmp_path, inputs, name="fnapi", runner=FNAPI, **common)
    check_cache(fn_out, paths, CHUNK, append_eos=True)
    mp_out, _ = build(tmp_path, inputs, name="direct_mp2", runner=DIRECT_MP2, **common)
    portable = ["--runner=PortableRunner", f"--job_endpoint={job_service}", "--environment_type=LOOPBACK"]
    pr_out, _ = build(tmp_path, inputs, name="portable", runner=portable, **common)
    ref = tree_bytes(fn_out)
    assert len(ref) > 20 and any(k.startswith("bad/") for k in ref)
    for other in (mp_out, pr_out):
        got = tree_bytes(other)
        assert sorted(got) == sorted(ref), other
        for k in ref:
            assert got[k] == ref[k], f"{other}: {k} differs"


@pytest.mark.slow
def test_columnar_and_json_array_inputs_identical_bytes_across_runners(tmp_path, job_service):
    """Every input format in one build: the same bytes on every runner (Dask: test_build_cache_dask.py)."""
    from columnar_files import corpus_table, every_format

    inputs = list(every_format(tmp_path / "in", corpus_table(200, seed=4)).values())
    common = dict(chunk_bytes=CHUNK * 2, max_bad_fraction=1.0, append_eos=True, keep_fields="source,id")
    outs = [build(tmp_path, inputs, name=name, runner=runner, **common)[0] for name, runner in (
        ("fnapi", FNAPI), ("direct_mp2", DIRECT_MP2),
        ("portable", ["--runner=PortableRunner", f"--job_endpoint={job_service}", "--environment_type=LOOPBACK"]))]
    ref = tree_bytes(outs[0])
    assert len(ref) > 50
    for other in outs[1:]:
        assert tree_bytes(other) == ref, other
