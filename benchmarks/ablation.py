"""Paired A/B runs of one command under several environments: does a piece of machinery pay for itself?

    python -m benchmarks.ablation run --rounds 5 --variant base: --variant nofork:CHUNKLEDGER_FORK_WORKERS=0 \\
        --build OUT -- python -m pipelines.build_cache --input ... --output OUT --tokenizer tiktoken:cl100k_base
    python -m benchmarks.ablation read --cache DIR [--batches N] [--shuffle]   (the training read, one run)

Each round runs every variant once, in an order rotated from round to round (a machine shared with other
work drifts; pairing each variant with the first one *of the same round* cancels most of that). Per run:

- wall: seconds from starting the command until it exits;
- CPU-s: user + system seconds of the whole process tree, from the kernel's accounting of reaped children
  (this process makes itself the tree's subreaper, so a worker that outlives its parent is counted too);
- peak RSS: the largest sum of RSS over the process tree, sampled every 0.25 s;
- ``--build OUT``: OUT is removed before each run, its ledger's token count is checked to be the same in
  every run, and with the build's trace (``CHUNKLEDGER_TRACE``) the start-up share
  (benchmarks/pipeline_bench.py: 1 - busy seconds at the steady rate / wall) is reported.

The summary gives, per variant, the median and range of wall and CPU-s, and the paired ratios variant /
first variant (median and range over rounds): > 1 means the variant (the machinery turned off) costs more.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from benchmarks.common import REPO, log

_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        log("ablation: cannot become a subreaper; orphaned descendants' CPU is not counted")


def _busy_cpu_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _reap_all(timeout_s: float = 60.0) -> int:
    """Reap every descendant left (orphans re-parented to this subreaper); kill those alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    n = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return n
        if pid:
            n += 1
            continue
        if time.monotonic() > deadline:
            for p in psutil.Process().children():
                p.kill()
            deadline = float("inf")
        time.sleep(0.05)


def _sample_rss(pid: int, peak: list, done: threading.Event, interval_s: float = 0.25) -> None:
    """Largest sum of RSS over the process tree of ``pid`` (MB), sampled every ``interval_s``."""
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return
    while not done.is_set():
        total = 0.0
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            procs = [root]
        for p in procs:
            try:
                total += p.memory_info().rss / 1e6
            except psutil.Error:
                pass
        peak[0] = max(peak[0], total)
        done.wait(interval_s)


def run_once(cmd: list[str], env: dict, build: Path | None) -> dict:
    if build is not None and build.exists():
        shutil.rmtree(build)
    trace_path = None
    full = dict(os.environ)
    full.setdefault("PYTHONPATH", str(REPO))
    full.update(env)
    if build is not None:
        trace_path = build.with_name(build.name + "-trace.jsonl")
        trace_path.unlink(missing_ok=True)
        full["CHUNKLEDGER_TRACE"] = str(trace_path)
    cpu0, busy0 = _children_cpu_s(), _busy_cpu_s()
    started = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=full, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak = [0.0]
    done = threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(proc.pid, peak, done), daemon=True)
    sampler.start()
    out = proc.communicate()[0].decode("utf-8", "replace")
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    orphans = _reap_all()
    cpu = _children_cpu_s() - cpu0
    other = max(0.0, _busy_cpu_s() - busy0 - cpu) / wall
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-3000:]}")
    res = {"wall_s": wall, "cpu_s": cpu, "peak_rss_tree_mb": peak[0], "other_cores": other, "orphans": orphans, "tail": out.strip()[-400:]}
    if build is not None:
        from benchmarks.pipeline_bench import trace_figures
        from pipelines import trace as build_trace

        tokens = int(json.loads((build / "ledger.json").read_text())["totals"]["tokens"])
        res["tokens"] = tokens
        figs = trace_figures(build_trace.read(str(trace_path)), started, wall, tokens) if trace_path.exists() else {}
        if figs:
            res["startup_share"] = 1 - figs["busy_s"] / wall
            res["workers_forked"] = figs["fixed_cpu"]["workers_forked"]
    for line in out.splitlines():
        if line.startswith("ABLATION "):
            res.update(json.loads(line[len("ABLATION "):]))
    return res


