"""Chaos: faults injected at random into real builds; a cache with exit code 0 must equal a clean build.

Every case ends in one of two acceptable outcomes: the build finishes and its cache is byte-identical to
a clean build of the inputs as they are, or it fails (exit code 2 or 1) with a message naming the file
or the cause, leaves no cache that claims to be finished, and a rerun after the fix (or after nothing,
for crashes) finishes byte-identical.

Cases: random SIGKILLs of the launcher at any atomic write, the final ledger write included
(``tests/support/kill_at.py``); an input edited between the kill and the rerun; both again for a split build
(``--validation_fraction``), and a split and a plain build started at once; truncated and bit-flipped
compressed inputs; two builds started at once into one output; a full disk (a small tmpfs; skipped,
with the reason, where ``mount`` is not allowed); a read-only output; a worker process killed; gs://
without a reachable server; random jsonl lines, through byte ranges and a gzip stream alike (hypothesis:
every line is in a chunk or a dead letter, never lost).

The default is quick enough for CI (a couple of minutes). ``CHUNKLEDGER_CHAOS=long`` runs many more
random cases; ``CHUNKLEDGER_CHAOS_REPORT=path.json`` collects every case's outcome (docs/RELIABILITY.md
shows the table of a long run; tests/support/chaos.py). Kills of the launcher's process group at random
moments under CPU contention, and reruns while the killed launcher is still a zombie, are in
tests/end_to_end/test_chaos_contention.py.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import zstandard

from build_helpers import REPO, build, load_ledger, sample_texts, tree_bytes, write_shard
from chaos import LONG, OPTS, SEED, argv, n, record, write_corpus, write_report
from pipelines.errors import BuildError, EnvironmentFault
from reader.format import spec as fmt

pytestmark = [pytest.mark.timeout(1800 if LONG else 600), pytest.mark.slow]  # kills and reruns: make test only


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    write_report()


LOG_DIR = ""  # the builders' failure logs go here, not to the system's temporary directory


@pytest.fixture(scope="module", autouse=True)
def log_dir(tmp_path_factory):
    global LOG_DIR
    LOG_DIR = str(tmp_path_factory.mktemp("chaos_logs"))
    yield LOG_DIR

def cli(args: list[str], kill_at: str | None = None, env: dict | None = None) -> subprocess.Popen:
    """The command-line build in a subprocess (``kill_at``: SIGKILL it at that write, see tests/support/kill_at.py)."""
    cmd = [sys.executable, os.path.join(REPO, "tests", "support", "kill_at.py"), kill_at] if kill_at else \
        [sys.executable, "-m", "pipelines.build_cache"]
    env = dict(env or os.environ, TMPDIR=LOG_DIR)
    return subprocess.Popen([*cmd, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out + err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A plain shard with bad lines, a gzip and a zstd shard."""
    d = tmp_path_factory.mktemp("chaos_in")
    write_corpus(d)
    return d


@pytest.fixture(scope="module")
def clean(corpus, tmp_path_factory):
    out, _ = build(tmp_path_factory.mktemp("chaos_clean"), [str(corpus / "*")], **OPTS)
    return tree_bytes(out)


def copy_corpus(corpus, dst) -> str:
    shutil.copytree(corpus, dst)
    return str(dst)


# ---------------------------------------------------------------------------------------------------
# SIGKILL at random writes, then rerun (and: an input edited in between)


def _writes(tree: dict) -> int:
    """The atomic writes of a build whose finished tree is ``tree``: every file once (the chunks' entries and the
    table too) and the plan ledger(s)."""
    return len(tree) + sum(1 for k in tree if k.endswith(fmt.LEDGER_NAME))


def test_random_kills_then_rerun_is_byte_identical(corpus, clean, tmp_path):
    rng = random.Random(SEED)
    writes = _writes(clean)
    assert sum(1 for k in clean if os.path.basename(k).startswith("table-")) == 1
    # the final ledger write (finalize), and the table's: killed before its rename, and after it, before the
    # ledger's (the table is on disk, the ledger is still the plan)
    points = [f"{writes}:before_rename", f"{writes}:after_rename", f"{writes - 1}:before_rename",
              f"{writes - 1}:after_rename"]
    points += [f"{rng.randint(1, writes)}:{rng.choice(['before_rename', 'after_rename'])}"
               for _ in range(n(3, 40))]
    for i, point in enumerate(points):
        out = str(tmp_path / f"k{i}")
        code, text = finish(cli(argv(str(corpus / "*"), out), kill_at=point))
        assert code == -signal.SIGKILL, (point, text[-2000:])
        if point == f"{writes - 1}:after_rename":
            assert any(f.startswith("table-") for f in os.listdir(out)) and not load_ledger(out)["finished"]
        _, res = build(tmp_path, [str(corpus / "*")], name=f"k{i}", **OPTS)
        assert res["resumed"]
        ok = tree_bytes(out) == clean
        case = "SIGKILL in the final ledger write (finalize), rerun" if point.startswith(f"{writes}:") else \
            "SIGKILL between the table's write and the ledger's (finalize), rerun" if \
            point.startswith(f"{writes - 1}:") else "SIGKILL at a random write, rerun"
        record(case, "byte-identical" if ok else "DIFFERENT")
        assert ok, point


