"""Environment faults in one or two lines, and the traceback in a log file.

A full disk, a read-only or misplaced ``--output``, missing credentials or a killed worker is not a bug
in the input: the user needs the path or the cause and to know that rerunning the same command resumes.
:func:`explain` finds the cause in an exception (its chain of causes and, for a worker's error that a
runner re-raised as text, that text). :class:`BuildLog` sends everything but the launcher's own lines (the
log records, the workers' stderr, the traceback) to a file whose path a failure's message names.
"""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from typing import Sequence

RERUN = "Rerunning the same command resumes: completed chunks are kept."

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


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a Ctrl-C (a runner running the workers in-process wraps it in its own error)."""
    return any(isinstance(e, KeyboardInterrupt) for e in _chain(exc))


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


class HideRunnerTracebacks(logging.Filter):
    """Keeps the console to the point: a worker's error that a runner logs with its traceback (the launcher
    reports its cause in one or two lines; :class:`BuildLog` keeps the record). Runners log under their own
    names, and under the root logger for what their job service or a worker forwarded."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or record.name.startswith("chunkledger"):
            return True
        return not (record.exc_info or "Traceback (most recent call last)" in record.getMessage())


class BuildLog:
    """The full log of a command-line build, in a file named in a failure's message.

    The launcher's file descriptor 2 goes to the file, and with it the stderr of every process it starts:
    Beam's SDK workers print a failing bundle's traceback there, and their own on a Ctrl-C. ``sys.stderr``
    becomes the console (the original stderr), where the launcher prints its own lines; :attr:`handler`
    writes log records to the file. :meth:`close` restores both and removes the file unless :meth:`keep`
    was called.

    Args:
      argv: the command line (written at the top of the file).
    """

    def __init__(self, argv: Sequence[str]):
        # A new file of a name nobody can guess (O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600): a file or symlink
        # planted in the shared temporary directory is never written through or over.
        fd, self.path = tempfile.mkstemp(prefix=f"chunkledger-build-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-",
                                         suffix=".log")
        # O_APPEND: the launcher's lines and its children's writes never overwrite each other
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        self.file = os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace", buffering=1)
        self.file.write(f"command: {sys.executable} -m pipelines.build_cache {' '.join(argv)}\n\n")
        self.handler = logging.StreamHandler(self.file)
        self.handler.setLevel(logging.INFO)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.kept = False
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = sys.stderr
        self._saved_fd = os.dup(2)
        try:
            on_fd2 = sys.stderr.fileno() == 2
        except (AttributeError, OSError, ValueError):  # a stream of its own (a caller's capture)
            on_fd2 = False
        # the console: what sys.stderr was, on a descriptor of its own if it was descriptor 2
        self.console = io.TextIOWrapper(io.FileIO(os.dup(self._saved_fd), "w"), encoding="utf-8",
                                        errors="backslashreplace", line_buffering=True) if on_fd2 else sys.stderr
        os.dup2(fd, 2)
        sys.stderr = self.console

    @classmethod
    def start(cls, argv: Sequence[str]) -> "BuildLog | None":
        """A started log, or None if the file cannot be created (the console then shows everything)."""
        try:
            return cls(argv)
        except OSError:
            return None

    def thread_exception(self, args) -> None:
        """A ``threading.excepthook``: a runner's thread dying (with a killed worker) is logged, not shown."""
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        name = args.thread.name if args.thread is not None else "?"
        self._write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} exception in thread {name}:\n{text}")

    def keep(self, exc: BaseException | None = None) -> str:
        """Keep the file (with ``exc``'s traceback at its end); its path."""
        if exc is not None:
            self._write("\n" + "".join(traceback.format_exception(exc)))
        self.kept = True
        return self.path

    def _write(self, text: str) -> None:
        try:
            self.file.write(text)
        except (OSError, ValueError):
            pass  # a full disk: the message on the console still says what failed

    def close(self) -> None:
        """Restore stderr (console handlers writing to :attr:`console` go back to it) and remove the file
        unless kept."""
        self.console.flush()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        sys.stderr = self._saved
        if self.console is not self._saved:
            for h in logging.getLogger().handlers:
                if isinstance(h, logging.StreamHandler) and h.stream is self.console:
                    h.setStream(self._saved)
            self.console.close()
        try:
            self.file.close()
        except OSError:
            pass
        if not self.kept:
            try:
                os.unlink(self.path)
            except OSError:
                pass
