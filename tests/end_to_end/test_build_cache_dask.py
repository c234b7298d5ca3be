"""The builder on a real Dask cluster: a `dask scheduler` and two `dask worker` processes on 127.0.0.1.

Checks that ``--runner=DaskRunner --dask_client_address=...`` builds the FnApiRunner's cache byte for byte,
that both workers build units (their pids in the build trace are the workers the scheduler knows), that a
SIGKILLed worker mid-build costs nothing (Dask retries its units elsewhere, or the job fails and the rerun
resumes), and that a wrong address fails at once, naming it, before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pipelines import build_cache, trace
from pipelines.runners import choice as runners
from pipelines.build_cache import BuildError
from build_helpers import FNAPI, load_ledger, sample_texts, tree_bytes, write_shard
from build_helpers import build, check_cache
from build_helpers import mixed_lines

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHUNK = 256 << 10
START_SECONDS = 120  # scheduler and workers up (workers import Dask and register)
BUILD_SECONDS = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three shards (plain with bad lines, gzip, zstd): about 20 work units of a tenth of a second or more."""
    d = tmp_path_factory.mktemp("dask_in")
    texts = sample_texts(4000, seed=5, min_words=100, max_words=600)
    q = len(texts) // 4
    bad, _ = mixed_lines(3, n_good=30)
    paths = [write_shard(str(d / "a.jsonl"), bad + [{"text": t} for t in texts[:2 * q]]),
             write_shard(str(d / "b.jsonl.gz"), [{"text": t} for t in texts[2 * q:3 * q]]),
             write_shard(str(d / "c.jsonl.zst"), [{"text": t} for t in texts[3 * q:]])]
    return str(d / "*"), paths


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The FnApiRunner's cache of the corpus, checked against the format."""
    pattern, paths = corpus
    out, _ = build(tmp_path_factory.mktemp("dask_ref"), [pattern], name="fnapi", runner=FNAPI, chunk_bytes=CHUNK,
                   max_bad_fraction=1.0, append_eos=True)
    check_cache(out, paths, CHUNK, append_eos=True)
    files = tree_bytes(out)
    assert any(k.startswith("bad/") for k in files)
    return files



def work_units(ledger: dict) -> set:
    """(shard, index) of every work unit of a build: each chunk of a plain shard, each compressed shard."""
    return {(i["shard"], k) for i in ledger["inputs"]
            for k in (range(i["chunks"]) if i["compression"] == "none" else [None])}


def build_argv(pattern: str, out: str, address: str) -> list[str]:
    return [sys.executable, "-m", "pipelines.build_cache", "--input", pattern, "--output", out,
            "--tokenizer", "tiktoken:cl100k_base", "--chunk_bytes", str(CHUNK), "--append_eos",
            "--max_bad_fraction", "1.0", "--runner=DaskRunner", f"--dask_client_address={address}"]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it if it is still there after 15 s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # also whatever the process started, if it left any
    proc.wait(timeout=30)


class DaskCluster:
    """A scheduler and worker processes on 127.0.0.1 (the venv's own Dask), each in its own process group.

    Workers run without a nanny (the pid the test kills is the worker), one thread each, and write the
    build trace to ``trace_path``. ``--death-timeout`` and ``--idle-timeout`` end them even if the test
    process dies before its clean-up.
    """

    def __init__(self, tmp, scheduler_env: dict[str, str] | None = None):
        self.tmp = tmp
        self.trace_path = str(tmp / "trace.jsonl")
        self.scheduler_file = str(tmp / "scheduler.json")
        self.procs: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []
        self.scheduler = self._spawn("scheduler", [
            "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
            "--scheduler-file", self.scheduler_file, "--idle-timeout", "900"], scheduler_env or {})
        deadline = time.time() + START_SECONDS
        while not os.path.exists(self.scheduler_file):
            self._check_alive(self.scheduler, deadline)
            time.sleep(0.1)
        time.sleep(0.2)  # the file is written in one go; let it land
        with open(self.scheduler_file, encoding="utf-8") as f:
            self.address = json.load(f)["address"]

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, **env), start_new_session=True)
        log.close()
        proc.name = name
        self.procs.append(proc)
        return proc

    def log(self, proc: subprocess.Popen) -> str:
        with open(self.tmp / f"{proc.name}.log", encoding="utf-8", errors="replace") as f:
            return f.read()[-3000:]

    def _check_alive(self, proc: subprocess.Popen, deadline: float) -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"dask {proc.name} exited with {proc.returncode}:\n{self.log(proc)}")
        if time.time() > deadline:
            raise RuntimeError(f"dask {proc.name} not ready after {START_SECONDS} s:\n{self.log(proc)}")

    def start_worker(self) -> subprocess.Popen:
        name = f"worker{sum(p.name.startswith('worker') for p in self.procs)}"  # names are never reused
        proc = self._spawn(name, [
            "-m", "distributed.cli.dask_worker", self.address, "--nthreads", "1", "--no-nanny", "--no-dashboard",
            "--name", name, "--local-directory", str(self.tmp / name), "--death-timeout", "60"],
            {trace.ENV: self.trace_path})
        self.workers.append(proc)
        return proc

    def wait_for_workers(self, n: int) -> dict[str, int]:
        """Block until the scheduler knows ``n`` workers; returns worker address -> pid (asked of each)."""
        from distributed import Client

        deadline = time.time() + START_SECONDS
        with Client(self.address, timeout=30, set_as_default=False) as client:
            while len(client.scheduler_info()["workers"]) < n:
                for w in self.workers:
                    self._check_alive(w, deadline)
                time.sleep(0.2)
            return client.run(os.getpid)

    def kill(self, worker: subprocess.Popen) -> None:
        """SIGKILL a worker (no clean-up on its side, as when a machine dies); it no longer counts."""
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
        self.workers.remove(worker)

    def stop(self) -> None:
        for proc in reversed(self.procs):  # workers first, then the scheduler
            _stop(proc)