def _parse_variant(s: str) -> tuple[str, dict]:
    name, _, rest = s.partition(":")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, env


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(runs: list[dict], names: list[str]) -> dict:
    out: dict = {}
    base = names[0]
    by = {(r["round"], r["variant"]): r for r in runs}
    rounds = sorted({r["round"] for r in runs})
    keys = ["wall_s", "cpu_s", "peak_rss_tree_mb"] + [k for k in ("startup_share", "steady_s") if any(k in r for r in runs)]
    for n in names:
        mine = [r for r in runs if r["variant"] == n]
        s = {k: _stats([r[k] for r in mine if k in r]) for k in keys if any(k in r for r in mine)}
        s["other_cores"] = _stats([r["other_cores"] for r in mine])
        if n != base:
            for k in ("wall_s", "cpu_s", "steady_s"):
                pairs = [by[(i, n)][k] / by[(i, base)][k] for i in rounds
                         if (i, n) in by and (i, base) in by and k in by[(i, n)]]
                if pairs:
                    s[f"ratio_{k}"] = _stats(pairs)
        out[n] = s
    return out


def _print_summary(summary: dict) -> None:
    for n, s in summary.items():
        parts = [f"{k} {v['median']:.2f} [{v['min']:.2f}..{v['max']:.2f}]" for k, v in s.items()]
        print(f"{n}: " + "; ".join(parts))


def cmd_run(a) -> int:
    _become_subreaper()
    variants = [_parse_variant(v) for v in a.variant]
    names = [n for n, _ in variants]
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    build = Path(a.build).resolve() if a.build else None
    runs = []
    log_f = open(a.log, "a") if a.log else None
    tokens = None
    for i in range(a.rounds):
        k = i % len(variants)
        for name, env in variants[k:] + variants[:k]:
            log(f"ablation: round {i + 1}/{a.rounds}, {name}")
            r = run_once(cmd, env, build)
            r.update(round=i, variant=name)
            if build is not None:
                if tokens is not None and r["tokens"] != tokens:
                    raise RuntimeError(f"token count changed: {r['tokens']} != {tokens}")
                tokens = r["tokens"]
            log(f"ablation:   wall {r['wall_s']:.2f} s, CPU {r['cpu_s']:.2f} s, other cores {r['other_cores']:.2f}"
                + (f", start-up share {r['startup_share']:.3f}" if "startup_share" in r else ""))
            runs.append(r)
            if log_f:
                log_f.write(json.dumps(r) + "\n")
                log_f.flush()
    summary = summarize(runs, names)
    _print_summary(summary)
    print("BENCH_RESULT " + json.dumps({"command": cmd, "variants": dict(variants), "summary": summary}))
    return 0


def cmd_read(a) -> int:
    """One training read: packed concat rows, seq_len 2048, batch 64, num_workers=2, from step 0."""
    from reader import Reader, ReadOptions

    opts = ReadOptions(seq_len=2048, batch_size=64, packing="concat", num_workers=a.workers,
                       shuffle_seed=0 if a.shuffle else None)
    t0 = time.perf_counter()
    r = Reader(str(a.cache), opts)
    t_first = None
    sink = 0
    for b, batch in r.iter_batches(0, a.batches):
        sink += int(batch["targets"][0, 0])
        if t_first is None:
            t_first = time.perf_counter()
    end = time.perf_counter()
    stats = {"steady_s": end - t_first, "open_to_last_s": end - t0}
    r.close()
    print("ABLATION " + json.dumps(stats))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="paired A/B rounds of a command")
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--variant", action="append", required=True,
                   help="NAME:ENV=VALUE,... (the first is the reference; NAME: for the environment as it is)")
    r.add_argument("--build", help="the build's output directory (removed before each run)")
    r.add_argument("--log", help="append each run as a JSON line to this file")
    r.add_argument("command", nargs=argparse.REMAINDER)
    d = sub.add_parser("read", help="one training read (run it under `run`)")
    d.add_argument("--cache", required=True)
    d.add_argument("--batches", type=int, default=400)
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--shuffle", action="store_true")
    a = ap.parse_args(argv)
    return cmd_run(a) if a.what == "run" else cmd_read(a)


if __name__ == "__main__":
    sys.exit(main())
