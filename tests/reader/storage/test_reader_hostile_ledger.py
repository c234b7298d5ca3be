"""A ledger, sidecar or ``_DONE.json`` that lies (edited by hand, damaged, or hostile) is a damaged cache
with a one-line error naming the file and the entry, never a traceback, and never a file read outside the
cache: chunk paths that are not the format's own, integers out of range, JSON nested too deep, a build's
plan marked finished, token ids outside the vocabulary."""

import json
import os
import shutil

import numpy as np
import pytest

from reader import ReadOptions, Reader
from reader.cli.main import main
from reader.format import sidecar
from reader.format import spec as fmt
from reader.storage.cache import Cache

import cachegen

pytestmark = pytest.mark.timeout(300)
DEEP = "[" * 200_000 + "]" * 200_000  # json.loads raises RecursionError on it


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hostile") / "cache")
    chunks = cachegen.random_chunks(np.random.default_rng(5), 6, empty_prob=0.0, max_docs=8, max_len=50)
    cachegen.write_synthetic_cache(d, chunks, chunks_per_shard=[4, 2], row_group_tokens=16)
    return d


@pytest.fixture
def cache(pristine, tmp_path):
    root = str(tmp_path / "cache")
    shutil.copytree(pristine, root)
    return root


def _ledger(root):
    return json.load(open(os.path.join(root, fmt.LEDGER_NAME)))


def _write_ledger(root, ledger):
    open(os.path.join(root, fmt.LEDGER_NAME), "w").write(fmt.dumps_ledger(ledger))


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def _damaged(capsys, root, said):
    """Opening fails with one DamagedCache line naming the ledger; ``validate`` reports it as a problem
    (exit 1), ``inspect`` as an error (exit 1); no traceback anywhere."""
    with pytest.raises(fmt.DamagedCache) as e:
        Cache(root)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(os.path.join(root, fmt.LEDGER_NAME) + ": ") and said in msg, msg
    code, out = _run(capsys, "validate", root)
    assert code == 1 and f"PROBLEM {msg}" in out and "Traceback" not in out, out
    code, out = _run(capsys, "inspect", root)
    assert code == 1 and out == f"error: {msg}\n", out
    return msg


# -- paths ------------------------------------------------------------------------------------------


def _move_chunk_outside(root, rel):
    """Move chunk 0 to ``rel`` (relative to the cache root) and rewrite its sidecar and the ledger's
    sidecar_checksum to match: every checksum agrees, only the path is not the format's."""
    led = _ledger(root)
    e = led["chunks"][0]
    target = os.path.normpath(os.path.join(root, rel))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.move(os.path.join(root, e["path"]), target)
    side_path = os.path.join(root, fmt.sidecar_path(e["shard"], e["index_in_shard"]))
    side = json.load(open(side_path))
    side["path"] = rel
    open(side_path, "wb").write(sidecar.sidecar_bytes(side))
    e["path"], e["sidecar_checksum"] = rel, fmt.checksum(sidecar.sidecar_bytes(side))
    _write_ledger(root, led)
    return target


@pytest.mark.parametrize("rel", ["../outside/x.parquet", "chunks/shard-00000/../../../outside/x.parquet",
                                 "chunks/shard-00000/chunk-0.parquet", "chunks/shard-00001/chunk-000000.parquet"])
def test_a_chunk_path_other_than_the_formats_is_a_damaged_cache(cache, capsys, rel):
    outside = _move_chunk_outside(cache, rel)
    msg = _damaged(capsys, cache, f"chunk entry 0: path {rel!r}, the format's path of shard 0 chunk 0 is "
                                  "'chunks/shard-00000/chunk-000000.parquet'")
    assert "restore it, or rebuild the cache" in msg
    with pytest.raises(fmt.DamagedCache):
        Reader(cache, ReadOptions(seq_len=8, batch_size=2))
    assert os.path.exists(outside)  # (the file is there to be served: nothing opened it)


def test_a_dead_letter_path_other_than_the_formats_is_a_damaged_cache(cache, capsys):
    led = _ledger(cache)
    led["chunks"][1]["dead_letters"] = "../../etc/x.jsonl"
    _write_ledger(cache, led)
    _damaged(capsys, cache, "chunk entry 1: dead_letters '../../etc/x.jsonl', the format's path of the dead "
                            "letters of shard 1 chunk 0 is 'bad/shard-00001/chunk-000000.jsonl'")


