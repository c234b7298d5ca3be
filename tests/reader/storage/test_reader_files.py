"""The one atomic write (reader/storage/files.py): a file appears under its name complete or not at all.

Local files and a non-local fsspec store (``memory://``, whose rename is fsspec's ``mv``) alike; gs:// is
covered end to end against an emulator in tests/end_to_end/test_gcs.py. The builder's backend over Beam's
FileSystems is checked in tests/pipelines/test_pipelines_filesystem.py.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import fsspec
import pytest

from reader.storage import files


def test_a_local_write_creates_its_directory_and_replaces_an_older_file(tmp_path):
    path = str(tmp_path / "a" / "b" / "x.json")
    files.write(files.local(), path, b"one")
    files.write(files.local(), path, lambda f: (f.write(b"tw"), f.write(b"o")))
    assert open(path, "rb").read() == b"two"
    assert os.listdir(tmp_path / "a" / "b") == ["x.json"]


def test_a_failed_write_leaves_neither_the_file_nor_its_temporary_file_and_names_the_file(tmp_path):
    path = str(tmp_path / "x.bin")

    def full_disk(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")  # as a write() raises it: no file name

    with pytest.raises(OSError) as e:
        files.write(files.local(), path, full_disk)
    assert e.value.errno == errno.ENOSPC and e.value.filename == path
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError):  # any other error: raised as it is, nothing left behind
        files.write(files.local(), path, lambda f: (f.write(b"x"), int("not a number")))
    assert os.listdir(tmp_path) == []


def test_a_failed_rename_removes_the_temporary_file(tmp_path):
    (tmp_path / "x.bin").mkdir()  # a directory where the file goes: the rename fails
    with pytest.raises(OSError):
        files.write(files.local(), str(tmp_path / "x.bin"), b"data")
    assert os.listdir(tmp_path) == ["x.bin"] and os.listdir(tmp_path / "x.bin") == []


def test_the_temporary_name_is_beside_the_file_and_marked():
    a, b = files.temp_name("gs://b/cache/chunks/000/x.json"), files.temp_name("gs://b/cache/chunks/000/x.json")
    assert a != b and a.startswith("gs://b/cache/chunks/000/.tmp-") and a.endswith("-x.json")
    assert files.temp_name("x.json").startswith(".tmp-")


def test_a_killed_writer_leaves_only_a_temporary_file(tmp_path):
    """SIGKILL in the middle of writing: the name never holds a partial file."""
    path = str(tmp_path / "x.bin")
    code = ("import os, signal, sys; from reader.storage import files\n"
            "def fill(f):\n    f.write(b'half'); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
            "files.write(files.local(), sys.argv[1], fill)")
    proc = subprocess.run([sys.executable, "-c", code, path], capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    left = os.listdir(tmp_path)
    assert len(left) == 1 and left[0].startswith(files.TMP_PREFIX) and left[0].endswith("-x.bin")


def test_an_fsspec_store_that_is_not_local(tmp_path):
    fs = fsspec.filesystem("memory")
    try:
        files.write(fs, "/atomic-test/d/x.json", b"v1")
        files.write_stream(fs, "/atomic-test/d/x.json", open(__file__, "rb"), block=100)
        assert fs.cat_file("/atomic-test/d/x.json") == open(__file__, "rb").read()
        assert [os.path.basename(p) for p in fs.find("/atomic-test")] == ["x.json"]
        with pytest.raises(RuntimeError):
            files.write(fs, "/atomic-test/d/y.json", lambda f: (f.write(b"x"), (_ for _ in ()).throw(RuntimeError())))
        assert [os.path.basename(p) for p in fs.find("/atomic-test")] == ["x.json"]
    finally:
        files.remove_quietly(fs, "/atomic-test")


# -- the door: what is opened ------------------------------------------------------------------------------
def _refused(fn, *args, what: str, **kw):
    with pytest.raises(files.UnsafeFile) as e:
        fn(*args, **kw)
    assert what in str(e.value) and "\n" not in str(e.value), str(e.value)
    return e.value


def test_the_door_refuses_a_fifo_a_device_and_a_directory_at_once_without_reading(tmp_path):
    """A FIFO nobody writes would block an open() forever, ``/dev/zero`` would read without end: both are
    refused at once (the FIFO opened without blocking), through every way in: read, a range, open, and the
    builder's and the cache's storage."""
    import threading

    fifo = str(tmp_path / "ledger.json")
    os.mkfifo(fifo)
    os.mkdir(tmp_path / "d")
    os.symlink("/dev/zero", tmp_path / "zero.json")
    done = threading.Event()

    def attempts():
        for path, what in ((fifo, "a FIFO (named pipe), not a regular file"),
                           (str(tmp_path / "zero.json"), "a character device"), (str(tmp_path / "d"), "a directory")):
            _refused(files.read_local, path, what=what)
            _refused(files.read_local, path, what=what, start=10, end=20)
            _refused(files.open_local, path, what=what)
            _refused(files.local().read, path, what=what)
            in_root = "outside" if path.endswith("zero.json") else what  # a link out of the root, first
            _refused(files.FsspecStorage(files.local().fs, root=str(tmp_path)).open, path, what=in_root)
        done.set()

    t = threading.Thread(target=attempts, daemon=True)
    t.start()
    t.join(20)
    assert done.is_set(), "the door blocked on a FIFO"


def test_the_door_bounds_a_read_where_the_format_says_how_much_there_can_be(tmp_path):
    path = tmp_path / "x.json"
    path.write_bytes(b"x" * 1000)
    assert files.read_local(str(path), limit=1000) == b"x" * 1000
    e = _refused(files.read_local, str(path), limit=999, what="1000 bytes, more than the 999")
    assert e.path == str(path)
    fs = fsspec.filesystem("memory")
    try:
        fs.pipe_file("/door-test/x.json", b"y" * 100)
        assert files.FsspecStorage(fs).read("/door-test/x.json", limit=100) == b"y" * 100
        _refused(files.FsspecStorage(fs).read, "/door-test/x.json", limit=99, what="more than the 99")
    finally:
        files.remove_quietly(fs, "/door-test")


def test_symlinks_by_kind_of_file(tmp_path):
    """An input the user names follows symlinks anywhere; a file inside a root only within it; a write never
    goes through one (neither the file nor, below the root, a directory)."""
    root, out = tmp_path / "cache", tmp_path / "elsewhere"
    root.mkdir()
    out.mkdir()
    (out / "secret").write_bytes(b"secret")
    (root / "own").write_bytes(b"own")
    os.symlink(out / "secret", root / "away")
    os.symlink(root / "own", root / "near")
    assert files.read_local(str(root / "away")) == b"secret"  # an input: followed
    inside = files.FsspecStorage(files.local().fs, root=str(root))
    assert inside.read(str(root / "near")) == b"own"
    _refused(inside.read, str(root / "away"), what=f"a symlink to {out / 'secret'}, outside {root}")
    _refused(inside.open, str(root / "away"), what="outside")
    _refused(files.regular_size, str(root / "away"), root=str(root), what="outside")
    # writes: a planted directory symlink below the root is never written through
    os.symlink(out, root / "index")
    _refused(files.write, inside, str(root / "index" / "x.json"), b"data", what=f"{root / 'index'} is a symlink")
    assert sorted(os.listdir(out)) == ["secret"]
    # nor a symlink at the file's own name: replaced, its target untouched
    files.write(inside, str(root / "away"), b"new")
    assert (out / "secret").read_bytes() == b"secret" and (root / "away").read_bytes() == b"new"
    assert not os.path.islink(root / "away")
