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
