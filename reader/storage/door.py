"""The door of the storage port (:mod:`reader.storage.files`, which offers these functions to its callers):
every local file the project opens is opened here, so a FIFO, a device, a socket or a directory where a file
belongs is refused at once, naming it (a FIFO opened for reading would block forever, ``/dev/zero`` would
read without end), never read.

Symlinks, by kind of file: an input the user names follows them anywhere; a file found inside a root (a
cache, a ``save_to_disk`` directory) only to a file within that root; a write never goes through one (a new
file is created ``O_EXCL | O_NOFOLLOW``, and below a root no directory may be a symlink). Where a format says
how large a file can be, the caller passes that bound (``limit``) and a larger file is refused unread.
Object stores have no FIFOs or symlinks: there a bound is the only check. Refusals are :class:`UnsafeFile`
(an ``OSError``).
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import stat
from typing import BinaryIO

MAX_SMALL_FILE_BYTES = 16 << 20  # a JSON file of settings (an identity, a state.json, a template): far less


class UnsafeFile(OSError):
    """A file the door refuses: not a regular file, a symlink out of the root its file must stay in, a write
    through a symlink, or a file larger than its format allows. The message names the file and what it is."""

    def __init__(self, path: str, what: str):
        super().__init__(errno.EINVAL, what, path)
        self.path, self.what = path, what

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"

    def __reduce__(self):  # picklable (workers send exceptions to the launcher)
        return (UnsafeFile, (self.path, self.what))


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a regular file"``, ``"a FIFO (named pipe)"``, ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def not_regular(path: str, mode: int) -> UnsafeFile:
    return UnsafeFile(path, f"{kind_of(mode)}, not a regular file: only regular files are read (remove it, or "
                            "replace it with the file meant)")


def too_large(path: str, size: int, limit: int) -> UnsafeFile:
    return UnsafeFile(path, f"{size} bytes, more than the {limit} such a file can hold: not the file meant (or "
                            "damaged)")


def inside(path: str, root: str) -> str:
    """``path`` resolved (symlinks followed), refused unless it lies within ``root`` (resolved too)."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    if real != top and not real.startswith(top.rstrip(os.sep) + os.sep):
        raise UnsafeFile(path, f"a symlink to {real}, outside {root}: files of {root} may link only within it")
    return real


def open_local(path: str, *, root: str | None = None, limit: int | None = None) -> io.BufferedReader:
    """A local file opened for reading through the door (see the module doc): refused unless it is a regular
    file (a FIFO is opened without blocking, then refused), within ``root`` if given (symlinks followed only
    within it), and of at most ``limit`` bytes if given. ``FileNotFoundError`` if there is none."""
    real = inside(path, root) if root is not None else None
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path, st.st_mode)
        if real is not None:  # the file opened is the one checked (not a link swapped in meanwhile)
            was = os.stat(real)
            if (was.st_dev, was.st_ino) != (st.st_dev, st.st_ino):
                raise UnsafeFile(path, f"changed while it was opened (a symlink replaced?); {root} must not change")
        if limit is not None and st.st_size > limit:
            raise too_large(path, st.st_size, limit)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def regular_size(path: str, *, root: str | None = None) -> int:
    """The size of a local regular file (symlinks followed; with ``root``, only within it), refusing anything
    else without opening it."""
    real = inside(path, root) if root is not None else path
    st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, st.st_mode)
    return st.st_size


def read_local(path: str, *, root: str | None = None, limit: int | None = None, start: int = 0,
               end: int | None = None) -> bytes:
    """The bytes of a local file (``[start, end)`` of them) through :func:`open_local`; a file that grew past
    ``limit`` while read is refused too."""
    with open_local(path, root=root, limit=limit) as f:
        if start:
            f.seek(start)
        n = -1 if end is None else max(0, end - start)
        if limit is not None and (n < 0 or n > limit + 1):
            n = limit + 1
        data = f.read(n)
    if limit is not None and len(data) > limit:
        raise too_large(path, len(data), limit)
    return data


def no_symlink_below(root: str, path: str) -> None:
    """Refuse a write to ``path`` whose directories between ``root`` and it hold a symlink (the file would be
    written outside ``root``)."""
    rel = os.path.relpath(path, root)
    if rel == os.curdir or rel.startswith(os.pardir):
        if rel.startswith(os.pardir):
            raise UnsafeFile(path, f"outside {root}, where its files are written")
        return
    at = root
    for part in rel.split(os.sep)[:-1]:
        at = os.path.join(at, part)
        try:
            if stat.S_ISLNK(os.lstat(at).st_mode):
                raise UnsafeFile(path, f"{at} is a symlink (to {os.readlink(at)}); writes never go through a symlink: "
                                       "remove the link")
        except FileNotFoundError:
            return


def create_local(path: str, mode: int = 0o644) -> BinaryIO:
    """A new local file to write (its directory made): ``O_EXCL | O_NOFOLLOW``, so never an existing file, nor
    through a symlink."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    return os.fdopen(fd, "wb")
