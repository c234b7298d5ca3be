"""Chaos: the launcher's whole process group SIGKILLed, and the same command rerun at once, while the killed
launcher is still in the process table (a zombie its parent has not reaped, as under a container's PID 1
that reaps orphans late). The rerun must take the lock over and finish byte-identical to a clean build.

* One kill at a chosen write (``tests/support/kill_at.py N:pause``), with the build started as the issue
  saw it: a real ``python`` launcher started by an intermediate process that does not wait() for it.
* The contention stress: kills at random moments (a timer, not a write count: between the first chunk's
  write and the end of the process) of builds forked from a warm process (``tests/support/build_forker.py``:
  a real launcher without the seconds of imports, so dozens of kills fit in CI), while busy loops load
  every core; at least 30 kills (``CHUNKLEDGER_CHAOS=long``: 100), each followed at once by a rerun that
  must equal the clean build.

Outcomes go to the chaos report (tests/support/chaos.py, docs/RELIABILITY.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time

import pytest

from build_helpers import REPO, build, tree_bytes
from chaos import LONG, OPTS, SEED, argv, n, record, write_corpus, write_report
from kill_at import PAUSED

pytestmark = [pytest.mark.timeout(1800 if LONG else 900), pytest.mark.slow,
              pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on processes through pidfds (Linux)")]
SUPPORT = os.path.join(REPO, "tests", "support")
FIRST_CHUNK = 2  # the builder's atomic writes: the plan ledger, then the chunks' files (tests/support/kill_at.py)


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    write_report()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("contention_in")
    write_corpus(d)
    return d


@pytest.fixture(scope="module")
def clean(corpus, tmp_path_factory):
    out, _ = build(tmp_path_factory.mktemp("contention_clean"), [str(corpus / "*")], **OPTS)
    return tree_bytes(out)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("contention_logs"))


def exited(pid: int, timeout: float) -> bool:
    """Whether ``pid`` terminated within ``timeout`` seconds (without reaping it: it stays a zombie)."""
    fd = os.pidfd_open(pid)
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def kill_group_leaving_a_zombie(pid: int) -> None:
    """SIGKILL the process group led by ``pid``; return once it is a zombie (its parent does not reap yet)."""
    os.killpg(pid, signal.SIGKILL)
    assert exited(pid, 60), f"process {pid} survived SIGKILL for 60 s"
    assert state(pid) == "Z"


# An intermediate process: starts the launcher in its own process group, and does not wait() for it until
# its stdin closes. The launcher's stdout is this process's, so the test reads both from one pipe.
INTERMEDIATE = """
import subprocess, sys
p = subprocess.Popen(sys.argv[1:], start_new_session=True)
print("launcher", p.pid, flush=True)
sys.stdin.read()
p.wait()
"""


def test_launcher_group_killed_then_an_immediate_rerun_while_its_zombie_remains(corpus, clean, tmp_path, log_dir):
    rng = random.Random(SEED + 8)
    writes = len(clean) + 1
    for i, point in enumerate([f"{rng.randint(2, writes - 1)}:pause", f"{writes}:pause"]):  # mid-build, finalize
        out = str(tmp_path / f"z{i}")
        cmd = [sys.executable, "-c", INTERMEDIATE, sys.executable, os.path.join(SUPPORT, "kill_at.py"), point,
               *argv(str(corpus / "*"), out)]
        proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, TMPDIR=log_dir))
        try:
            launcher = int(proc.stdout.readline().split()[1])
            lines = []
            for line in proc.stdout:  # until the launcher stops before the chosen rename (EOF: it died first)
                if line.strip() == PAUSED:
                    break
                lines.append(line)
            else:
                pytest.fail(f"the build never reached write {point}: {''.join(lines)[-2000:]}")
            kill_group_leaving_a_zombie(launcher)
            _, res = build(tmp_path, [str(corpus / "*")], name=f"z{i}", **OPTS)  # at once
            assert state(launcher) == "Z"  # still in the process table during the whole rerun
        finally:
            proc.stdin.close()
            proc.wait(timeout=60)  # it reaps the launcher, then exits
            proc.stdout.close()
        assert res["resumed"]
        ok = tree_bytes(out) == clean
        record("SIGKILL of the launcher's process group (paused at a write), rerun at once while it is a zombie",
               "lock taken over, byte-identical" if ok else "DIFFERENT")
        assert ok, point


@contextlib.contextmanager
def busy_cores():
    """A busy loop per core (at most 8), each ending by itself after 15 minutes if it outlives the test."""
    cores = min(8, len(os.sched_getaffinity(0)))
    code = "import time\nend = time.monotonic() + 900\nwhile time.monotonic() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(cores)]
    try:
        yield cores
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=60)


class Forker:
    """Client of tests/support/build_forker.py: builds forked from a warm process, reaped only on request."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.proc = subprocess.Popen([sys.executable, os.path.join(SUPPORT, "build_forker.py"), log_dir,
                                      "tiktoken:cl100k_base"], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, TMPDIR=log_dir))

    def _ask(self, line: str) -> list[str]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split()
        assert answer, f"the forker died (exit code {self.proc.wait(timeout=60)})"
        return answer

    def build(self, args: list[str], notify_at: int) -> int:
        """Fork a build; :meth:`wait_writing` returns once its ``notify_at``-th atomic write is being published."""
        return int(self._ask(f"build {notify_at} " + json.dumps(args))[1])

    def wait_writing(self, pid: int) -> bool:
        """Until the build's write chosen in :meth:`build` (True), or its end (False)."""
        return self._ask(f"wait {pid}")[0] == "writing"

    def reap(self, pid: int) -> int:
        return int(self._ask(f"reap {pid}")[2])

    def log(self, pid: int) -> str:
        with open(os.path.join(self.log_dir, f"{pid}.log"), errors="replace") as f:
            return f.read()[-3000:]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()


