"""What the command line shows: the progress line (on a terminal, and piped), one message for a failure
with the path of the full log, one line for Ctrl-C. Real builds in subprocesses, each bounded in time and
killed (its whole process group) if it overruns.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from build_helpers import REPO, load_ledger, sample_texts, write_shard
from pipelines.errors import DamagedInput
from pipelines.inputs.decompress import open_input
from reader.format import spec as fmt

pytestmark = pytest.mark.timeout(900)

BUILD_SECONDS = 300
CHUNK = 8192
RERUN = "Rerunning the same command resumes: completed chunks are kept."
RUNNERS = {"default": [], "fnapi": ["--runner=FnApiRunner"],
           "portable": ["--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=LOOPBACK"]}
# in make test only: the portable runner's cases (it starts a job service) and the default runner's (it forks
# worker processes); the in-process runner's run in test-fast too
RUNNER_CASES = [pytest.param(r, marks=[pytest.mark.slow] * (r != "fnapi")) for r in RUNNERS]
MB = r"[\d,]+\.\d"
BUILDING = re.compile(rf"building: ({MB}) of (~?)({MB}) MB \((\d+\.\d)%\), ([\d,]+) documents?, ([\d,]+) tokens?, "
                      r"([\d,]+) bad records?(?:, ETA unknown|, [\d,]+\.\d MB/s, ETA (?:\d+ h \d+ min|\d+ min \d+ s|\d+ s))")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 4 MB in some 500 chunks: a plain shard with 3 bad lines, and a gzip shard."""
    d = tmp_path_factory.mktemp("console_in")
    texts = sample_texts(3000, seed=32, min_words=100, max_words=400)
    lines = [{"text": t} for t in texts[:2200]]
    for i, bad in enumerate([b"not json", b'{"no_text": 1}', b"[1, 2]"]):
        lines.insert(500 * (i + 1), bad)
    write_shard(str(d / "a.jsonl"), lines)
    write_shard(str(d / "b.jsonl.gz"), [{"text": t} for t in texts[2200:]])
    return str(d / "*")


def _env(tmp_path, **more) -> dict:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(logs), **more)


def _sigint_default() -> None:
    """preexec_fn: SIGINT at its default in the build, as a terminal starts it. A test run started with SIGINT
    ignored (``&`` in a script) would pass that on, and the launcher rightly leaves Ctrl-C alone then."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ctrl_c(argv: list[str], env: dict, ready) -> tuple[int, str, bytes, bool]:
    """Start a build as a terminal does, press Ctrl-C (SIGINT to its process group) once ``ready()`` holds
    (it may wait up to BUILD_SECONDS), and return its exit code, stderr, stdout and whether its whole process
    group is gone."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=_sigint_default)
    try:
        deadline = time.monotonic() + BUILD_SECONDS
        while proc.poll() is None and time.monotonic() < deadline and not ready():
            time.sleep(0.01)  # waiting for what the test interrupts
        assert proc.poll() is None, "the build ended before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
        gone = _group_gone(proc.pid)
    finally:
        _kill_group(proc)
    return proc.returncode, stderr.decode(), stdout, gone


def _logs(tmp_path) -> list[str]:
    return glob.glob(str(tmp_path / "logs" / "chunkledger-build-*"))


def _argv(pattern: str, out: str, runner: list[str]) -> list[str]:
    return [sys.executable, "-m", "pipelines.build_cache", "--input", pattern, "--output", out,
            "--tokenizer", "tiktoken:cl100k_base", "--chunk_bytes", str(CHUNK), "--max_bad_fraction", "0.01",
            *runner]


