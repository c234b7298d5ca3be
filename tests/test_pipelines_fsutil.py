"""File helpers (pipelines/fsutil.py): line iteration over whole files and byte ranges, decompression."""

from __future__ import annotations

import io
import math
import random

import pytest

from pipelines.fsutil import LineReader, iter_range_lines, open_decompressed


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


def test_open_decompressed_reads_multi_member_gzip_and_multi_frame_zstd(tmp_path):
    import gzip

    import zstandard

    parts = [b'{"text": "part %d"}\n' % i * 1000 for i in range(3)]
    gz = tmp_path / "m.jsonl.gz"
    gz.write_bytes(b"".join(gzip.compress(p) for p in parts))
    zst = tmp_path / "m.jsonl.zst"
    zst.write_bytes(b"".join(zstandard.ZstdCompressor().compress(p) for p in parts))
    for path, comp in ((gz, "gzip"), (zst, "zstd")):
        with open_decompressed(str(path), comp) as f:
            got = b"".join(iter(lambda: f.read(777), b""))
        assert got == b"".join(parts), comp
