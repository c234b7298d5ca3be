"""One JSON array of records (pipelines/inputs/json_array.py): elements cut out by offset, whatever the read
block, their record bytes tiling the file; anything that is not one array is damage, never fewer records."""

from __future__ import annotations

import io
import json
import random

import pytest

from pipelines.errors import DamagedFile
from pipelines.inputs.json_array import ArrayRecords, first_byte

RECORDS = ([{"instruction": f'say "{i}" [x]', "output": "a\\b}{" * (i % 3), "nested": [1, {"a": []}]}
            for i in range(40)]
           + [{"text": "emoji 🙂 and 数据"}, 1, "a string, with comma", None, [1, [2]], 2.5e3, True, "ends in \\"])


@pytest.mark.parametrize("indent", [None, 0, 2])
@pytest.mark.parametrize("block", [1, 2, 3, 7, 64, 1 << 20])
def test_elements_offsets_and_tails_for_any_block(indent, block):
    data = ("\ufeff" + json.dumps(RECORDS, indent=indent, ensure_ascii=False) + "\n").encode()
    reader = ArrayRecords(io.BytesIO(data), "f.json", block)
    out = list(reader)
    assert [json.loads(e) for _, e, _ in out] == RECORDS
    assert all(data[off:off + len(e)] == e for off, e, _ in out)  # offsets are byte offsets in the file
    first = out[0][0]
    assert b"".join(e + t for _, e, t in out) == data[first:]  # record bytes tile the file from the first one
    assert reader.end == len(data)


def test_an_empty_array_has_no_records():
    assert list(ArrayRecords(io.BytesIO(b" [ \n ] \n"), "f.json")) == []


@pytest.mark.parametrize("data,what", [
    (b'[{"a": 1} {"b": 2}]', "'{' after an element (a missing ',') (at byte 10)"),
    (b'[{"a": 1},', "the file ends inside the array (truncated?) (at byte 10)"),
    (b'[{"a": "unterminated]', "the file ends inside the array"),
    (b'[{"a": [1}]', "'}' closes a '[' (at byte 9)"),
    (b'[1] [2]', "bytes after the closing ']' (at byte 4)"),
    (b'{"a": 1}', "it does not start with '['"),
    (b'[,1]', "',' where a value belongs (at byte 1)"),
    (b'[1,]', "']' where a value belongs (at byte 3)"),
])
def test_anything_but_one_array_is_damage_naming_the_offset(data, what):
    for block in (1, 4, 1 << 20):
        with pytest.raises(DamagedFile, match="input file f.json is damaged: not one JSON array: " + _re(what)):
            list(ArrayRecords(io.BytesIO(data), "f.json", block))


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_a_truncated_array_fails_after_its_complete_elements():
    """Elements stream out as they are found; the end of the file inside the array is an error (the unit
    builder then keeps nothing built from the file), never a shorter array."""
    data = json.dumps([{"text": str(i)} for i in range(100)]).encode()
    cut = data[:data.index(b'{"text": "60"}') + 5]
    got = []
    with pytest.raises(DamagedFile, match="ends inside the array"):
        for rec in ArrayRecords(io.BytesIO(cut), "f.json", 64):
            got.append(rec)
    assert [json.loads(e)["text"] for _, e, _ in got] == [str(i) for i in range(60)]


def test_first_byte_skips_bom_and_whitespace():
    assert first_byte(b"\xef\xbb\xbf \n [") == ord("[")
    assert first_byte(b'  {"a": 1}') == ord("{")
    assert first_byte(b" \n ") is None


def test_random_arrays_round_trip():
    rng = random.Random(5)
    for _ in range(30):
        recs = [{"t": "".join(rng.choice('ab"\\{}[],: \n') for _ in range(rng.randint(0, 12)))}
                for _ in range(rng.randint(0, 8))]
        data = json.dumps(recs, indent=rng.choice([None, 1])).encode()
        out = list(ArrayRecords(io.BytesIO(data), "r.json", rng.randint(1, 9)))
        assert [json.loads(e) for _, e, _ in out] == recs


