"""The chunk table of format version 4 (reader/format/table.py, docs/FORMAT.md "Chunk table"): every earlier
version opens and reads the same batches; a torn or edited table is refused block by block, naming the block;
index files of a version 4 cache in the table's block format; ``validate`` holds the table against the
sidecars, and ``--sample`` checks a deterministic sample."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from reader import ReadOptions, Reader
from reader.cli.main import main
from reader.format import spec as fmt
from reader.format import blocks
from reader.format import table as chunk_table
from reader.format.sidecar import sidecar_bytes
from reader.order.streams import round_robin_order
from reader.storage import index as index_mod
from reader.storage.cache import Cache

import cachegen

CPS = [5, 4, 3]


@pytest.fixture(scope="module")
def chunks():
    return cachegen.random_chunks(np.random.default_rng(7), sum(CPS), max_docs=8, max_len=40)


def _cache(root, chunks, version, **kw):
    cachegen.write_synthetic_cache(str(root), chunks, chunks_per_shard=CPS, row_group_tokens=16, format_version=version, **kw)
    return str(root)


def _batches(root, opts, n=6, **kw):
    with Reader(root, opts, **kw) as r:
        return [{k: v.copy() for k, v in b.items()} for _, b in r.iter_batches(0, n)]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert np.array_equal(x[k], y[k]), k


# (the pass rule and best fit's continuation pieces given: their defaults follow the format version)
OPTIONS = [ReadOptions(seq_len=16, batch_size=4, ideal_readers=3, pass_rule="streams"),
           ReadOptions(seq_len=16, batch_size=4, ideal_readers=2, packed=False, shuffle_seed=3, pass_rule="spans"),
           ReadOptions(seq_len=16, batch_size=4, packing="best_fit", best_fit_window_tokens=32, drop_long=True,
                       pass_rule="streams", best_fit_continuations=1),
           ReadOptions(seq_len=16, batch_size=3, eval_mode=True)]


def test_every_version_opens_and_reads_the_same_batches(tmp_path, chunks):
    """Versions 1 and 2 (a chunk list, as writers before 3 wrote it), 3 and 4 (the table) of the same chunks read
    the same batches; the committed cache of the tree before the subpackages opens too."""
    roots = {v: _cache(tmp_path / f"v{v}", chunks, v) for v in (1, 2, 3, 4)}
    led = json.load(open(os.path.join(roots[4], fmt.LEDGER_NAME)))
    assert "chunks" not in led and chunk_table.is_table_name(led["table"]["path"])
    assert os.path.exists(os.path.join(roots[4], led["table"]["path"]))
    for opts in OPTIONS:
        want = _batches(roots[2], opts, num_readers=1)
        for v in (1, 3, 4):
            _same(_batches(roots[v], opts, num_readers=1), want)
    t2, t4 = Cache(roots[2]).table, Cache(roots[4]).table
    assert list(t4.checksums) == list(t2.checksums) and list(t4.paths) == list(t2.paths)
    assert t4.sidecar_checksums[:] == t2.sidecar_checksums[:] and np.array_equal(t4.tokens, t2.tokens)
    fixture = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "cache_before_layout", "cache")
    c = Cache(fixture)
    assert c.complete and c.ledger.raw["format_version"] in (2, 3) and len(c.table) > 0


def test_a_torn_or_edited_table_is_refused_block_by_block(tmp_path, chunks):
    """Blocks of 4 rows: a byte changed in any piece of any block is named (the count columns when the cache
    opens, a checksum column when a chunk of that block is read); a table cut short, or missing, too."""
    src = str(tmp_path / "src")
    cachegen.write_synthetic_cache(src, chunks, chunks_per_shard=CPS, row_group_tokens=16, format_version=4)
    led = json.load(open(os.path.join(src, fmt.LEDGER_NAME)))
    entries = cachegen.table_rows(src)
    led["table"] = cachegen.write_table(*cachegen._fs(src), entries, masked=False, block_rows=4)
    open(os.path.join(src, fmt.LEDGER_NAME), "w").write(fmt.dumps_ledger(led))
    want = _batches(src, OPTIONS[0])
    desc = led["table"]
    assert len(desc["blocks"]) == 3
    names = [c[0] for c in desc["columns"]]
    for b, pieces in enumerate(desc["blocks"]):
        for name, (off, length, _) in zip(names, pieces):
            root = str(tmp_path / f"b{b}-{name}")
            shutil.copytree(src, root)
            path = os.path.join(root, desc["path"])
            data = bytearray(open(path, "rb").read())
            data[off + length // 2] ^= 0x40
            open(path, "wb").write(data)
            said = f"{os.path.join(root, desc['path'])}: block {b} of column {name} (bytes [{off}, {off + length}))"
            with pytest.raises(fmt.DamagedCache) as e:
                c = Cache(root)
                if name in chunk_table.OPEN_COLUMNS:
                    pytest.fail("opened with a damaged count column")
                if name == "bad_records":  # (validate reads it)
                    blocks.rows_of(chunk_table.table_of(c.table), [b * 4])
                getattr(c.table, "checksums" if name == "checksum" else "sidecar_checksums")[b * 4]
            assert str(e.value).startswith(said) and "checksum does not match" in str(e.value), str(e.value)
            if name not in chunk_table.OPEN_COLUMNS:  # the blocks not damaged still read
                other = (b + 1) % 3
                assert Cache(root).table.checksums[other * 4] == Cache(src).table.checksums[other * 4]
    root = str(tmp_path / "torn")
    shutil.copytree(src, root)
    path = os.path.join(root, desc["path"])
    os.truncate(path, desc["blocks"][2][0][0] + 3)  # in block 2's first piece
    with pytest.raises(fmt.DamagedCache, match=r"block 2 of column docs .* is cut short"):
        Cache(root)
    os.remove(path)
    with pytest.raises(fmt.DamagedCache, match=r"table-[0-9a-f]{16}\.bin: missing \(the ledger names it\)"):
        Cache(root)
    for edit, said in ((lambda d: d.update(rows=d["rows"] + 1), "table.rows 13, the inputs have 12 chunks"),
                       (lambda d: d.update(checksum="sha256:" + "0" * 64), "does not name"),
                       (lambda d: d["blocks"][1][0].__setitem__(0, 7), "contiguous from byte 0")):
        root = str(tmp_path / "ledger")
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(src, root)
        bad = json.loads(json.dumps(led))
        edit(bad["table"])
        open(os.path.join(root, fmt.LEDGER_NAME), "w").write(fmt.dumps_ledger(bad))
        with pytest.raises(fmt.DamagedCache, match=said):
            Cache(root)
    _same(_batches(src, OPTIONS[0]), want)


def test_order_position_is_the_round_robin_order():
    counts = np.asarray([3, 0, 5, 1, 2, 5])
    order = round_robin_order(counts)
    for c, (s, k) in enumerate(order.tolist()):
        assert chunk_table.order_position(counts, s, k) == c


@pytest.mark.parametrize("packing,drop_long,caps", [("unpacked", False, ""), ("best_fit", False, "-C4"),
                                                    ("best_fit", True, "-C2-S2")])
def test_index_files_of_a_version_4_cache_are_in_the_block_format(tmp_path, chunks, monkeypatch, packing, drop_long,
                                                                  caps):
    """Written by the first reader, read by the next without counting a chunk, and counted again when a
    piece is damaged (the same batches either way). Named by every option that changes the counts, best fit's
    caps too (version 4: 4 continuation pieces by default), which the header repeats."""
    root = _cache(tmp_path / "c", chunks, 4)
    opts = (ReadOptions(seq_len=16, batch_size=4, packed=False, drop_long=drop_long) if packing == "unpacked" else
            ReadOptions(seq_len=16, batch_size=4, packing="best_fit", best_fit_window_tokens=32, drop_long=drop_long,
                        max_segments=2 if caps == "-C2-S2" else None))
    want = _batches(root, opts)
    name = f"{packing}-L16{'-W32' if packing == 'best_fit' else ''}{caps}{'-drop_long' * drop_long}.bin"
    path = os.path.join(root, "index", name)
    raw = open(path, "rb").read()
    head, parts = blocks.read_parts(raw, path)
    assert head["fingerprint"] == json.load(open(os.path.join(root, fmt.LEDGER_NAME)))["table"]["checksum"]
    assert head["caps"] == {"-C4": {"continuations": 4, "max_segments": None},
                            "-C2-S2": {"continuations": 2, "max_segments": 2}}.get(caps)
    assert parts["chunks"]["examples"].size == sum(CPS)
    counted = []
    real = index_mod.ExampleIndex._count
    monkeypatch.setattr(index_mod.ExampleIndex, "_count", lambda self, t, c: counted.append(c) or real(self, t, c))
    _same(_batches(root, opts), want)
    assert counted == []
    data = bytearray(raw)
    data[-3] ^= 1  # the last piece
    open(path, "wb").write(data)
    _same(_batches(root, opts), want)
    assert sorted(counted) == list(range(sum(CPS))) and open(path, "rb").read() == raw  # counted, rewritten
    if packing == "best_fit":  # a file of other caps under this name is not taken
        counted.clear()
        line, rest = raw.split(b"\n", 1)
        other = dict(json.loads(line), caps={"continuations": 1, "max_segments": None})
        open(path, "wb").write(json.dumps(other).encode() + b"\n" + rest)
        _same(_batches(root, opts), want)
        assert sorted(counted) == list(range(sum(CPS))) and open(path, "rb").read() == raw


def test_the_index_command_builds_what_readers_load(tmp_path, chunks, capsys, monkeypatch):
    root = _cache(tmp_path / "c", chunks, 4)
    assert main(["index", root, "--seq_len", "16", "--packing", "best_fit", "--best_fit_window_tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{root}/index/best_fit-L16-W32-C4.bin: ") and f"of {sum(CPS)} chunks, counted in " in out, out
    counted = []
    real = index_mod.ExampleIndex._count
    monkeypatch.setattr(index_mod.ExampleIndex, "_count", lambda self, t, c: counted.append(c) or real(self, t, c))
    _batches(root, ReadOptions(seq_len=16, batch_size=4, packing="best_fit", best_fit_window_tokens=32))
    assert main(["index", root, "--seq_len", "16", "--packing", "best_fit", "--best_fit_window_tokens", "32"]) == 0
    assert counted == [] and "already there, checked against the table: nothing counted" in capsys.readouterr().out


def _validate(capsys, *argv):
    code = main(["validate", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_validate_holds_the_table_against_the_sidecars(tmp_path, chunks, capsys):
    src = _cache(tmp_path / "src", chunks, 4)
    code, out = _validate(capsys, src)
    assert code == 0 and f"OK: {sum(CPS)} chunks" in out, out
    # a sidecar that disagrees with the table (the chunk file backs the table): the sidecar is named
    root = str(tmp_path / "side")
    shutil.copytree(src, root)
    t = Cache(root).table
    rel = fmt.sidecar_path(int(t.shard[5]), int(t.index_in_shard[5]))
    side = json.load(open(os.path.join(root, rel)))
    side["checksum"] = "sha256:" + "1" * 64
    open(os.path.join(root, rel), "wb").write(sidecar_bytes(side))
    code, out = _validate(capsys, root)
    assert code == 1 and f"PROBLEM {os.path.join(root, rel)}: damaged sidecar: differs from the ledger entry in " \
                          "['checksum']" in out, out
    # a table rewritten consistently with other numbers (its ledger too): the chunk file and its sidecar agree,
    # so the table is named
    root = str(tmp_path / "table")
    shutil.copytree(src, root)
    rows = cachegen.table_rows(root)
    rows[5]["tokens"] += 3
    led = json.load(open(os.path.join(root, fmt.LEDGER_NAME)))
    os.remove(os.path.join(root, led["table"]["path"]))
    led["table"] = cachegen.write_table(*cachegen._fs(root), rows, masked=False)
    led["totals"]["tokens"] += 3
    open(os.path.join(root, fmt.LEDGER_NAME), "w").write(fmt.dumps_ledger(led))
    code, out = _validate(capsys, root)
    table = os.path.join(root, led["table"]["path"])
    assert code == 1 and f"PROBLEM {table}: the entry of chunk 5 ({t.paths[5]}) says tokens {rows[5]['tokens']}; " \
                          f"the chunk file and its sidecar say {rows[5]['tokens'] - 3}. The table was changed" in out, out
    # --sample: the same chunks for the same seed; a sample that misses chunk 5 finds nothing
    got = {}
    for seed in range(8):
        code, out = _validate(capsys, root, "--sample", "3", "--seed", str(seed))
        assert "of 12 chunks (--sample 3 --seed" in out, out
        got[seed] = (code, out)
        assert _validate(capsys, root, "--sample", "3", "--seed", str(seed)) == got[seed]
    assert {c for c, _ in got.values()} == {0, 1}  # some samples hold chunk 5, some do not
    code, out = _validate(capsys, root, "--sample", "0.5")
    assert "6 of 12 chunks" in out