def test_a_sidecar_of_a_running_build_naming_another_path_is_damaged(tmp_path):
    root = str(tmp_path / "live")
    cachegen.write_synthetic_cache(root, [[[1, 2]], [[3]]], finished=False)
    side_path = os.path.join(root, fmt.sidecar_path(0, 1))
    for key, value in (("dead_letters", "../x.jsonl"), ("shard", 1 << 40)):
        side = json.load(open(side_path))
        side[key] = value
        open(side_path, "wb").write(sidecar.sidecar_bytes(side))
        with pytest.raises(fmt.DamagedCache, match=rf"^{side_path}: not a valid sidecar \({key} "):
            Cache(root)


# -- numbers and nesting ----------------------------------------------------------------------------

OUT_OF_RANGE = [
    ("shard 2**40", lambda led: led["chunks"][0].update(shard=1 << 40),
     "chunk entry 0: shard 1099511627776 is outside [0, 1] (the ledger has 2 inputs)"),
    ("index -1", lambda led: led["chunks"][2].update(index_in_shard=-1), "chunk entry 2: index_in_shard -1 is outside"),
    ("docs of 400 digits", lambda led: led["chunks"][3].update(docs=10 ** 400),
     "chunk entry 3: docs 1000000000"),
    ("tokens 2**63", lambda led: led["chunks"][1].update(tokens=1 << 63), "chunk entry 1: tokens 9223372036854775808"),
    ("bytes 2**60", lambda led: led["chunks"][1].update(bytes=1 << 60), "chunk entry 1: bytes 1152921504606846976 is "
                                                                         "outside [0, 281474976710656]"),
    ("bytes a string", lambda led: led["chunks"][1].update(bytes="x"), "chunk entry 1: bytes 'x' is not an integer"),
    ("input size 2**70", lambda led: led["inputs"][0].update(size=1 << 70), "inputs[0].size 1180591620717411303424"),
    ("input chunks 2**40", lambda led: led["inputs"][1].update(chunks=1 << 40), "inputs[1].chunks 1099511627776"),
    ("vocab_size 2**40", lambda led: led["tokenizer"].update(vocab_size=1 << 40), "tokenizer.vocab_size 1099511627776"),
    ("eos_id past the vocabulary", lambda led: led["tokenizer"].update(vocab_size=10, eos_id=10),
     "tokenizer.eos_id 10 is not null or an id of the vocabulary [0, 10)"),
    ("chunk_bytes 0", lambda led: led["config"].update(chunk_bytes=0), "config.chunk_bytes 0 is not an integer in [1,"),
    ("bad_records a string", lambda led: led["bad_records"].update(x="y"), "bad_records must map names to integers"),
    ("totals 2**70", lambda led: led["totals"].update(docs=1 << 70), "totals must map names to integers"),
    ("finished a string", lambda led: led.update(finished="no"), "finished 'no' is not true or false"),
]


@pytest.mark.parametrize("what,edit,said", OUT_OF_RANGE, ids=[c[0] for c in OUT_OF_RANGE])
def test_integers_out_of_range_in_a_ledger_are_one_line_errors(cache, capsys, what, edit, said):
    led = _ledger(cache)
    edit(led)
    _write_ledger(cache, led)
    _damaged(capsys, cache, said)


def test_a_ledger_nested_too_deep_is_a_damaged_cache(cache, capsys):
    open(os.path.join(cache, fmt.LEDGER_NAME), "w").write(DEEP)
    _damaged(capsys, cache, "not valid JSON (nested too deep)")


def test_a_sidecar_nested_too_deep_or_with_huge_numbers_is_named(cache, capsys):
    led = _ledger(cache)
    e = led["chunks"][2]
    side_path = os.path.join(cache, fmt.sidecar_path(e["shard"], e["index_in_shard"]))
    side = json.load(open(side_path))
    side["footer"][0] = 1 << 70  # the ledger vouches for the sidecar: its checksum is rewritten to match
    e["sidecar_checksum"] = fmt.checksum(sidecar.sidecar_bytes(side))
    open(side_path, "wb").write(sidecar.sidecar_bytes(side))
    _write_ledger(cache, led)
    with Reader(cache, ReadOptions(seq_len=4, batch_size=2, prefetch_threads=0)) as r:
        with pytest.raises(fmt.DamagedCache, match=rf"^{side_path}: malformed row_group_index/footer \(numbers "):
            for _ in r.iter_batches(0, 200):
                pass
    open(side_path, "w").write(DEEP)
    code, out = _run(capsys, "validate", cache)
    assert code == 1 and f"PROBLEM {side_path}: damaged sidecar: not valid JSON (nested too deep)" in out


