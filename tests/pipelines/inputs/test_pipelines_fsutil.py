"""File helpers (pipelines/inputs/fsutil.py): line iteration over whole files and byte ranges, input spans, writes."""

from __future__ import annotations

import io
import math
import random

import pytest

from pipelines.inputs import fsutil
from pipelines.inputs.fsutil import LineReader, RangeLines, SpanHasher, iter_range_lines


def lines_with_offsets(data: bytes):
    out, pos = [], 0
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    for p in parts:
        out.append((pos, p))
        pos += len(p) + 1
    return out


@pytest.mark.parametrize("seed", range(4))
def test_line_reader_and_ranges_partition_the_file(tmp_path, seed):
    rng = random.Random(seed)
    lines = [b"x" * rng.choice([0, 1, 3, 10, 40, 200]) for _ in range(60)]
    data = b"\n".join(lines) + (b"\n" if seed % 2 else b"")
    path = tmp_path / "f.jsonl"
    path.write_bytes(data)
    want = lines_with_offsets(data)
    for block in (1, 3, 7, 64, 1 << 20):
        reader = LineReader(io.BytesIO(data), block=block)
        assert list(reader) == want
        assert reader.pos == len(data)
    for chunk in (1, 5, 17, 100, len(data)):
        got = []
        for k in range(math.ceil(len(data) / chunk)):
            lo, hi = k * chunk, min((k + 1) * chunk, len(data))
            part = list(iter_range_lines(str(path), lo, hi, block=rng.choice([2, 9, 4096])))
            assert all(lo <= off < hi for off, _ in part)
            got += part
        assert got == want, chunk


@pytest.mark.parametrize("seed", range(4))
def test_chunk_spans_tile_the_file_and_hash_exactly_its_bytes(tmp_path, seed):
    """Each chunk's span runs from its first line to the next chunk's first line: the spans cover the file
    once, and each checksum is the sha256 of exactly those bytes (with or without a final newline)."""
    import hashlib

    rng = random.Random(seed)
    lines = [b"y" * rng.choice([0, 2, 9, 33, 150]) for _ in range(50)]
    data = b"\n".join(lines) + (b"\n" if seed % 2 else b"")
    path = tmp_path / "f.jsonl"
    path.write_bytes(data)
    for chunk in (1, 7, 40, len(data) + 3):
        pos = 0
        for k in range(math.ceil(len(data) / chunk)):
            lo, hi = k * chunk, min((k + 1) * chunk, len(data))
            lines_in = RangeLines(str(path), lo, hi, block=rng.choice([3, 64, 4096]))
            hasher = SpanHasher()
            for off, line in lines_in:
                hasher.add(off, line)
            (a, e), checksum = hasher.finish(lines_in.end)
            assert a == pos and a <= e and e <= len(data), (chunk, k)
            assert checksum == "sha256:" + hashlib.sha256(data[a:e]).hexdigest()
            pos = e
        assert pos == len(data)


def test_failed_atomic_write_leaves_no_temporary_file(tmp_path):
    class FullDisk:
        calls = 0

        def read(self, n):
            self.calls += 1
            if self.calls > 1:
                raise OSError(28, "No space left on device")
            return b"partial"

    with pytest.raises(OSError):
        fsutil.write_atomic_stream(str(tmp_path / "x.json"), FullDisk())
    assert list(tmp_path.iterdir()) == []


def test_remove_temp_files_keeps_those_of_a_concurrent_run(tmp_path):
    import os
    import time

    old = tmp_path / (fsutil.TMP_PREFIX + "old-ledger.json")
    new = tmp_path / (fsutil.TMP_PREFIX + "new-ledger.json")
    old.write_bytes(b"x")
    new.write_bytes(b"y")
    os.utime(old, (time.time() - 100, time.time() - 100))
    assert fsutil.remove_temp_files(str(tmp_path), older_than=time.time() - 50) == 1
    assert not old.exists() and new.exists()
