"""Start a group of cooperating worker processes (jax.distributed, torch.distributed ranks) for a test.

Each process is started in its own session and writes its log to a file; the wait is bounded, leftovers
are always killed with their children (a rank's DataLoader workers), and a lost race for the free
coordinator port is retried once on another port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from typing import Callable, Mapping, Sequence

import pytest



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(argv: Callable[[int, int], Sequence[str]], n: int, out_dir: str, env: Mapping[str, str],
              result: Callable[[int], str], timeout_s: float, what: str = "processes") -> list[dict]:
    """Run ``argv(i, port)`` for i in 0..n-1 and return the JSON each left at ``result(i)``.

    Fails the test with the end of every log if a process fails or the group outlives ``timeout_s``.
    """
    for retry_port in (True, False):
        got = _run_once(argv, n, out_dir, env, result, timeout_s, what, retry_port)
        if got is not None:
            return got
    raise AssertionError("unreachable")


def _run_once(argv, n, out_dir, env, result, timeout_s, what, retry_port):
    port = free_port()
    procs, logs = [], []
    try:
        for i in range(n):
            log = open(os.path.join(out_dir, f"log{i}.txt"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(list(argv(i, port)), env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            text = ""
            for log in logs:
                log.seek(0)
                text += log.read()[-3000:]
            if retry_port and "address already in use" in text.lower():  # lost the free-port race
                return None
            pytest.fail(f"{what} failed or timed out after {timeout_s}s: {failed}\n{text}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)  # the process and its children
                p.wait(timeout=10)
        for log in logs:
            log.close()
    reports = []
    for i in range(n):
        with open(result(i)) as f:
            reports.append(json.load(f))
    return reports
