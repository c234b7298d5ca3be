"""Environment faults in one or two lines, and the traceback in a log file.

A full disk, a read-only or misplaced ``--output``, missing credentials or a killed worker is not a bug
in the input: the user needs the path or the cause and to know that rerunning the same command resumes.
:func:`explain` finds the cause in an exception (its chain of causes and, for a worker's error that a
runner re-raised as text, that text); :class:`RecentLogs` keeps the last log records so that
:func:`write_log` can put them, with the traceback, in a file whose path the error message names.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from typing import Sequence

RERUN = "Rerunning the same command resumes: completed chunks are kept."
LOG_RECORDS = 2000

_OS_ERRORS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a path component is a file, not a directory",
    errno.EISDIR: "is a directory",
    errno.EIO: "input/output error (a failing disk or network filesystem)",
}
# The same causes when a runner passes on a worker's error as text.
_TEXT = [
    (re.compile(r"No space left on device(?::\s*'([^']+)')?"), "no space left on the device"),
    (re.compile(r"Disk quota exceeded(?::\s*'([^']+)')?"), "disk quota exceeded"),
    (re.compile(r"Read-only file system(?::\s*'([^']+)')?"), "read-only file system"),
    (re.compile(r"Permission denied(?::\s*'([^']+)')?"), "permission denied"),
    (re.compile(r"Channel closed prematurely|SDK harness .* (?:crashed|exited|died)|Worker .* (?:died|crashed)|"
                r"Broken pipe|Connection reset by peer|Socket closed|StatusCode\.UNAVAILABLE"),
     "a worker process died (killed by a signal, the out-of-memory killer or a crash) or lost its connection"),
    (re.compile(r"DefaultCredentialsError|Could not automatically determine credentials|401 Unauthorized|"
                r"403 Forbidden|does not have storage\.objects"),
     "Cloud Storage refused the credentials (or found none)"),
]


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def explain(exc: BaseException, output: str | None = None) -> str | None:
    """One or two sentences naming the cause and the path, ending with :data:`RERUN`; None if unknown."""
    where = f" (under {output})" if output else ""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _OS_ERRORS:
            path = e.filename or output
            return f"{_OS_ERRORS[e.errno]}: {path}. {_fix(e.errno)}{RERUN}"
    text = "\n".join(f"{type(e).__name__}: {e}" for e in _chain(exc))
    for pattern, what in _TEXT:
        m = pattern.search(text)
        if m:
            path = m.group(1) if m.groups() and m.group(1) else None
            return f"{what}: {path}. {RERUN}" if path else f"{what}{where}. {RERUN}"
    return None


def _fix(code: int) -> str:
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "Free some space (a crashed run's .tmp-* files are removed by the next run). "
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "Make --output writable, or choose another. "
    return ""


class RecentLogs(logging.Handler):
    """Keeps the last :data:`LOG_RECORDS` formatted log records (for :func:`write_log`)."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.records: collections.deque[str] = collections.deque(maxlen=LOG_RECORDS)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never fail the build
            pass

    def thread_exception(self, args) -> None:
        """A ``threading.excepthook``: a runner thread's dying traceback goes here, not to the console."""
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        name = args.thread.name if args.thread is not None else "?"
        self.records.append(f"{time.strftime('%Y-%m-%d %H:%M:%S')} exception in thread {name}:\n{text}")


class HideRunnerTracebacks(logging.Filter):
    """Keeps the console to the point: a worker's error that a runner logs with its traceback (the launcher
    reports its cause in one or two lines, and :class:`RecentLogs` keeps the record for the log file)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.name.startswith("apache_beam"):
            return True
        return not (record.exc_info or "Traceback (most recent call last)" in record.getMessage())


def write_log(exc: BaseException, argv: Sequence[str], recent: RecentLogs | None) -> str | None:
    """Write the command, the recent log records and the traceback to a file; its path (None if impossible)."""
    name = f"chunkledger-build-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path = os.path.join(tempfile.gettempdir(), name)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"command: {sys.executable} -m pipelines.build_cache {' '.join(argv)}\n\n")
            if recent is not None:
                f.write("recent log records:\n" + "\n".join(recent.records) + "\n\n")
            f.write("".join(traceback.format_exception(exc)))
    except OSError:
        return None
    return path