@contextlib.contextmanager
def dask_cluster(tmp, workers: int = 2, scheduler_env: dict[str, str] | None = None):
    cluster = None
    try:
        cluster = DaskCluster(tmp, scheduler_env)
        for _ in range(workers):
            cluster.start_worker()
        pids = cluster.wait_for_workers(workers)
        assert sorted(pids.values()) == sorted(w.pid for w in cluster.workers)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)  # Beam's own Dask client would wait far longer on the silent port
def test_missing_or_unreachable_scheduler_fails_at_once_naming_it(corpus, tmp_path):
    pattern, _ = corpus
    out = str(tmp_path / "never")
    with pytest.raises(BuildError, match="needs the Dask scheduler.*--dask_client_address=HOST:PORT"):
        build_cache.run(build_argv(pattern, out, "x")[3:-1])
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BuildError, match=f"--dask_client_address=tcp://127.0.0.1:{port}: no Dask scheduler"):
        build_cache.run(build_argv(pattern, out, f"tcp://127.0.0.1:{port}")[3:])
    with pytest.raises(BuildError, match="--dask_scheduler_file=.*nope.json: cannot read"):
        build_cache.run(build_argv(pattern, out, "x")[3:-1] + [f"--dask_scheduler_file={tmp_path}/nope.json"])
    # Something listens but never speaks Dask: bounded by the connection timeout, then the same error.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = "127.0.0.1:%d" % silent.getsockname()[1]
        with pytest.raises(BuildError, match=f"--dask_client_address={address}: no Dask scheduler answers"):
            build_cache.run(build_argv(pattern, out, address)[3:])
    assert not os.path.exists(out)  # nothing was planned or written


@pytest.mark.slow
def test_dask_cluster_build_is_byte_identical_and_uses_both_workers(corpus, reference, tmp_path):
    pattern, _ = corpus
    with dask_cluster(tmp_path) as cluster:
        out = str(tmp_path / "dask")
        proc = subprocess.run(build_argv(pattern, out, cluster.address), cwd=REPO, capture_output=True, text=True,
                              timeout=BUILD_SECONDS, env=dict(os.environ, **{trace.ENV: cluster.trace_path}))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "chunkledger:" in proc.stdout
        got = tree_bytes(out)
        assert sorted(got) == sorted(reference)
        for k in reference:
            assert got[k] == reference[k], f"{k} differs from the FnApiRunner's"
        ev = _events(cluster.trace_path)
        ledger = load_ledger(out)
        units = work_units(ledger)
        done = [e for e in ev if e["event"] == "unit_done"]
        assert sorted((e["shard"], e["index"]) for e in done) == sorted(units)  # each unit once, no retry
        workers = {w.pid for w in cluster.workers}
        by_pid = {pid: sum(e["pid"] == pid for e in done) for pid in workers}
        assert all(n > 0 for n in by_pid.values()), f"units per worker pid: {by_pid}"
        assert {e["pid"] for e in done} == workers
        assert len({e["pid"] for e in ev if e["event"] == "finalize_done"} & workers) == 1
        launcher = {e["pid"] for e in ev if e["event"] == "launcher_start"}
        assert len(launcher) == 1 and not launcher & workers
        # the short name, and the defaults that spread the units (options given are kept)
        args = runners.runner_args(["--runner=DaskRunner", f"--dask_client_address={cluster.address}"])
        assert args[-3:] == [f"--runner={runners.DASK_RUNNER}", "--dask_connection_timeout=10",
                             "--dask_partition_size=1"]
        own = ["--runner=dask", f"--dask_scheduler_file={cluster.scheduler_file}", "--dask_npartitions=3"]
        assert runners.runner_args(own)[3:] == [f"--runner={runners.DASK_RUNNER}",
                                                     "--dask_connection_timeout=10"]


