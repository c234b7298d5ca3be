"""reader.storage.validate: every kind of damage is reported naming the damaged file (the Parquet chunk, its
sidecar, or the ledger) and the problem precisely, never blaming another file.

Each case damages one file of a small cache the way a disk, a copy tool or a person would, runs
``python -m reader validate`` (in process) and checks the exit status and every PROBLEM line.
"""

import json
import os
import re
import shutil

import numpy as np
import pytest

from reader import ChunkError, ReadOptions, Reader
from reader.format import spec as fmt
from reader.storage.cache import Cache
from reader.cli.main import main
from reader.storage.validate import validate_chunk

import cachegen

pytestmark = pytest.mark.timeout(120)
VICTIM = 2  # global index of the damaged chunk (shard 0, chunk 1)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("validate") / "cache")
    rng = np.random.default_rng(5)
    chunks = cachegen.random_chunks(rng, 6, empty_prob=0.0, max_docs=8, max_len=50)
    entries = cachegen.write_synthetic_cache(d, chunks, chunks_per_shard=[4, 2], row_group_tokens=16)
    assert len(entries[VICTIM]["row_group_index"]) >= 2  # a row group to damage besides the first
    return d, entries


@pytest.fixture
def cache(pristine, tmp_path):
    src, entries = pristine
    root = str(tmp_path / "cache")
    shutil.copytree(src, root)
    e = entries[VICTIM]
    return root, e


def _flip(path, at):
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0x01
    open(path, "wb").write(bytes(data))


def _edit_ledger(root, fn):
    path = os.path.join(root, fmt.LEDGER_NAME)
    ledger = json.load(open(path))
    fn(ledger)
    open(path, "w").write(fmt.dumps_ledger(ledger))


def _validate(root, capsys):
    code = main(["validate", root])
    out = capsys.readouterr()
    problems = [ln[len("PROBLEM "):] for ln in out.out.splitlines() if ln.startswith("PROBLEM ")]
    return code, problems, out


def _sidecar(root, e):
    return os.path.join(root, fmt.sidecar_path(e["shard"], e["index_in_shard"]))


# how to damage the cache -> (the file that must be named, what must be said about it)
def _truncate(root, e):
    os.truncate(os.path.join(root, e["path"]), 300)
    return e["path"], rf"truncated at 300 of {e['bytes']:,} bytes"


def _flip_row_group(root, e):
    off, length = e["row_group_index"][1][:2]
    _flip(os.path.join(root, e["path"]), off + length // 2)
    return e["path"], rf"checksum mismatch in row group 1 of {len(e['row_group_index'])} \(bytes \[{off}, "


def _flip_first_row_group(root, e):
    off, length = e["row_group_index"][0][:2]
    _flip(os.path.join(root, e["path"]), off + 5)
    return e["path"], r"checksum mismatch in row group 0 of"


def _flip_footer(root, e):
    _flip(os.path.join(root, e["path"]), e["footer"][0] + 20)
    return e["path"], r"checksum mismatch in the Parquet footer"


def _flip_magic(root, e):
    _flip(os.path.join(root, e["path"]), e["bytes"] - 1)  # the trailing PAR1 is part of the footer range
    return e["path"], r"checksum mismatch in the Parquet footer"


def _append(root, e):
    with open(os.path.join(root, e["path"]), "ab") as f:
        f.write(b"\0\0")
    return e["path"], rf"longer than recorded: {e['bytes'] + 2:,} bytes"


def _delete_chunk(root, e):
    os.remove(os.path.join(root, e["path"]))
    return e["path"], r"missing \(the ledger lists it\)"


def _delete_sidecar(root, e):
    os.remove(_sidecar(root, e))
    return fmt.sidecar_path(e["shard"], e["index_in_shard"]), r"sidecar missing"


def _flip_sidecar_syntax(root, e):
    _flip(_sidecar(root, e), 0)  # "{" -> "z"
    return fmt.sidecar_path(e["shard"], e["index_in_shard"]), r"damaged sidecar: not valid JSON"


def _flip_sidecar_checksum(root, e):
    path = _sidecar(root, e)
    text = open(path).read()
    digit = e["checksum"][-1]
    new = e["checksum"][:-1] + ("0" if digit != "0" else "1")
    open(path, "w").write(text.replace(e["checksum"], new))
    return fmt.sidecar_path(e["shard"], e["index_in_shard"]), r"damaged sidecar: differs from the ledger entry in \['checksum'\]"


def _flip_sidecar_row_group_sum(root, e):
    path = _sidecar(root, e)
    old = e["row_group_index"][0][4]
    new = old[:-1] + ("0" if old[-1] != "0" else "1")
    text = open(path).read()
    open(path, "w").write(text.replace(old, new))
    return (fmt.sidecar_path(e["shard"], e["index_in_shard"]),
            r"damaged sidecar: its sha256 is .*row_group_index/footer do not match the chunk file")


def _ledger_checksum(root, e):
    def edit(led):
        c = led["chunks"][VICTIM]["checksum"]
        led["chunks"][VICTIM]["checksum"] = c[:-1] + ("0" if c[-1] != "0" else "1")
    _edit_ledger(root, edit)
    return fmt.LEDGER_NAME, rf"the entry of chunk {VICTIM} \({e['path']}\) says checksum .*the chunk file and its sidecar say"


def _ledger_bytes(root, e):
    _edit_ledger(root, lambda led: led["chunks"][VICTIM].update(bytes=e["bytes"] + 7))
    return fmt.LEDGER_NAME, rf"the entry of chunk {VICTIM} .* says bytes {e['bytes'] + 7}; .* say {e['bytes']}\."


def _ledger_docs(root, e):
    _edit_ledger(root, lambda led: led["chunks"][VICTIM].update(docs=e["docs"] + 1))
    return fmt.LEDGER_NAME, rf"(the entry of chunk {VICTIM} .* says docs {e['docs'] + 1}; |totals.docs|doc_offset)"


def _ledger_sidecar_checksum(root, e):
    _edit_ledger(root, lambda led: led["chunks"][VICTIM].update(sidecar_checksum="sha256:" + "0" * 64))
    return fmt.LEDGER_NAME, rf"the entry of chunk {VICTIM} .* says sidecar_checksum sha256:0000.*which matches the chunk file"


def _ledger_totals(root, e):
    _edit_ledger(root, lambda led: led["totals"].update(tokens=led["totals"]["tokens"] + 1))
    return fmt.LEDGER_NAME, r"totals.tokens = \d+, the chunk entries sum to \d+"


def _ledger_drop_entry(root, e):
    _edit_ledger(root, lambda led: led["chunks"].pop())
    return fmt.LEDGER_NAME, r"input shard \d \(.*\) should have \d chunks, the ledger lists \d"


def _ledger_syntax(root, e):
    os.truncate(os.path.join(root, fmt.LEDGER_NAME), 100)
    return fmt.LEDGER_NAME, r"not valid JSON .*damaged or half-written"


DAMAGE = [_truncate, _flip_row_group, _flip_first_row_group, _flip_footer, _flip_magic, _append, _delete_chunk,
          _delete_sidecar, _flip_sidecar_syntax, _flip_sidecar_checksum, _flip_sidecar_row_group_sum,
          _ledger_checksum, _ledger_bytes, _ledger_docs, _ledger_sidecar_checksum, _ledger_totals,
          _ledger_drop_entry, _ledger_syntax]


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__.lstrip("_") for d in DAMAGE])
def test_validate_names_the_damaged_file_and_the_problem(cache, capsys, damage):
    root, e = cache
    culprit, said = damage(root, e)
    code, problems, out = _validate(root, capsys)
    assert code == 1, out
    assert problems, out.out
    where = os.path.join(root, culprit)
    for p in problems:  # every problem is about the culprit: nothing else is blamed
        assert p.startswith(where + ": "), f"{p!r} should name {culprit}"
    assert any(re.search(said, p) for p in problems), (said, problems)
    assert "<Buffer>" not in out.out + out.err


