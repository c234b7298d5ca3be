"""Shards read in one pass (pipelines/inputs/single_pass.py): each chunk's input span and checksum, for JSON Lines
(lines) and a JSON array (record bytes), tile the file and hash exactly its bytes."""

from __future__ import annotations

import hashlib
import io
import json

import pytest

from pipelines.inputs.single_pass import ArrayStream, LineStream

RECORDS = [{"text": f"record {i} " + "w" * (i * 7 % 90)} for i in range(60)]


def chunked(stream, chunk_bytes: int):
    """``(k, [offsets], span, checksum)`` of every chunk, as the unit builder cuts them."""
    records = list(stream)
    end = stream.end
    n = -(-end // chunk_bytes)
    out = []
    for k in range(n):
        offs = [off for off, _ in records if off // chunk_bytes == k]
        later = [off for off, _ in records if off // chunk_bytes > k]
        span, checksum = stream.result(k, later[0] if later else end)
        out.append((k, offs, span, checksum))
    return out


@pytest.mark.parametrize("chunk_bytes", [64, 300, 1000, 1 << 20])
def test_line_and_array_chunks_tile_the_file_with_checksums_of_its_bytes(chunk_bytes):
    lines = "".join(json.dumps(r) + "\n" for r in RECORDS).encode()
    array = json.dumps(RECORDS, indent=2).encode()
    for data, stream in ((lines, LineStream(io.BytesIO(lines), chunk_bytes, max_line=200)),
                         (array, ArrayStream(io.BytesIO(array), "f.json", chunk_bytes, max_element=200))):
        chunks = chunked(stream, chunk_bytes)
        first = chunks[0][2][0]
        assert first == (0 if data is lines else array.index(b"{"))  # an array's '[' is in no chunk
        pos = first
        for k, offs, (a, e), checksum in chunks:
            assert a == pos and (offs == [] and a == e or offs[0] == a)  # contiguous; empty chunks are [e, e]
            assert all(k * chunk_bytes <= off < (k + 1) * chunk_bytes for off in offs)
            assert checksum == "sha256:" + hashlib.sha256(data[a:e]).hexdigest()
            pos = e
        assert pos == len(data)
        assert sum(len(offs) for _, offs, _, _ in chunks) == len(RECORDS)


def test_over_long_records_are_not_held():
    """A line or an element over the limit comes as its head and size (memory: the limit, not the record)."""
    from pipelines.inputs.lines import LongLine
    from pipelines.inputs.json_array import LongElement

    records = [{"text": "short"}, {"text": "x" * 5000}, {"text": "after"}]
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    array = json.dumps(records).encode()
    for stream, long_type in ((LineStream(io.BytesIO(lines), 1 << 20, max_line=1000), LongLine),
                              (ArrayStream(io.BytesIO(array), "f.json", 1 << 20, max_element=1000), LongElement)):
        got = list(stream)
        assert [type(r) for _, r in got] == [bytes, long_type, bytes]
        assert len(got[1][1]) == len(json.dumps(records[1])) and got[1][1].head.startswith(b'{"text": "xxx')
