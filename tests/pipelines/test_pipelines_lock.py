"""The output lock (pipelines/lock.py): one launcher per output; a dead launcher's lock is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from pipelines.errors import BuildError
from pipelines.lock import LOCK_NAME, acquire


def test_a_live_holder_is_refused_by_name_and_release_frees_the_output(tmp_path):
    out = str(tmp_path / "cache")
    held = acquire(out)
    holder = json.load(open(os.path.join(out, LOCK_NAME)))
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(BuildError, match=f"another build \\(process {os.getpid()} on .*\\) is writing into {out}"):
        acquire(out)
    held.release()
    assert not os.path.exists(os.path.join(out, LOCK_NAME))
    acquire(out).release()


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    out = str(tmp_path / "cache")
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(child.stdout)  # that process has exited
    os.makedirs(out)
    with open(os.path.join(out, LOCK_NAME), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": dead_pid, "start_ticks": 1, "token": "old"}, f)
    held = acquire(out)
    assert json.load(open(os.path.join(out, LOCK_NAME)))["token"] == held.token
    held.release()


def test_a_reused_pid_is_not_the_holder(tmp_path):
    out = str(tmp_path / "cache")
    os.makedirs(out)
    with open(os.path.join(out, LOCK_NAME), "w") as f:  # our pid, but another process start time
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": -5, "token": "old"}, f)
    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        pytest.skip("process start times come from /proc")
    acquire(out).release()


def test_another_hosts_lock_and_a_lock_being_written_are_respected(tmp_path):
    out = str(tmp_path / "cache")
    os.makedirs(out)
    path = os.path.join(out, LOCK_NAME)
    with open(path, "w") as f:
        json.dump({"host": "some-other-host", "pid": 1, "token": "x"}, f)
    with pytest.raises(BuildError, match=f"process 1 on some-other-host.*delete {path}"):
        acquire(out)
    with open(path, "w") as f:
        f.write("")  # created, not yet written by another launcher
    with pytest.raises(BuildError, match="a launcher writing its lock just now"):
        acquire(out)
    os.utime(path, (time.time() - 60, time.time() - 60))  # left half-written by a launcher killed long ago
    acquire(out).release()
