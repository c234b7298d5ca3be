"""Where a Hugging Face tokenizer's files come from: a local file or directory, any fsspec URL, or the hub.

Part of resolving a tokenizer spec (:mod:`reader.tokenizers.tokenizer_lib`, the one module that loads a tokenizer
library); this one only finds ``tokenizer.json`` and ``tokenizer_config.json`` and returns their text. Hub
names are fetched with ``huggingface_hub`` (imported lazily; never ``transformers``), and only if the hub
answers within :data:`HUB_PROBE_S`: offline, only the local hub cache is used, so a machine without network
fails at once rather than after the library's retries.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from typing import Any, Callable, Mapping
from urllib.parse import urlparse

from reader.storage import files

HUB_PROBE_S = 3.0  # how long the hub may take to accept a connection before the machine counts as offline
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
FORMS = ("tiktoken:NAME, a tokenizer.json file or a directory holding one (local or gs://...), or a Hugging "
         "Face hub name ORG/NAME")


class TokenizerError(ValueError):
    """A tokenizer spec cannot be resolved, or a token or id is not the tokenizer's; the message says what to give."""


class NoTokenizerJson(TokenizerError):
    """A directory or hub repository without ``tokenizer.json`` (the builder may still load it with transformers)."""


def eos_from_config(text: str | None) -> str | None:
    """The ``eos_token`` of a tokenizer_config.json text (a string, or a dict with ``content``)."""
    if not text:
        return None
    try:
        eos = json.loads(text).get("eos_token")
    except (ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) and eos else None


def local_files(path: str) -> tuple[str, str | None]:
    """The text of a local tokenizer.json (the file, or in the directory) and of the config beside it."""
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise NoTokenizerJson(f"tokenizer {os.path.dirname(path)!r}: the directory holds no {TOKENIZER_FILE}")
    config = os.path.join(os.path.dirname(path), CONFIG_FILE)

    def text(p: str) -> str:
        return files.read_local(p).decode("utf-8", errors="replace")

    return text(path), text(config) if os.path.isfile(config) else None


def fsspec_reader(storage_options: Mapping[str, Any] | None) -> Callable[[str], bytes | None]:
    def read(url: str) -> bytes | None:
        try:
            return files.read_url(url, storage_options)
        except FileNotFoundError:
            return None

    return read


def url_files(spec: str, read: Callable[[str], bytes | None]) -> tuple[str, str | None]:
    """A remote ``tokenizer.json`` file, or a remote directory holding one (and maybe tokenizer_config.json)."""
    is_file = spec.endswith(".json")
    base = spec.rsplit("/", 1)[0] if is_file else spec.rstrip("/")
    data = read(spec if is_file else base + "/" + TOKENIZER_FILE)
    if data is None:
        raise TokenizerError(f"tokenizer {spec!r}: no {TOKENIZER_FILE} there; give a remote {TOKENIZER_FILE} file or "
                             "a directory holding one")
    config = read(base + "/" + CONFIG_FILE)
    return data.decode("utf-8"), None if config is None else config.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------------------
# The Hugging Face hub


def hub_reachable(timeout_s: float = HUB_PROBE_S) -> bool:
    """Whether the hub (or the HTTPS proxy in the environment) accepts a connection within ``timeout_s``;
    False at once with ``HF_HUB_OFFLINE``. The probe runs on a thread, since a name lookup has no timeout."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy if proxy else constants.ENDPOINT)
    address = (url.hostname or "", url.port or (443 if url.scheme == "https" else 80))
    answered: list[bool] = []

    def probe():
        try:
            socket.create_connection(address, timeout=timeout_s).close()
            answered.append(True)
        except OSError:
            answered.append(False)

    t = threading.Thread(target=probe, name="hub-probe", daemon=True)
    t.start()
    t.join(timeout_s)
    return bool(answered and answered[0])


def hub_local_only(repo: str) -> bool:
    """True if the hub is not reachable and the local hub cache holds ``repo``'s tokenizer files (use only those).

    Raises:
        TokenizerError: the hub is not reachable and nothing of ``repo`` is in the local hub cache.
    """
    if hub_reachable():
        return False
    from huggingface_hub import try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(repo, f), str) for f in (TOKENIZER_FILE, CONFIG_FILE)):
        return True
    raise TokenizerError(f"tokenizer {repo!r}: the Hugging Face hub is not reachable from here and the local hub "
                         f"cache has no {repo}. Download the tokenizer where there is network and give its "
                         f"directory, or check the name. A tokenizer is {FORMS}.")


def hub_files(repo: str) -> tuple[str, str | None]:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

    local_only = hub_local_only(repo)

    def fetch(name: str) -> str | None:
        try:
            path = hf_hub_download(repo, name, local_files_only=local_only)
        except EntryNotFoundError:  # also: not in the local hub cache
            return None
        except RepositoryNotFoundError as e:
            raise TokenizerError(f"tokenizer {repo!r}: no such Hugging Face hub repository (or it is gated: log in "
                                 f"with `hf auth login`). A tokenizer is {FORMS}.") from e
        except Exception as e:  # noqa: BLE001 - the hub's HTTP errors, a full disk: one line naming them
            raise TokenizerError(f"tokenizer {repo!r}: cannot fetch {name} from the Hugging Face hub "
                                 f"({type(e).__name__}: {e})") from e
        return files.read_local(path).decode("utf-8", errors="replace")  # the hub cache's symlink followed

    text = fetch(TOKENIZER_FILE)
    if text is None:
        raise NoTokenizerJson(f"tokenizer {repo!r}: the hub repository has no {TOKENIZER_FILE}"
                              + (" in the local hub cache (the hub is not reachable)" if local_only else ""))
    return text, fetch(CONFIG_FILE)