def _read_all(fd: int, proc: subprocess.Popen, seen=None) -> bytes:
    """Everything written to ``fd`` until the process closes it, read as it comes (``seen`` gets each read)."""
    deadline, got = time.monotonic() + BUILD_SECONDS, b""
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"the build did not end within {BUILD_SECONDS} s; so far: {got[-2000:]!r}")
        try:
            part = os.read(fd, 1 << 16)
        except OSError:  # EIO: a terminal whose other side closed
            part = b""
        if not part:
            break
        got += part
        if seen is not None:
            seen(got)
    proc.wait(timeout=60)
    return got


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def _group_gone(pgid: int, seconds: float = 30) -> bool:
    """Whether every process of the launcher's group exits within ``seconds`` (the warm process, whose
    workers it stops, ends when it sees the launcher gone)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _final_line(out: str) -> str:
    t = load_ledger(out)["totals"]
    return (f"built: {t['uncompressed_bytes'] / 1e6:,.1f} of {t['uncompressed_bytes'] / 1e6:,.1f} MB (100.0%), "
            f"{t['docs']:,} documents, {t['tokens']:,} tokens, {t['bad_records']:,} bad records")


def _mid_build(match: re.Match, out: str) -> bool:
    """A line that shows part of the input done: it was printed before the build ended."""
    t = load_ledger(out)["totals"]
    done, docs = float(match[1].replace(",", "")), int(match[5].replace(",", ""))
    return done < t["uncompressed_bytes"] / 1e6 and docs < t["docs"] and float(match[4]) < 100


@pytest.mark.slow
def test_piped_stderr_gets_a_line_per_interval_then_the_last_at_100_percent(corpus, tmp_path):
    out = str(tmp_path / "cache")
    proc = subprocess.Popen(_argv(corpus, out, []), cwd=REPO, env=_env(tmp_path, CHUNKLEDGER_PROGRESS_INTERVAL="0.2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        first_seen = []
        err = _read_all(proc.stderr.fileno(), proc,
                        lambda got: first_seen or (b"building: " in got and first_seen.append(proc.poll())))
        stdout = proc.stdout.read().decode()
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert first_seen == [None]  # read while the launcher was still running
    lines = err.decode().splitlines()
    assert lines[-1].startswith(_final_line(out) + ", ") and lines[-1].endswith(" MB/s"), lines[-1]
    matches = [BUILDING.fullmatch(ln) for ln in lines[:-1]]
    assert matches and all(matches), lines  # nothing else on stderr, every line in the documented format
    assert any(_mid_build(m, out) for m in matches), lines
    done = [float(m[1].replace(",", "")) for m in matches]
    assert done == sorted(done)
    assert stdout.startswith("chunkledger: ") and stdout.count("\n") == 1
    assert _logs(tmp_path) == []  # a build that succeeds leaves no log


@pytest.mark.slow
def test_a_terminal_gets_one_line_rewritten_in_place(corpus, tmp_path):
    out = str(tmp_path / "cache")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 250, 0, 0))  # wide: no line cut
    try:
        proc = subprocess.Popen(_argv(corpus, out, []), cwd=REPO, env=_env(tmp_path), stdout=subprocess.PIPE,
                                stderr=slave, start_new_session=True)
    finally:
        os.close(slave)
    try:
        err = _read_all(master, proc).decode()
        proc.stdout.read()
    finally:
        os.close(master)
        _kill_group(proc)
    assert proc.returncode == 0, err[-3000:]
    assert err.count("\n") == 1 and err.endswith("\x1b[K\r\n"), repr(err[-500:])  # no scrolling: one line
    shown = err[:-len("\x1b[K\r\n")].split("\x1b[K")
    assert all(s.startswith("\r") for s in shown), repr(err[:500])
    shown = [s[1:] for s in shown]
    assert shown[-1].startswith(_final_line(out))
    matches = [BUILDING.fullmatch(s) for s in shown[:-1]]
    assert matches and all(matches), shown
    assert any(float(m[4]) < 100 for m in matches)  # shown before the build ended


def _damaged(tmp_path) -> tuple[str, str]:
    """A gzip shard cut in half, and the message its damage makes (the offset as the decoder reports it)."""
    path = str(tmp_path / "in" / "cut.jsonl.gz")
    write_shard(path, [{"text": t} for t in sample_texts(400, seed=9)])
    with open(path, "rb+") as f:
        f.truncate(os.path.getsize(path) // 2)
    try:
        with open_input(path, "gzip") as f:
            while f.read(1 << 16):
                pass
    except DamagedInput as e:
        offset = e.offset
    return path, (f"error: input file {path} is damaged: the gzip stream ends before its end-of-stream marker "
                  f"(truncated) after {offset} uncompressed bytes. Nothing built from it is kept as complete. "
                  "Replace the file with an intact copy (or leave it out of --input) and rerun the same command.")


@pytest.mark.parametrize("runner", RUNNER_CASES, ids=str)
def test_a_failed_build_prints_one_message_and_the_path_of_its_log(tmp_path, runner):
    path, message = _damaged(tmp_path)
    out = str(tmp_path / "cache")
    proc = subprocess.run(_argv(path, out, RUNNERS[runner]), cwd=REPO, capture_output=True, text=True,
                          env=_env(tmp_path, CHUNKLEDGER_PROGRESS_INTERVAL="3600"), timeout=BUILD_SECONDS)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 2 and lines[0] == message, proc.stderr[-5000:]
    logs = _logs(tmp_path)
    assert len(logs) == 1 and lines[1] == f"(details: {logs[0]}; --debug prints them)"
    assert re.fullmatch(r"chunkledger-build-\d{8}-\d{6}-\d+-\w+\.log", os.path.basename(logs[0]))
    log = open(logs[0], encoding="utf-8").read()
    assert log.startswith(f"command: {sys.executable} -m pipelines.build_cache --input {path} ")
    assert "Traceback (most recent call last)" in log and "DamagedInput" in log  # what the console did not show
    assert proc.stdout == "" and not load_ledger(out)["finished"]


def test_the_log_is_a_new_private_file_never_one_planted_in_its_place(tmp_path, monkeypatch):
    """The log was ``$TMPDIR/chunkledger-build-<time>-<pid>.log``, opened with O_CREAT | O_TRUNC: a symlink
    planted at that predictable name made a build overwrite the link's target. It is now a new file of an
    unpredictable name (O_EXCL | O_NOFOLLOW, mode 0600), which the error still names."""
    import stat
    import tempfile

    from pipelines import faults

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(faults.time, "strftime", lambda *a: "20250101-000000")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / f"chunkledger-build-20250101-000000-{os.getpid()}.log")
    (tmp_path / "chunkledger-build-20250101-000000.log").write_text("another's")
    log = faults.BuildLog(["--input", "x"])
    try:
        log.file.write("a line\n")
        kept = log.keep()
    finally:
        log.close()
    assert victim.read_text() == "precious" and (tmp_path / "chunkledger-build-20250101-000000.log").read_text() \
        == "another's"
    assert os.path.dirname(kept) == str(tmp_path) and not os.path.islink(kept)
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o600 and open(kept).read().endswith("a line\n")


@pytest.mark.parametrize("runner", RUNNER_CASES, ids=str)
def test_ctrl_c_prints_one_line_and_exits_130(corpus, tmp_path, runner):
    """SIGINT to the launcher's process group, as a terminal's Ctrl-C sends it: the workers (forked, or
    in-process) end quietly, and the launcher prints one line."""
    out = str(tmp_path / "cache")
    sidecars = os.path.join(out, fmt.CHUNKS_DIR, "*", "chunk-*.json")
    code, stderr, stdout, gone = _ctrl_c(  # once the workers wrote their first chunks: busy with the rest
        _argv(corpus, out, RUNNERS[runner]), _env(tmp_path, CHUNKLEDGER_PROGRESS_INTERVAL="3600"),
        lambda: len(glob.glob(sidecars)) >= 2)
    assert (code, stderr, stdout) == (130, f"interrupted. {RERUN}\n", b"")
    assert gone, "processes of the build outlived its launcher"
    assert json.load(open(os.path.join(out, fmt.LEDGER_NAME)))["finished"] is False  # interrupted mid-build
    assert glob.glob(str(tmp_path / "logs" / "chunkledger-*")) == []  # no log, no workers' or claims' directory


def test_ctrl_c_while_the_launcher_starts_prints_one_line(corpus, tmp_path):
    """Ctrl-C as soon as the warm process is started, while the launcher imports Beam: one line, 130, and
    nothing left (the warm process, still importing, is stopped; its directory removed)."""
    out, trace_path = str(tmp_path / "cache"), str(tmp_path / "trace.jsonl")
    code, stderr, stdout, gone = _ctrl_c(  # once the launcher traced that the warm process started
        _argv(corpus, out, []), _env(tmp_path, CHUNKLEDGER_TRACE=trace_path),
        lambda: os.path.exists(trace_path) and b"warm_process_started" in open(trace_path, "rb").read())
    assert (code, stderr, stdout) == (130, f"interrupted. {RERUN}\n", b"")
    assert gone and glob.glob(str(tmp_path / "logs" / "chunkledger-*")) == []


# Hides apitools, as an install with only the `pipeline` extra lacks it (the gcs and dataflow extras bring it):
# Apache Beam then logs a warning on import. On PYTHONPATH, so that every process of the build has it.
WITHOUT_APITOOLS = """
import importlib.abc, sys
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "apitools" or name.startswith("apitools."):
            raise ImportError("hidden: as with only the pipeline extra")
