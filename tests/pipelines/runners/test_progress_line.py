"""The progress line's numbers and output (pipelines/runners/progress_line.py), on real builds' outputs.

The command line's line, on a terminal and piped, is tested end to end in
tests/end_to_end/test_build_cache_console.py.
"""

import fcntl
import gzip
import json
import logging
import os
import pty
import random
import select
import shutil
import struct
import termios
import threading

import pytest

from build_helpers import build, load_ledger, sample_texts, write_shard
from pipelines.filesystem import BEAM
from pipelines.launcher import plan_build
from pipelines.options import parse_args
from pipelines.runners import progress_line
from reader.format import spec as fmt
from reader.format import table as chunk_table

CHUNK = 4096


def _argv(inputs, out):
    return [a for p in inputs for a in ("--input", p)] + ["--output", out, "--tokenizer", "tiktoken:cl100k_base",
                                                          "--chunk_bytes", str(CHUNK)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished cache of a plain shard (with bad lines) and a gzip shard, and its plan."""
    d = tmp_path_factory.mktemp("progress")
    texts = sample_texts(160, seed=7)
    lines = [{"text": t} for t in texts[:80]]
    lines[5:5] = [b"not json", b'{"no_text": 1}']
    inputs = [write_shard(str(d / "in" / "a.jsonl"), lines),
              write_shard(str(d / "in" / "b.jsonl.gz"), [{"text": t} for t in texts[80:]])]
    out, res = build(d, inputs, chunk_bytes=CHUNK, max_bad_fraction=0.1)
    plan = plan_build(parse_args(_argv(inputs, out))).plan
    return out, plan, load_ledger(out), inputs


def _entries(out):
    """The chunks' entry files: what the progress line of a version 4 build reads (0.4 KB each, not a sidecar)."""
    root = os.path.join(out, fmt.CHUNKS_DIR)
    return sorted(os.path.join(root, s, f) for s in os.listdir(root) for f in os.listdir(os.path.join(root, s))
                  if f.startswith("chunk-") and f.endswith(chunk_table.ENTRY_SUFFIX))


def test_a_finished_output_sums_to_its_ledger(finished, monkeypatch):
    out, plan, ledger, _ = finished
    read = []
    real = BEAM.read_many
    monkeypatch.setattr(BEAM, "read_many", lambda paths: read.extend(paths) or real(paths))
    snap = progress_line.Scanner(out, plan).scan()
    assert read and not [p for p in read if p.endswith(".json") and not p.endswith(fmt.SHARD_DONE_NAME)]
    t = ledger["totals"]
    assert (snap.docs, snap.tokens, snap.bad_records, snap.done_bytes, snap.total_bytes, snap.estimated) == (
        t["docs"], t["tokens"], t["bad_records"], t["uncompressed_bytes"], t["uncompressed_bytes"], False)
    assert t["bad_records"] == 2 and t["chunks"] > 4


def test_mid_build_counts_only_finished_chunks_and_estimates_the_compressed_total(finished, tmp_path):
    out, plan, ledger, inputs = finished
    partial = str(tmp_path / "partial")
    shutil.copytree(out, partial)  # a copy to take files away from
    gz = plan.inputs[1]
    os.remove(os.path.join(partial, fmt.shard_done_path(gz.shard)))  # the gzip shard still streaming
    gone = _entries(partial)[::2]
    for path in gone:
        os.remove(path)
    kept = [c for c in ledger["chunks"]
            if os.path.join(partial, chunk_table.entry_path(c["shard"], c["index_in_shard"])) not in gone]
    snap = progress_line.Scanner(partial, plan).scan()
    assert snap.docs == sum(c["docs"] for c in kept) and snap.tokens == sum(c["tokens"] for c in kept)
    assert snap.bad_records == sum(c["bad_records"] for c in kept)
    assert snap.done_bytes == sum(c["byte_range"][1] - c["byte_range"][0] for c in kept)
    # the gzip shard's size times its ratio, sampled from its head (here the whole file: exact)
    uncompressed = len(gzip.decompress(open(inputs[1], "rb").read()))
    assert snap.estimated and snap.total_bytes == plan.inputs[0].size + int(gz.size * (uncompressed / gz.size))
    assert progress_line.render(snap, None).startswith(f"building: {snap.done_bytes / 1e6:,.1f} of ~")


def test_a_changed_or_damaged_entry_is_read_again_or_skipped(finished, tmp_path):
    out, plan, ledger, _ = finished
    partial = str(tmp_path / "p")
    shutil.copytree(out, partial)
    scanner = progress_line.Scanner(partial, plan)
    before = scanner.scan()
    first = _entries(partial)[0]
    with open(first, "wb") as f:
        f.write(b"{half an entry")  # a damaged file from an earlier run: not counted, not fatal
    after = scanner.scan()
    c = ledger["chunks"][0]
    assert (before.docs - after.docs, before.done_bytes - after.done_bytes) == (
        c["docs"], c["byte_range"][1] - c["byte_range"][0])


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_sample_ratio_of_a_small_file_is_exact_and_of_a_big_one_from_its_head(tmp_path, compression):
    ext = ".gz" if compression == "gzip" else ".zst"
    rng = random.Random(5)
    words = [f"w{rng.randrange(10 ** 6)}" for _ in range(2000)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 200))) for _ in range(4000)]
    small = write_shard(str(tmp_path / f"s.jsonl{ext}"), [{"text": t} for t in texts[:100]])
    body = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts[:100])
    assert progress_line.sample_ratio(small, compression) == len(body) / os.path.getsize(small)
    big = write_shard(str(tmp_path / f"b.jsonl{ext}"), [{"text": t} for t in texts])
    body = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts)
    assert len(body) > 3 << 20  # the head sampled is under a third of it
    ratio = progress_line.sample_ratio(big, compression, want=1 << 20)
    assert abs(ratio / (len(body) / os.path.getsize(big)) - 1) < 0.1  # homogeneous text: the head's is the file's


