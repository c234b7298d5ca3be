"""An optional timeline of one build, for benchmarks: where the fixed seconds of a run go.

Set ``CHUNKLEDGER_TRACE=/path/to/file`` and every process of a local build (the launcher and each worker)
appends one JSON line per event: ``{"t": <unix seconds>, "cpu": <the process's CPU seconds so far>, "pid": ...,
"event": ..., ...}``. Unset (the
default), :func:`event` returns at once and nothing is written. The trace never affects the cache: it is
written outside the output directory and read only by ``benchmarks/pipeline_bench.py``.

Events: ``launcher_start`` (before Beam is imported), ``warm_process_started`` (``warm_pid``: the process
forking the local workers, see pipelines/runners/local_workers.py; events of its workers carry ``forked``),
``warm_imported``/``warm_loaded`` (the warm process: worker modules imported; tokenizer loaded too),
``launcher_imported``, ``planned``, ``run_start``,
``run_done``, ``launcher_exit`` (launcher); ``setup_start``/``setup_done`` (worker DoFn set-up; ``proc_start``: when
the worker process started),
``unit_start``/``unit_done`` (one work unit; fields ``shard``, ``index``; ``tokens`` when done),
``finalize_start``/``finalize_done``.
"""

from __future__ import annotations

import json
import os
import time

ENV = "CHUNKLEDGER_TRACE"


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def event(name: str, **fields) -> None:
    """Append one event to the trace file named by ``$CHUNKLEDGER_TRACE`` (no-op when unset)."""
    path = os.environ.get(ENV)
    if not path:
        return
    if os.environ.get("CHUNKLEDGER_FORKED_WORKER"):  # a worker forked by the warm process (local_workers.py)
        fields["forked"] = True
    line = json.dumps({"t": time.time(), "cpu": time.process_time(), "pid": os.getpid(), "event": name,
                       **fields}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, line.encode())  # one short O_APPEND write: lines from processes never interleave
        finally:
            os.close(fd)
    except OSError:
        pass  # a trace must never break a build


def process_start() -> float | None:
    """When this process started (unix seconds, 10 ms resolution; Linux only, else None)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of proc(5), "starttime": clock ticks after boot
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def read(path: str) -> list[dict]:
    """The events of a trace file, in time order."""
    from reader.storage import files  # the tool reading a trace (not the light path writing one)

    text = files.read_local(path).decode("utf-8")
    events = [json.loads(line) for line in text.splitlines() if line.strip()]
    return sorted(events, key=lambda e: e["t"])
