"""A memo of what resolving a local Hugging Face ``tokenizer.json`` gives, so a machine parses each one once.

Resolving a ``tokenizer.json`` (:func:`pipelines.tokenize.tokenizer.resolve`) parses it with the ``tokenizers``
library and serializes it back (``Tokenizer.to_str()``: the payload shipped to the workers, whose sha256 is
the ledger's identity). For a 100k-token vocabulary that is about 0.6 CPU-seconds, paid by the launcher
and again by the warm worker process (:mod:`pipelines.runners.local_workers`) before the first work unit can start.
The result is a pure function of the file's bytes, the ``tokenizer_config.json`` beside it (its
``eos_token``) and the library's code, so it is recorded under a key that digests all three
(:func:`package_digest` of ``tokenizers``) plus the interpreter's version.

An entry is checked when read: its payload's sha256 must be its recorded hash, or the entry is ignored and
the file parsed again. Entries live in ``$CHUNKLEDGER_CACHE_DIR/hf-resolve/`` (default
``$XDG_CACHE_HOME/chunkledger``, else ``~/.cache/chunkledger``); ``CHUNKLEDGER_RESOLVE_CACHE=0`` turns it off (an
800 MB build with a cl100k ``tokenizer.json`` then takes 1.065x the CPU-seconds: docs/DESIGN.md, "Ablations"). A memo
that cannot be read or written is ignored. Remote specs (``gs://...``) and hub names are not remembered.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys

from reader.format.tokenizer_id import hash_hf_json
from reader.storage import files

ENV_DIR = "CHUNKLEDGER_CACHE_DIR"
ENV_SWITCH = "CHUNKLEDGER_RESOLVE_CACHE"
VERSION = b"chunkledger hf resolve cache 1"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def directory() -> str:
    base = os.environ.get(ENV_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "chunkledger")
    return os.path.join(base, "hf-resolve")


def package_digest(module) -> str:
    """sha256 over every file of an imported module's package (sources and native libraries), once per process."""
    return _tree_digest(os.path.dirname(os.path.abspath(module.__file__)))


@functools.lru_cache(maxsize=None)
def _tree_digest(root: str) -> str:
    h = hashlib.sha256()
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for name in sorted(names):
            if not name.endswith((".pyc", ".pyo")):
                path = os.path.join(d, name)
                with files.open_local(path) as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
                h.update(os.path.relpath(path, root).encode() + b"\0" + digest.encode() + b"\0")
    return h.hexdigest()


def key(tokenizer_json: bytes, config_json: bytes | None) -> str:
    """The key of resolving these bytes with the installed ``tokenizers``."""
    import tokenizers

    h = hashlib.sha256(VERSION)
    for part in (sys.version.encode(), package_digest(tokenizers).encode(), tokenizer_json,
                 b"\0no config" if config_json is None else b"\1" + config_json):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def lookup(k: str) -> dict | None:
    """``{"vocab_size", "eos_id", "eos_token", "eos_how", "hash", "payload"}`` recorded under ``k``, or None
    (``eos_how`` is None in an entry from before it was recorded: resolve again)."""
    if not enabled():
        return None
    base = os.path.join(directory(), k)
    try:
        entry = json.loads(files.read_local(base + ".json", root=directory()))
        payload = files.read_local(base + ".payload", root=directory()).decode("utf-8")
    except (OSError, ValueError):
        return None
    if not (isinstance(entry, dict) and entry.get("key") == k and entry.get("hash") == hash_hf_json(payload)):
        return None  # damaged or from something else: parse the file again
    return {"vocab_size": entry["vocab_size"], "eos_id": entry["eos_id"], "eos_token": entry.get("eos_token"),
            "eos_how": entry.get("eos_how"), "hash": entry["hash"], "payload": payload}


def record(k: str, vocab_size: int, eos_id: int | None, hash_: str, payload: str, *, eos_token: str | None = None,
           eos_how: str | None = None) -> None:
    """Record a resolution under ``k`` (payload first, then the entry naming it; a failure is ignored)."""
    if not enabled():
        return
    base = os.path.join(directory(), k)
    entry = json.dumps({"key": k, "vocab_size": vocab_size, "eos_id": eos_id, "eos_token": eos_token,
                        "eos_how": eos_how, "hash": hash_}, sort_keys=True)
    try:
        for suffix, text in ((".payload", payload), (".json", entry)):
            files.write(files.local(), base + suffix, text.encode("utf-8"))
    except OSError:
        pass
