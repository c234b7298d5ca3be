"""Test-side: command-line builds forked from one warm process, to be killed at random moments, cheaply.

    python tests/support/build_forker.py LOG_DIR TOKENIZER

Starting ``python -m pipelines.build_cache`` costs a couple of CPU-seconds of imports and a tokenizer load
before the build does anything; the chaos stress kills dozens of builds. This process imports the builder
and loads TOKENIZER once (as the local runner's warm process does, pipelines/runners/local_workers.py),
then per request forks a child that runs ``pipelines.build_cache.main(argv)``: a real launcher (it takes the
lock, plans, runs the pipeline in-process with the FnApiRunner, finalizes), in its own session and process
group (kill the group), with its output in ``LOG_DIR/<pid>.log``. Like PID 1 in a container without an
init, this process does not reap a child until asked: a killed build stays a zombie meanwhile.

Protocol, one line each way:

* ``build N ARGV_JSON`` -> ``started PID``: fork a build; it reports when its N-th atomic write into the
  cache is about to be renamed into place (wrapping ``reader.storage.files.publish`` in the child, as
  ``kill_at.py`` does; the product code has no hook);
* ``wait PID`` -> ``writing PID`` once that happened, or ``ended PID`` if the build ended first;
* ``reap PID`` -> ``reaped PID STATUS`` (``os.waitstatus_to_exitcode``).

End of input: kill and reap every child, and exit. The forker gets SIGTERM when its parent dies
(PR_SET_PDEATHSIG) and does the same.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _notify_at(n: int, fd: int) -> None:
    """In the child: write one byte to ``fd`` when the N-th atomic write of the build is published."""
    from pipelines.filesystem import BEAM
    from reader.storage import files

    real, seen = files.publish, [0]

    def publish(fs, tmp, path):
        if fs is BEAM:
            seen[0] += 1
            if seen[0] == n:
                os.write(fd, b"w")
                os.close(fd)
        real(fs, tmp, path)

    files.publish = publish


def _child(n: int, argv: list[str], log_dir: str, notify: int, others: list[int]) -> None:
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()
        for fd in others:
            os.close(fd)
        log = os.open(os.path.join(log_dir, f"{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        _notify_at(n, notify)
        from pipelines.build_cache import main

        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def warm_up(tokenizer: str) -> None:
    """Import the builder and load the tokenizer; refuse if that left a thread running (forking is then unsafe).

    The threads numpy and pyarrow start at import are idle and fork-safe (local_workers relies on the same).
    """
    import pipelines.build_cache  # noqa: F401
    from pipelines.tokenize.fast_tokenizer import load_cached
    from pipelines.tokenize.tokenizer import DEFAULT_VERIFY_EVERY, resolve

    baseline = _threads()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    load_cached(resolve(tokenizer).with_backend("auto", DEFAULT_VERIFY_EVERY))
    del os.environ["TOKENIZERS_PARALLELISM"]
    if _threads() > baseline:
        raise RuntimeError(f"loading {tokenizer} left {_threads() - baseline} threads running: cannot fork safely")


def serve(log_dir: str) -> None:
    children: dict[int, int] = {}  # pid -> read end of its notification pipe
    baseline = _threads()
    try:
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "build":
                n_text, _, argv = arg.partition(" ")
                if _threads() > baseline:
                    raise RuntimeError("a thread started in the forker: forking it would not be safe")
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    _child(int(n_text), json.loads(argv), log_dir, w, [r, *children.values()])
                os.close(w)  # the child holds the only write end: its death is an end of file here
                children[pid] = r
                print(f"started {pid}", flush=True)
            elif cmd == "wait":
                pid = int(arg)
                print(f"{'writing' if os.read(children[pid], 1) else 'ended'} {pid}", flush=True)
            elif cmd == "reap":
                pid = int(arg)
                _, status = os.waitpid(pid, 0)
                os.close(children.pop(pid))
                print(f"reaped {pid} {os.waitstatus_to_exitcode(status)}", flush=True)
            else:
                raise ValueError(f"unknown request {line!r}")
    finally:
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            os.waitpid(pid, 0)


if __name__ == "__main__":
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: die with the test
    except OSError:
        pass
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the children's groups are killed too
    sys.path.insert(0, REPO)
    warm_up(sys.argv[2])
    serve(sys.argv[1])
