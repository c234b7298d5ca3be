"""One build at a time per output: the ``_BUILDING.json`` lock, held by the launcher while it runs.

Two runs of the same command would write the same bytes (every file is a pure function of the inputs and
the options, written under a temporary name and renamed), but two builds with different options that
both find an empty ``--output`` would interleave their chunks. So the launcher takes ``ROOT/_BUILDING.json``
before it reads the existing ledger and removes it when it stops. The file records the holder (host,
process id, start time) for the refusal message.

A crash must never block the rerun that resumes it, even seconds after a SIGKILL, while the killed
launcher is still exiting or is a zombie nobody has reaped yet (a container without an init reaps orphans
late). So on a local filesystem the lock *is* an OS file lock on that file (``flock``), held on a
descriptor open for the launcher's life: the kernel releases it when the holder's files are closed, as its
process dies, whatever remains of it in the process table. A lock file whose ``flock`` is free is stale
and is taken over (its record is rewritten). A record naming another host is respected anyway, as
before: ``flock`` between machines sharing a filesystem works only where the filesystem carries locks.

On ``gs://`` there are no OS locks: the record is checked, then written (objects appear whole; two
launchers starting within the same second could both pass). Its holder counts as alive while a process
with that pid and start time exists on this host and is neither exiting nor a zombie.

The lock covers the launcher's lifetime: a job that outlives it (a Dataflow Flex Template launch, which
only describes the job) is not covered.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
import uuid

from reader.format import spec as fmt
from reader.storage.progress import holder_alive, record, start_ticks

from pipelines import filesystem
from pipelines.errors import BuildError
from pipelines.filesystem import is_remote

HALF_WRITTEN_SECONDS = 10  # gs://: an unreadable lock younger than this is being written by another launcher
EXIT_GRACE_SECONDS = 10.0  # a dying holder's flock is released when the kernel closes its files: wait that long

# Descriptors of the locks this process holds. A flock belongs to the open file description, which a
# forked child shares; a child forked without exec (multiprocessing's "fork", os.fork) would keep the lock
# after the launcher died. So the child closes its copies at once (below), and O_CLOEXEC covers fork+exec
# (Beam's workers and the warm process are started with exec). POSIX record locks (lockf) are not
# inherited, but any close() of that file in the holder drops them, and they do not exclude two locks
# taken in one process: flock with these two guards is the simpler thing to get right.
_HELD_FDS: set[int] = set()


def _close_in_child() -> None:
    for fd in _HELD_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


@dataclasses.dataclass
class BuildLock:
    """The lock this launcher holds on ``output`` (release it with :meth:`release`)."""

    output: str
    token: str
    fd: int | None = None  # the flock'ed descriptor (local outputs)
    owner: int = dataclasses.field(default_factory=os.getpid)

    @property
    def path(self) -> str:
        return fmt.join(self.output, fmt.LOCK_NAME)

    def release(self) -> None:
        """Remove the lock if it is still ours (in the process that took it; a forked child does nothing)."""
        if os.getpid() != self.owner:
            return
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                if _same_file(fd, self.path):  # not replaced by a later holder (after a manual delete)
                    os.remove(self.path)  # while still locked: a waiter then finds the file gone and retries
            except OSError:
                pass
            finally:
                _HELD_FDS.discard(fd)
                os.close(fd)
            return
        try:
            raw = filesystem.read_or_none(self.path)
            if raw is not None and json.loads(raw).get("token") == self.token:
                filesystem.BEAM.remove(self.path)
        except Exception:  # noqa: BLE001 - never mask the build's own outcome; a stale lock is taken over later
            pass


def _refuse(output: str, holder: dict, note: str = "") -> BuildError:
    who = (f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}" if holder
           else "a launcher writing its lock just now")
    return BuildError(
        f"another build ({who}) is writing into {output}{note}. Wait for it to finish, or stop it, then rerun "
        f"the same command. If no build is running there any more (its machine went down), delete "
        f"{fmt.join(output, fmt.LOCK_NAME)} and rerun.")


def _record(token: str, flock: bool) -> bytes:
    pid = os.getpid()
    record = {"host": socket.gethostname(), "pid": pid, "start_ticks": start_ticks(pid),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "token": token}
    if flock:
        record["flock"] = True  # its liveness is the flock's (a record without it: an older launcher's)
    return (json.dumps(record, sort_keys=True) + "\n").encode()


def acquire(output: str) -> BuildLock:
    """Take the lock on ``output`` (creating the directory), or raise BuildError naming the holder."""
    token = uuid.uuid4().hex
    if is_remote(output):
        return _acquire_by_record(output, token)
    return _acquire_flock(output, token)


# --------------------------------------------------------------------------------------------------
# Local outputs: an OS file lock


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)  # a record is a few hundred bytes; anything longer is not one


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _acquire_flock(output: str, token: str) -> BuildLock:
    lock = BuildLock(output=output, token=token)
    path = lock.path
    os.makedirs(output, exist_ok=True)
    deadline = None
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise BuildError(f"{path} is a symbolic link; a build's lock is a regular file. Remove the link "
                                 "and rerun.") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = record(_read_fd(fd))
            os.close(fd)
            if holder and holder_alive(holder) is False:
                # The recorded holder is dying (or dead): the kernel drops its lock once its files are
                # closed, a moment after the SIGKILL. Wait for that, bounded.
                deadline = deadline or time.monotonic() + EXIT_GRACE_SECONDS
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                raise _refuse(output, holder, " (that process has ended, but the lock is still held: by a "
                                              "process it started?)") from None
            raise _refuse(output, holder or {}) from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise BuildError(f"cannot lock {path}: the filesystem of --output does not support file locks "
                                 f"({e.strerror}). Write the cache to a local disk or gs://.") from None
            raise
        try:
            if not _same_file(fd, path):
                os.close(fd)  # released and removed by its holder between our open and our lock: again
                continue
            holder = record(_read_fd(fd))
            if holder and not holder.get("flock") and holder_alive(holder) is not False:
                raise _refuse(output, holder)  # a launcher of an older version, which takes no flock
            if holder and holder.get("flock") and holder_alive(holder) is None:
                raise _refuse(output, holder)  # another machine: its flock may not reach this one
            os.ftruncate(fd, 0)
            body = _record(token, flock=True)
            os.pwrite(fd, body, 0)
        except BaseException:
            os.close(fd)
            raise
        lock.fd = fd
        _HELD_FDS.add(fd)
        return lock


# --------------------------------------------------------------------------------------------------
# gs://: the record alone


def _acquire_by_record(output: str, token: str) -> BuildLock:
    body = _record(token, flock=False)
    lock = BuildLock(output=output, token=token)
    for _ in range(3):
        holder = _read(lock.path)
        if holder is not None:
            stale = holder_alive(holder) is False if holder else _older_than(lock.path, HALF_WRITTEN_SECONDS)
            if not stale:
                raise _refuse(output, holder)
            _remove_stale(lock.path)
        if _create(lock.path, body):
            return lock
    raise _refuse(output, _read(lock.path) or {})


def _read(path: str) -> dict | None:
    return record(filesystem.read_or_none(path))


def _older_than(path: str, seconds: float) -> bool:
    try:
        m = filesystem.BEAM.match(path)[0]
    except Exception:  # noqa: BLE001 - gone meanwhile
        return True
    return not m.mtime or time.time() - m.mtime > seconds


def _remove_stale(path: str) -> None:
    filesystem.BEAM.remove(path)


def _create(path: str, body: bytes) -> bool:
    """Create the lock object unless it exists (False then)."""
    if filesystem.BEAM.exists(path):
        return False
    f = filesystem.BEAM.create(path)
    try:
        f.write(body)
    finally:
        f.close()
    return True
