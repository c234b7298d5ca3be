"""Remembering conformance checks that passed, so a machine runs each one once instead of once per worker.

The conformance check (:mod:`pipelines.tokenize.conformance`) costs about as much CPU as loading the fast tokenizer,
in every worker process of every build. Its outcome is a pure function of what goes into it, so a pass is
recorded under a key that digests all of it, and a worker that finds its key recorded skips the check:

* the conformance texts, by what generates them (:func:`pipelines.tokenize.conformance.texts_source_digest`: the
  module's files, the code of its functions and its tables, and the tokenizer's special-token strings), so a
  remembered pass costs no generating;
* the fast encoder's input (the ranks and pattern or scheme given to fastokens or GigaToken, or the
  ``tokenizer.json``) and the reference's (the tiktoken Encoding's pattern, ranks and special tokens, or the
  same ``tokenizer.json``);
* the code that runs: every file of the fast library's package and of the reference library (native libraries
  included), the source files of the encoder classes (and of this package's tokenizer modules), the code
  objects of the encoders' methods (an encoder patched in-process gets another key), and the
  reference-only characters;
* the Python version, the machine architecture and the libraries' environment variables (``FASTOKENS_*``,
  ``RAYON_NUM_THREADS``).

Any change to one of them is a new key, so the check runs again. Only passes are recorded (a failure is
checked again every time). The sampled re-encoding during builds (``--verify_every``) is unaffected.

Entries live in ``$CHUNKLEDGER_CACHE_DIR/conformance/`` (default ``$XDG_CACHE_HOME/chunkledger``, else
``~/.cache/chunkledger``); ``CHUNKLEDGER_CONFORMANCE_CACHE=0`` turns the cache off. A cache that cannot be
read or written is ignored: the check then simply runs.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import marshal
import os
import platform
import sys
from typing import Iterable, Sequence

from reader.storage import atomic

ENV_DIR = "CHUNKLEDGER_CACHE_DIR"
ENV_SWITCH = "CHUNKLEDGER_CONFORMANCE_CACHE"
VERSION = b"chunkledger conformance cache 1"

_PACKAGE_DIGESTS: dict[str, str] = {}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def directory() -> str:
    """Where passes are recorded."""
    base = os.environ.get(ENV_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "chunkledger")
    return os.path.join(base, "conformance")


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def package_digest(module) -> str:
    """sha256 over every file of an imported module's package (sources and native libraries), once per process."""
    root = os.path.dirname(os.path.abspath(module.__file__))
    digest = _PACKAGE_DIGESTS.get(root)
    if digest is None:
        h = hashlib.sha256()
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for name in sorted(files):
                if name.endswith((".pyc", ".pyo")):
                    continue
                path = os.path.join(d, name)
                h.update(os.path.relpath(path, root).encode() + b"\0" + _file_digest(path).encode() + b"\0")
        digest = _PACKAGE_DIGESTS[root] = h.hexdigest()
    return digest


def code_digest(classes: Iterable[type], modules: Iterable = ()) -> str:
    """sha256 over the source files defining ``classes`` and ``modules``, and the code objects of the classes'
    methods (so a method replaced in-process changes it too)."""
    h = hashlib.sha256()
    files = {os.path.abspath(m.__file__) for m in modules}
    for cls in classes:
        h.update(f"{cls.__module__}.{cls.__qualname__}\0".encode())
        try:
            files.add(inspect.getsourcefile(cls) or "")
        except TypeError:  # built-in classes
            pass
        for name in sorted(vars(cls)):
            fn = vars(cls)[name]
            fn = getattr(fn, "__func__", fn)
            code = getattr(fn, "__code__", None)
            if code is not None:
                h.update(name.encode() + b"\0" + hashlib.sha256(marshal.dumps(code)).digest())
    for path in sorted(f for f in files if f):
        h.update(path.encode() + b"\0" + _file_digest(path).encode())
    return h.hexdigest()


def make_key(parts: Sequence[str | bytes]) -> str:
    """The key of a check from its parts (see the module docstring), plus the interpreter and environment."""
    h = hashlib.sha256(VERSION)
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("FASTOKENS_") or k == "RAYON_NUM_THREADS")
    for p in [sys.version, platform.machine(), json.dumps(env), *parts]:
        b = p if isinstance(p, bytes) else p.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


def passed(key: str) -> bool:
    """Whether a pass is recorded under ``key``."""
    if not enabled():
        return False
    try:
        with open(os.path.join(directory(), key + ".json"), encoding="utf-8") as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(entry, dict) and entry.get("key") == key and entry.get("passed") is True


def record(key: str, about: dict) -> None:
    """Record a pass under ``key`` (atomically; a failure to write is ignored)."""
    if not enabled():
        return
    body = json.dumps({"key": key, "passed": True, **about}, sort_keys=True).encode("utf-8")
    try:
        atomic.write(atomic.local(), os.path.join(directory(), key + ".json"), body)
    except OSError:
        pass