def test_a_done_file_of_a_running_build_nested_too_deep_or_out_of_range(tmp_path):
    root = str(tmp_path / "live")
    cachegen.write_synthetic_cache(root, [[[1, 2]], [[3]]], finished=False, compressed=[True], done_shards=[0])
    done = os.path.join(root, fmt.shard_done_path(0))
    for body, said in ((DEEP, "not valid JSON (nested too deep)"),
                       ('{"chunks": 1099511627776}', '"chunks" 1099511627776 is not a chunk count')):
        open(done, "w").write(body)
        with pytest.raises(fmt.DamagedCache, match=rf"^{done}: " + said.replace("(", r"\(").replace(")", r"\)")):
            Cache(root)


# -- finished must agree with the files ---------------------------------------------------------------


@pytest.fixture(scope="module")
def gzip_build(tmp_path_factory):
    """A real build of one gzip shard (its chunk count is known only from its _DONE.json)."""
    from build_helpers import build, sample_texts, write_shard

    tmp = tmp_path_factory.mktemp("gzbuild")
    shard = write_shard(str(tmp / "a.jsonl.gz"), [{"text": t} for t in sample_texts(40, seed=1)])
    out, _ = build(tmp, [shard], chunk_bytes=2048)
    return out


def _plan_marked_finished(src, dst, chunks=None):
    """The build's plan (docs/FORMAT.md: no chunks, table, totals or sizes; a gzip shard's chunk count null),
    edited to say finished; with ``chunks`` (a count for every shard), a table of that many rows too, so that it
    opens."""
    shutil.copytree(src, dst)
    led = _ledger(dst)
    led.update(finished=True, chunks=[], totals={}, bad_records={})
    del led["table"]
    for inp in led["inputs"]:
        inp.pop("uncompressed_bytes")
        inp["chunks"] = chunks
    if chunks is not None:
        led["table"] = cachegen.write_table(*cachegen._fs(dst), [], masked=False) if not chunks else None
    _write_ledger(dst, led)


def test_a_gzip_builds_plan_marked_finished_is_not_an_empty_cache(gzip_build, tmp_path, capsys):
    n = len(Cache(gzip_build).table)
    assert n > 10 and json.load(open(os.path.join(gzip_build, fmt.shard_done_path(0))))["chunks"] == n
    root = str(tmp_path / "plan")
    _plan_marked_finished(gzip_build, root)
    msg = _damaged(capsys, root, "says finished, but records no chunk count for input shard 0 and no chunk table "
                                 "(a build's plan marked finished")
    code, out = _run(capsys, "export", root, "--format", "megatron", "--out", str(tmp_path / "m" / "x"))
    assert code == 1 and msg in out and not os.path.exists(tmp_path / "m")
    with pytest.raises(fmt.DamagedCache):
        Reader(root, ReadOptions(seq_len=8, batch_size=2))


def test_a_shards_chunk_count_must_be_what_its_size_implies(gzip_build, tmp_path, capsys):
    """The last chunk of the shard dropped from the ledger, with its count and the totals edited to match:
    still refused when opened (a shard of U bytes has ceil(U / chunk_bytes) chunks)."""
    root = str(tmp_path / "short")
    shutil.copytree(gzip_build, root)
    rows = {i: r for i, r in enumerate(cachegen.table_rows(root))}
    led = _ledger(root)
    n = len(rows)
    last = rows.pop(n - 1)
    led["inputs"][0]["chunks"] = n - 1
    led["totals"].update(chunks=n - 1, docs=led["totals"]["docs"] - last["docs"],
                         tokens=led["totals"]["tokens"] - last["tokens"])
    led["table"] = cachegen.write_table(*cachegen._fs(root), [rows[i] for i in range(n - 1)], masked=False)
    _write_ledger(root, led)
    size = led["inputs"][0]["uncompressed_bytes"]
    _damaged(capsys, root, f"input shard 0 ({os.path.dirname(gzip_build)}/a.jsonl.gz) of {size} bytes has {n - 1} "
                           f"chunks, the format says {n} of 2048 bytes")


