"""One build at a time per output: the ``_BUILDING.json`` lock, held by the launcher while it runs.

Two runs of the same command would write the same bytes (every file is a pure function of the inputs and
the options, written under a temporary name and renamed), but two builds with different options that
both find an empty ``--output`` would interleave their chunks. So the launcher creates
``ROOT/_BUILDING.json`` (host, process id and start time) before it reads the existing ledger, and
removes it when it stops. A second launcher refuses while the holder lives. A lock whose holder is dead
(same host, process gone or replaced: a SIGKILL, a reboot) is taken over, so a crash never blocks the
rerun that resumes it. On a local filesystem the lock is created with ``O_CREAT | O_EXCL``; on ``gs://``
it is checked, then written (Cloud Storage objects appear whole; two launchers starting within the
same second could both pass).

The lock covers the launcher's lifetime: a job that outlives it (a Dataflow Flex Template launch, which
only describes the job) is not covered.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import uuid

from apache_beam.io.filesystems import FileSystems

from reader.format import spec as fmt

from pipelines.inputs import fsutil
from pipelines.errors import BuildError
from pipelines.options import is_remote

LOCK_NAME = "_BUILDING.json"
HALF_WRITTEN_SECONDS = 10  # an unreadable lock younger than this is being written by another launcher


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid from the holder."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(holder: dict) -> bool | None:
    """True/False for a holder on this host; None when it cannot be known (another host)."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    ticks = _start_ticks(pid)
    return ticks is None or holder.get("start_ticks") in (None, ticks)


@dataclasses.dataclass
class BuildLock:
    """The lock this launcher holds on ``output`` (release it with :meth:`release`)."""

    output: str
    token: str

    @property
    def path(self) -> str:
        return fmt.join(self.output, LOCK_NAME)

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        try:
            raw = fsutil.read_bytes_or_none(self.path)
            if raw is not None and json.loads(raw).get("token") == self.token:
                fsutil.delete_if_exists(self.path)
        except Exception:  # noqa: BLE001 - never mask the build's own outcome; a stale lock is taken over later
            pass


def _refuse(output: str, holder: dict) -> BuildError:
    who = (f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}" if holder
           else "a launcher writing its lock just now")
    return BuildError(
        f"another build ({who}) is writing into {output}. Wait for it to finish, or stop it, then rerun the "
        f"same command. If no build is running there any more (its machine went down), delete "
        f"{fmt.join(output, LOCK_NAME)} and rerun.")


def acquire(output: str) -> BuildLock:
    """Take the lock on ``output`` (creating the directory), or raise BuildError naming the holder."""
    token = uuid.uuid4().hex
    pid = os.getpid()
    record = {"host": socket.gethostname(), "pid": pid, "start_ticks": _start_ticks(pid),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "token": token}
    body = (json.dumps(record, sort_keys=True) + "\n").encode()
    lock = BuildLock(output=output, token=token)
    for _ in range(3):
        holder = _read(lock.path)
        if holder is not None:
            stale = _alive(holder) is False if holder else _older_than(lock.path, HALF_WRITTEN_SECONDS)
            if not stale:
                raise _refuse(output, holder)
            _remove_stale(lock.path, holder)
        if _create(lock.path, body, output):
            return lock
    raise _refuse(output, _read(lock.path) or {})


def _read(path: str) -> dict | None:
    raw = fsutil.read_bytes_or_none(path)
    if raw is None:
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        return {}  # half-written by a launcher killed at that moment: stale
    return holder if isinstance(holder, dict) else {}


def _older_than(path: str, seconds: float) -> bool:
    try:
        m = FileSystems.match([path])[0].metadata_list[0]
    except Exception:  # noqa: BLE001 - gone meanwhile
        return True
    return not m.last_updated_in_seconds or time.time() - m.last_updated_in_seconds > seconds


def _remove_stale(path: str, holder: dict) -> None:
    if not is_remote(path):
        aside = f"{path}.stale-{uuid.uuid4().hex}"
        try:
            os.rename(path, aside)  # only one of two launchers taking over wins this rename
            os.remove(aside)
        except FileNotFoundError:
            pass
        return
    fsutil.delete_if_exists(path)


def _create(path: str, body: bytes, output: str) -> bool:
    """Create the lock file unless it exists (False then)."""
    if is_remote(path):
        if FileSystems.exists(path):
            return False
        f = FileSystems.create(path, mime_type="application/json")
        try:
            f.write(body)
        finally:
            f.close()
        return True
    os.makedirs(output, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, body)
    finally:
        os.close(fd)
    return True