sys.meta_path.insert(0, _Hide())
"""


@pytest.mark.slow
def test_a_routine_build_and_its_rerun_write_no_warning_even_with_only_the_pipeline_extra(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(WITHOUT_APITOOLS)
    env = _env(tmp_path, PYTHONPATH=os.pathsep.join([str(site), REPO]), CHUNKLEDGER_PROGRESS_INTERVAL="0.2")
    beam = subprocess.run([sys.executable, "-c", "import apache_beam"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert "WARNING:root:apitools not found, and bigquery client libraries" in beam.stderr  # what is hidden
    argv = [sys.executable, "-m", "pipelines.build_cache", "--input", os.path.join(REPO, "pipelines", "sample_corpus",
            "*"), "--output", str(tmp_path / "cache"), "--tokenizer", "tiktoken:cl100k_base"]  # the default runner
    for run in ("build", "rerun"):  # the build on the default runner: its forked workers import Beam too
        more = [] if run == "build" else ["--runner=FnApiRunner"]
        p = subprocess.run(argv + more, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BUILD_SECONDS)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "WARNING" not in p.stderr, (run, p.stderr)
        assert p.stderr.splitlines()[-1].startswith("built: 0.4 of 0.4 MB (100.0%), 382 documents"), p.stderr
    assert "already complete" in p.stdout  # the rerun verified the finished cache
    # a warning to act on still reaches the console, in the builder's format
    one = os.path.join(REPO, "pipelines", "sample_corpus", "part-00.jsonl")
    twice = [*argv[:3], "--input", one, "--input", one, "--output", str(tmp_path / "again"), *argv[-2:],
             "--runner=FnApiRunner"]
    p = subprocess.run(twice, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BUILD_SECONDS)
    assert p.returncode == 0 and [ln for ln in p.stderr.splitlines() if "WARNING" in ln] == [
        f"WARNING chunkledger.build: input file {one} is matched by more than one --input; it is read once"], p.stderr
