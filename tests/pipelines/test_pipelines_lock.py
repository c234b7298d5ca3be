"""The output lock (pipelines/lock.py): one launcher per output; a dead launcher's lock is taken over.

Locally the lock is a flock on ``_BUILDING.json``; the holders here are real processes (``HOLDER``), killed
with SIGKILL and left unreaped (zombies) where the case needs it. ``gs://`` keeps the record-only scheme,
checked here on a local directory through the same functions.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from build_helpers import REPO
from pipelines import lock
from pipelines.errors import BuildError
from pipelines.lock import acquire
from reader.format import spec as fmt

pytestmark = pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/stat"), reason="holders are read in /proc")

# A launcher stand-in: takes the lock, says so, optionally forks a child that outlives it, then holds the lock
# until its stdin closes.
HOLDER = """
import os, sys
from pipelines.lock import acquire
out, mode = sys.argv[1], sys.argv[2]
if mode == "wait-go":
    sys.stdin.readline()
try:
    held = acquire(out)
except Exception as e:
    print("refused", e, flush=True)
    sys.exit(0)
if mode == "fork":
    child = os.fork()
    if child == 0:  # a worker forked without exec: it must not keep the lock
        sys.stdin.read()
        os._exit(0)
    print("child", child, flush=True)
print("held", os.getpid(), flush=True)
sys.stdin.read()
held.release()
"""


def holder(out: str, mode: str = "hold") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, out, mode], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def wait_exited(pid: int, timeout: float = 30) -> None:
    """Until ``pid`` has terminated (a zombie, if its parent has not reaped it), without reaping it."""
    fd = os.pidfd_open(pid)
    try:
        assert select.select([fd], [], [], timeout)[0], f"process {pid} still running after {timeout}s"
    finally:
        os.close(fd)


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    for f in (proc.stdin, proc.stdout):
        f.close()


def test_a_live_holder_is_refused_by_name_and_release_frees_the_output(tmp_path):
    out = str(tmp_path / "cache")
    held = acquire(out)
    holder_ = json.load(open(os.path.join(out, fmt.LOCK_NAME)))
    assert holder_["pid"] == os.getpid() and holder_["host"] == socket.gethostname()
    with pytest.raises(BuildError, match=f"another build \\(process {os.getpid()} on .*\\) is writing into {out}"):
        acquire(out)  # the same process, another descriptor: flock excludes it too
    held.release()
    assert not os.path.exists(os.path.join(out, fmt.LOCK_NAME))
    acquire(out).release()


def test_a_holder_in_another_process_is_refused_until_it_stops(tmp_path):
    out = str(tmp_path / "cache")
    proc = holder(out)
    try:
        line = proc.stdout.readline().split()
        assert line[0] == "held", line
        with pytest.raises(BuildError, match=f"another build \\(process {line[1]} on "):
            acquire(out)
        proc.stdin.close()  # it releases
        assert proc.wait(timeout=60) == 0
        acquire(out).release()
    finally:
        stop(proc)


def test_a_killed_holder_still_in_the_process_table_is_taken_over_at_once(tmp_path):
    """SIGKILL, not reaped: a zombie with the recorded pid and start time. Its lock is free."""
    out = str(tmp_path / "cache")
    proc = holder(out)
    try:
        assert proc.stdout.readline().startswith("held")
        os.kill(proc.pid, signal.SIGKILL)
        wait_exited(proc.pid)
        assert state(proc.pid) == "Z"
        record = json.load(open(os.path.join(out, fmt.LOCK_NAME)))
        assert record["pid"] == proc.pid and record["start_ticks"] == lock.start_ticks(proc.pid)
        held = acquire(out)
        assert json.load(open(os.path.join(out, fmt.LOCK_NAME)))["token"] == held.token
        held.release()
    finally:
        stop(proc)


def test_a_child_forked_by_the_holder_does_not_keep_the_lock_after_the_holder_dies(tmp_path):
    out = str(tmp_path / "cache")
    proc = holder(out, "fork")
    child = None
    try:
        first = proc.stdout.readline().split()
        assert first[0] == "child", first
        child = int(first[1])
        assert proc.stdout.readline().startswith("held")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert state(child) in "RSD"  # the forked child lives on
        acquire(out).release()
    finally:
        stop(proc)  # closes the stdin the child reads: it exits
        if child is not None:
            try:
                wait_exited(child, timeout=30)
            except (ProcessLookupError, AssertionError):
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_launchers_starting_at_once_exclude_each_other(tmp_path):
    out = str(tmp_path / "cache")
    procs = [holder(out, "wait-go") for _ in range(3)]
    try:
        for p in procs:
            p.stdin.write("go\n")
        for p in procs:
            p.stdin.flush()
        answers = [p.stdout.readline() for p in procs]
        assert sorted(a.split()[0] for a in answers) == ["held", "refused", "refused"], answers
        assert all("another build (" in a for a in answers if a.startswith("refused")), answers
    finally:
        for p in procs:
            stop(p)


def _write_record(out: str, **record) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, fmt.LOCK_NAME)
    with open(path, "w") as f:
        json.dump(record, f)
    return path


def test_a_lock_file_whose_flock_is_free_is_taken_over(tmp_path):
    """Even naming a live process of this host (its pid reused, or a record copied): the flock decides."""
    out = str(tmp_path / "cache")
    me = os.getpid()
    _write_record(out, host=socket.gethostname(), pid=me, start_ticks=lock.start_ticks(me), token="old", flock=True)
    held = acquire(out)
    assert json.load(open(os.path.join(out, fmt.LOCK_NAME)))["token"] == held.token
    held.release()
    open(os.path.join(out, fmt.LOCK_NAME), "w").close()  # empty: a launcher killed while writing its record
    acquire(out).release()


def test_records_without_a_flock_and_other_hosts_records_are_respected(tmp_path):
    out = str(tmp_path / "cache")
    me = os.getpid()
    # a launcher of an older version (no flock) that is alive: refused; once dead (a reused pid): taken over
    _write_record(out, host=socket.gethostname(), pid=me, start_ticks=lock.start_ticks(me), token="x")
    with pytest.raises(BuildError, match=f"process {me} on "):
        acquire(out)
    path = _write_record(out, host=socket.gethostname(), pid=me, start_ticks=-5, token="x")
    acquire(out).release()
    path = _write_record(out, host="some-other-host", pid=1, token="x", flock=True)
    with pytest.raises(BuildError, match=f"process 1 on some-other-host.*delete {path}"):
        acquire(out)


def test_a_lock_being_written_is_respected(tmp_path):
    """The flock is held and the record still empty: another launcher is writing it right now."""
    out = str(tmp_path / "cache")
    path = os.path.join(out, fmt.LOCK_NAME)
    os.makedirs(out)
    code = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(BuildError, match="a launcher writing its lock just now"):
            acquire(out)
    finally:
        stop(proc)


def test_a_symlink_in_place_of_the_lock_is_refused(tmp_path):
    out = tmp_path / "cache"
    out.mkdir()
    (out / fmt.LOCK_NAME).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(BuildError, match=f"{out / fmt.LOCK_NAME} is a symbolic link"):
        acquire(str(out))
    assert not (tmp_path / "elsewhere.json").exists()


# --------------------------------------------------------------------------------------------------
# The record-only scheme of gs:// (exercised on a local directory)


def _zombie() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_exited(proc.pid)
    assert state(proc.pid) == "Z"
    return proc


def test_record_scheme_a_zombie_holder_is_dead_a_live_one_is_not(tmp_path):
    out = str(tmp_path / "cache")
    proc = _zombie()
    try:
        _write_record(out, host=socket.gethostname(), pid=proc.pid, start_ticks=lock.start_ticks(proc.pid),
                      token="old")
        held = lock._acquire_by_record(out, "new")
        assert json.load(open(os.path.join(out, fmt.LOCK_NAME)))["token"] == "new"
        with pytest.raises(BuildError, match=f"process {os.getpid()} on "):
            lock._acquire_by_record(out, "third")
        held.release()
        assert not os.path.exists(os.path.join(out, fmt.LOCK_NAME))
    finally:
        proc.wait()


def test_record_scheme_respects_other_hosts_and_a_record_being_written(tmp_path):
    out = str(tmp_path / "cache")
    path = _write_record(out, host="some-other-host", pid=1, token="x")
    with pytest.raises(BuildError, match=f"process 1 on some-other-host.*delete {path}"):
        lock._acquire_by_record(out, "t")
    open(path, "w").close()  # created, not yet written by another launcher
    with pytest.raises(BuildError, match="a launcher writing its lock just now"):
        lock._acquire_by_record(out, "t")
    os.utime(path, (time.time() - 60, time.time() - 60))  # left half-written by a launcher killed long ago
    lock._acquire_by_record(out, "t").release()
