"""The tokenizer identity that ``--tokenizer_from CACHE_OR_JSON`` names: read from a cache's ledger, a JSON file
holding an identity, or a flat-tokens export's recorded attributes (the importers' way to take a tokenizer
without the tokenizer libraries)."""

from __future__ import annotations

import os
from typing import Any, Mapping

from reader.format import spec as fmt
from reader.format.tokenizer_id import MAKE_ONE, TokenizerIdError, check
from reader.storage import files, remote
from reader.storage.cache import Cache
from reader.storage.whatis import NotACache


def _is_json_file(url: str) -> bool:
    if url.endswith(".json"):
        return True
    return remote.protocol_of(url) == "file" and os.path.isfile(os.path.expanduser(url.split("://", 1)[-1]))


def _read_json_file(url: str) -> Any:
    fs, path, anonymous = remote.filesystem(url)
    try:
        text = files.FsspecStorage(fs).read(path, limit=files.MAX_SMALL_FILE_BYTES)
    except files.UnsafeFile as e:
        raise TokenizerIdError(f"{url}: {e.what}") from None
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise TokenizerIdError(f"{url}: no such file. --tokenizer_from takes a cache (the directory holding "
                               f"{fmt.LEDGER_NAME}) or a JSON file holding a tokenizer identity ({MAKE_ONE})") from None
    except Exception as e:
        if remote.is_storage_error(e):
            raise remote.storage_error(url, e, anonymous=anonymous) from e
        raise
    try:
        return fmt.load_json(text)
    except ValueError as e:
        raise TokenizerIdError(f"{url}: not valid JSON ({e}); give a tokenizer identity as {MAKE_ONE} writes "
                               f"it, or a cache") from None


def _exported_identity(url: str) -> dict[str, Any] | None:
    """The identity a flat-tokens export records in its root attributes (``.zattrs``: ``chunkledger.tokenizer``,
    plain JSON, so no zarr is needed), or None if ``url`` holds no such file."""
    fs, path, _ = remote.filesystem(url)
    where = path.rstrip("/") + "/.zattrs"
    try:
        raw = fmt.load_json(files.FsspecStorage(fs).read(where, limit=files.MAX_SMALL_FILE_BYTES))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError, files.UnsafeFile):
        return None
    except Exception as e:  # noqa: BLE001 - a storage error: the cache path below reports it properly
        if remote.is_storage_error(e):
            return None
        raise
    ident = raw.get("chunkledger", {}).get("tokenizer") if isinstance(raw, Mapping) else None
    if not isinstance(ident, Mapping):
        return None
    return check(ident, f"{url.rstrip('/')}/.zattrs: chunkledger.tokenizer")


def load(url: str) -> dict[str, Any]:
    """The tokenizer identity at ``url`` (local path or fsspec URL), checked (:func:`check`).

    ``url`` is a cache root (its ledger's ``tokenizer``; a split build's ``train`` or ``validation``
    directory is a cache root too), or a JSON file holding an identity object, or an object whose
    ``tokenizer`` key holds one (a ``ledger.json``, ``python -m reader inspect --json`` output), or a
    flat-tokens dataset that ``python -m reader export-flat-tokens`` wrote (its recorded identity). A
    :class:`TokenizerIdError` (or a storage error) names ``url`` and what to pass instead.
    """
    url = os.fspath(url)
    if _is_json_file(url):
        raw = _read_json_file(url)
        if isinstance(raw, Mapping) and isinstance(raw.get("tokenizer"), Mapping) and "hash" not in raw:
            return check(raw["tokenizer"], f"{url}: tokenizer")
        return check(raw, url)
    exported = _exported_identity(url)
    if exported is not None:
        return exported
    try:
        cache = Cache(url)
    except NotACache as e:
        raise TokenizerIdError(f"{e}; or give a JSON file holding a tokenizer identity ({MAKE_ONE})") from None
    return check(cache.ledger.tokenizer, f"{cache.display(fmt.LEDGER_NAME)}: tokenizer")