@pytest.mark.parametrize("block", [1, 5, 64, 1 << 20])
def test_over_long_elements_are_streamed_past_and_every_byte_is_fed(block):
    """An element over ``max_element`` comes as its first bytes and size; the feed sees every byte from the first
    element on, each in the span of the element it follows (docs/FORMAT.md: record bytes)."""
    from pipelines.inputs.json_array import LONG_HEAD, LongElement

    long_text = "x" * (3 * LONG_HEAD)
    records = [{"text": "a"}, {"text": long_text}, [1, 2], {"text": "b" * 40}, {"text": "c"}]
    data = json.dumps(records, indent=1).encode() + b"  \n"

    class Feed:
        def __init__(self):
            self.starts, self.data = [], bytearray()

        def start(self, offset):
            assert offset == self.starts[0] + len(self.data) if self.starts else True
            self.starts.append(offset)

        def update(self, b):
            self.data += b

    feed = Feed()
    out = list(ArrayRecords(io.BytesIO(data), "f.json", block, max_element=30, feed=feed))
    assert feed.starts == [off for off, _, _ in out]
    assert bytes(feed.data) == data[out[0][0]:]  # every byte from the first element to the end, once
    kinds = [type(e) for _, e, _ in out]
    assert kinds == [bytes, LongElement, bytes, LongElement, bytes]
    whole = list(ArrayRecords(io.BytesIO(data), "f.json", block))  # no limit: every element held
    assert [(off, t) for off, _, t in out] == [(off, t) for off, _, t in whole]
    for (_, e, _), (_, w, _) in zip(out, whole):
        assert e == w if type(e) is bytes else (len(e) == len(w) > 30 and e.head == w[:LONG_HEAD])


# Runs in the child, its address space capped at 1 GiB: the build's reading of a gzip JSON array
# (pipelines.inputs.single_pass.ArrayStream, max_element of the default max_doc_bytes), then its peak RSS.
CAPPED = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from pipelines.inputs.decompress import open_input
from pipelines.inputs.json_array import LongElement
from pipelines.inputs.single_pass import ArrayStream
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the imports (Beam's file systems)
with open_input(sys.argv[1], "gzip") as stream:
    records = ArrayStream(stream, sys.argv[1], 1 << 20, max_element=32 << 20)
    got = [[off, len(e), type(e) is LongElement] for off, e in records]
print("RESULT " + json.dumps({"records": got, "end": records.end,
                              "growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before}))
"""


def _capped_read(path: str) -> dict:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", CAPPED, path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def test_whitespace_and_deep_brackets_cost_bounded_memory(tmp_path):
    """Whitespace between elements was kept one list entry per byte: a 20 KB ``.json.gz`` holding 20 MiB of
    spaces peaked at 2.1 GB (and exited 0); 50 Mi nested ``[`` in one too-long element peaked at 3.5 GB. Both
    now read holding at most one element of ``max_element`` bytes, under a 1 GiB address-space cap, every
    element where it is."""
    import gzip

    spaces, depth = 20 << 20, 50 << 20
    path = str(tmp_path / "a.json.gz")
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b'[{"text": "a"},')
        for _ in range(spaces >> 20):
            f.write(b" " * (1 << 20))
        f.write(b'{"text": "b"},')
        for part in (b"[", b"]"):
            for _ in range(depth >> 20):
                f.write(part * (1 << 20))
        f.write(b',{"text": "c"}]')
    got = _capped_read(path)
    first, second = 15 + spaces, 15 + spaces + 14
    assert got["records"] == [[1, 13, False], [first, 13, False], [second, 2 * depth, True],
                              [second + 2 * depth + 1, 13, False]]
    assert got["end"] == second + 2 * depth + 1 + 14
    # at most one element of max_element (32 MiB) is held, and read blocks
    assert got["growth"] < 48 << 20, f"peak RSS grew by {got['growth'] >> 20} MiB"


def test_a_deep_element_s_brackets_are_still_matched_past_the_remembered_depth():
    from pipelines.inputs.json_array import KEPT_DEPTH

    n = KEPT_DEPTH + 5
    ok = b"[" + b"{" + b"[" * n + b"]" * n + b"}" + b",1]"
    assert [(o, len(e)) for o, e, _ in ArrayRecords(io.BytesIO(ok), "f.json", 1 << 16)] == [(1, 2 * n + 2), (2 * n + 4, 1)]
    bad = b"[" + b"{" + b"[" * n + b"]" * n + b"]" + b"]"
    with pytest.raises(DamagedFile, match=_re(f"']' closes a '{{' (at byte {2 * n + 2})")):
        list(ArrayRecords(io.BytesIO(bad), "f.json", 1 << 16))
