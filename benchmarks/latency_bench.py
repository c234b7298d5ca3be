"""Reading ``gs://`` when every request takes D milliseconds: the reader against the same read at 0 ms and from disk.

    python -m benchmarks.latency_bench --work DIR [--tokens N] [--budget_mb M] [--shuffled_budget_mb M]
        [--seconds S] [--rounds R] [--quick]

``make bench`` runs it with the defaults. A synthetic cache (``--tokens``, 128 Mi by default: documents of
log-normal lengths, Zipf-distributed ids below 100k, which zstd compresses to about the bytes per token of
real text; 72 chunks in 4 shards, the builder's 128 Ki-token row groups) is written with the tests' cache
writer and uploaded to the GCS emulator (``tests/support/gcs_emulator.py``, in memory) four times, as four
caches. The reader reads it through the project's latency proxy (``tests/support/latency_proxy.py``, a
process of its own on loopback that holds every request D ms before passing it on) at D = 0, 25, 50 and
100 ms, and from local disk, as host 1 of 4 (``seq_len=2048, batch_size=32``, R* = 16, flat layout, one
process), starting at step 3000 (a resume), with a memory budget (``--budget_mb``, 64 MiB by default) well
below the host's share of the cache decoded (33.6 M tokens, 134 MB; a quarter of the budget goes to the
batches read ahead), so that the steady state is a real one, as on a real cache many times a host's budget:
past the first pass the reads do not find their row groups still decoded, and a read's lookahead is what
the budget allows. A shuffled read is given three mixes of row groups decoded (``--shuffled_budget_mb``, 96
MiB), as docs/READING.md asks of a read from object storage: with two (64 MiB, enough on local disk) the
next mix cannot load while the current one is read, and the read at 50 ms ran at 0.49-0.56 of 0 ms; at 32
MiB it thrashes.

- ``packed``: concat windows in order; ``shuffled``: the same with ``shuffle_seed=0``; ``mixture``: a
  mixture of the four caches (weights 0.4/0.3/0.2/0.1), packed.
- Per read: seconds from opening the reader to the first batch (``first_batch_s``: the seek), the steady
  rate (tokens per second of the reader's rows over ``--seconds`` of reading, after ``--warmup`` seconds
  from the first batch in which the read-ahead grows to the latency; ``rate`` from the first batch on is
  reported too), the requests and
  bytes fetched per token read (the store's counters: a chunk opened is two requests, its sidecar and
  footer), and the CPU seconds per batch of this process and of the emulator.
- Runs alternate (every configuration once per round), and each figure is the best of the rounds; a
  ratio to 0 ms is the median over the rounds of that round's two runs, made back to back (the best of
  each side apart would let one lucky 0 ms run set every ratio, on a machine shared with other work).
- Where 0 ms differs from disk: the emulator is a Python HTTP server (one request at a time) on the same
  cores. Its own cost is measured apart: a plain client (``http.client``, one connection per request, as
  the emulator wants) asks it, then the proxy at 0 ms, for every row group's byte range of the cache,
  one after the other; seconds and emulator CPU-seconds per request. During the reads, the CPU per
  batch of this process, the emulator and the proxy say where a batch's time goes.
- The process's peak RSS (sampled) during one more 50 ms read of each kind with the default budget (1 GiB),
  its growth over the RSS before the first read against that budget.

Prints one ``BENCH_RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import subprocess
import sys
import statistics
import time
from pathlib import Path

import numpy as np
import psutil

from benchmarks.common import emit_result, log
from benchmarks.reader_bench import RssSampler

SUPPORT = Path(__file__).resolve().parents[1] / "tests" / "support"
sys.path.insert(0, str(SUPPORT))

import cachegen  # noqa: E402  (the tests' cache writer, the emulator and the proxy)
from gcs_emulator import GcsEmulator  # noqa: E402

from reader import ReadOptions, Reader  # noqa: E402
from reader.format import spec as fmt  # noqa: E402

L, B, HOSTS, HOST, START = 2048, 32, 4, 1, 3000
DELAYS_MS = (0, 25, 50, 100)
KINDS = ("packed", "shuffled", "mixture")
WEIGHTS = (0.4, 0.3, 0.2, 0.1)
ROW_GROUP_TOKENS = 128 << 10


def write_cache(root: Path, tokens: int, chunks: int = 72, seed: int = 0) -> int:
    """The synthetic cache (see the module docstring); returns its tokens."""
    if (root / fmt.LEDGER_NAME).exists():
        return int(json.loads((root / fmt.LEDGER_NAME).read_text())["totals"]["tokens"])
    rng = np.random.default_rng(seed)
    per, out = tokens // chunks, []
    for _ in range(chunks):
        docs, n = [], 0
        while n < per:
            length = int(rng.lognormal(6, 1.2)) + 1
            docs.append(np.minimum(rng.zipf(1.3, length), 100_000).astype(np.int32))
            n += length
        out.append(docs)
    shards = 4 if chunks % 4 == 0 else 1
    cachegen.write_synthetic_cache(str(root), out, chunks_per_shard=[chunks // shards] * shards,
                                   row_group_tokens=ROW_GROUP_TOKENS)
    return int(json.loads((root / fmt.LEDGER_NAME).read_text())["totals"]["tokens"])


class Proxy:
    """``tests/support/latency_proxy.py`` as a process of its own, holding every request ``delay_ms``."""

    def __init__(self, upstream_port: int, delay_ms: float):
        self.proc = subprocess.Popen([sys.executable, str(SUPPORT / "latency_proxy.py"), "--upstream_port",
                                      str(upstream_port), "--delay_ms", str(delay_ms), "--max_s", "7200"],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.close()
            raise RuntimeError(f"the latency proxy did not start: {line!r}")
        self.port = int(line.split()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def options(kind: str, budget: int) -> ReadOptions:
    o = ReadOptions(seq_len=L, batch_size=B, ideal_readers=16, layout="flat", memory_budget_bytes=budget)
    return dataclasses.replace(o, shuffle_seed=0) if kind == "shuffled" else o


def cpu_s(pid: int | None = None) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def one_read(source: str, kind: str, seconds: float, warmup: float, budget: int, storage_options: dict | None,
             emulator_pid: int | None, proxy_pid: int | None = None) -> dict:
    """One read from step ``START`` (see the module docstring)."""
    t0 = time.perf_counter()
    r = Reader(source, options(kind, budget), num_readers=HOSTS, reader_index=HOST, storage_options=storage_options)
    rows = len(r.my_rows)
    it = r.iter_batches(START)
    first = t_s = None
    n = 0
    for b, x in it:
        now = time.perf_counter()
        n += 1
        if first is None:
            first = now
            ref = np.array(x["tokens"][:, 1:], copy=True)  # the first batch, to compare across storage
        if t_s is None and now - first >= warmup:
            t_s, skip, c_s = now, n, cpu_s()
            e_s = cpu_s(emulator_pid) if emulator_pid else 0.0
            p_s = cpu_s(proxy_pid) if proxy_pid else 0.0
        elif t_s is not None and now - t_s >= seconds:
            break
    end, c_e = time.perf_counter(), cpu_s()
    e_e = cpu_s(emulator_pid) if emulator_pid else 0.0
    p_e = cpu_s(proxy_pid) if proxy_pid else 0.0
    st = r.store
    tokens = n * rows * L
    out = {"first_batch_s": first - t0, "rate": (n - 1) * rows * L / (end - first),
           "steady": (n - skip) * rows * L / (end - t_s), "cpu_ms_per_batch": (c_e - c_s) / (n - skip) * 1e3,
           "emulator_cpu_ms_per_batch": (e_e - e_s) / (n - skip) * 1e3,
           "proxy_cpu_ms_per_batch": (p_e - p_s) / (n - skip) * 1e3, "ms_per_batch": (end - t_s) / (n - skip) * 1e3,
           "requests_per_mtoken": (st.fetches + 2 * st.meta_fetches) / tokens * 1e6,
           "bytes_per_token": st.bytes_fetched / tokens, "steady_batches": n - skip, "first": ref}
    it.close()
    r.close()
    return out


def ranges_of(cache: Path) -> list[tuple[str, int, int]]:
    """Every row group's byte range of the cache: ``(chunk path, start, end)``."""
    out = []
    for e in json.loads((cache / fmt.LEDGER_NAME).read_text())["chunks"]:
        side = json.loads((cache / fmt.sidecar_path(e["shard"], e["index_in_shard"])).read_text())
        out += [(e["path"], int(a), int(a) + int(n)) for a, n, *_ in side["row_group_index"]]
    return out