def _random_edit(rng: random.Random, path: str) -> str:
    """A same-length edit of a plain shard: a letter changed, or a space turned into a newline."""
    data = bytearray(open(path, "rb").read())
    if rng.random() < 0.7:
        at = rng.choice([i for i, c in enumerate(data) if chr(c).isalpha()])
        data[at] = ord("Q") if data[at] != ord("Q") else ord("q")
        kind = "letter changed"
    else:
        at = rng.choice([i for i, c in enumerate(data) if c == ord(" ")])
        data[at] = ord("\n")
        kind = "space -> newline"
    with open(path, "wb") as f:
        f.write(data)
    return kind


def test_kill_then_edit_the_input_then_rerun_equals_a_clean_build_of_the_edit(corpus, clean, tmp_path):
    rng = random.Random(SEED + 1)
    writes = _writes(clean)
    for i in range(n(2, 15)):
        d = copy_corpus(corpus, tmp_path / f"in{i}")
        out = str(tmp_path / f"e{i}")
        point = f"{rng.randint(2, writes)}:{rng.choice(['before_rename', 'after_rename'])}"
        code, text = finish(cli(argv(os.path.join(d, "*"), out), kill_at=point))
        assert code == -signal.SIGKILL, (point, text[-2000:])
        kind = _random_edit(rng, os.path.join(d, "a.jsonl"))
        _, res = build(tmp_path, [os.path.join(d, "*")], name=f"e{i}", **OPTS)
        want, _ = build(tmp_path, [os.path.join(d, "*")], name=f"e{i}-clean", **OPTS)
        ok = tree_bytes(out) == tree_bytes(want)
        record(f"SIGKILL, input edited in place ({kind}), rerun", "equals a clean build of the edit" if ok
               else "DIFFERENT")
        assert ok, (point, kind)


# ---------------------------------------------------------------------------------------------------
# Split builds (--validation_fraction): the same properties for both caches

SPLIT_ARGS = ("--validation_fraction", "0.3", "--split_seed", "7")
SPLIT_OPTS = dict(OPTS, validation_fraction=0.3, split_seed=7)


@pytest.fixture(scope="module")
def clean_split(corpus, tmp_path_factory):
    out, _ = build(tmp_path_factory.mktemp("chaos_split_clean"), [str(corpus / "*")], **SPLIT_OPTS)
    return tree_bytes(out)


def test_split_build_random_kills_then_rerun_is_byte_identical(corpus, clean_split, tmp_path):
    rng = random.Random(SEED + 5)
    writes = _writes(clean_split)  # every file once, the two plan ledgers, the entries
    # between the two final ledgers (train finished, validation not), the very last write, and after both
    # tables, before the ledgers
    points = [f"{writes - 1}:after_rename", f"{writes}:before_rename", f"{writes - 2}:after_rename"]
    points += [f"{rng.randint(1, writes)}:{rng.choice(['before_rename', 'after_rename'])}" for _ in range(n(3, 40))]
    for i, point in enumerate(points):
        out = str(tmp_path / f"k{i}")
        code, text = finish(cli(argv(str(corpus / "*"), out, *SPLIT_ARGS), kill_at=point))
        assert code == -signal.SIGKILL, (point, text[-2000:])
        build(tmp_path, [str(corpus / "*")], name=f"k{i}", **SPLIT_OPTS)
        ok = tree_bytes(out) == clean_split
        record("split build: SIGKILL at a random write, rerun", "both caches byte-identical" if ok else "DIFFERENT")
        assert ok, point