def test_contention_stress_random_kills_then_an_immediate_rerun_is_byte_identical(corpus, clean, tmp_path, log_dir):
    rng = random.Random(SEED + 9)
    want = n(30, 100)
    inputs = str(corpus / "*")
    forker = Forker(log_dir)
    t_start = time.monotonic()
    try:
        with busy_cores() as cores:
            # The moments are drawn from the first chunk's write (the second write of the build, after the plan
            # ledger; the lock is held) to the end of the process: the span of a whole build under this load.
            # The load of a shared machine varies: a build that ends before its kill sets the span, and every
            # kill lengthens it a little, so that late moments (finalize, the lock's release) are drawn too.
            pid = forker.build(argv(inputs, str(tmp_path / "calibration")), notify_at=FIRST_CHUNK)
            assert forker.wait_writing(pid), forker.log(pid)
            t0 = time.monotonic()
            assert exited(pid, 300), "the calibration build ran for 5 minutes"
            span = time.monotonic() - t0
            assert forker.reap(pid) == 0, forker.log(pid)
            assert tree_bytes(str(tmp_path / "calibration")) == clean
            kills = finished = 0
            for i in range(3 * want):
                if kills >= want:
                    break
                out = str(tmp_path / f"s{i}")
                pid = forker.build(argv(inputs, out), notify_at=FIRST_CHUNK)
                assert forker.wait_writing(pid), forker.log(pid)
                t0 = time.monotonic()
                if not exited(pid, rng.uniform(0, span)):
                    kill_group_leaving_a_zombie(pid)
                    span *= 1.1
                else:
                    span = time.monotonic() - t0
                    assert state(pid) == "Z"
                build(tmp_path, [inputs], name=f"s{i}", **OPTS)  # at once, the killed launcher still a zombie
                code = forker.reap(pid)
                assert code in (0, -signal.SIGKILL), forker.log(pid)
                kills += code == -signal.SIGKILL
                finished += code == 0
                ok = tree_bytes(out) == clean
                record(f"contention stress ({cores} busy cores): SIGKILL of the launcher's process group at a "
                       "random moment, rerun at once while it is a zombie",
                       ("killed" if code else "finished before the kill") + (", rerun byte-identical" if ok
                                                                               else ", DIFFERENT"))
                assert ok, (i, code)
    finally:
        forker.close()
    print(f"contention stress: {kills} kills, {kills + finished} reruns, {cores} busy cores, last span drawn from "
          f"{span:.2f}s, {time.monotonic() - t_start:.0f}s in all")
    assert kills >= want, f"only {kills} of {kills + finished} builds were killed before they finished"
