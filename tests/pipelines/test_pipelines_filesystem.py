"""The builder's file system (pipelines/filesystem.py): the storage port over Beam's FileSystems."""

from __future__ import annotations

import pytest

from reader.format import spec as fmt
from reader.storage import files

from pipelines import filesystem


def test_failed_atomic_write_leaves_no_temporary_file(tmp_path):
    class FullDisk:
        calls = 0

        def read(self, n):
            self.calls += 1
            if self.calls > 1:
                raise OSError(28, "No space left on device")
            return b"partial"

    with pytest.raises(OSError):
        files.write_stream(filesystem.BEAM, str(tmp_path / "x.json"), FullDisk())
    assert list(tmp_path.iterdir()) == []


def test_remove_temp_files_keeps_those_of_a_concurrent_run(tmp_path):
    import os
    import time

    old = tmp_path / (fmt.TMP_PREFIX + "old-ledger.json")
    new = tmp_path / (fmt.TMP_PREFIX + "new-ledger.json")
    old.write_bytes(b"x")
    new.write_bytes(b"y")
    os.utime(old, (time.time() - 100, time.time() - 100))
    assert filesystem.remove_temp_files(str(tmp_path), older_than=time.time() - 50) == 1
    assert not old.exists() and new.exists()