def test_split_build_kill_then_edit_the_input_then_rerun(corpus, clean_split, tmp_path):
    """Equals a clean split build of the edit; or, if the kill came after the train cache was finished,
    the rerun refuses naming the file and leaves that cache as it was."""
    rng = random.Random(SEED + 6)
    writes = _writes(clean_split)
    points = [f"{writes - 1}:after_rename"]  # train finished, validation not: the edit must be refused
    points += [f"{rng.randint(2, writes)}:{rng.choice(['before_rename', 'after_rename'])}" for _ in range(n(2, 15))]
    for i, point in enumerate(points):
        d = copy_corpus(corpus, tmp_path / f"in{i}")
        out = str(tmp_path / f"e{i}")
        code, text = finish(cli(argv(os.path.join(d, "*"), out, *SPLIT_ARGS), kill_at=point))
        assert code == -signal.SIGKILL, (point, text[-2000:])
        train = os.path.join(out, "train")
        finished = os.path.exists(os.path.join(train, fmt.LEDGER_NAME)) and load_ledger(train)["finished"]
        before = tree_bytes(train)
        kind = _random_edit(rng, os.path.join(d, "a.jsonl"))
        try:
            build(tmp_path, [os.path.join(d, "*")], name=f"e{i}", **SPLIT_OPTS)
        except BuildError as e:
            ok = finished and "changed since the cache in" in str(e) and tree_bytes(train) == before
            record(f"split build: SIGKILL after train was finished, input edited ({kind}), rerun",
                   "refused, file named, train unchanged" if ok else "WRONG")
            assert ok, (point, str(e))
            continue
        want, _ = build(tmp_path, [os.path.join(d, "*")], name=f"e{i}-clean", **SPLIT_OPTS)
        ok = not finished and tree_bytes(out) == tree_bytes(want)
        record(f"split build: SIGKILL, input edited in place ({kind}), rerun",
               "equals a clean split build of the edit" if ok else "DIFFERENT")
        assert ok, (point, kind)


def test_split_and_plain_build_started_at_once_into_one_output(corpus, clean, clean_split, tmp_path):
    out = str(tmp_path / "both")
    procs = [cli(argv(str(corpus / "*"), out, *SPLIT_ARGS)), cli(argv(str(corpus / "*"), out))]
    results = [finish(p) for p in procs]
    assert sorted(c for c, _ in results) == [0, 2], results
    refused = next(text for code, text in results if code == 2)
    assert f"another build (process" in refused or "split build" in refused or "without --validation_fraction" in \
        refused, refused
    ok = tree_bytes(out) == (clean_split if results[0][0] == 0 else clean)
    record("a split and a plain build at once into one output", "one refused, the other's output byte-identical"
           if ok else "MIXED")
    assert ok


# ---------------------------------------------------------------------------------------------------
# Damaged compressed inputs


def _damage(rng: random.Random, data: bytes, how: str) -> bytes:
    if how == "truncated":
        return data[:rng.randint(1, len(data) - 1)]
    out = bytearray(data)
    at = rng.randrange(10, len(out))  # past the header (no checksum covers a gzip header's mtime/OS bytes)
    out[at] ^= 1 << rng.randrange(8)
    return bytes(out)


@pytest.mark.parametrize("comp", ["gzip", "zstd"])
def test_damaged_compressed_input_never_finishes_a_cache(tmp_path, comp):
    rng = random.Random(SEED + (2 if comp == "gzip" else 3))
    body = [{"text": t} for t in sample_texts(400, seed=34)]
    name = "d.jsonl.gz" if comp == "gzip" else "d.jsonl.zst"
    src = write_shard(str(tmp_path / "src" / name), body)
    if comp == "zstd":  # as the zstd command line writes it: with the frame checksum
        plain = zstandard.ZstdDecompressor().decompressobj().decompress(open(src, "rb").read())
        with open(src, "wb") as f:
            f.write(zstandard.ZstdCompressor(level=3, write_checksum=True).compress(plain))
    intact = open(src, "rb").read()
    clean_out, _ = build(tmp_path, [src], name="clean", chunk_bytes=65536)
    os.makedirs(tmp_path / "in", exist_ok=True)
    path = str(tmp_path / "in" / name)
    for i in range(n(4, 30)):
        how = "truncated" if i % 2 == 0 else "bit flipped"
        with open(path, "wb") as f:
            f.write(_damage(rng, intact, how))
        out = str(tmp_path / f"o{i}")
        try:
            _, res = build(tmp_path, [path], name=f"o{i}", chunk_bytes=65536)
        except BuildError as e:
            assert path in str(e), str(e)
            ledger = load_ledger(out) if os.path.exists(os.path.join(out, fmt.LEDGER_NAME)) else {}
            assert not ledger.get("finished") and not os.path.exists(os.path.join(out, fmt.shard_done_path(0)))
            assert not glob.glob(os.path.join(out, "chunks", "*", "*.json")), "chunks of a damaged stream kept"
            record(f"{comp} input {how}", "refused, file named" + (", at open" if "not readable" in str(e)
                                                                    else ""))
            with open(path, "wb") as f:
                f.write(intact)
            build(tmp_path, [path], name=f"o{i}", chunk_bytes=65536)  # restored: the rerun finishes
            assert _same_but_path(out, clean_out)
            continue
        # a damage no check can see must not change what is read (e.g. a flip in gzip's unchecked header)
        ok = _same_but_path(out, clean_out)
        record(f"{comp} input {how}", "finished: damage did not change the data" if ok else "WRONG CACHE")
        assert ok