def test_validate_compares_every_shards_files_with_the_ledger(gzip_build, tmp_path, capsys):
    """A plan edited further (its shard said to have 0 chunks) opens as an empty cache: opening reads no
    directory, but validate lists each shard's files and reads its _DONE.json."""
    root = str(tmp_path / "plan0")
    _plan_marked_finished(gzip_build, root, chunks=0)
    n = json.load(open(os.path.join(root, fmt.shard_done_path(0))))["chunks"]
    assert len(Cache(root).table) == 0
    code, out = _run(capsys, "validate", root)
    assert code == 1, out
    assert f"PROBLEM {root}/chunks/shard-00000: holds chunk 0 (and {n - 1} more), ledger.json lists 0 chunks" in out
    assert f"PROBLEM {root}/chunks/shard-00000/_DONE.json: says chunks {n}; ledger.json says chunks 0" in out
    os.makedirs(os.path.join(root, fmt.shard_dir(3)))
    code, out = _run(capsys, "validate", root)
    assert f"PROBLEM {root}/chunks/shard-00003: a directory of shard 3, but ledger.json has 1 input shards" in out
    code, out = _run(capsys, "validate", gzip_build)
    assert code == 0 and f"OK: {n} chunks" in out


# -- token ids against the vocabulary -----------------------------------------------------------------


def test_validate_checks_token_ids_against_the_vocabulary(gzip_build, tmp_path, capsys):
    root = str(tmp_path / "vocab")
    shutil.copytree(gzip_build, root)
    led = _ledger(root)
    led["tokenizer"]["vocab_size"], led["tokenizer"]["eos_id"] = 1000, None
    _write_ledger(root, led)
    code, out = _run(capsys, "validate", root)
    problems = [ln for ln in out.splitlines() if ln.startswith("PROBLEM ")]
    assert code == 1 and problems, out
    first = os.path.join(root, Cache(root).table.paths[0])
    assert problems[0].startswith(f"PROBLEM {first}: row group 0 holds token id ")
    assert "outside the vocabulary [0, 1000) of the ledger's tokenizer (tiktoken:cl100k_base)" in problems[0]
    code, out = _run(capsys, "validate", root, "--quick")  # (no token is decoded)
    assert code == 0, out



def test_an_unpacked_index_file_that_lies_is_counted_again(cache):
    """``index/unpacked-L{L}.json`` (written by readers into the cache) nested too deep, with a number too
    large for numpy, or with impossible counts under the right fingerprint: the reader counts again."""
    opts = ReadOptions(seq_len=8, batch_size=4, packed=False, prefetch_threads=0)

    def batches():
        with Reader(cache, opts) as r:
            return [b["targets"].tolist() for _, b in r.iter_batches(0, 6)]

    want = batches()
    path = os.path.join(cache, "index", "unpacked-L8.json")
    good = json.load(open(path))
    for body in (DEEP, json.dumps(dict(good, counts=[1 << 70] * len(good["counts"]))),
                 json.dumps(dict(good, counts=[-5] + good["counts"][1:]))):
        open(path, "w").write(body)
        assert batches() == want


def test_an_unpacked_index_file_with_an_edited_count_is_refused_when_read_and_named_by_validate(cache, capsys):
    """A count edited under the right fingerprint was trusted: other batches, exit 0, and ``validate`` OK.
    Each chunk's count is now checked against its documents when they are read (as best-fit windows are),
    and ``validate`` counts every index file again."""
    opts = ReadOptions(seq_len=8, batch_size=4, packed=False, prefetch_threads=0)
    with Reader(cache, opts) as r:
        want = [b["targets"].tolist() for _, b in r.iter_batches(0, 4)]
    path = os.path.join(cache, "index", "unpacked-L8.json")
    good = json.load(open(path))
    assert _run(capsys, "validate", cache)[0] == 0
    open(path, "w").write(json.dumps(dict(good, counts=[good["counts"][0] + 1] + good["counts"][1:])))
    first = os.path.join(cache, _ledger(cache)["chunks"][0]["path"])
    with pytest.raises(fmt.DamagedCache, match=rf"^{first}: its documents make {good['counts'][0]} unpacked examples of "
                                               rf"8 tokens, the index says {good['counts'][0] + 1}\. Delete {path}"):
        with Reader(cache, opts) as r:
            [b for _, b in r.iter_batches(0, 4)]
    code, out = _run(capsys, "validate", cache)
    assert code == 1 and (f"PROBLEM {path}: its counts differ from what the chunks make (chunk 0: the file says "
                          f"{good['counts'][0] + 1}, its documents make {good['counts'][0]})") in out, out
    os.remove(path)
    with Reader(cache, opts) as r:
        assert [b["targets"].tolist() for _, b in r.iter_batches(0, 4)] == want


