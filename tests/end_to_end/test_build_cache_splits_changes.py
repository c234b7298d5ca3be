"""Split builds rerun after something changed: damaged or lost files in either cache, inputs edited or
resized, a damaged compressed input, a build half finalized, another launcher holding the lock.

The hardening of plain builds applies to both caches of a split build: every chunk of both records the
input bytes it was built from, a rerun checks both caches against their files and the input, rebuilds a
chunk in both when either is damaged or its input changed, and never rebuilds a finished cache from other
inputs. The cache a rerun leaves must equal a clean build of the inputs as they are, or the rerun must
refuse naming the file and the fix.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

from build_helpers import load_ledger, read_dead_letters, sample_texts, tree_bytes, write_shard
from pipelines import lock
from pipelines.inputs.lines import READ_BLOCK
from pipelines.build_cache import BuildError
from reader.format import spec as fmt
from build_helpers import build
from test_build_cache_changes import edit_same_length, good_line_with, make_corpus, unfinish

CHUNK = 3000
SPLITS = ("train", "validation")
OPTS = dict(chunk_bytes=CHUNK, max_bad_fraction=1.0, validation_fraction=0.3, split_seed=7)


def roots(out: str) -> list[str]:
    return [os.path.join(out, s) for s in SPLITS]


def flip_byte(path: str, at: int = 40) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_both_caches_record_the_same_input_bytes_for_each_chunk(tmp_path):
    d = tmp_path / "in"
    a, _ = make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], **OPTS)
    train, val = (load_ledger(r) for r in roots(out))
    data = open(a, "rb").read()
    n = 0
    for t, v in zip(train["chunks"], val["chunks"]):
        sides = [json.load(open(os.path.join(r, fmt.sidecar_path(t["shard"], t["index_in_shard"]))))
                 for r in roots(out)]
        assert sides[0]["input_span"] == sides[1]["input_span"] and sides[0]["input_checksum"] == sides[1]["input_checksum"]
        assert sides[1]["dead_letters"] is None and sides[1]["dead_letters_checksum"] is None
        if t["shard"] == 0:  # the plain shard: the span's sha256 is the input's own bytes
            lo, hi = sides[0]["input_span"]
            assert sides[0]["input_checksum"] == fmt.checksum(data[lo:hi])
            n += 1
    assert n > 5


def test_unfinished_split_build_rebuilds_in_both_caches_exactly_the_chunks_whose_lines_changed(tmp_path):
    d = tmp_path / "in"
    a, _ = make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], **OPTS)
    for r in roots(out):
        unfinish(r)
    off1 = edit_same_length(a, good_line_with(a, b"the "), b"the ", b"THE ")
    edit_same_length(a, good_line_with(a, b"the ", (off1 // CHUNK + 2) * CHUNK), b"the ", b"THE ")
    _, res = build(tmp_path, [str(d / "*")], **OPTS)
    c = res["counters"]
    assert c["chunks_input_changed"] == 2 and c["chunks_rebuilt"] == 2 and c["chunks_written"] == 2
    assert c["chunks_checked"] == c["chunks_skipped"] + 2 == len(res["ledger"]["chunks"])
    clean, _ = build(tmp_path, [str(d / "*")], name="clean", **OPTS)
    assert tree_bytes(out) == tree_bytes(clean)


@pytest.mark.slow
def test_finished_split_build_repairs_damage_in_either_cache_to_the_same_bytes(tmp_path):
    d = tmp_path / "in"
    make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], **OPTS)
    before = tree_bytes(out)
    train_root, val_root = roots(out)
    chunks = load_ledger(train_root)["chunks"]
    with_bad = next(c for c in chunks if c["dead_letters"])
    os.remove(os.path.join(train_root, with_bad["dead_letters"]))  # a lost dead-letter file (train only)
    lost = next(c for c in chunks if c is not with_bad and c["shard"] == 0)
    os.remove(os.path.join(train_root, fmt.sidecar_path(lost["shard"], lost["index_in_shard"])))  # a lost sidecar
    flipped = next(c for c in load_ledger(val_root)["chunks"] if c["shard"] == 1 and c["docs"])
    flip_byte(os.path.join(val_root, flipped["path"]))  # a flipped byte in a validation chunk, same size
    _, res = build(tmp_path, [str(d / "*")], **OPTS)
    assert not res["already_complete"]
    assert res["counters"]["chunks_rebuilt"] == 3 and res["counters"]["chunks_written"] == 3
    assert tree_bytes(out) == before
    _, res = build(tmp_path, [str(d / "*")], **OPTS)  # nothing left to repair: the next rerun only checks
    assert res["already_complete"] and res["counters"].get("chunks_written", 0) == 0
    assert res["counters"]["chunks_skipped"] == len(chunks)


@pytest.mark.slow
def test_split_chunk_that_is_not_the_recorded_one_is_refused_naming_it(tmp_path):
    """A complete validation chunk swapped for one of another build: the finished ledger does not record it."""
    d = tmp_path / "in"
    make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], **OPTS)
    other, _ = build(tmp_path, [str(d / "*")], name="other", **{**OPTS, "row_group_tokens": 256})
    val = load_ledger(os.path.join(out, "validation"))["chunks"]
    c = next(c for c in val if c["docs"] and c["shard"] == 0)
    sidecar = fmt.sidecar_path(c["shard"], c["index_in_shard"])
    for rel in (c["path"], sidecar):
        shutil.copy(os.path.join(other, "validation", rel), os.path.join(out, "validation", rel))
    with pytest.raises(BuildError, match=f"{out}/validation/{sidecar} is complete but is not the chunk the "
                                         f"finished ledger in {out}/validation records"):
        build(tmp_path, [str(d / "*")], **OPTS)


def test_finished_split_build_is_never_rebuilt_from_an_edited_input(tmp_path):
    d = tmp_path / "in"
    a, _ = make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], **OPTS)
    before = tree_bytes(out)
    edit_same_length(a, good_line_with(a, b"the "), b"the ", b"THE ")
    with pytest.raises(BuildError, match=f"input file {a} changed since the cache in {out}/train was finished"):
        build(tmp_path, [str(d / "*")], **OPTS)
    after = tree_bytes(out)
    assert "_FAILED.json" in after and not glob.glob(os.path.join(out, "*", "_FAILED.json"))  # one verdict, on top
    after.pop("_FAILED.json")
    assert after == before


def test_half_finalized_split_build_keeps_its_finished_cache(tmp_path):
    """Killed between the two final ledgers: train is finished, validation is not. The rerun finishes
    validation; an input edited meanwhile is refused (train is finished: readers may use it)."""
    d = tmp_path / "in"
    a, _ = make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], **OPTS)
    before = tree_bytes(out)
    unfinish(os.path.join(out, "validation"))
    original = open(a, "rb").read()
    edit_same_length(a, good_line_with(a, b"the "), b"the ", b"THE ")
    with pytest.raises(BuildError, match=f"input file {a} changed since the cache in {out}/train was finished"):
        build(tmp_path, [str(d / "*")], **OPTS)
    assert open(os.path.join(out, "train", fmt.LEDGER_NAME), "rb").read() == before["train/ledger.json"]
    with open(a, "wb") as f:
        f.write(original)
    _, res = build(tmp_path, [str(d / "*")], **OPTS)
    assert res["counters"].get("chunks_written", 0) == 0 and not res["already_complete"]
    assert tree_bytes(out) == before


def test_resized_input_in_an_unfinished_split_build_names_its_files_in_both_caches(tmp_path):
    d = tmp_path / "in"
    _, b = make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], **OPTS)
    for r in roots(out):
        unfinish(r)
    before = tree_bytes(out)
    write_shard(b, [{"text": t} for t in sample_texts(26, seed=22)])  # one more document: another size
    with pytest.raises(BuildError) as e:
        build(tmp_path, [str(d / "*")], **OPTS)
    msg = str(e.value)
    assert f"input file {b} (shard 1) changed size" in msg
    for r in roots(out):
        assert os.path.join(r, "chunks/shard-00001") in msg and os.path.join(r, "bad/shard-00001") in msg
    assert tree_bytes(out) == before
    for r in roots(out):  # the fix the message gives
        shutil.rmtree(os.path.join(r, "chunks", "shard-00001"))
    _, res = build(tmp_path, [str(d / "*")], **OPTS)
    assert res["counters"]["chunks_skipped"] == load_ledger(roots(out)[0])["inputs"][0]["chunks"]
    clean, _ = build(tmp_path, [str(d / "*")], name="clean", **OPTS)
    assert tree_bytes(out) == tree_bytes(clean)


@pytest.mark.slow
def test_damaged_compressed_input_leaves_no_chunk_of_it_in_either_cache(tmp_path):
    src = write_shard(str(tmp_path / "src" / "d.jsonl.gz"), [{"text": t} for t in sample_texts(1500, seed=34)])
    intact = open(src, "rb").read()
    clean, _ = build(tmp_path, [src], name="clean", chunk_bytes=65536, validation_fraction=0.3)
    assert load_ledger(os.path.join(clean, "train"))["inputs"][0]["uncompressed_bytes"] > 3 * READ_BLOCK // 2
    os.makedirs(tmp_path / "in")
    path = str(tmp_path / "in" / "d.jsonl.gz")
    with open(path, "wb") as f:  # truncated after more than one read block: chunks are written before the end
        f.write(intact[:len(intact) * 9 // 10])
    with pytest.raises(BuildError, match=path):
        build(tmp_path, [path], chunk_bytes=65536, validation_fraction=0.3)
    out = str(tmp_path / "cache")
    for r in roots(out):
        assert not load_ledger(r)["finished"] and not os.path.exists(os.path.join(r, fmt.shard_done_path(0)))
        assert not glob.glob(os.path.join(r, "chunks", "*", "*.json")), "chunks of a damaged stream kept"
    with open(path, "wb") as f:
        f.write(intact)
    build(tmp_path, [path], chunk_bytes=65536, validation_fraction=0.3)  # restored: the rerun finishes
    got, want = tree_bytes(out), tree_bytes(clean)
    assert sorted(got) == sorted(want) and all(got[k] == want[k] for k in want if k.endswith(".parquet"))


def test_lost_dead_letters_of_a_split_build_come_back_in_train(tmp_path):
    d = tmp_path / "in"
    make_corpus(d)
    out, _ = build(tmp_path, [str(d / "*")], **OPTS)
    want = read_dead_letters(os.path.join(out, "train"))
    shutil.rmtree(os.path.join(out, "train", fmt.BAD_DIR))
    build(tmp_path, [str(d / "*")], **OPTS)
    assert read_dead_letters(os.path.join(out, "train")) == want and want
    assert not os.path.exists(os.path.join(out, "validation", fmt.BAD_DIR))


def test_split_build_waits_for_no_one_but_refuses_while_another_holds_the_lock(tmp_path):
    d = tmp_path / "in"
    make_corpus(d)
    out = str(tmp_path / "cache")
    held = lock.acquire(out)  # a live launcher (this process) holds OUTPUT/_BUILDING.json
    try:
        with pytest.raises(BuildError, match=f"another build .* is writing into {out}"):
            build(tmp_path, [str(d / "*")], **OPTS)
        assert os.listdir(out) == [fmt.LOCK_NAME]  # refused before anything was written
    finally:
        held.release()
    build(tmp_path, [str(d / "*")], **OPTS)
    assert not os.path.exists(os.path.join(out, fmt.LOCK_NAME))
    assert sorted(os.listdir(out)) == ["splits.json", "train", "validation"]
