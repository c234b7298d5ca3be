"""What a path is when it is not a cache, and what to pass instead: the message of :class:`NotACache`.

``Reader(path)``, ``python -m reader inspect path`` and the other commands take a cache root: the
``--output`` directory of a build, holding ``ledger.json``. Given anything else (a typo, an empty
directory, an input shard, a chunk file, the top directory of a split build, a Megatron or flat-tokens
dataset), the error says what the path is and what to pass. The look-around happens only on this
error path (a few listings), never when a cache opens.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import fsspec

from reader.format import spec as fmt
from reader.format.splits import SPLIT_NAMES, SPLITS_MANIFEST_NAME

SPLITS = SPLIT_NAMES
BUILD = "python -m pipelines.build_cache --input 'SHARDS' --output CACHE --tokenizer SPEC"
IMPORT = ("python -m reader {0} --tokenizer_from CACHE_OR_JSON --out CACHE, or python -m pipelines.interop {0} "
          "--tokenizer SPEC --out CACHE")
_IN_CACHE = re.compile(r"(.*?)/?" + fmt.CHUNKS_DIR + r"(/shard-\d{5}(/chunk-\d{6}\.(parquet|json)|/_DONE\.json)?)?$")
_JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd", ".json.gz", ".ndjson")
_MAX_LOOKS = 32  # sub-directories looked into for a ledger (each is one request on an object store)


class NotACache(FileNotFoundError):
    """The path given as a cache holds no ``ledger.json``; the message says what it is and what to pass."""


def _join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def _parent(p: str) -> str:
    p = p.rstrip("/")
    return p.rsplit("/", 1)[0] if "/" in p else ""


def _name(p: str) -> str:
    return p.rstrip("/").rsplit("/", 1)[-1]


def _info(fs, path: str) -> dict[str, Any] | None:
    try:
        return fs.info(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _is_cache(fs, path: str) -> bool:
    try:
        return bool(fs.exists(_join(path, fmt.LEDGER_NAME)))
    except OSError:
        return False


def _listing(fs, path: str) -> list[dict[str, Any]]:
    try:
        return list(fs.ls(path, detail=True))
    except (FileNotFoundError, NotADirectoryError):
        return []


def describe(fs, root: str, url: str) -> str:
    """Why ``url`` (``root`` on ``fs``) is not a cache root, and what to pass instead (one or two sentences)."""
    try:
        return _describe(fs, root, url)
    except Exception:  # noqa: BLE001 - looking around failed (storage errors): say the essential
        return f"{url}: not a chunkledger cache (no {fmt.LEDGER_NAME} here). Pass the --output directory of a build"


def _describe(fs, root: str, url: str) -> str:
    head = f"{url}: not a chunkledger cache (no {fmt.LEDGER_NAME} here)"
    info = _info(fs, root)
    if info is None:
        return _missing(fs, root, url)
    if info.get("type") != "directory":
        return f"{url}: not a chunkledger cache (a cache is a directory): {_file(fs, root, url)}"
    return f"{head}: {_directory(fs, root, url)}"


def not_a_cache(fs, root: str, url: str) -> NotACache:
    return NotACache(describe(fs, root, url))


def _up_to_cache(fs, root: str, url: str) -> str | None:
    """The cache root that ``root`` lies inside (its chunks/ tree), as the user would type it."""
    m = _IN_CACHE.match(root.rstrip("/"))
    if not m:
        return None
    cut = len(root.rstrip("/")) - len(m.group(1))
    top = url.rstrip("/")[:len(url.rstrip("/")) - cut] if cut else url.rstrip("/")
    return top if _is_cache(fs, m.group(1)) else None


def _missing(fs, root: str, url: str) -> str:
    protocol = fsspec.core.split_protocol(url)[0]
    if protocol not in (None, "file", "local"):  # an object store: is the bucket there?
        bucket = root.strip("/").split("/", 1)[0]
        if _info(fs, bucket) is None:
            return (f"{url}: the bucket {protocol}://{bucket} does not exist (check its name; or these credentials "
                    "cannot see it)")
    parent = _parent(root)
    if parent and _info(fs, parent) is None:
        return f"{url}: does not exist (nor does its directory {_parent(url.rstrip('/')) or parent})"
    names = [_name(e["name"]) for e in _listing(fs, parent or ".") if e.get("type") == "directory"]
    near = difflib.get_close_matches(_name(root), names, n=3, cutoff=0.6)
    if near:
        shown = ", ".join(_join(_parent(url.rstrip("/")), n) if _parent(url.rstrip("/")) else n for n in near)
        return f"{url}: does not exist. Did you mean {shown}?"
    return f"{url}: does not exist. Pass the --output directory of a build (it holds {fmt.LEDGER_NAME})"


def _file(fs, root: str, url: str) -> str:
    name = _name(root)
    if name == fmt.LEDGER_NAME:
        return f"this is the ledger file itself; pass its directory {_parent(url.rstrip('/'))}"
    if name == SPLITS_MANIFEST_NAME:
        return f"this is the manifest of a split build; {_use_splits(_parent(url.rstrip('/')))}"
    inside = _up_to_cache(fs, root, url)
    if inside:
        return f"this is a file of the cache {inside}; pass {inside}"
    if name.endswith(_JSONL):
        return (f"this is a jsonl file (an input shard?). Build a cache from it ({BUILD.replace('SHARDS', url)}) "
                "and pass CACHE")
    if name.endswith((".bin", ".idx")):
        return (f"this is half of a Megatron dataset. Import it ({IMPORT.format('import-megatron PREFIX')}) and "
                "pass CACHE")
    if name.endswith(".parquet"):
        return ("this is a Parquet file, not a cache root. Pass the directory a build wrote (it holds "
                f"{fmt.LEDGER_NAME} and {fmt.CHUNKS_DIR}/)")
    return f"this is a file; pass the directory a build wrote (it holds {fmt.LEDGER_NAME} and {fmt.CHUNKS_DIR}/)"


def _use_splits(url: str) -> str:
    return f"use {' or '.join(_join(url, s) for s in SPLITS)}, each a complete cache"


def _directory(fs, root: str, url: str) -> str:
    inside = _up_to_cache(fs, root, url)
    if inside:
        return f"this directory is inside the cache {inside}; pass {inside}"
    entries = _listing(fs, root)
    names = sorted(_name(e["name"]) for e in entries)
    dirs = sorted(_name(e["name"]) for e in entries if e.get("type") == "directory")
    if not names:
        return (f"the directory is empty. Pass the --output directory of a build ({BUILD}); it holds "
                f"{fmt.LEDGER_NAME}")
    if SPLITS_MANIFEST_NAME in names:
        return f"it is a split build (its {SPLITS_MANIFEST_NAME} names two caches); {_use_splits(url)}"
    splits = [s for s in SPLITS if s in dirs and _is_cache(fs, _join(root, s))]
    if splits:
        return (f"it holds the {' and '.join(splits)} caches of a split build; pass "
                + " or ".join(_join(url, s) for s in splits))
    caches = [d for d in dirs[:_MAX_LOOKS] if _is_cache(fs, _join(root, d))]
    if caches:
        more = f" (and {len(caches) - 5} more)" if len(caches) > 5 else ""
        return f"it holds caches; pass one of {', '.join(_join(url, d) for d in caches[:5])}{more}"
    if fmt.CHUNKS_DIR in dirs:
        return (f"it holds {fmt.CHUNKS_DIR}/ but no {fmt.LEDGER_NAME}: the ledger was deleted or never written. "
                "Rerun the build command that wrote here (it resumes and rewrites the ledger)")
    if ".zgroup" in names or "zarr.json" in names:
        return (f"this is a zarr group (a flat-tokens dataset?). Import it "
                f"({IMPORT.format('import-flat-tokens ' + url)}) and pass CACHE")
    if any(n.endswith(_JSONL) for n in names):
        shards = _join(url, "*.jsonl*")
        return (f"it holds jsonl files (input shards?). Build a cache from them ({BUILD.replace('SHARDS', shards)}) "
                "and pass CACHE")
    if any(n.endswith(".idx") for n in names) and any(n.endswith(".bin") for n in names):
        return (f"it holds Megatron .bin/.idx files. Import them ({IMPORT.format('import-megatron PREFIX')}) and "
                "pass CACHE")
    shown = ", ".join(names[:6]) + (f", ... ({len(names)} entries)" if len(names) > 6 else "")
    return f"it holds {shown}. Pass the --output directory of a build (it holds {fmt.LEDGER_NAME})"
