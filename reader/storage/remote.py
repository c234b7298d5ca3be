"""Opening a remote cache (``gs://`` and other fsspec URLs) fast, or failing fast with the cause named.

Left to itself, gcsfs without credentials spends ~20 s probing for them (the GCE metadata server, twice)
and then ~30 s retrying a request the network cannot carry, and ends in a long traceback. Opening a
cache here takes a bounded time (at most ``CONNECT_TIMEOUT_S`` to resolve and connect, then
``OPEN_TIMEOUT_S`` for the first request) and fails with a :class:`StorageError` of one or two lines
that names the URL and the cause: no network, no credentials, no such bucket, no permission, or no
answer in time. Reads after a successful open keep gcsfs's own retries (a training run rides out
transient errors); an error that survives them is a :class:`StorageError` naming the file too.

Credentials for ``gs://`` are looked for the way Google's libraries do, without their slow probes:
``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's application-default credentials, gcsfs's token cache, a
Google Cloud VM or runtime (the metadata server, asked once with a short timeout). With none of those
and no ``token`` in ``storage_options``, the cache is opened anonymously (public buckets read fine), and
a refused request says that no credentials were found.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import os
import socket
import time
import urllib.parse
import urllib.request
from typing import Any, Mapping

import fsspec

from reader.storage.files import GCS_PROTOCOLS

CONNECT_TIMEOUT_S = 3.0  # resolving and connecting to the storage endpoint
OPEN_TIMEOUT_S = 10.0  # the first request (the ledger's metadata), retries included
METADATA_TIMEOUT_S = 1.0  # asking the GCE metadata server whether this is a Google Cloud machine
_FIX_CREDENTIALS = ("run `gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS to a "
                    "service-account key file, or pass storage_options={'token': ...}")


class StorageError(OSError):
    """A remote cache cannot be reached or read; the message names the URL, the cause and the fix."""


class ReaderStalled(TimeoutError):
    """A reader (a worker process, or a thread of this one) held work for ``worker_timeout_s`` without
    any progress: stopped, or stuck on a storage read (a range request not answered in that long)."""


def protocol_of(url: str) -> str:
    return fsspec.core.split_protocol(url)[0] or "file"


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str, bool]:
    """``(fs, path, anonymous)`` for ``url``: for ``gs://`` without a ``token`` option and without any
    credentials found, an anonymous filesystem (``anonymous`` True) instead of gcsfs's slow probing."""
    opts = dict(storage_options or {})
    anonymous = False
    if protocol_of(url) in GCS_PROTOCOLS and "token" not in opts:
        if not _gcs_credentials_available(url):
            opts["token"] = "anon"
            anonymous = True
    try:
        fs, path = fsspec.core.url_to_fs(url, **opts)
    except ImportError as e:
        raise StorageError(f"{url}: cannot open this kind of URL: {e}") from None
    return fs, path, anonymous or opts.get("token") == "anon"