def _same_but_path(out: str, clean_out: str) -> bool:
    """Same documents and chunk files (the ledgers differ in the recorded input path and size)."""
    a, b = tree_bytes(out), tree_bytes(clean_out)
    chunks = [k for k in b if k.endswith(".parquet")]
    return sorted(a) == sorted(b) and all(a[k] == b[k] for k in chunks)


# ---------------------------------------------------------------------------------------------------
# Two builds into one output


def test_two_builds_started_at_once_into_one_output(corpus, clean, tmp_path):
    for i in range(n(1, 5)):
        out = str(tmp_path / f"c{i}")
        procs = [cli(argv(str(corpus / "*"), out)) for _ in range(2)]
        results = [finish(p) for p in procs]
        codes = sorted(code for code, _ in results)
        assert codes in ([0, 0], [0, 2]), results
        if codes == [0, 2]:
            refused = next(text for code, text in results if code == 2)
            assert f"another build (process" in refused and f"is writing into {out}" in refused, refused
        ok = tree_bytes(out) == clean
        record("two identical builds at once", ("one refused (lock), other finished" if codes == [0, 2]
                                                 else "both finished") + (", byte-identical" if ok else ", DIFFERENT"))
        assert ok
    # different options at once: never a mixed cache
    out = str(tmp_path / "mixed")
    procs = [cli(argv(str(corpus / "*"), out)), cli(argv(str(corpus / "*"), out, "--append_eos"))]
    results = [finish(p) for p in procs]
    assert sorted(c for c, _ in results) == [0, 2], results
    winner = 0 if results[0][0] == 0 else 1
    want, _ = build(tmp_path, [str(corpus / "*")], name="want", **({"append_eos": True} if winner else {}), **OPTS)
    ok = tree_bytes(out) == tree_bytes(want)
    record("two builds with different options at once", "one refused, the other's cache byte-identical" if ok
           else "MIXED")
    assert ok


# ---------------------------------------------------------------------------------------------------
# Full disk, read-only output, a killed worker, an unreachable gs://


def _mount_tmpfs(path: str, size: int, *flags: str) -> str | None:
    """Mount a tmpfs of ``size`` bytes at ``path``; the reason if this machine does not allow it."""
    os.makedirs(path, exist_ok=True)
    opts = ",".join([f"size={size}", *flags])
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"mount exited {proc.returncode}")


def _umount(path: str) -> None:
    subprocess.run(["umount", "-l", path], capture_output=True)


def test_full_disk_names_the_path_then_a_rerun_with_space_finishes(corpus, clean, tmp_path):
    total = sum(len(v) for v in clean.values())
    rng = random.Random(SEED + 4)
    mnt = str(tmp_path / "mnt")
    fractions = [0.3, 0.7] if not LONG else [rng.uniform(0.1, 0.95) for _ in range(8)]
    for i, frac in enumerate(fractions):
        why = _mount_tmpfs(mnt, max(4096, int(total * frac)))
        if why is not None:
            pytest.skip(f"cannot mount a small tmpfs here ({why}); this case needs CAP_SYS_ADMIN")
        try:
            out = os.path.join(mnt, "cache")
            code, text = finish(cli(argv(str(corpus / "*"), out)))
            assert code == 1, text[-3000:]
            errors = [ln for ln in text.splitlines() if not ln.startswith("WARNING")]
            assert errors[0].startswith("error: no space left on the device: ") and mnt in errors[0], text
            assert "Rerunning the same command resumes" in errors[0] and len(errors) == 2, text
            assert not load_ledger(out)["finished"] if os.path.exists(os.path.join(out, "ledger.json")) else True
            subprocess.run(["mount", "-o", f"remount,size={total * 4}", mnt], check=True)  # free space
            _, res = build(tmp_path, [str(corpus / "*")], name=os.path.join("mnt", "cache"), **OPTS)
            ok = tree_bytes(out) == clean
            record("disk full mid-build, rerun after freeing space", "exit 1, path named; rerun byte-identical"
                   if ok else "DIFFERENT")
            assert ok
        finally:
            _umount(mnt)


