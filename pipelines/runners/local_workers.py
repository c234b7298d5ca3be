"""Local Beam SDK workers forked from one warm process, so a local build starts in seconds.

Beam's multi-process DirectRunner starts each SDK worker as a new Python process: every worker imports Beam
(about 2 CPU-seconds) and then loads the tokenizer (about 1 more), one after the other with the launcher's
own import of Beam. Here the launcher starts one *warm* process first, before it imports Beam itself; while
the launcher plans, the warm process imports the worker's modules (Beam's SDK harness and the builder's
DoFns, with the garbage collector off) and loads the build's tokenizer. Each worker the runner then starts
is a tiny client (``python -m pipelines.runners.local_workers connect SOCKET``) that hands its environment (the
runner's control and logging addresses, pipeline options, worker id), working directory and standard
streams to the warm process, which forks a child that runs Beam's own SDK harness
(``sdk_worker_main.main``) with them. The child exits when the runner is done with it; the client mirrors
its exit status, and a killed client takes its child with it.

Nothing about the pipeline changes: the same runner (Beam's FnApiRunner, what the DirectRunner runs), the
same job service, DoFns, bundles and outputs; only how worker processes come to life. The warm process
forks only while it runs no thread but the idle ones its libraries start at import (it checks); otherwise,
or if it cannot be reached, a worker starts the usual way (a fresh ``sdk_worker_main``).
``CHUNKLEDGER_FORK_WORKERS=0`` turns it off: an 800 MB local build with 2 workers then takes 1.10x the
CPU-seconds and 1.09x the wall time (docs/DESIGN.md, "Ablations").

Used for ``--runner=DirectRunner --direct_running_mode=multi_processing`` (the default local runner) on
Linux. This module must stay cheap to import: the launcher starts the warm process before importing Beam.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import gc
import json
import os
import selectors
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from pipelines.runners.choice import is_local_multiprocess

ENV_SWITCH = "CHUNKLEDGER_FORK_WORKERS"
FORKED_MARK = "CHUNKLEDGER_FORKED_WORKER"  # set in the environment of a forked worker
_HEADER = struct.Struct("<Q")
_STANDARD_WORKER = ["-m", "apache_beam.runners.worker.sdk_worker_main"]


def enabled() -> bool:
    return (os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")
            and sys.platform.startswith("linux") and hasattr(socket, "send_fds") and hasattr(os, "fork"))


def wants_local_workers(argv: list[str]) -> bool:
    """Whether a build command line runs Beam's multi-process DirectRunner (the default without ``--runner``)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--runner")
    p.add_argument("--direct_running_mode")
    a, _ = p.parse_known_args(argv)
    return is_local_multiprocess(a.runner, a.direct_running_mode)