def test_the_line_exact():
    snap = progress_line.Snapshot(docs=41200, tokens=11234567, bad_records=3, done_bytes=52_300_000,
                             total_bytes=104_000_000, estimated=True)
    assert progress_line.render(snap, 13.9e6) == ("building: 52.3 of ~104.0 MB (50.3%), 41,200 documents, 11,234,567 "
                                             "tokens, 3 bad records, 13.9 MB/s, ETA 4 s")
    assert progress_line.render(snap, None).endswith(", 3 bad records, ETA unknown")
    slow = progress_line.render(snap, 0.01e6)
    assert slow.endswith("0.0 MB/s, ETA 1 h 26 min")
    # every chunk is there, the ledger not yet: 99.9% until the build ends
    there = progress_line.Snapshot(docs=1, tokens=2, bad_records=0, done_bytes=5_000_000, total_bytes=5_000_000,
                              estimated=False)
    assert "(99.9%)" in progress_line.render(there, 1e6)
    done = progress_line.Snapshot.of_ledgers({None: {"totals": {"docs": 7, "tokens": 70, "bad_records": 1,
                                                           "uncompressed_bytes": 2_500_000}}})
    assert progress_line.render(done, 2e6) == ("built: 2.5 of 2.5 MB (100.0%), 7 documents, 70 tokens, 1 bad record, "
                                          "2.0 MB/s")


class _Lines:
    """A text stream that signals each write (the test waits on it instead of sleeping)."""

    def __init__(self):
        self.parts, self.wrote = [], threading.Event()

    def write(self, s):
        self.parts.append(s)
        self.wrote.set()

    def flush(self):
        pass

    def isatty(self):
        return False


def test_piped_console_prints_a_line_per_interval_and_the_last(finished, monkeypatch):
    out, plan, ledger, _ = finished
    monkeypatch.setenv(progress_line.ENV_INTERVAL, "0.05")
    stream = _Lines()
    console = progress_line.Console(stream)
    watcher = progress_line.watch(console, out, plan)
    assert stream.wrote.wait(30), "no line"
    watcher.finish(progress_line.Snapshot.of_ledgers({None: ledger}))
    lines = "".join(stream.parts).splitlines()
    assert len(lines) >= 2 and all(ln.startswith("building: ") for ln in lines[:-1])
    assert lines[-1].startswith(f"built: {ledger['totals']['uncompressed_bytes'] / 1e6:,.1f} of ")
    assert "(100.0%)" in lines[-1]


def test_terminal_console_rewrites_one_line_and_clears_it_for_a_log_record():
    master, slave = pty.openpty()
    stream = os.fdopen(slave, "w", encoding="utf-8")
    try:
        console = progress_line.Console(stream)
        assert console.tty
        console.show("building: one")
        console.show("building: two")
        console.log_filter(logging.LogRecord("x", logging.WARNING, "", 0, "m", (), None))
        console.clear()  # nothing shown any more: writes nothing
        console.end("built: three")
        got = b""
        while not got.endswith(b"\n") and select.select([master], [], [], 10)[0]:
            got += os.read(master, 4096)
        assert got.decode() == "\rbuilding: one\x1b[K\rbuilding: two\x1b[K\r\x1b[K\rbuilt: three\x1b[K\r\n"
    finally:
        os.close(master)
        stream.close()