def test_read_only_output_and_output_that_is_a_file(corpus, tmp_path):
    mnt = str(tmp_path / "ro")
    why = _mount_tmpfs(mnt, 1 << 20, "ro")
    if why is not None:
        pytest.skip(f"cannot mount a read-only tmpfs here ({why}); as root, permissions alone do not stop writes")
    try:
        code, text = finish(cli(argv(str(corpus / "*"), os.path.join(mnt, "cache"))))
    finally:
        _umount(mnt)
    errors = [ln for ln in text.splitlines() if not ln.startswith("WARNING")]
    assert code == 1 and errors[0].startswith(f"error: read-only file system: {mnt}/cache"), text
    assert len(errors) == 2 and errors[1].startswith(f"(details: {LOG_DIR}/chunkledger-build-"), text
    log = errors[1][len("(details: "):].split(";")[0]
    assert "Traceback" in open(log).read()  # the traceback the console did not show
    record("read-only --output", "exit 1, path named, log file named")
    (tmp_path / "afile").write_text("x")
    code, text = finish(cli(argv(str(corpus / "*"), str(tmp_path / "afile"))))
    assert code == 2 and f"error: --output {tmp_path / 'afile'} is a file, not a directory" in text, text
    record("--output is a file", "exit 2, path named")


def _children(pid: int) -> list[int]:
    out = []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(d, "stat")) as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(os.path.basename(d)))
        except (OSError, ValueError, IndexError):
            pass
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker processes through /proc")
def test_killed_worker_is_one_line_and_a_rerun_finishes(tmp_path):
    texts = sample_texts(600, seed=35, min_words=100, max_words=600)
    for s in range(2):
        write_shard(str(tmp_path / "in" / f"{s}.jsonl"), [{"text": t} for t in texts[s::2]])
    clean, _ = build(tmp_path, [str(tmp_path / "in" / "*")], name="clean", **OPTS)
    for i in range(n(1, 3)):
        out = str(tmp_path / f"cache{i}")
        args = [*argv(str(tmp_path / "in" / "*"), out)[:-1], "--runner=DirectRunner",
                "--direct_running_mode=multi_processing", "--direct_num_workers=2"]
        proc = cli(args)
        killed, deadline = None, time.time() + 240
        while killed is None and proc.poll() is None and time.time() < deadline:
            if len(glob.glob(os.path.join(out, "chunks", "*", "*.json"))) >= 2 + 3 * i:
                workers = [g for c in _children(proc.pid) for g in _children(c)] or _children(proc.pid)
                # Beam's own workers, or workers forked by the warm process (pipelines/runners/local_workers.py)
                workers = [w for w in workers if any(m in open(f"/proc/{w}/cmdline").read()
                                                     for m in ("sdk_worker", "local_workers\0serve"))]
                if workers:
                    killed = workers[0]
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.02)
        code, text = finish(proc)
        if killed is None:
            pytest.skip("the build finished before a worker could be killed")
        errors = [ln for ln in text.splitlines() if ln.startswith(("error:", "(details"))]
        assert code == 1 and errors and errors[0].startswith("error: a worker process died"), text[-3000:]
        assert "Rerunning the same command resumes" in errors[0] and "Traceback" not in text, text[-3000:]
        build(tmp_path, [str(tmp_path / "in" / "*")], name=f"cache{i}", **OPTS)
        ok = tree_bytes(out) == tree_bytes(clean)
        record("a worker process SIGKILLed (multi-process DirectRunner)", "exit 1, one line; rerun byte-identical"
               if ok else "DIFFERENT")
        assert ok


