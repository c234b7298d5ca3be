"""Reruns after something changed: an input edited in place, an input resized, cache files lost or damaged.

Inputs are identified by content: every chunk records the span of input bytes it was built from and
their sha256, and a rerun compares them with the input as it is now. The cache a rerun leaves must
equal a clean build of the inputs as they are, or the rerun must refuse naming the file and the fix.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from build_helpers import load_ledger, read_dead_letters, sample_texts, tree_bytes, write_shard
from pipelines.build_cache import BuildError
from reader.format import spec as fmt
from build_helpers import build, check_cache
from build_helpers import mixed_lines

CHUNK = 3000


def make_corpus(d) -> list[str]:
    lines, _ = mixed_lines(21, n_good=60)
    a = write_shard(str(d / "a.jsonl"), lines)
    b = write_shard(str(d / "b.jsonl.zst"), [{"text": t} for t in sample_texts(25, seed=22)])
    return [a, b]


def unfinish(out: str) -> None:
    """Turn a finished cache into the state a kill just before the final ledger write leaves."""
    plan = load_ledger(out)
    plan.update(finished=False, chunks=[], totals={}, bad_records={})
    for inp in plan["inputs"]:
        if inp["compression"] != "none":
            inp["chunks"] = None
        inp.pop("uncompressed_bytes")
    with open(os.path.join(out, fmt.LEDGER_NAME), "w") as f:
        f.write(fmt.dumps_ledger(plan))


def edit_same_length(path: str, line_no: int, old: bytes, new: bytes) -> int:
    """Replace ``old`` by ``new`` (same length) in line ``line_no``; returns that line's offset."""
    assert len(old) == len(new)
    data = open(path, "rb").read()
    lines = data.split(b"\n")
    assert old in lines[line_no], (line_no, lines[line_no][:80])
    lines[line_no] = lines[line_no].replace(old, new, 1)
    with open(path, "wb") as f:
        f.write(b"\n".join(lines))
    return sum(len(x) + 1 for x in lines[:line_no])


def good_line_with(path: str, word: bytes, from_offset: int = 0) -> int:
    """The number of the first document line at or after ``from_offset`` that holds ``word``."""
    pos = 0
    for i, ln in enumerate(open(path, "rb").read().split(b"\n")):
        if pos >= from_offset and ln.startswith(b'{"text"') and word in ln:
            return i
        pos += len(ln) + 1
    raise AssertionError(f"no line with {word!r} after {from_offset}")