# -- the reader's own files: FIFOs, devices, symlinks --------------------------------------------------
# Runs in the child (memory capped: /dev/zero read whole would exhaust it): for each path, ``inspect`` and a
# Reader's first batch, one RESULT line each.
READS = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from reader import ReadOptions, Reader
from reader.cli.main import main
for path in sys.argv[1:]:
    out = {}
    try:
        out["inspect"] = main(["inspect", path])
    except BaseException as e:
        out["inspect"] = f"{type(e).__name__}: {e}"
    try:
        with Reader(path, ReadOptions(seq_len=8, batch_size=4, packed=False, prefetch_threads=0)) as r:
            out["batch"] = r.batch(0)["targets"].tolist()
    except BaseException as e:
        out["batch"] = f"{type(e).__name__}: {e}"
    print("RESULT " + json.dumps(out), flush=True)
"""


def _reads_in_a_child(paths, timeout=120):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", READS, *paths], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=dict(os.environ, MALLOC_ARENA_MAX="2"))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == len(paths), f"{len(lines)} of {len(paths)} reads ended (a hang?): {(out + err)[-3000:]}"
    return [json.loads(ln.split("RESULT ", 1)[1]) for ln in lines], out + err


def test_the_readers_own_files_as_fifos_or_devices_never_hang_or_exhaust_memory(pristine, tmp_path):
    """A FIFO ``ledger.json``, mixture file or index file hung ``inspect`` and ``Reader(...)`` despite
    their timeouts; ``/dev/zero`` as a mixture or index file read without end (or a MemoryError traceback).
    Now a ledger or mixture file that is not a regular file is one line naming it; the reader's own index
    file is the reader's to make again (it is counted again, and replaced)."""
    roots = {}
    for name in ("fifo_ledger", "fifo_index", "zero_index", "plain"):
        roots[name] = str(tmp_path / name)
        shutil.copytree(pristine, roots[name])
    os.remove(os.path.join(roots["fifo_ledger"], fmt.LEDGER_NAME))
    os.mkfifo(os.path.join(roots["fifo_ledger"], fmt.LEDGER_NAME))
    for name, make in (("fifo_index", os.mkfifo), ("zero_index", lambda p: os.symlink("/dev/zero", p))):
        os.makedirs(os.path.join(roots[name], "index"), exist_ok=True)
        make(os.path.join(roots[name], "index", "unpacked-L8.json"))
    mixtures = {}
    for name, make in (("fifo", os.mkfifo), ("zero", lambda p: os.symlink("/dev/zero", p))):
        mixtures[name] = str(tmp_path / f"{name}.mix.json")
        make(mixtures[name])
    got, _ = _reads_in_a_child([roots["fifo_ledger"], mixtures["fifo"], mixtures["zero"], roots["fifo_index"],
                                roots["zero_index"], roots["plain"]])
    ledger = os.path.join(roots["fifo_ledger"], fmt.LEDGER_NAME)
    assert got[0]["inspect"] == 1 and got[0]["batch"] == (f"DamagedCache: {ledger}: a FIFO (named pipe), not a "
                                                          "regular file: only regular files are read (remove it, or "
                                                          "replace it with the file meant)")
    assert got[1]["batch"] == f"MixtureError: {mixtures['fifo']}: a FIFO (named pipe), not a regular file: only " \
                              "regular files are read (remove it, or replace it with the file meant)"
    assert got[2]["batch"].startswith(f"MixtureError: {mixtures['zero']}: a character device, not a regular file")
    assert got[1]["inspect"] == got[2]["inspect"] == 2
    want = got[5]["batch"]
    assert isinstance(want, list) and got[3]["batch"] == got[4]["batch"] == want
    for name in ("fifo_index", "zero_index"):  # made again, in place of the FIFO or the symlink
        path = os.path.join(roots[name], "index", "unpacked-L8.json")
        assert not os.path.islink(path) and json.load(open(path))["counts"]


def test_a_symlink_planted_at_the_index_directory_is_never_written_through(cache, tmp_path):
    """``CACHE/index -> elsewhere``: the reader wrote its index files into the link's target, outside the
    cache. It now writes no index file there (a warning names the link) and reads as before."""
    opts = ReadOptions(seq_len=8, batch_size=4, packed=False, prefetch_threads=0)
    with Reader(cache, opts) as r:
        want = [b["targets"].tolist() for _, b in r.iter_batches(0, 4)]
    shutil.rmtree(os.path.join(cache, "index"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, os.path.join(cache, "index"))
    with pytest.warns(UserWarning, match=f"not written: .*{os.path.join(cache, 'index')} is a symlink"):
        with Reader(cache, opts) as r:
            assert [b["targets"].tolist() for _, b in r.iter_batches(0, 4)] == want
    assert os.listdir(elsewhere) == []