def test_unreachable_gs_fails_within_seconds(tmp_path):
    pytest.importorskip("google.cloud.storage", reason="Beam's GCP extra is not installed")
    import socket

    with socket.socket() as s:  # a port nobody listens on: connection refused, as without network
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{port}")
    t0 = time.time()
    code, text = finish(cli(argv("gs://no-such-bucket/corpus/*.jsonl", str(tmp_path / "o")), env=env))
    took = time.time() - t0
    assert code == 1 and "error: gs://no-such-bucket: Cloud Storage did not answer within" in text, text[-3000:]
    assert "rerun the same command" in text and took < 60, took
    record("gs:// unreachable (no server, no credentials)", "exit 1 with the cause, within 60 s")


# ---------------------------------------------------------------------------------------------------
# Fuzzed jsonl lines: every line in a chunk or a dead letter, never lost


def test_fuzzed_lines_are_never_lost():
    from hypothesis import HealthCheck, given, settings, strategies as st

    from build_helpers import read_chunk, work_units
    from pipelines.plan import ChunkConfig, MatchedFile, make_plan
    from pipelines.tokenize.fast_tokenizer import load_cached
    from pipelines.tokenize.tokenizer import MAX_PIECE_CHARS, PIECE_CHARS, resolve
    from pipelines.chunking.units import UnitBuilder

    tok = resolve("tiktoken:cl100k_base")
    enc = load_cached(tok)
    json_line = st.builds(lambda t, extra: json.dumps({"text": t, **extra}, ensure_ascii=extra.get("a", True)).encode(),
                          st.text(max_size=60), st.dictionaries(st.sampled_from(["a", "id"]), st.booleans(), max_size=2))
    odd = st.sampled_from([b"", b"   ", b"{", b"[1]", b'{"text": 3}', b'{"text": ""}', b"\xff\xfe", b"\xef\xbb\xbf{\"text\": \"bom\"}",
                           b'{"text": "lone \\ud800"}', b'{"text": "crlf"}\r', b'"x"', b"null"])
    raw_bytes = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" "))
    line = st.one_of(json_line, json_line, odd, raw_bytes)

    @settings(max_examples=n(25, 300), deadline=None, derandomize=not LONG,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(line, max_size=30), st.booleans(), st.sampled_from([16, 64, 300]))
    def check(lines, final_newline, chunk_bytes):
        body = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
        config = ChunkConfig(text_key="text", append_eos=False, chunk_bytes=chunk_bytes, row_group_tokens=64,
                             compression="zstd", compression_level=3, token_encoding="PLAIN",
                             piece_chars=PIECE_CHARS, max_piece_chars=MAX_PIECE_CHARS)
        parts = body.split(b"\n")
        if parts[-1] == b"":  # after a final newline (or in an empty file) there is no line
            parts.pop()
        starts, pos = [], 0
        for ln in parts:
            starts.append((pos, ln))
            pos += len(ln) + 1
        parquet = []
        with tempfile.TemporaryDirectory() as d:
            for name in ("f.jsonl", "f.jsonl.gz"):
                path = os.path.join(d, name)
                with open(path, "wb") as f:
                    f.write(gzip.compress(body, mtime=0) if name.endswith(".gz") else body)
                out = os.path.join(d, "out-" + name)
                plan = make_plan(tok.identity(), config, [MatchedFile(path, os.path.getsize(path))])
                ub = UnitBuilder(out, enc, config.to_json(), tok.eos_id)
                sidecars = [sc for u in work_units(plan) for r in ub.build(u) for sc in r.entries]
                seen = {}
                for sc in sidecars:
                    cols = read_chunk(out, sc["path"])
                    for off, toks in zip(cols["offset"], cols["token_ids"]):
                        seen.setdefault(off, []).append(("doc", toks))
                    if sc["dead_letters"]:
                        for rec in map(json.loads, open(os.path.join(out, sc["dead_letters"]), encoding="utf-8")):
                            raw = rec["line"].encode() if "line" in rec else __import__("base64").b64decode(
                                rec["line_base64"])
                            seen.setdefault(rec["offset"], []).append(("bad", raw))
                assert sorted(seen) == [off for off, _ in starts], name
                for off, ln in starts:
                    ((kind, value),) = seen[off]  # exactly once
                    if kind == "bad":
                        assert value == ln
                    else:
                        text = json.loads(ln.decode("utf-8").lstrip("\ufeff"))["text"]
                        assert value == enc.encode_many([text])[0].tolist()
                parquet.append([open(os.path.join(out, sc["path"]), "rb").read() for sc in sidecars])
        assert parquet[0] == parquet[1]  # a byte range and a gzip stream build the same chunks

    check()
    record("random jsonl lines (hypothesis), byte ranges and gzip", f"{n(25, 300)} examples: every line once")
