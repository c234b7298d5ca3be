"""Reading a remote cache ahead: its requests (range requests on an asynchronous filesystem's event loop).

``counting://`` (tests/support/counting_fs.py) serves local files as an asynchronous fsspec filesystem, as
gcsfs serves gs://, and records every request: a read asks only for the byte ranges of the row groups its
rows need (adjacent ones together, never a whole chunk), never has more than ``MAX_REQUESTS`` out at once,
asks for all the ranges of a batch together (a resume's first batch too), and returns the local read's
batches. The read-ahead's planning starts requests while the decoding threads are busy, is sized by the
reads' rate without their waits for requests (a mixture's caches by their share of a batch), and plans
more batches per task as its lookahead grows; a shuffled read opens the next mix's chunks
ahead. Against the GCS emulator behind the latency proxy (tests/support/latency_proxy.py), a request that
never returns raises ReaderStalled after worker_timeout_s, and one that fails names the chunk file.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import threading
import time
import types

import numpy as np
import pytest

import cachegen
import mixgen
from counting_fs import counting
from reader import ReadOptions, Reader, ReaderStalled
from reader.format import spec as fmt
from reader.batch import prefetch as prefetch_mod
from reader.batch import readahead as readahead_mod
from reader.storage import requests as requests_mod

OPTS = ReadOptions(seq_len=16, batch_size=8, ideal_readers=4)
READS = {
    "packed": OPTS,
    "shuffled": dataclasses.replace(OPTS, shuffle_seed=3),
    "best_fit": dataclasses.replace(OPTS, packing="best_fit", best_fit_window_tokens=60),
    "unpacked": dataclasses.replace(OPTS, packed=False),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    rng = np.random.default_rng(5)
    chunks = cachegen.random_chunks(rng, 12, max_docs=9, max_len=70)
    root = str(tmp_path_factory.mktemp("remote-reads") / "cache")
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=[6, 6], row_group_tokens=24)
    return root


def row_groups(root: str) -> dict[str, list[tuple[int, int]]]:
    """Each chunk file's row-group byte ranges ``[start, end)``, and its footer's (as the reader asks for it)."""
    ledger = json.load(open(os.path.join(root, fmt.LEDGER_NAME)))
    out = {}
    for e in ledger["chunks"]:
        side = json.load(open(os.path.join(root, fmt.sidecar_path(e["shard"], e["index_in_shard"]))))
        groups = [(int(a), int(a) + int(n)) for a, n, *_ in side["row_group_index"]]
        f_off, f_len, _ = side["footer"]
        out[os.path.join(root, e["path"])] = groups + [(f_off, f_off + f_len + 1)]
    return out


def batches(source: str, opts: ReadOptions, start: int, count: int, **kw) -> list[dict]:
    with Reader(source, opts, num_readers=2, reader_index=1, **kw) as r:
        return [{k: v.copy() for k, v in x.items()} for _, x in r.iter_batches(start, count)]


def local_read(root: str, opts: ReadOptions, read):
    """``read(reader)`` on the local cache as reader 1 of 2, and the row groups it needed: ``{(chunk file, byte
    offset)}``."""
    with Reader(root, dataclasses.replace(opts, prefetch_threads=0), num_readers=2, reader_index=1) as local:
        loaded = []
        load = local.store._load_row_group
        local.store._load_row_group = lambda c, g: loaded.append((c, g)) or load(c, g)
        got = read(local)
        need = {(os.path.join(root, local.cache.table.paths[c]), int(local.store.meta(c).rg_ranges[g, 0]))
                for c, g in loaded}
    return got, need


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert sorted(x) == sorted(y)
        for k in y:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("kind", sorted(READS))
def test_remote_reads_ask_only_for_their_row_groups_coalesced_and_bounded(cache, kind, monkeypatch):
    monkeypatch.setattr(requests_mod, "MAX_REQUESTS", 3)
    opts = READS[kind]
    want = batches(cache, opts, 40, 30)
    with Reader(cache, opts, num_readers=2, reader_index=1) as local:  # the chunks this host's rows lie in
        for _ in local.iter_batches(40, 30):
            pass
        mine = {os.path.join(cache, local.cache.table.paths[c]) for c in local.store.opened}
    with counting() as fs:
        got = batches("counting://" + cache, opts, 40, 30)
    assert_same(got, want)
    ranges = row_groups(cache)
    spans = []
    for path, start, end in fs.calls:
        if path.endswith(".json"):  # the ledger, the sidecars, index files: whole (a bounded read asks for
            # the bytes up to its bound, past the file's end)
            assert start is None or (start == 0 and end > os.path.getsize(path)), (path, start, end)
            continue
        assert path in mine, f"{path}: not a chunk of this host's rows"
        assert start is not None, f"{path}: fetched whole"
        starts, ends = [a for a, _ in ranges[path]], [z for _, z in ranges[path]]
        assert start in starts and end in ends and starts.index(start) <= ends.index(end), (path, start, end)
        spans.append(ends.index(end) - starts.index(start) + 1)
    assert spans and fs.most_in_flight <= 3
    if kind in ("packed", "unpacked"):  # adjacent row groups wanted together: one request
        assert max(spans) >= 2


def test_a_remote_mixture_reads_the_local_batches(cache, tmp_path):
    root = str(tmp_path / "mix")
    comps, _ = mixgen.write_components(root, [10, 14, 9], seed=4, row_group_tokens=16)
    local = mixgen.write_mixture(str(tmp_path / "local.json"), [(f"c{i}", p, w) for i, (p, w) in
                                                                 enumerate(zip(comps, (0.5, 0.3, 0.2)))])
    remote = mixgen.write_mixture(str(tmp_path / "remote.json"), [(f"c{i}", "counting://" + p, w) for i, (p, w) in
                                                                   enumerate(zip(comps, (0.5, 0.3, 0.2)))])
    for opts in (OPTS, dataclasses.replace(OPTS, shuffle_seed=1)):
        want = batches(local, opts, 25, 20)
        with counting() as fs:
            got = batches(remote, opts, 25, 20)
        assert_same(got, want)
        assert fs.calls and all(s is not None for p, s, _ in fs.calls if p.endswith(".parquet"))


def test_a_resumed_read_asks_for_its_first_batchs_row_groups_together(cache):
    """Every row group the first batch at step 60 needs is asked for before any of them comes back."""
    opts = READS["packed"]
    want, need = local_read(cache, opts, lambda r: r.batch(60))
    assert len(need) >= 4
    ranges = row_groups(cache)
    data = {(p, a) for p, rr in ranges.items() for a, _ in rr[:-1]}
    with counting() as fs:
        fs.hold(lambda path, start, end: (path, start) in data)  # row groups wait; sidecars and footers come
        with Reader("counting://" + cache, opts, num_readers=2, reader_index=1) as r:
            out: list = []
            t = threading.Thread(target=lambda: out.append(r.batch(60)))
            t.start()

            def covered(held) -> bool:
                got = {(p, a) for p, s, e in held for a, z in ranges[p][:-1] if s <= a and z <= e}
                return need <= got

            try:
                assert fs.wait_held(covered, timeout=60), f"asked for {fs.held}, the batch needs {sorted(need)}"
            finally:
                fs.release()
                t.join(60)
    assert out, "the batch did not come"
    for k in want:
        np.testing.assert_array_equal(out[0][k], want[k], err_msg=k)


def test_read_ahead_starts_its_requests_while_the_decoding_threads_are_busy(cache):
    """Planning what later batches need only starts requests: it must not wait behind the row groups the
    store's threads are decoding (there it would lose up to a round trip per batch planned). With the one
    decoding thread held, a hint for batches 60..63 still returns, and their row groups are asked for."""
    opts = READS["packed"]
    want, need = local_read(cache, opts, lambda r: r.batches(60, 4))
    assert len(need) >= 4
    ranges = row_groups(cache)
    with counting() as fs:
        with Reader("counting://" + cache, dataclasses.replace(opts, prefetch_threads=1), num_readers=2,
                    reader_index=1) as r:
            busy = threading.Event()
            r.store.submit(busy.wait, 60)  # the one decoding thread, held
            try:
                hint = r.store.plan(r.prefetch, 60, None, 4)  # what iter_batches does lookahead batches ahead
                hint.result(timeout=20)

                def asked() -> set:
                    return {(p, a) for p, s, e in list(fs.calls) if s is not None
                            for a, z in ranges[p][:-1] if s <= a and z <= e}

                deadline = time.monotonic() + 20
                while not need <= asked() and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert need <= asked(), f"asked for {sorted(asked())}, batches 60..63 need {sorted(need)}"
            finally:
                busy.set()
            got = r.batches(60, 4)
    assert_same(got, want)


def test_the_pace_leaves_out_the_reads_waits_for_requests(cache, monkeypatch):
    """The read-ahead is sized by the rate the reads go at when they are not waiting for requests: counted
    in, a read-ahead too short for the latency would slow the reads and so shorten itself."""
    clock = [100.0]
    monkeypatch.setattr(prefetch_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    waited = [0.0]
    pace = prefetch_mod.Pace(lambda: waited[0])
    pace.note(0, 9)
    clock[0] += 0.4
    waited[0] += 0.3  # of the 0.4 s until the next read, the reads waited 0.3 s for requests
    pace.note(10, 19)
    assert pace.rate() == pytest.approx(10 / 0.1)
    monkeypatch.undo()
    # what a read waits for a request is what the store counts
    with counting() as fs:
        fs.hold(lambda path, start, end: path.endswith(".parquet"))
        with Reader("counting://" + cache, READS["packed"], num_readers=2, reader_index=1) as r:
            t = threading.Thread(target=lambda: r.batch(60))
            t.start()
            assert fs.wait_held(lambda held: len(held) > 0, timeout=60)
            time.sleep(0.3)
            fs.release()
            t.join(60)
            assert r.store.waited_s >= 0.25


def test_a_mixtures_lookahead_follows_the_share_of_a_batch_each_cache_serves(tmp_path):
    """A cache at weight w advances w of a batch per batch: within its share of the budget it looks 1/w
    times as many batches ahead as one that serves every row."""
    comps, _ = mixgen.write_components(str(tmp_path / "mix"), [10, 14, 9], seed=4, row_group_tokens=64)
    opts = dataclasses.replace(OPTS, seq_len=8)
    path = mixgen.write_mixture(str(tmp_path / "m.json"), [(f"c{i}", p, w) for i, (p, w) in
                                                            enumerate(zip(comps, (0.25, 0.25, 0.5)))])
    with Reader(path, opts) as r:
        got = r.lookahead_batches()
        whole = r.prefetcher.prefetchers[2].lookahead()  # as if the largest cache served every row
    assert got == 2 * whole


def test_a_mix_coming_into_view_opens_the_next_mixs_chunks(cache):
    """Shuffled whole-mix reads: when a mix comes into view, the chunks of the mix after it are opened
    (sidecar and footer) but none of their row groups asked for, so that mix's row groups are one round
    trip away when its turn comes, not three."""
    from reader.order.shuffle import ShuffleConfig

    cfg = ShuffleConfig(seed=3, first_window=16, growth=2.0, max_window=64, block_size=8, mix_size=16, lanes=4)
    opts = dataclasses.replace(OPTS, shuffle=cfg)
    ranges = row_groups(cache)
    with counting() as fs:
        with Reader("counting://" + cache, opts, num_readers=2, reader_index=1) as r:
            pf, lanes = r.prefetcher, r.order.lanes()
            assert pf.whole_mixes
            for b in range(20, 60):  # a batch whose mix is followed by one reading other chunks
                _, lo, hi = lanes.mixes(lanes.lane_rows(b * opts.batch_size + r.my_rows)[0][:1])
                ahead = set(pf._mix_chunks(int(hi[0]))) - set(pf._mix_chunks(int(lo[0])))
                if ahead:
                    break
            assert ahead and all(r.store.cached_meta(c) is None for c in ahead)
            for fut in pf.prefetch(b):
                fut.result(timeout=20)
            deadline = time.monotonic() + 20
            while any(r.store.cached_meta(c) is None for c in ahead) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert all(r.store.cached_meta(c) is not None for c in ahead), "the next mix's chunks were not opened"
            paths = {os.path.join(cache, r.cache.table.paths[c]) for c in ahead}
            data = [(p, s) for p, s, e in list(fs.calls) if p in paths and s is not None
                    for a, z in ranges[p][:-1] if s <= a < e]
            assert not data, f"row groups of the next mix were asked for: {data}"


@pytest.mark.parametrize("lookahead, stride", [(16, 8), (1024, 64)])
def test_a_long_lookahead_plans_more_batches_per_hint(lookahead, stride):
    """A remote read's lookahead grows with the latency and the rate; each hint task then plans more
    batches, so a plan asks for several row groups of a chunk in one request, not one at a time."""
    hinted = []
    pool = cf.ThreadPoolExecutor(1)
    try:
        got = [i for i, _ in readahead_mod.read_ahead(lambda i, n: list(range(i, i + n)), 0, stop=3000,
                                                      hint=lambda i, n: hinted.append((i, n)),
                                                      submit_hint=pool.submit, lookahead=lambda: lookahead)]
    finally:
        pool.shutdown(wait=True)
    assert got == list(range(3000))
    assert max(n for _, n in hinted) == stride


# -- against the GCS emulator, behind the latency proxy ------------------------------------------------------------

TIMEOUT_S = 2.0  # worker_timeout_s
BOUND_S = 30.0  # the error must come well within this


@pytest.fixture(scope="module")
def emulator(cache):
    pytest.importorskip("gcsfs", reason="the gcs extra (gcsfs) is not installed")
    pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (test extra) is not installed")
    from gcs_emulator import GcsEmulator

    with GcsEmulator(bucket="remote-reads") as emu:
        emu.gcsfs().put(cache + "/", f"{emu.bucket}/cache/", recursive=True)
        yield emu


@pytest.fixture
def proxy(emulator, monkeypatch):
    from latency_proxy import LatencyProxy

    # reader workers import gcsfs afresh: its experimental bucket probe would hang against the emulator
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    with LatencyProxy(emulator.port, delay_s=0.01, max_s=300) as p:
        yield p


def through(emulator, proxy) -> dict:
    return dict(emulator.storage_options, endpoint_url=proxy.endpoint)


@pytest.mark.timeout(120)
def test_reads_through_the_latency_proxy_equal_the_local_read(cache, emulator, proxy):
    for opts in (READS["packed"], READS["shuffled"], dataclasses.replace(READS["packed"], num_workers=2)):
        want = batches(cache, dataclasses.replace(opts, num_workers=0), 30, 25)
        got = batches(emulator.url("cache"), opts, 30, 25, storage_options=through(emulator, proxy))
        assert_same(got, want)
    assert proxy.requests > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_request_that_never_returns_raises_reader_stalled(emulator, proxy, workers):
    proxy.stall(lambda line: ".parquet" in line)
    opts = dataclasses.replace(READS["packed"], worker_timeout_s=TIMEOUT_S, num_workers=workers)
    with Reader(emulator.url("cache"), opts, storage_options=through(emulator, proxy)) as r:
        t0 = time.monotonic()
        # (the watch on the read-ahead, or the request's own deadline: both come after worker_timeout_s)
        with pytest.raises(ReaderStalled, match=r"made no progress for 2 s while assembling batches 0\.\.\d+|"
                                                rf"^{STALLED}"):
            next(r.iter_batches(0))
        assert TIMEOUT_S <= time.monotonic() - t0 < BOUND_S
    assert proxy.stalled.is_set()


STALLED = (r"gs://remote-reads/cache/chunks/shard-\d+/chunk-\d+\.parquet bytes \d+\.\.\d+: no answer in 2 s "
           r"\(ReadOptions\.worker_timeout_s=2, retries included\): .*Check them, or raise worker_timeout_s")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("read", ["batch", "meta"])
def test_a_wait_for_a_request_that_never_returns_ends_naming_the_file_and_range(emulator, proxy, read):
    # A read without the read-ahead's watch (Reader.batch), and a chunk's opening: only the request's deadline
    # ends these waits (gcsfs's default requests_timeout=None is no deadline at all; the emulator's options
    # set 30 s, which would end them later with a StorageError that names no range).
    proxy.stall(lambda line: ".parquet" in line)
    opts = dataclasses.replace(READS["packed"], worker_timeout_s=TIMEOUT_S)
    with Reader(emulator.url("cache"), opts, storage_options=through(emulator, proxy)) as r:
        t0 = time.monotonic()
        with pytest.raises(ReaderStalled, match=rf"^{STALLED}"):
            r.batch(0) if read == "batch" else r.store.meta(0)
        assert TIMEOUT_S <= time.monotonic() - t0 < BOUND_S
    assert proxy.stalled.is_set()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("status, match", [(403, "permission denied"), (404, "missing")])
def test_a_failing_request_names_the_chunk_file(emulator, proxy, status, match):
    proxy.fail(lambda line: "chunk-000003.parquet" in line, status)
    with Reader(emulator.url("cache"), READS["packed"], storage_options=through(emulator, proxy)) as r:
        t0 = time.monotonic()
        with pytest.raises(Exception, match=rf"^gs://remote-reads/cache/chunks/shard-\d+/chunk-000003\.parquet: .*{match}"):
            for _ in r.iter_batches(0, 400):
                pass
        assert time.monotonic() - t0 < BOUND_S


def test_a_remote_lookahead_may_hold_half_the_budget_a_local_one_an_eighth(cache, monkeypatch):
    """A read gets at most its lookahead per request latency, so on a remote cache the latency's lookahead may
    fill half the budget with decoded tokens (4 bytes each); the local rule stays within an eighth."""
    opts = dataclasses.replace(OPTS, memory_budget_bytes=1 << 22)
    per_batch = opts.batch_size * opts.seq_len / opts.ideal_readers  # tokens a stream advances per batch
    with Reader(cache, opts) as r:
        pf = r.prefetcher
        monkeypatch.setattr(pf, "_row_group_tokens", lambda: 1 << 30)  # (row groups larger than the cap)
        local = pf.lookahead()
        monkeypatch.setattr(pf, "store", types.SimpleNamespace(latency_s=1.0))  # a slow store, read fast
        monkeypatch.setattr(pf.pace, "rate", lambda: 1e9)
        remote = pf.lookahead()
        budget = pf.options.memory_budget_bytes  # (the store's part: the batches assembled ahead have theirs)
    held = lambda ahead: ahead * per_batch * 4 * opts.ideal_readers / budget  # noqa: E731
    assert held(local) == pytest.approx(1 / 8, rel=0.01) and held(remote) == pytest.approx(1 / 2, rel=0.01)