def _gcs_credentials_available(url: str) -> bool:
    """Whether Google credentials exist here, decided in at most ``METADATA_TIMEOUT_S``."""
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key:
        if not os.path.exists(key):
            raise StorageError(f"{url}: GOOGLE_APPLICATION_CREDENTIALS={key} names no file; point it to a "
                               "service-account key file, or unset it")
        return True
    config = os.environ.get("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    if os.path.exists(os.path.join(config, "application_default_credentials.json")):
        return True
    if os.path.exists(os.path.join(os.path.expanduser("~"), ".gcs_tokens")):
        return True
    if any(os.environ.get(k) for k in ("GCE_METADATA_HOST", "GCE_METADATA_IP", "K_SERVICE", "CLOUD_RUN_JOB")):
        return True
    try:
        with open("/sys/class/dmi/id/product_name") as f:
            if "Google" in f.read():
                return True
    except OSError:
        pass
    return _on_google_cloud()


@functools.lru_cache(maxsize=1)
def _on_google_cloud() -> bool:
    """Whether the GCE metadata server answers (asked once per process: a machine does not move)."""
    req = urllib.request.Request("http://169.254.169.254/computeMetadata/v1/", headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=METADATA_TIMEOUT_S) as r:
            return r.headers.get("Metadata-Flavor") == "Google"
    except Exception:  # noqa: BLE001 - any failure means: not a Google Cloud machine
        return False


def _endpoint(fs) -> tuple[str, int] | None:
    loc = getattr(fs, "_location", None)
    if not isinstance(loc, str) or "://" not in loc:
        return None
    u = urllib.parse.urlsplit(loc)
    return u.hostname or "", u.port or (443 if u.scheme == "https" else 80)


def _connect(host: str, port: int) -> None:
    socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()


def check_open(fs, url: str, first: str, shown: str, *, anonymous: bool) -> None:
    """Bounded first contact with a remote cache: the endpoint answers, and the metadata of ``first``
    (the ledger) can be read or is absent. Raises :class:`StorageError` naming ``shown`` (the ledger's
    URL) and the cause otherwise; a missing ledger is left to the caller (it says what the path is)."""
    t0 = time.monotonic()
    where = _endpoint(fs) if protocol_of(url) in GCS_PROTOCOLS else None
    if where is not None:
        host, port = where
        pool = cf.ThreadPoolExecutor(1, thread_name_prefix="chunkledger-connect")
        try:
            pool.submit(_connect, host, port).result(timeout=CONNECT_TIMEOUT_S + 1)
        except cf.TimeoutError:
            raise StorageError(f"{shown}: cannot reach {host}:{port} (no answer within {CONNECT_TIMEOUT_S:.0f} s): "
                               "no network, or a firewall/proxy in the way") from None
        except socket.gaierror as e:
            raise StorageError(f"{shown}: cannot resolve {host} ({e.strerror}): no network, or DNS is down") from None
        except OSError as e:
            raise StorageError(f"{shown}: cannot connect to {host}:{port} ({e.strerror or e}): no network, "
                               "or the storage endpoint is down") from None
        finally:
            pool.shutdown(wait=False)
    if not getattr(fs, "async_impl", False):
        return  # a synchronous filesystem takes no deadline; its own errors are classified later
    left = max(1.0, OPEN_TIMEOUT_S - (time.monotonic() - t0))
    try:
        fs.info(first, timeout=left)
    except FileNotFoundError:
        return
    except Exception as e:  # noqa: BLE001 - classified below
        raise storage_error(shown, e, anonymous=anonymous, waited=OPEN_TIMEOUT_S) from None


def is_storage_error(e: BaseException) -> bool:
    """An error of the storage layer (network, HTTP, credentials), as opposed to a damaged file."""
    mod = type(e).__module__.split(".")[0]
    if mod == "pyarrow" or isinstance(e, FileNotFoundError):
        return False  # pyarrow's IO errors are about the bytes it was given
    return isinstance(e, OSError) or mod in ("gcsfs", "aiohttp", "google", "requests", "botocore")


def storage_error(shown: str, e: BaseException, *, anonymous: bool = False, waited: float | None = None
                  ) -> StorageError:
    """A :class:`StorageError` naming ``shown`` and the cause of ``e`` (an exception from fsspec/gcsfs)."""
    if isinstance(e, (StorageError, ReaderStalled)):
        return e
    code = getattr(e, "code", None) or getattr(e, "status", None)
    text = " ".join(str(e).split())
    name = type(e).__name__
    if isinstance(e, TimeoutError) or name in ("FSTimeoutError", "ServerTimeoutError"):
        after = f"within {waited:.0f} s" if waited else "in time"
        return StorageError(f"{shown}: no answer {after} (retries included): the network is down or slow, or the "
                            "storage service keeps failing")
    if code == 401 or "401" in text.split(", ")[-1:]:
        if anonymous:
            return StorageError(f"{shown}: no credentials found, and the bucket refuses anonymous reads: "
                                f"{_FIX_CREDENTIALS}")
        return StorageError(f"{shown}: the credentials were refused (401: {text}); {_FIX_CREDENTIALS}")
    if code == 403 or text.startswith("Forbidden") or isinstance(e, PermissionError):
        detail = text.split(" ", 2)[-1] if text.startswith("Forbidden") else text
        return StorageError(f"{shown}: permission denied ({detail}); ask for read access to the bucket "
                            "(roles/storage.objectViewer) or use other credentials")
    if name in ("RefreshError", "DefaultCredentialsError", "TransportError"):
        return StorageError(f"{shown}: the credentials could not be used ({text}); {_FIX_CREDENTIALS}")
    if "DNS" in name or isinstance(e, socket.gaierror) or "Name or service not known" in text:
        return StorageError(f"{shown}: cannot resolve the storage host ({text}): no network, or DNS is down")
    if name.startswith("ClientConnector") or isinstance(e, ConnectionError):
        return StorageError(f"{shown}: cannot connect ({text}): no network, or the storage endpoint is down")
    if text.startswith("Bad Request"):
        return StorageError(f"{shown}: the storage service rejected the request ({text}); is the bucket name valid?")
    return StorageError(f"{shown}: cannot read ({name}: {text})")
