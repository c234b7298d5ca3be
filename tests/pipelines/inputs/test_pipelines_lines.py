"""An input's lines (pipelines/inputs/lines.py): iterated over whole files and byte ranges, input spans, long lines."""

from __future__ import annotations

import hashlib
import io
import math
import random

import pytest

from pipelines.inputs.lines import LONG_LINE_HEAD, LongLine, LineReader, RangeLines, SpanHasher


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
            part = list(RangeLines(str(path), lo, hi, block=rng.choice([2, 9, 4096])))
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


# -- lines over max_line: streamed past, never held ---------------------------------------------------
def _read_all(reader, consume):
    """``(offset, bytes or LongLine, size)`` of every line; a long line's bytes are taken only if ``consume``
    (else the reader drains it: its size and head are there once the next line is)."""
    out = []
    for off, line in reader:
        if type(line) is LongLine:
            data = b"".join(line.pieces()) if consume else line
            assert not consume or line.head == data[:LONG_LINE_HEAD]
            out.append((off, data, len(line) if consume else None))
        else:
            out.append((off, line, None))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_long_lines_are_streamed_with_exact_offsets(tmp_path, seed):
    rng = random.Random(seed)
    lines = [b"z" * rng.choice([0, 1, 5, 20, 21, 60, 300, 4100]) for _ in range(40)]
    data = b"\n".join(lines) + (b"\n" if seed % 2 else b"")
    want = lines_with_offsets(data)
    max_line = 20
    for block in (1, 3, 7, 64, 1 << 20):
        for consume in (True, False):  # a consumer that leaves a long line unread does not shift the rest
            reader = LineReader(io.BytesIO(data), block=block, max_line=max_line)
            got = _read_all(reader, consume)
            assert [off for off, *_ in got] == [off for off, _ in want], (block, consume)
            for (off, line, size), (_, raw) in zip(got, want):
                if len(raw) > max_line and not consume:
                    assert len(line) == len(raw) and line.head == raw[:LONG_LINE_HEAD], (block, off)
                elif len(raw) > max_line:
                    assert line == raw and size == len(raw), (block, off)
                else:
                    assert line == raw and size is None, (block, off)
            assert reader.pos == len(data)
    path = tmp_path / "f.jsonl"
    path.write_bytes(data)
    for chunk in (7, 40, 333, len(data)):
        pos, got = 0, []
        for k in range(math.ceil(len(data) / chunk)):
            lo, hi = k * chunk, min((k + 1) * chunk, len(data))
            part = RangeLines(str(path), lo, hi, block=rng.choice([2, 9, 4096]), max_line=max_line)
            hasher = SpanHasher()
            for off, line in part:
                assert lo <= off < hi
                got.append(off)
                hasher.add(off, line)  # takes a long line's bytes as they stream
            (a, e), checksum = hasher.finish(part.end)
            assert a == pos and checksum == "sha256:" + hashlib.sha256(data[a:e]).hexdigest(), (chunk, k)
            pos = e
        assert got == [off for off, _ in want] and pos == len(data), chunk


class _Endless:
    """A stream of ``n`` bytes of one line (a newline at the end), made on the fly: holds nothing."""

    def __init__(self, n: int):
        self.left = n

    def read(self, k: int) -> bytes:
        k = min(k, self.left)
        self.left -= k
        return b"a" * (k - 1) + (b"\n" if self.left == 0 else b"a") if k else b""


def test_a_long_line_costs_max_line_bytes_of_memory_not_its_size():
    import tracemalloc

    n = 64 << 20
    tracemalloc.start()
    try:
        reader = LineReader(_Endless(n), max_line=1 << 20)
        hasher = SpanHasher()
        for off, line in reader:
            hasher.add(off, line)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reader.pos == n and type(line) is LongLine and len(line) == n - 1
    assert hasher.finish(n)[1] == "sha256:" + hashlib.sha256(b"a" * (n - 1) + b"\n").hexdigest()
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB for a {n >> 20} MiB line"
