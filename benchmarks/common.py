"""Shared helpers: run a command while sampling its process tree (RSS, CPU) and its progress."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

REPO = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "BENCH_RESULT "


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Machine speed probes: this VM's cores and memory change speed from minute to minute (other tenants of the
# host), by more than some gaps to a target. run_monitored samples both before every measured command, in
# this (otherwise idle) process, so the report can show how the machine moved during the run.

PROBES: list[dict] = []  # filled by run_monitored while probing is on (see probe())
PROBING = False


def _probe_data() -> tuple[bytes, int, "object"]:
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(0)
    tokens = np.minimum(rng.zipf(1.2, 1 << 20), 100_000).astype(np.int32)  # token-like: Zipfian ids < 2^17
    raw = tokens.tobytes()
    return pa.compress(raw, codec="zstd", asbytes=True), len(raw), np.ones(64 << 18, np.int32)  # 64 MB


_PROBE_DATA = None


def probe(label: str, seconds: float = 0.25) -> dict:
    """One core's zstd decompression rate (compute, like the reader's decoding) and a numpy copy rate
    (memory, like the memmap baseline), each the best of 3 timings over about ``seconds``; appended to
    :data:`PROBES`."""
    global _PROBE_DATA
    import numpy as np
    import pyarrow as pa

    if _PROBE_DATA is None:
        _PROBE_DATA = _probe_data()
    comp, n, arr = _PROBE_DATA
    dst = np.empty_like(arr)

    def rate(fn, nbytes):  # the best of 3 timings (a moment's interference is not the machine's speed)
        fn()  # warm
        best = 0.0
        for _ in range(3):
            k, t = 0, time.perf_counter()
            while time.perf_counter() - t < seconds / 3:
                fn()
                k += 1
            best = max(best, k * nbytes / (time.perf_counter() - t))
        return best

    rec = {"label": label, "t": time.strftime("%H:%M:%S"),
           "zstd_decompress_mb_s": rate(lambda: pa.decompress(comp, decompressed_size=n, codec="zstd"), n) / 1e6,
           "memcpy_gb_s": rate(lambda: np.copyto(dst, arr), arr.nbytes) / 1e9}
    PROBES.append(rec)
    return rec


def _label(cmd: list[str]) -> str:
    """A short name for a measured command: its module, subcommand and the flags that tell runs apart."""
    words = [cmd[2] if len(cmd) > 2 and cmd[1] == "-m" else Path(cmd[0]).name]
    if len(cmd) > 3 and not cmd[3].startswith("-"):
        words.append(cmd[3])
    for i, c in enumerate(cmd):
        if c.startswith("--direct_num_workers") or c in ("--first_half",):
            words.append(c)
        elif c in ("--backend", "--tokenizer", "--encoder") and i + 1 < len(cmd):
            words.append(f"{c} {Path(cmd[i + 1]).name}")
    return " ".join(words)


@dataclass
class Monitored:
    """What one monitored command did."""

    wall_s: float
    returncode: int
    peak_rss_tree_mb: float  # max over samples of the summed RSS of the whole process tree
    peak_rss_proc_mb: float  # max over samples and processes of one process's RSS
    samples: list = field(default_factory=list)  # [t, rss_tree_mb, cpu_cores, progress]
    cpu_s: float = 0.0  # CPU seconds used by the command's process tree
    other_cores: float = 0.0  # mean cores used by OTHER processes on the machine meanwhile (contention)
    result: dict | None = None  # the child's BENCH_RESULT line, if any
    stdout_tail: str = ""
    stderr_tail: str = ""
    started_at: float = 0.0  # unix time the command was started (after any speed probe)


def _tree(p: psutil.Process) -> list[psutil.Process]:
    try:
        return [p] + p.children(recursive=True)
    except psutil.Error:
        return [p]


def run_monitored(
    cmd: list[str],
    *,
    env: dict | None = None,
    cwd: str | Path | None = None,
    progress: Callable[[], float] | None = None,
    interval_s: float = 0.25,
    timeout_s: float = 3600,
    check: bool = True,
) -> Monitored:
    """Run ``cmd``; sample RSS and CPU of its process tree (and ``progress()``) every ``interval_s``.
    While :data:`PROBING` is on, a speed :func:`probe` runs first (labelled with the command)."""
    if PROBING:
        probe(_label(cmd))
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONPATH", str(REPO))
    if env:
        full_env.update(env)
    out_f = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{os.getpid()}-out.txt", "w+b")
    err_f = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{os.getpid()}-err.txt", "w+b")
    sys0 = _busy_cpu_s()
    tree_cpu = 0.0
    t0 = time.perf_counter()
    started_at = time.time()
    proc = subprocess.Popen(cmd, env=full_env, cwd=str(cwd or REPO), stdout=out_f, stderr=err_f)
    root = psutil.Process(proc.pid)
    samples: list = []
    peak_tree = peak_proc = 0.0
    cpu_prev: dict[int, float] = {}
    t_prev = t0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak_tree, peak_proc, t_prev, tree_cpu
        now = time.perf_counter()
        rss_sum = 0.0
        cpu_sum = 0.0
        for p in _tree(root):
            try:
                with p.oneshot():
                    rss = p.memory_info().rss / 1e6
                    ct = p.cpu_times()
                    cpu = ct.user + ct.system
            except psutil.Error:
                continue
            rss_sum += rss
            peak_proc = max(peak_proc, rss)
            cpu_sum += cpu - cpu_prev.get(p.pid, cpu)
            cpu_prev[p.pid] = cpu
        peak_tree = max(peak_tree, rss_sum)
        tree_cpu += cpu_sum
        dt = max(1e-6, now - t_prev)
        t_prev = now
        prog = None
        if progress is not None:
            try:
                prog = progress()
            except Exception:  # a progress probe must never break a measurement
                prog = None
        samples.append([round(now - t0, 3), round(rss_sum, 1), round(cpu_sum / dt, 3), prog])

    # New processes' first CPU reading counts from 0 (their whole life so far).
    def first_seen_zero() -> None:
        for p in _tree(root):
            cpu_prev.setdefault(p.pid, 0.0)

    while True:
        first_seen_zero()
        sample()
        try:
            proc.wait(timeout=interval_s)
            break
        except subprocess.TimeoutExpired:
            if time.perf_counter() - t0 > timeout_s:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"timed out after {timeout_s} s: {' '.join(cmd)}")
    wall = time.perf_counter() - t0
    other = max(0.0, (_busy_cpu_s() - sys0 - tree_cpu) / max(wall, 1e-6))
    if progress is not None:
        try:
            samples.append([round(wall, 3), 0.0, 0.0, progress()])
        except Exception:
            pass
    stop.set()
    out_f.seek(0)
    err_f.seek(0)
    out = out_f.read().decode("utf-8", "replace")
    err = err_f.read().decode("utf-8", "replace")
    for f in (out_f, err_f):
        f.close()
        os.unlink(f.name)
    result = None
    for line in out.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
    m = Monitored(
        wall_s=wall,
        returncode=proc.returncode,
        peak_rss_tree_mb=peak_tree,
        peak_rss_proc_mb=peak_proc,
        other_cores=other,
        cpu_s=tree_cpu,
        samples=samples,
        result=result,
        # (paths inside the checkout as the repository names them: the details file is committed)
        stdout_tail=out[-3000:].replace(f"{REPO}/", ""),
        stderr_tail=err[-3000:].replace(f"{REPO}/", ""),
        started_at=started_at,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"command failed with exit code {proc.returncode}: {' '.join(map(str, cmd))}\n"
            f"--- stderr (tail) ---\n{m.stderr_tail}\n--- stdout (tail) ---\n{m.stdout_tail}"
        )
    return m


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all processes) since boot."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def emit_result(obj: dict) -> None:
    """Child side of :func:`run_monitored`: print the result line the parent parses."""
    print(RESULT_PREFIX + json.dumps(obj), flush=True)


def machine_description() -> dict:
    vm = psutil.virtual_memory()
    cpu_model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = (0.0, 0.0, 0.0)
    import importlib.metadata as md

    versions = {}
    for pkg in ("apache-beam", "pyarrow", "numpy", "tiktoken", "tokenizers", "datasets", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu": cpu_model,
        "cores": os.cpu_count(),
        "memory_gb": round(vm.total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in load],
        "versions": versions,
    }


def dir_bytes(path: Path, pattern: str = "**/*") -> int:
    return sum(p.stat().st_size for p in Path(path).glob(pattern) if p.is_file())