def plain_client(port: int, bucket: str, prefix: str, ranges, emulator_pid: int) -> dict:
    """Ask for ``ranges`` one after the other with ``http.client`` (a connection each): seconds and emulator
    CPU-seconds per request."""
    t0, c0 = time.perf_counter(), cpu_s(emulator_pid)
    got = 0
    for path, a, z in ranges:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        obj = (prefix + path).replace("/", "%2F")
        conn.request("GET", f"/download/storage/v1/b/{bucket}/o/{obj}?alt=media", headers={"Range": f"bytes={a}-{z - 1}"})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        if resp.status != 206 or len(body) != z - a:
            raise RuntimeError(f"{path} [{a}, {z}): status {resp.status}, {len(body)} bytes")
        got += len(body)
    dt, dc = time.perf_counter() - t0, cpu_s(emulator_pid) - c0
    return {"ms_per_request": dt / len(ranges) * 1e3, "emulator_cpu_ms_per_request": dc / len(ranges) * 1e3,
            "mb_per_s": got / dt / 1e6}


def run(work: Path, tokens: int, seconds: float, warmup: float, budget_mb: float, rounds: int, chunks: int,
        shuffled_budget_mb: float = 96.0) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    budgets = {k: int((shuffled_budget_mb if k == "shuffled" else budget_mb) * (1 << 20)) for k in KINDS}
    cache = work / "cache"
    total = write_cache(cache, tokens, chunks)
    res: dict = {"latency_run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "latency_load_average": round(os.getloadavg()[0], 1),
                 "latency_cache_tokens": total, "latency_cache_chunks": chunks, "latency_seconds": seconds,
                 "latency_warmup_s": warmup, "latency_rounds": rounds,
                 "latency_hosts": HOSTS, "latency_batch_size": B, "latency_seq_len": L, "latency_start": START}
    mix = work / "mix4.json"
    best: dict[tuple[str, str], dict] = {}
    steadies: dict[tuple[str, str], list[float]] = {}  # per round, for the paired ratios
    firsts: dict[str, np.ndarray] = {}

    def keep(key, got):
        ref = got.pop("first")
        want = firsts.setdefault(key[0], ref)
        if not np.array_equal(ref, want):
            raise AssertionError(f"{key}: its first batch differs from the local read's")
        steadies.setdefault(key, []).append(got["steady"])
        old = best.get(key)
        if old is None:
            best[key] = got
        else:  # the best of the rounds, figure by figure
            for k, v in got.items():
                old[k] = max(old[k], v) if k in ("rate", "steady") else min(old[k], v)

    with GcsEmulator(bucket="latency") as emu:
        fs = emu.gcsfs()
        for i in range(len(WEIGHTS)):
            fs.put(str(cache) + "/", f"{emu.bucket}/c{i}/", recursive=True)
        mix.write_text(json.dumps({"mixture": 1, "components": [
            {"name": f"c{i}", "path": emu.url(f"c{i}"), "weight": w} for i, w in enumerate(WEIGHTS)]}))
        local_mix = work / "mix4-local.json"  # four caches on disk too: links to the one (its page cache)
        for i in range(len(WEIGHTS)):
            if not (work / f"c{i}").exists():
                (work / f"c{i}").symlink_to(cache.name)
        local_mix.write_text(json.dumps({"mixture": 1, "components": [
            {"name": f"c{i}", "path": str(work / f"c{i}"), "weight": w} for i, w in enumerate(WEIGHTS)]}))
        proxies = {d: Proxy(emu.port, d) for d in DELAYS_MS}
        pid = emu.proc.pid
        base_rss, peak_rss = psutil.Process().memory_info().rss, 0
        try:
            for rnd in range(rounds):
                for kind in KINDS:
                    src, budget = str(local_mix) if kind == "mixture" else str(cache), budgets[kind]
                    keep((kind, "local"), one_read(src, kind, seconds, warmup, budget, None, None))
                    for d in DELAYS_MS:
                        so = dict(emu.storage_options, endpoint_url=proxies[d].endpoint)
                        src = str(mix) if kind == "mixture" else emu.url("c0")
                        got = one_read(src, kind, seconds, warmup, budget, so, pid, proxies[d].proc.pid)
                        keep((kind, f"{d}ms"), got)
                        log(f"latency round {rnd}: {kind} at {d} ms: steady {got['steady'] / 1e6:.1f} M tok/s, first "
                            f"batch {got['first_batch_s']:.2f} s")
            # peak RSS against the default budget, as a run would read (the reads above keep theirs small)
            so = dict(emu.storage_options, endpoint_url=proxies[50].endpoint)
            for kind in KINDS:
                with RssSampler() as rss:
                    one_read(str(mix) if kind == "mixture" else emu.url("c0"), kind, seconds, warmup,
                             ReadOptions().memory_budget_bytes, so, pid)
                peak_rss = max(peak_rss, rss.peak)
            # the emulator's own cost: every row group once, from a plain client, direct and through the proxy
            ranges = ranges_of(cache)
            direct = plain_client(emu.port, emu.bucket, "c0/", ranges, pid)
            proxied = plain_client(proxies[0].port, emu.bucket, "c0/", ranges, pid)
        finally:
            for p in proxies.values():
                p.close()
    res["latency_rss_before_mb"] = base_rss / 1e6  # the process with the emulator's client, before any read
    res["latency_reader_peak_rss_mb"] = peak_rss / 1e6
    res["latency_memory_budget_mb"] = ReadOptions().memory_budget_bytes / 1e6
    res["latency_read_budget_mb"] = budgets["packed"] / 1e6
    res["latency_shuffled_read_budget_mb"] = budgets["shuffled"] / 1e6
    for (kind, where), got in best.items():
        for k, v in got.items():
            res[f"latency_{kind}_{where}_{k}"] = v
    def paired(kind: str, a: str, b: str) -> float:  # median over the rounds of a / b
        return statistics.median(x / y for x, y in zip(steadies[(kind, a)], steadies[(kind, b)]))

    for kind in KINDS:
        for d in DELAYS_MS:
            res[f"latency_{kind}_{d}ms_vs_0ms"] = paired(kind, f"{d}ms", "0ms")
        res[f"latency_{kind}_0ms_vs_local"] = paired(kind, "0ms", "local")
    res["latency_50ms_vs_0ms_min"] = min(res[f"latency_{k}_50ms_vs_0ms"] for k in KINDS)
    res["latency_first_batch_s_50ms_max"] = max(res[f"latency_{k}_50ms_first_batch_s"] for k in KINDS)
    res["latency_rss_growth_vs_budget"] = (peak_rss - base_rss) / 1e6 / res["latency_memory_budget_mb"]
    res["latency_row_group_requests"] = len(ranges)
    for name, got in (("direct", direct), ("proxy", proxied)):
        for k, v in got.items():
            res[f"latency_emulator_{name}_{k}"] = v
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=128 << 20)
    ap.add_argument("--chunks", type=int, default=72)
    ap.add_argument("--budget_mb", type=float, default=64.0, help="the reader's memory_budget_bytes, MiB")
    ap.add_argument("--shuffled_budget_mb", type=float, default=96.0,
                    help="a shuffled read's memory_budget_bytes, MiB (three of its mixes)")
    ap.add_argument("--seconds", type=float, default=1.5, help="the steady window of each read")
    ap.add_argument("--warmup", type=float, default=0.75, help="seconds of each read before its window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: proves the measurement runs")
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.chunks, a.seconds, a.warmup, a.rounds = 1 << 20, 32, 0.2, 0.1, 1
    emit_result(run(a.work, a.tokens, a.seconds, a.warmup, a.budget_mb, a.rounds, a.chunks, a.shuffled_budget_mb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