def preload_hint(argv: list[str]) -> dict:
    """The tokenizer options of a build command line (what the warm process loads ahead of the workers)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--tokenizer")
    p.add_argument("--tokenizer_backend", default="auto")
    p.add_argument("--verify_every")
    a, _ = p.parse_known_args(argv)
    return {"tokenizer": a.tokenizer, "backend": a.tokenizer_backend, "verify_every": a.verify_every}


@contextlib.contextmanager
def _ctrl_c_ignored():
    """SIGINT ignored while a child is started: it inherits that from its first instruction. Ctrl-C is the
    launcher's to report; the warm process stops when the launcher is gone, and its forked workers end
    quietly on a Ctrl-C (:func:`_run_child`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler Python did not install, which it cannot restore
            signal.signal(signal.SIGINT, previous)


class WarmProcess:
    """Launcher side: the warm process, and the worker command that reaches it.

    Args:
      preload: :func:`preload_hint` of the command line (or None: load no tokenizer ahead).
    """

    def __init__(self, preload: dict | None = None):
        self.dir = tempfile.mkdtemp(prefix="chunkledger-workers-")
        self.socket_path = os.path.join(self.dir, "warm.sock")
        cmd = [sys.executable, "-m", "pipelines.runners.local_workers", "serve", self.socket_path,
               json.dumps(preload or {})]
        # stdin is the lifeline: when the launcher exits (even killed) the warm process sees EOF and stops.
        with _ctrl_c_ignored():
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        from pipelines import trace

        trace.event("warm_process_started", warm_pid=self.proc.pid)

    def worker_command(self) -> str:
        """The command line Beam runs for each SDK worker."""
        return " ".join(shlex.quote(x) for x in
                        [sys.executable, "-m", "pipelines.runners.local_workers", "connect", self.socket_path])

    def close(self) -> None:
        """Stop the warm process (its forked workers have finished with the job) and remove its socket."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# The worker command (a client of the warm process)


def connect(socket_path: str) -> int:
    """Run one SDK worker through the warm process; the standard worker if it cannot run one.

    The warm process answers ``started <pid>`` once it forked the worker, then ``exit <status>``. Without a
    ``started`` (unreachable, refused, or gone while still loading) nothing ran and a standard worker starts.
    """
    # Ctrl-C reaches every process of the terminal's group: this one then ends quietly, and the warm process
    # stops its worker when the connection closes (the launcher prints the one line).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lines: list[bytes] = []
    try:
        s.connect(socket_path)
        body = json.dumps({"env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(s, [_HEADER.pack(len(body)) + body], [0, 1, 2])
        buf = b""
        while True:
            part = s.recv(256)
            if not part:
                break
            buf += part
            *done, buf = buf.split(b"\n")
            lines += done
            if lines and lines[-1].startswith(b"exit "):
                break
    except OSError:
        pass
    finally:
        s.close()
    if not lines or not lines[0].startswith(b"started "):
        os.execv(sys.executable, [sys.executable] + _STANDARD_WORKER)
    if not lines[-1].startswith(b"exit "):
        return 1  # the warm process went away while the worker ran
    return int(lines[-1].split()[1])


# --------------------------------------------------------------------------------------------------
# The warm process


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0  # unknown: never fork


def _settled(baseline: int, timeout_s: float = 1.0) -> bool:
    """Whether the process runs no more threads than ``baseline`` (a joined thread may take a moment to exit)."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = _threads()
        if 0 < n <= baseline or time.monotonic() > deadline:
            return 0 < n <= baseline
        time.sleep(0.002)


def _preload(hint: dict) -> None:
    """Load the build's tokenizer as a worker would (any failure is left to the workers to report)."""
    spec = hint.get("tokenizer")
    if not spec or not (spec.startswith("tiktoken:") or os.path.exists(spec)):
        return  # hub names need network access and transformers: the workers load those themselves
    try:
        from pipelines.tokenize.fast_tokenizer import load_cached
        from pipelines.tokenize.tokenizer import DEFAULT_VERIFY_EVERY, resolve

        every = hint.get("verify_every")
        load_cached(resolve(spec).with_backend(hint.get("backend") or "auto",
                                               int(every) if every is not None else DEFAULT_VERIFY_EVERY))
    except Exception:  # noqa: BLE001 - the worker loads it again and reports the error properly
        pass


def _run_child(conn: socket.socket, fds: list[int], message: dict) -> None:
    """In the forked child: become the SDK worker the client would have started."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Ctrl-C ends the worker quietly (see connect)
        for i, fd in enumerate(fds[:3]):
            os.dup2(fd, i)
        for fd in fds:
            os.close(fd)
        conn.close()
        os.environ.clear()
        os.environ.update(message["env"])
        os.environ[FORKED_MARK] = "1"  # what this worker's trace events say (benchmarks, tests)
        os.chdir(message["cwd"])
        sys.argv = [sys.argv[0]]
        gc.enable()
        from apache_beam.runners.worker import sdk_worker_main

        sdk_worker_main.main([])
        code = 0
    except BaseException:  # noqa: BLE001 - the harness logged it; the exit status tells the runner
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    if len(data) < _HEADER.size:
        raise OSError("short message")
    (n,) = _HEADER.unpack(data[:_HEADER.size])
    body = data[_HEADER.size:]
    while len(body) < n:
        part = conn.recv(n - len(body))
        if not part:
            raise OSError("short message")
        body += part
    return json.loads(body), list(fds)


def serve(socket_path: str, hint: dict) -> None:
    """The warm process: import and load, then fork one SDK worker per client until the launcher goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as started by WarmProcess: a Ctrl-C is the launcher's to report
    # Listen first: workers the runner starts meanwhile wait in the backlog instead of starting cold.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    gc.disable()  # hundreds of thousands of long-lived objects are created now: never walk them
    # The modules the tokenizer's load runs in, imported before the loading thread starts: the two threads
    # below then never import the same module at once. numpy and pyarrow start their idle threads here.
    from pipelines.tokenize import fast_tokenizer  # noqa: F401
    from pipelines import trace

    # The threads these libraries start at import (pyarrow's allocator and pools, numpy's BLAS) are idle and
    # fork-safe (they re-create what they need in a child). Any thread started after that (by a tokenizer
    # library) is not known to be: then nothing is forked.
    baseline = _threads()
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the HF reference without its thread pool, here only
    # The tokenizer loads while Beam is imported: building fastokens (most of a load) releases the GIL, so on
    # a second core it takes little time from the import.
    loader = threading.Thread(target=_preload, args=(hint,), name="chunkledger-preload", daemon=True)
    loader.start()
    try:
        from apache_beam.runners.worker import sdk_worker_main  # noqa: F401

        from pipelines.chunking import transforms  # noqa: F401 - the DoFns' modules
        trace.event("warm_imported")
    finally:
        loader.join()
        if parallelism is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism
    trace.event("warm_loaded")
    gc.freeze()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "launcher")
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    clients: dict[socket.socket, int] = {}
    forkable = _settled(baseline)
    try:
        while True:
            for key, _ in sel.select(timeout=0.05):
                if key.data == "launcher":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return  # the launcher is gone
                elif key.data == "accept":
                    conn, _ = listener.accept()
                    try:
                        message, fds = _receive(conn)
                    except (OSError, ValueError):
                        conn.close()
                        continue
                    if not forkable or not 0 < _threads() <= baseline:
                        forkable = False
                        for fd in fds:
                            os.close(fd)
                        conn.sendall(b"refused\n")  # the client starts a standard worker
                        conn.close()
                        continue
                    pid = os.fork()
                    if pid == 0:
                        sel.close()
                        listener.close()
                        for c in clients:
                            c.close()
                        _run_child(conn, fds, message)
                    for fd in fds:
                        os.close(fd)
                    try:
                        conn.sendall(b"started %d\n" % pid)
                    except OSError:
                        pass  # the client is gone: its worker is stopped below
                    children[pid] = conn
                    clients[conn] = pid
                    sel.register(conn, selectors.EVENT_READ, "client")
                else:  # a client closed its end (it was killed): stop its worker
                    conn = key.fileobj
                    try:
                        alive = conn.recv(1, socket.MSG_PEEK)
                    except OSError:
                        alive = b""
                    if not alive:
                        pid = clients.get(conn)
                        sel.unregister(conn)
                        if pid is not None:
                            _kill(pid)
            _reap(children, clients, sel)
    finally:
        for pid in list(children):
            _kill(pid)
        deadline = time.monotonic() + 5
        while children and time.monotonic() < deadline:
            _reap(children, clients, sel)
            time.sleep(0.02)
        listener.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(children: dict, clients: dict, sel) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        clients.pop(conn, None)
        code = os.waitstatus_to_exitcode(status)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        try:
            conn.sendall(b"exit %d\n" % (code if code >= 0 else 128 - code))
        except OSError:
            pass
        conn.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["connect"] and len(argv) == 2:
        return connect(argv[1])
    if argv[:1] == ["serve"] and len(argv) == 3:
        serve(argv[1], json.loads(argv[2]))
        return 0
    print("usage: python -m pipelines.runners.local_workers connect SOCKET | serve SOCKET PRELOAD_JSON", file=sys.stderr)
    return 2


if __name__ == "__main__":
    code = main()
    if sys.argv[1:2] == ["serve"]:
        # The warm process has reaped its workers and the launcher removes its socket: nothing is left to
        # clean up, and the interpreter's teardown of Beam and the tokenizer would keep the launcher waiting.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
