"""A local Cloud Storage emulator for tests: ``gcp-storage-emulator`` in a subprocess on 127.0.0.1.

Usage::

    with GcsEmulator(bucket="b") as emu:
        emu.upload(local_path, "corpus/part-00.jsonl")
        with emu.beam_env():            # Beam's gs:// (and the DataflowRunner's staging) -> the emulator
            build_cache.run([...])
        fs = emu.gcsfs()                 # gcsfs against the emulator (anonymous)

Beam's GCS client honours ``STORAGE_EMULATOR_HOST``; without credentials it would first retry
``google.auth.default()`` for ~20 s per process, so :meth:`beam_env` also makes Beam connect anonymously
(in this process only: run Beam in-process, e.g. with the FnApiRunner).

gcsfs needs ``token="anon"`` and the endpoint, and must not use its experimental zonal/HNS class
(``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``, on by default, is read when gcsfs is first imported; that class
asks the Storage Control gRPC API about every bucket and hangs against the emulator). While the
emulator runs, ``gs://`` in fsspec (so also ``reader.Reader(..., storage_options=emu.storage_options)``)
resolves to the plain ``gcsfs.core.GCSFileSystem``, whatever the import order.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

# The emulator serves one request at a time from a listen backlog of 5 (socketserver's default): a client
# with more requests in flight (the reader's read-ahead) has connections dropped and retried by TCP a second
# later. Run with a backlog of 256 instead.
_START = ("import sys, socketserver; socketserver.TCPServer.request_queue_size = 256; "
          "from gcp_storage_emulator.__main__ import main; sys.exit(main())")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    def __init__(self, bucket: str = "chunkledger-test", start_timeout: float = 60.0):
        self.bucket = bucket
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self._fs = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "GcsEmulator":
        # stderr to a file, not a pipe: the emulator prints a traceback for every client that closes a
        # connection early, and once a pipe nobody reads is full (64 KiB) it blocks, and the test hangs.
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _START, "start", "--host=127.0.0.1", f"--port={self.port}", f"--default-bucket={self.bucket}",
             "--in-memory", "--quiet"],
            stdout=subprocess.DEVNULL, stderr=self._stderr, preexec_fn=_die_with_parent)
        self._plain_gcsfs_for_gs()
        deadline = time.time() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                tail = self.stderr_tail()
                self.close()
                raise RuntimeError(f"gcp-storage-emulator exited: {tail}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{self.bucket}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"gcp-storage-emulator did not answer on {self.endpoint} within "
                                   f"{self.start_timeout:.0f}s")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._restore_fsspec()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        if getattr(self, "_stderr", None) is not None:
            self._stderr.close()
            self._stderr = None

    def stderr_tail(self, n: int = 2000) -> str:
        """The last ``n`` characters the emulator wrote to stderr."""
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - n))
        return self._stderr.read().decode(errors="replace")

    # -- clients -----------------------------------------------------------------------------------
    def url(self, key: str = "") -> str:
        return f"gs://{self.bucket}/{key}" if key else f"gs://{self.bucket}"

    @property
    def storage_options(self) -> dict:
        """fsspec/gcsfs options for this emulator (e.g. ``Reader(..., storage_options=emu.storage_options)``)."""
        return {"token": "anon", "endpoint_url": self.endpoint, "requests_timeout": 30}

    def gcsfs(self):
        from gcsfs.core import GCSFileSystem

        if self._fs is None:
            self._fs = GCSFileSystem(skip_instance_cache=True, **self.storage_options)
        return self._fs

    def _plain_gcsfs_for_gs(self) -> None:
        import fsspec
        from fsspec.registry import _registry
        from gcsfs.core import GCSFileSystem

        self._saved_registry = {k: _registry.get(k) for k in ("gs", "gcs")}
        for proto in ("gs", "gcs"):
            fsspec.register_implementation(proto, GCSFileSystem, clobber=True)

    def _restore_fsspec(self) -> None:
        saved = getattr(self, "_saved_registry", None)
        if saved is None:
            return
        from fsspec.registry import _registry

        for proto, cls in saved.items():
            if cls is None:
                _registry.pop(proto, None)
            else:
                _registry[proto] = cls
        self._saved_registry = None

    def upload(self, local: str | os.PathLike, key: str) -> str:
        self.gcsfs().put_file(str(local), f"{self.bucket}/{key}")
        return self.url(key)

    @contextlib.contextmanager
    def beam_env(self):
        """Point Beam's gs:// at the emulator, anonymously, for the duration of the block (this process)."""
        from apache_beam.internal.gcp import auth

        saved_env = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
        saved_cred = (auth._Credentials._credentials_init, auth._Credentials._credentials)
        os.environ["STORAGE_EMULATOR_HOST"] = self.endpoint
        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
        auth._Credentials._credentials_init, auth._Credentials._credentials = True, None  # anonymous
        try:
            yield self
        finally:
            auth._Credentials._credentials_init, auth._Credentials._credentials = saved_cred
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v



def _die_with_parent() -> None:
    """In the emulator child: get SIGTERM when the test process dies (no orphans after a killed run)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