def test_a_sound_cache_validates(cache, capsys):
    root, _ = cache
    code, problems, out = _validate(root, capsys)
    assert code == 0 and problems == [] and "OK: 6 chunks" in out.out
    c = Cache(root)
    assert all(validate_chunk(c, i) == [] for i in range(6))


def test_deleted_ledger_says_what_the_directory_is(cache, capsys):
    root, _ = cache
    os.remove(os.path.join(root, fmt.LEDGER_NAME))
    assert main(["validate", root]) == 2  # not a cache any more: an error, not a list of problems
    err = capsys.readouterr().err
    assert err.startswith(f"error: {root}: not a chunkledger cache (no ledger.json here)")
    assert "holds chunks/ but no ledger.json" in err and "Rerun the build command" in err


@pytest.mark.parametrize("damage,said", [(_truncate, r"truncated at 300 of [\d,]+ bytes"),
                                         (_flip_row_group, r"checksum mismatch in row group 1"),
                                         (_flip_footer, r"footer checksum mismatch")])
def test_the_reader_names_the_same_file(cache, damage, said):
    root, e = cache
    damage(root, e)
    opts = ReadOptions(seq_len=4, batch_size=1, ideal_readers=1, eval_mode=True, index_cache=False)
    with Reader(root, opts) as rd:
        with pytest.raises(ChunkError, match=said) as got:
            for _ in rd.iter_batches(0):
                pass
    assert str(got.value).startswith(os.path.join(root, e["path"]) + ": ")


def test_inspect_names_a_damaged_chunk_never_a_buffer(cache, capsys):
    root, e = cache
    _truncate(root, e)
    assert main(["inspect", root, "--max_chunks", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {os.path.join(root, e['path'])}: truncated at 300 of {e['bytes']:,} bytes")
    assert "<Buffer>" not in err and len(err.strip().splitlines()) <= 2


def test_inspect_of_an_unreadable_footer_names_the_file(cache, capsys):
    root, e = cache
    path = os.path.join(root, e["path"])
    data = bytearray(open(path, "rb").read())
    data[-8:-4] = b"\xff\xff\xff\x7f"  # the footer length: pyarrow cannot open the file at all
    open(path, "wb").write(bytes(data))
    assert main(["inspect", root, "--max_chunks", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: not a readable Parquet chunk (")
    assert "<Buffer>" not in err