@pytest.mark.slow
@pytest.mark.parametrize("allowed_failures", [None, 0], ids=["dask-retries", "job-fails"])
def test_sigkill_of_a_worker_mid_build_then_rerun_is_byte_identical(corpus, reference, tmp_path, allowed_failures):
    """SIGKILL one of two workers while it builds a unit, once some units are done.

    With Dask's default retries the scheduler moves the lost work to the surviving worker and the first run
    succeeds; with retries off (``allowed-failures: 0``) the job fails with KilledWorker and the message
    says to rerun. Either way, rerunning the same command (after starting a replacement worker) ends with
    the FnApiRunner's bytes.
    """
    pattern, _ = corpus
    env = {} if allowed_failures is None else {"DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": str(allowed_failures)}
    out = str(tmp_path / "killed")
    with dask_cluster(tmp_path, scheduler_env=env) as cluster:
        workers = {w.pid: w for w in cluster.workers}
        launcher = subprocess.Popen(build_argv(pattern, out, cluster.address), cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            victim, in_flight, done_before = _kill_a_busy_worker(cluster, launcher)
            stdout, stderr = launcher.communicate(timeout=BUILD_SECONDS)
        finally:
            _stop(launcher)
        assert victim.returncode == -signal.SIGKILL
        units = work_units(load_ledger(out))
        assert 0 < done_before < len(units), "the kill did not land mid-build"
        survivor = next(pid for pid in workers if pid != victim.pid)
        after = [e for e in _events(cluster.trace_path) if e["t"] > in_flight["t"]]
        if allowed_failures is None:
            assert launcher.returncode == 0, stderr[-3000:]
            assert load_ledger(out)["finished"] is True
            # the unit the victim was building was built again, by the survivor
            assert any(e["event"] == "unit_done" and e["pid"] == survivor and
                       (e["shard"], e["index"]) == (in_flight["shard"], in_flight["index"]) for e in after)
        else:
            assert launcher.returncode == 1, (stdout[-2000:], stderr[-3000:])  # an environment fault
            assert "KilledWorker" in stderr and "Rerunning the same command resumes" in stderr, stderr[-3000:]
            assert load_ledger(out)["finished"] is False
        cluster.start_worker()
        cluster.wait_for_workers(2)
        rerun = subprocess.run(build_argv(pattern, out, cluster.address), cwd=REPO, capture_output=True,
                               text=True, timeout=BUILD_SECONDS)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        expected = "already complete" if allowed_failures is None else "resuming the unfinished build"
        assert expected in rerun.stdout + rerun.stderr
    got = tree_bytes(out)
    assert sorted(got) == sorted(reference)  # no temporary file of the killed worker is left either
    for k in reference:
        assert got[k] == reference[k], f"{k} differs from the FnApiRunner's"


def _events(path: str) -> list[dict]:
    """The trace's events so far, in time order (a line still being appended is left for the next look)."""
    if not os.path.exists(path):
        return []
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return sorted(events, key=lambda e: e["t"])


def _kill_a_busy_worker(cluster: DaskCluster, launcher: subprocess.Popen):
    """Once 3 units are done, SIGKILL a worker that is inside a unit. Returns (worker, its unit_start, units done)."""
    workers = {w.pid: w for w in cluster.workers}
    deadline = time.time() + BUILD_SECONDS
    while time.time() < deadline and launcher.poll() is None:
        ev = _events(cluster.trace_path)
        done = sum(e["event"] == "unit_done" for e in ev)
        open_units: dict[int, dict] = {}
        for e in ev:
            if e["event"] == "unit_start":
                open_units[e["pid"]] = e
            elif e["event"] == "unit_done":
                open_units.pop(e["pid"], None)
        busy = [pid for pid in open_units if pid in workers]
        if done >= 3 and busy:
            victim = workers[busy[0]]
            cluster.kill(victim)
            return victim, open_units[busy[0]], done
        time.sleep(0.01)
    raise AssertionError(f"no worker was busy after 3 units (build exit code {launcher.poll()})")


@pytest.mark.slow
def test_dask_cluster_builds_columnar_and_json_array_inputs_byte_identical(tmp_path):
    from columnar_files import corpus_table, every_format

    inputs = list(every_format(tmp_path / "in", corpus_table(300, seed=6)).values())
    args = [a for p in inputs for a in ("--input", p)] + ["--tokenizer", "tiktoken:cl100k_base", "--chunk_bytes",
                                                          "8192", "--keep_fields", "source", "--append_eos"]
    ref = str(tmp_path / "fnapi")
    build_cache.run(args + ["--output", ref] + FNAPI)
    with dask_cluster(tmp_path) as cluster:
        out = str(tmp_path / "dask")
        proc = subprocess.run([sys.executable, "-m", "pipelines.build_cache", *args, "--output", out,
                               "--runner=DaskRunner", f"--dask_client_address={cluster.address}"], cwd=REPO,
                              capture_output=True, text=True, timeout=BUILD_SECONDS)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree_bytes(out) == tree_bytes(ref)
    assert {i["format"] for i in load_ledger(out)["inputs"]} == {"jsonl", "json_array", "parquet", "arrow"}
