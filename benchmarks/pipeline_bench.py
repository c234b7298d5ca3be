"""Time one end-to-end cache build (``python -m pipelines.build_cache``) as a monitored subprocess.

Whole-command figures include interpreter start-up, planning, Beam's worker start-up and the final
ledger. The steady-state rate is measured on the busy part of the build, from the build's own timeline
(``CHUNKLEDGER_TRACE``, see pipelines/trace.py): each worker process's rate is its tokens over the
seconds it spent inside work units, and the steady state is the sum of the workers' rates (every worker
busy). ``busy_s`` = tokens / steady rate; everything else in the wall time is fixed cost (before the
first unit, after the last one) or tail (workers idle while another finishes its last units), itemized in
``fixed``. Without a trace (an old build), the rate falls back to the slope of sidecar tokens between the
first and the last chunk (biased high: it counts the first wave's work as if it had started at the first
chunk's end).
"""

from __future__ import annotations

import json
import os
import math
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import Monitored, dir_bytes, log, run_monitored
from pipelines import trace as build_trace


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


def _union_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def trace_figures(events: list[dict], t_launch: float, wall_s: float, tokens: int) -> dict:
    """Steady state and the itemized fixed seconds of one build, from its trace (see pipelines/trace.py).

    ``t_launch``: unix time the command was started; ``wall_s``: its whole duration.
    """
    starts: dict[tuple, float] = {}
    per_pid: dict[int, dict] = {}
    for e in events:
        key = (e["pid"], e.get("shard"), e.get("index"))
        if e["event"] == "unit_start":
            starts[key] = e["t"]
        elif e["event"] == "unit_done" and key in starts:
            w = per_pid.setdefault(e["pid"], {"intervals": [], "tokens": 0})
            w["intervals"].append((starts.pop(key), e["t"]))
            w["tokens"] += int(e.get("tokens") or 0)
    if not per_pid:
        return {}
    rates = {pid: w["tokens"] / _union_s(w["intervals"]) for pid, w in per_pid.items() if _union_s(w["intervals"]) > 0}
    steady = sum(rates.values())
    if steady <= 0:
        return {}
    first = min(a for w in per_pid.values() for a, _ in w["intervals"]) - t_launch
    last = max(b for w in per_pid.values() for _, b in w["intervals"]) - t_launch

    def at(name: str, pick=min) -> float | None:
        ts = [e["t"] - t_launch for e in events if e["event"] == name]
        return pick(ts) if ts else None

    proc_start = min((e["proc_start"] for e in events if e["event"] == "setup_start" and e.get("proc_start")),
                     default=None)

    def cpu_at(name: str) -> list[float]:
        return [e["cpu"] for e in events if e["event"] == name and "cpu" in e]

    busy = tokens / steady
    fixed = {
        "before_first_unit_s": first,
        "after_last_unit_s": wall_s - last,
        "tail_s": (last - first) - busy,  # inside the work span but not at the steady rate: unequal finish
        "launcher_python_s": at("launcher_start"),
        "launcher_imports_s": _diff(at("launcher_imported"), at("launcher_start")),
        "plan_s": _diff(at("planned"), at("launcher_imported")),
        "planned_to_worker_setup_s": _diff(at("setup_start"), at("planned")),
        "first_worker_process_s": _diff(proc_start, t_launch),  # when the first worker process started
        "worker_start_to_setup_s": _diff(at("setup_start"), _diff(proc_start, t_launch)),
        "worker_setup_s": _diff(at("setup_done", max), at("setup_start")),
        "setup_to_first_unit_s": _diff(first, at("setup_done")),
        "last_unit_to_finalize_s": _diff(at("finalize_start"), last),
        "finalize_s": _diff(at("finalize_done"), at("finalize_start")),
        "runner_shutdown_s": _diff(at("run_done"), at("finalize_done")),
        "launcher_exit_s": _diff(wall_s, at("launcher_exit")),
    }
    # CPU-seconds of the fixed work (robust to other processes on the machine): the launcher up to the run,
    # each worker process up to its first unit (Python, Beam, the DoFn, the tokenizer)
    starts_cpu = {e["pid"]: e["cpu"] for e in events if e["event"] == "setup_start" and "cpu" in e}
    launcher_cpu = cpu_at("run_start")
    worker_cpu = cpu_at("setup_done")
    fixed_cpu = {
        "launcher_to_run_cpu_s": launcher_cpu[0] if launcher_cpu else None,
        "worker_to_first_unit_cpu_s": max(worker_cpu) if worker_cpu else None,
        "worker_setup_cpu_s": max((e["cpu"] - starts_cpu[e["pid"]] for e in events
                                   if e["event"] == "setup_done" and e["pid"] in starts_cpu), default=None),
        "workers_forked": sum(1 for e in events if e["event"] == "setup_start" and e.get("forked")),
    }
    return {
        "fixed_cpu": fixed_cpu,
        "steady_tokens_per_s": steady,
        "busy_s": busy,
        "first_chunk_s": first,
        "last_chunk_s": last,
        "steady_method": "trace: sum of per-worker rates inside units",
        "worker_tokens_per_s": sorted(rates.values()),
        "workers_seen": len(per_pid),
        "units": sum(len(w["intervals"]) for w in per_pid.values()),
        "fixed": fixed,
    }


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


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
    trace_path = out.with_name(out.name + "-trace.jsonl")
    trace_path.unlink(missing_ok=True)
    log(f"build: {workers} worker(s), {tokenizer} -> {out}")
    m: Monitored = run_monitored(cmd, progress=progress, timeout_s=timeout_s,
                                 env={build_trace.ENV: str(trace_path.resolve())})
    ledger = json.loads((out / "ledger.json").read_text())
    if not ledger.get("finished"):
        raise RuntimeError(f"build into {out} exited 0 but its ledger says finished=false")
    totals = ledger["totals"]
    tokens = int(totals["tokens"])
    by_shard: dict[int, int] = {}
    from reader.storage.cache import Cache

    table = Cache(str(out)).table
    for s, n in zip(table.shard.tolist(), table.tokens.tolist()):
        by_shard[s] = by_shard.get(s, 0) + n
    parquet = dir_bytes(out, "chunks/shard-*/chunk-*.parquet")
    total_bytes = dir_bytes(out)
    res = {
        "wall_s": m.wall_s,
        "tokens": tokens,
        "tokens_by_shard": [by_shard.get(i, 0) for i in range(len(ledger["inputs"]))],
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
    traced = trace_figures(build_trace.read(str(trace_path)), m.started_at, m.wall_s, tokens) if trace_path.exists() else {}
    res.update(traced or steady_state(m.samples, tokens))
    res["startup_fraction"] = 1 - res["busy_s"] / m.wall_s
    res.update(cpu_busy(m.samples))
    fx = res.get("fixed") or {}
    log(f"build: {tokens} tokens in {m.wall_s:.1f} s = {res['tokens_per_s'] / 1e6:.2f} M tok/s whole command, "
        f"steady {((res['steady_tokens_per_s'] or 0) / 1e6):.2f} M tok/s, start-up fraction "
        f"{res['startup_fraction']:.3f}" + (f" (before the first unit {fx['before_first_unit_s']:.1f} s, tail "
                                            f"{fx['tail_s']:.1f} s, after the last unit {fx['after_last_unit_s']:.1f} s)"
                                            if fx else "") +
        f", peak RSS tree {m.peak_rss_tree_mb:.0f} MB (other processes used {m.other_cores:.2f} cores meanwhile)")
    return res


def write_parquet_copy(jsonl: Path, out: Path, group_bytes: int = 8 << 20) -> int:
    """The texts of a ``{"text": ...}`` jsonl shard as a Parquet file (zstd, row groups of about
    ``group_bytes`` of text, as datatrove and HF datasets write them); returns its documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("text", pa.string())])
    docs = 0
    with open(jsonl, "rb") as f, pq.ParquetWriter(str(out), schema, compression="zstd") as w:
        batch, held = [], 0
        for line in f:
            batch.append(json.loads(line)["text"])
            held += len(line)
            if held >= group_bytes:
                w.write_table(pa.table({"text": batch}, schema=schema), row_group_size=len(batch))
                docs += len(batch)
                batch, held = [], 0
        if batch:
            w.write_table(pa.table({"text": batch}, schema=schema), row_group_size=len(batch))
            docs += len(batch)
    return docs


def parquet_vs_jsonl(corpus: Path, files: list[str], work: Path, tokenizer: str = "tiktoken:cl100k_base") -> dict:
    """A build of the shards ``files`` of ``corpus`` written as Parquet against the build of the same jsonl shards,
    side by side (2 workers each): jsonl, Parquet, jsonl again; the Parquet build's rate over the mean of the two
    jsonl builds' around it (a drift of the machine's speed during the three cancels). Both must hold the same
    documents and tokens."""
    pq_dir = Path(work) / "parquet-input"
    shutil.rmtree(pq_dir, ignore_errors=True)
    pq_dir.mkdir(parents=True)
    for name in files:
        write_parquet_copy(Path(corpus) / name, pq_dir / (Path(name).stem + ".parquet"))
    jsonl = [str(Path(corpus) / name) for name in files]
    cache = Path(work) / "cache-input-format"
    first = build(jsonl, cache, tokenizer)
    parquet = build([str(p) for p in sorted(pq_dir.glob("*.parquet"))], cache, tokenizer)
    second = build(jsonl, cache, tokenizer)
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(pq_dir, ignore_errors=True)
    for ref in (first, second):
        if (parquet["tokens"], parquet["docs"]) != (ref["tokens"], ref["docs"]):
            raise AssertionError(f"the Parquet-input build holds {parquet['docs']} documents and {parquet['tokens']} "
                                 f"tokens, the jsonl build of the same texts {ref['docs']} and {ref['tokens']}")

    def mean(key: str) -> float:
        return ((first[key] or 0) + (second[key] or 0)) / 2 or math.inf

    ratio = parquet["tokens_per_s"] / mean("tokens_per_s")
    log(f"Parquet input / jsonl input, same texts: {ratio:.3f} (jsonl builds before and after: "
        f"{first['tokens_per_s'] / 1e6:.2f} and {second['tokens_per_s'] / 1e6:.2f} M tok/s)")
    return {"pipeline_parquet_input_tokens_per_s": parquet["tokens_per_s"],
            "pipeline_jsonl_input_tokens_per_s": mean("tokens_per_s"),
            "pipeline_parquet_vs_jsonl_input": ratio,
            "pipeline_parquet_vs_jsonl_input_steady": (parquet["steady_tokens_per_s"] or 0)
                                                      / mean("steady_tokens_per_s"),
            "pipeline_parquet_vs_jsonl_input_cpu": (parquet["tokens_per_cpu_s"] or 0) / mean("tokens_per_cpu_s"),
            "other_cores_during_pipeline_parquet_input": parquet["other_cores"]}


def main(argv=None) -> int:
    """One timed build with its itemized fixed seconds (the same build ``make bench`` times)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--input", action="append", required=True, help="input glob (repeatable)")
    ap.add_argument("--output", type=Path, required=True, help="cache directory (deleted first)")
    ap.add_argument("--tokenizer", default="tiktoken:cl100k_base")
    ap.add_argument("--workers", type=int, default=2)
    a, extra = ap.parse_known_args(argv)
    # the build runs in the checkout: relative paths are the caller's
    inputs = [i if "://" in i else os.path.abspath(i) for i in a.input]
    res = build(inputs, a.output.absolute(), a.tokenizer, workers=a.workers, extra=extra)
    keys = ("wall_s", "tokens", "tokens_per_s", "steady_tokens_per_s", "busy_s", "startup_fraction", "steady_method",
            "worker_tokens_per_s", "units", "fixed", "fixed_cpu", "cpu_s", "tokens_per_cpu_s", "cpu_busy_mean_cores", "other_cores",
            "peak_rss_tree_mb")
    print(json.dumps({k: res.get(k) for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
