"""Time one end-to-end cache build (``python -m pipelines.build_cache``) as a monitored subprocess.

Whole-command figures include interpreter start-up, planning, Beam's worker start-up and the final
ledger. The steady-state rate is measured on the busy part of the build: the progress probe counts the
tokens of chunk sidecars as they appear, and the rate is taken between the first and the last chunk.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import Monitored, dir_bytes, log, run_monitored


class SidecarProgress:
    """Tokens of all chunk sidecars present under ``cache``/chunks (each parsed once)."""

    def __init__(self, cache: Path):
        self.cache = Path(cache)
        self.seen: dict[str, int] = {}
        self.first_seen: dict[str, float] = {}
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        chunks = self.cache / "chunks"
        if not chunks.is_dir():
            return 0
        for p in chunks.glob("shard-*/chunk-*.json"):
            key = str(p)
            if key in self.seen:
                continue
            try:
                self.seen[key] = int(json.loads(p.read_text())["tokens"])
                self.first_seen[key] = time.perf_counter() - self.t0
            except (OSError, ValueError, KeyError):
                continue  # not complete yet (should not happen: sidecars are renamed into place)
        return float(sum(self.seen.values()))


def steady_state(samples: list, total_tokens: int) -> dict:
    """The rate of the busy part of a build, from monitor samples ``[t, rss, cores, tokens_done]``.

    Preferred: the slope of tokens in finished chunks between the first and the last chunk (needs at
    least two distinct progress steps). Fallback (tiny builds whose chunks all land at once): tokens over
    the seconds during which the process tree kept at least one core busy.
    """
    pts = [(s[0], s[3]) for s in samples if s[3] is not None]
    first = next(((t, p) for t, p in pts if p > 0), None)
    last = next(((t, p) for t, p in pts if p >= total_tokens), pts[-1] if pts else None)
    if total_tokens > 0 and first is not None and last is not None and last[0] > first[0] and last[1] > first[1]:
        rate = (last[1] - first[1]) / (last[0] - first[0])
        return {"steady_tokens_per_s": rate, "busy_s": total_tokens / rate, "first_chunk_s": first[0],
                "last_chunk_s": last[0], "steady_method": "sidecar slope"}
    busy = cpu_busy(samples)["cpu_busy_s"]
    if not busy:
        busy = max(1e-3, samples[-1][0] if samples else 1e-3)
    return {"steady_tokens_per_s": total_tokens / busy, "busy_s": busy, "first_chunk_s": None,
            "last_chunk_s": None, "steady_method": "cpu busy"}


def cpu_busy(samples: list, threshold: float = 1.0) -> dict:
    """Seconds during which the process tree used at least ``threshold`` cores, and mean cores then."""
    busy, cores, prev_t = 0.0, 0.0, 0.0
    for t, _rss, cpu, _p in samples:
        dt = t - prev_t
        prev_t = t
        if cpu >= threshold:
            busy += dt
            cores += cpu * dt
    return {"cpu_busy_s": busy, "cpu_busy_mean_cores": (cores / busy) if busy else None}


def build(
    inputs: list[str],
    out: Path,
    tokenizer: str,
    *,
    workers: int = 2,
    extra: list[str] | None = None,
    timeout_s: float = 3600,
) -> dict:
    """Run one clean build into ``out`` and return its figures."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "pipelines.build_cache"]
    for i in inputs:
        cmd += ["--input", str(i)]
    cmd += [
        "--output", str(out.resolve()),
        "--tokenizer", tokenizer,
        "--runner", "DirectRunner",
        "--direct_running_mode=multi_processing",
        f"--direct_num_workers={workers}",
    ]
    cmd += list(extra or [])
    progress = SidecarProgress(out)
    log(f"build: {workers} worker(s), {tokenizer} -> {out}")
    m: Monitored = run_monitored(cmd, progress=progress, timeout_s=timeout_s)
    ledger = json.loads((out / "ledger.json").read_text())
    if not ledger.get("finished"):
        raise RuntimeError(f"build into {out} exited 0 but its ledger says finished=false")
    totals = ledger["totals"]
    tokens = int(totals["tokens"])
    parquet = dir_bytes(out, "chunks/shard-*/chunk-*.parquet")
    total_bytes = dir_bytes(out)
    res = {
        "wall_s": m.wall_s,
        "tokens": tokens,
        "docs": int(totals["docs"]),
        "chunks": int(totals["chunks"]),
        "bad_records": int(totals.get("bad_records", 0)),
        "tokens_per_s": tokens / m.wall_s,
        "peak_rss_tree_mb": m.peak_rss_tree_mb,
        "peak_rss_proc_mb": m.peak_rss_proc_mb,
        "other_cores": m.other_cores,
        "cpu_s": m.cpu_s,
        "tokens_per_cpu_s": tokens / m.cpu_s if m.cpu_s else None,
        "parquet_bytes": parquet,
        "cache_bytes": total_bytes,
        "chunk_bytes": ledger["config"].get("chunk_bytes"),
        "compression": ledger["config"].get("compression"),
        "samples": m.samples,
        "stderr_tail": m.stderr_tail[-1500:],
    }
    res.update(steady_state(m.samples, tokens))
    res.update(cpu_busy(m.samples))
    log(f"build: {tokens} tokens in {m.wall_s:.1f} s = {res['tokens_per_s'] / 1e6:.2f} M tok/s whole command, "
        f"steady {((res['steady_tokens_per_s'] or 0) / 1e6):.2f} M tok/s, peak RSS tree {m.peak_rss_tree_mb:.0f} MB "
        f"(other processes used {m.other_cores:.2f} cores meanwhile)")
    return res