def test_the_line_fits_the_terminal_shortening_its_middle_never_the_rate_or_eta():
    line = ("building: 16.8 of ~130.5 MB (12.9%), 23,402 documents, 3,959,632 tokens, 0 bad records, 12.9 MB/s, "
            "ETA 1 min 4 s")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # an 80-column terminal
    stream = os.fdopen(slave, "w", encoding="utf-8")
    try:
        progress_line.Console(stream).end(line)
        got = b""
        while not got.endswith(b"\n") and select.select([master], [], [], 10)[0]:
            got += os.read(master, 4096)
        assert got.decode() == ("\rbuilding: 16.8 of ~130.5 MB (12.9%), …, 3.96M tok, 12.9 MB/s, ETA 1 min 4 s"
                                "\x1b[K\r\n")
    finally:
        os.close(master)
        stream.close()
    # each step shortens the middle only as far as needed; a line that fits is left alone
    assert progress_line.fit(line, 200) == line
    assert progress_line.fit(line, 100) == ("building: 16.8 of ~130.5 MB (12.9%), 23,402 docs, 3,959,632 tok, 0 bad, "
                                       "12.9 MB/s, ETA 1 min 4 s")
    assert progress_line.fit(line, 90) == "building: 16.8 of ~130.5 MB (12.9%), …, 3.96M tok, 0 bad, 12.9 MB/s, ETA 1 min 4 s"
    assert progress_line.fit(line, 70) == "building: 16.8 of ~130.5 MB (12.9%), 12.9 MB/s, ETA 1 min 4 s"
    assert progress_line.fit(line, 40) == "building: 16.…, 12.9 MB/s, ETA 1 min 4 s"
    bad = line.replace("0 bad records", "3 bad records")  # bad records are kept longer than tokens
    assert progress_line.fit(bad, 79) == "building: 16.8 of ~130.5 MB (12.9%), …, 3 bad, 12.9 MB/s, ETA 1 min 4 s"
    for width in range(25, 120):
        assert len(progress_line.fit(line, width)) <= width and progress_line.fit(line, width).endswith("12.9 MB/s, ETA 1 min 4 s")


def test_a_progress_failure_is_logged_and_never_raised(finished, tmp_path, monkeypatch):
    _, plan, _, _ = finished
    out = tmp_path / "broken"
    out.mkdir()

    def unreadable(pattern):
        raise NotADirectoryError(20, "Not a directory", str(out / fmt.CHUNKS_DIR))

    monkeypatch.setattr(progress_line.BEAM, "match", unreadable)  # the output cannot be listed
    logged, records = threading.Event(), []

    class Handler(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
            logged.set()

    handler = Handler()
    progress_line.LOG.addHandler(handler)
    try:
        stream = _Lines()
        watcher = progress_line.watch(progress_line.Console(stream), str(out), plan)  # the scan fails at once
        assert logged.wait(30)
        watcher.stop()
    finally:
        progress_line.LOG.removeHandler(handler)
    assert records == ["no progress line from now on (NotADirectoryError: [Errno 20] Not a directory: "
                       f"'{out / fmt.CHUNKS_DIR}'); the build goes on"]
    assert stream.parts == []


def test_input_bytes_done_counts_built_and_kept_chunks(finished, tmp_path):
    """The counter a Dataflow user watches: every chunk's input bytes, whether this run built or kept it."""
    out, plan, ledger, inputs = finished
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    os.remove(os.path.join(copy, fmt.chunk_path(0, 1)))  # one chunk to rebuild, the rest kept
    _, res = build(tmp_path, inputs, name="copy", chunk_bytes=CHUNK, max_bad_fraction=0.1)
    c = res["counters"]
    assert c["input_bytes_done"] == ledger["totals"]["uncompressed_bytes"]
    assert c["chunks_written"] == 1 and c["input_bytes"] < c["input_bytes_done"]
    assert load_ledger(str(copy))["totals"] == ledger["totals"]


def test_counts_of_one_are_singular_in_the_line_and_the_summary():
    from pipelines import build_cache

    one = progress_line.Snapshot(docs=1, tokens=1, bad_records=1, done_bytes=10, total_bytes=10, estimated=False,
                            complete=True)
    assert progress_line.render(one, None) == "built: 0.0 of 0.0 MB (100.0%), 1 document, 1 token, 1 bad record"
    totals = {"docs": 1, "tokens": 7, "chunks": 1, "bad_records": 1, "uncompressed_bytes": 20}
    run = build_cache._this_run({"chunks_written": 1, "tokens": 7}, 1.0, verified=False)
    assert build_cache._summary({None: {"totals": totals}}, "out", run) == (
        "chunkledger: 1 document, 7 tokens, 1 chunk, 1 bad record, 20 input bytes; this run in 1.0s: built 1 chunk, "
        "7 tokens (7 tokens/s, 0.0 MB/s) -> out")