def test_same_length_edit_rebuilds_exactly_the_chunks_whose_lines_changed(tmp_path):
    d = tmp_path / "in"
    a, b = make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    unfinish(out)
    # two lines in different chunks of the plain shard: "the " -> "THE " (a fix that keeps the size)
    first = good_line_with(a, b"the ")
    off1 = edit_same_length(a, first, b"the ", b"THE ")
    off2 = edit_same_length(a, good_line_with(a, b"the ", (off1 // CHUNK + 2) * CHUNK), b"the ", b"THE ")
    changed = {off1 // CHUNK, off2 // CHUNK}
    assert len(changed) == 2
    _, res = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    c = res["counters"]
    assert c["chunks_input_changed"] == 2 and c["chunks_rebuilt"] == 2 and c["chunks_written"] == 2
    assert c["chunks_checked"] == c["chunks_skipped"] + 2 == len(res["ledger"]["chunks"])
    assert "rebuilt 2 (2 because their input changed)" in res["summary"]
    clean, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0, name="clean")
    assert tree_bytes(out) == tree_bytes(clean)
    check_cache(out, [a, b], CHUNK)


def test_same_size_edit_that_moves_a_line_boundary_across_chunks(tmp_path):
    """A space turned into a newline in a line that crosses a chunk boundary: both chunks change."""
    d = tmp_path / "in"
    a, b = make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    unfinish(out)
    data = bytearray(open(a, "rb").read())
    boundary = 2 * CHUNK
    start = data.rfind(b"\n", 0, boundary) + 1  # the line holding the boundary started before it
    space = data.index(b" ", boundary + 1)
    assert start < boundary and data.find(b"\n", start) > space
    data[space:space + 1] = b"\n"
    with open(a, "wb") as f:
        f.write(data)
    _, res = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    assert res["counters"]["chunks_input_changed"] == 2  # the line's own chunk, and the next one, where a line now starts
    clean, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0, name="clean")
    assert tree_bytes(out) == tree_bytes(clean)


def test_resized_input_is_refused_naming_the_file_then_its_shard_is_rebuilt(tmp_path):
    d = tmp_path / "in"
    a, b = make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    unfinish(out)
    before = tree_bytes(out)
    write_shard(b, [{"text": t} for t in sample_texts(26, seed=22)])  # one more document: another size
    with pytest.raises(BuildError) as e:
        build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    msg = str(e.value)
    assert f"input file {b} (shard 1) changed size" in msg and "no longer line up" in msg
    assert os.path.join(out, "chunks/shard-00001") in msg and os.path.join(out, "bad/shard-00001") in msg
    assert tree_bytes(out) == before  # refused before touching anything
    # the fix the message gives: delete that shard's files and rerun; the other shard is kept
    shutil.rmtree(os.path.join(out, "chunks", "shard-00001"))
    _, res = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    assert res["counters"]["chunks_skipped"] == load_ledger(out)["inputs"][0]["chunks"]
    clean, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0, name="clean")
    assert tree_bytes(out) == tree_bytes(clean)


def test_finished_cache_rerun_repairs_lost_or_damaged_files_to_the_same_bytes(tmp_path):
    d = tmp_path / "in"
    a, b = make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    before = tree_bytes(out)
    chunks = load_ledger(out)["chunks"]
    with_bad = next(c for c in chunks if c["dead_letters"])
    os.remove(os.path.join(out, with_bad["dead_letters"]))  # a lost dead-letter file
    victim = next(c for c in chunks if c is not with_bad and c["shard"] == 0)
    os.remove(os.path.join(out, fmt.sidecar_path(victim["shard"], victim["index_in_shard"])))  # a lost sidecar
    flipped = next(c for c in chunks if c["shard"] == 1 and c["docs"])
    with open(os.path.join(out, flipped["path"]), "r+b") as f:  # a flipped byte, same size
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    _, res = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    assert not res["already_complete"]
    assert res["counters"]["chunks_rebuilt"] == 3 and res["counters"]["chunks_written"] == 3
    assert tree_bytes(out) == before
    # nothing left to repair: the next rerun only checks
    _, res = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    assert res["already_complete"] and res["counters"].get("chunks_written", 0) == 0
    assert res["counters"]["chunks_skipped"] == len(chunks)


def test_finished_cache_is_never_rebuilt_from_an_edited_input(tmp_path):
    d = tmp_path / "in"
    a, b = make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    before = tree_bytes(out)
    edit_same_length(a, good_line_with(a, b"the "), b"the ", b"THE ")
    with pytest.raises(BuildError, match=f"input file {a} changed since the cache in .* was finished"):
        build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    after = tree_bytes(out)
    after.pop("_FAILED.json")  # the verdict, removed by the next run
    assert after == before
    with open(a, "ab") as f:
        f.write(b'{"text": "one more line"}\n')
    with pytest.raises(BuildError, match=f"input file {a} changed since the cache in .* was finished \\(size"):
        build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)


def test_finished_format_1_cache_is_left_as_it_is(tmp_path):
    d = tmp_path / "in"
    make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    ledger = load_ledger(out)
    ledger["format_version"] = 1
    with open(os.path.join(out, fmt.LEDGER_NAME), "w") as f:
        f.write(fmt.dumps_ledger(ledger))
    before = tree_bytes(out)
    _, res = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    assert res["already_complete"] and "format 1 cache: readable as before" in res["summary"]
    assert tree_bytes(out) == before
    assert fmt.Ledger.parse(json.dumps(ledger)).finished  # still readable
    with pytest.raises(fmt.FormatError, match="format_version 5, this reader reads 1, 2, 3, 4; upgrade"):
        fmt.Ledger.parse(json.dumps(dict(ledger, format_version=5)))


@pytest.mark.parametrize("version", [2, 3])
def test_a_cache_of_an_older_version_is_rerun_and_resumed_as_that_version(tmp_path, version):
    """A cache an earlier chunkledger built (version 2: JSON Lines text; 3: what version 3 added) keeps its
    version when rerun, finished or not: its bytes, and so its batches (the pass rule follows the
    version), stay what they were."""
    d = tmp_path / "in"
    make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    old = load_ledger(out)
    assert old["format_version"] == fmt.FORMAT_VERSION == 4
    old["format_version"] = version
    del old["table"]  # (load_ledger gave it the chunk list an older version's ledger holds instead)
    if version == 2:  # what version 2 wrote: no input formats
        for inp in old["inputs"]:
            del inp["format"]
    old_text = fmt.dumps_ledger(old)
    path = os.path.join(out, fmt.LEDGER_NAME)
    with open(path, "w") as f:
        f.write(old_text)
    _, res = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    assert res["already_complete"] and open(path).read() == old_text
    unfinish(out)
    assert load_ledger(out)["format_version"] == version
    os.remove(os.path.join(out, old["chunks"][1]["path"]))
    _, res = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    assert not res["already_complete"] and open(path).read() == old_text


def test_dead_letters_survive_a_repair(tmp_path):
    d = tmp_path / "in"
    a, _ = make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    want = read_dead_letters(out)
    shutil.rmtree(os.path.join(out, fmt.BAD_DIR))
    build(tmp_path, [str(d / "*")], chunk_bytes=CHUNK, max_bad_fraction=1.0)
    assert read_dead_letters(out) == want and want
