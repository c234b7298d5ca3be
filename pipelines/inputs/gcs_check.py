"""Cloud Storage before the job: a quick, bounded access check, and the CRC32C of each gs:// input.

Beam's GCS client retries a failing call for up to two minutes (and, without credentials, first spends
seconds looking for them), so a typo in a bucket name or a machine without network or credentials would
take minutes to fail. :func:`check_access` asks once per bucket with a short timeout and a bounded retry
(at most :data:`CHECK_SECONDS` per bucket) and fails with the cause and the fix.

Cloud Storage keeps a CRC32C of every object; the launcher records it in the ledger (``inputs[].crc32c``)
so that a rerun knows without reading a byte whether an input still holds the same content.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Iterable

from pipelines.errors import EnvironmentFault

LOG = logging.getLogger("chunkledger.build")

REQUEST_SECONDS = 5.0  # one HTTP request
CHECK_SECONDS = 10.0  # one bucket's check, retries included
CREDENTIALS_HINT = ("Set up credentials (gcloud auth application-default login, or GOOGLE_APPLICATION_CREDENTIALS="
                    "key.json) and check the network, then rerun the same command.")
_GLOB = re.compile(r"[*?\[]")


def split_url(url: str) -> tuple[str, str]:
    """``gs://bucket/key`` -> ``(bucket, key)``."""
    rest = url[len("gs://"):]
    bucket, _, key = rest.partition("/")
    return bucket, key


def _client():
    """A storage client with the default credentials, or anonymous (and why) when there are none."""
    try:
        from google.cloud import storage
    except ImportError as e:
        raise EnvironmentFault("gs:// paths need Beam's GCP extra: pip install 'chunkledger[dataflow]' "
                               "(apache-beam[gcp])") from e
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        credentials, project = google.auth.default()
        return storage.Client(credentials=credentials, project=project or "-"), None
    except DefaultCredentialsError:
        return storage.Client.create_anonymous_client(), "no Google Cloud credentials were found"


def _retry():
    from google.api_core.retry import Retry

    return Retry(initial=0.5, maximum=2.0, multiplier=2.0, timeout=CHECK_SECONDS)


def _short(e: BaseException) -> str:
    text = str(e)
    cause = getattr(e, "cause", None) or getattr(e, "last_exc", None)
    if cause is not None:
        text = f"{text.split(',')[0]}; last error: {cause}"
    text = " ".join(text.split())
    return text[:300] + ("..." if len(text) > 300 else "")


def check_access(urls: Iterable[str]) -> None:
    """Fail fast (EnvironmentFault naming the bucket, the cause and the fix) unless every bucket answers.

    Each bucket is asked for one object listing, with a :data:`REQUEST_SECONDS` timeout per request and
    retries for at most :data:`CHECK_SECONDS`.
    """
    buckets = sorted({split_url(u)[0] for u in urls if u.startswith("gs://")})
    if not buckets:
        return
    client, anonymous = _client()
    from google.api_core import exceptions as gexc

    for bucket in buckets:
        t0 = time.time()
        try:
            list(client.list_blobs(bucket, max_results=1, timeout=REQUEST_SECONDS, retry=_retry()))
        except gexc.NotFound as e:
            raise EnvironmentFault(f"gs://{bucket}: the bucket does not exist (or is not visible to these "
                                   f"credentials): {_short(e)}") from e
        except (gexc.Forbidden, gexc.Unauthorized) as e:
            who = anonymous or "the credentials in use"
            raise EnvironmentFault(f"gs://{bucket}: access denied ({who}): {_short(e)}. "
                                   f"{CREDENTIALS_HINT}") from e
        except Exception as e:  # noqa: BLE001 - RetryError, connection errors: all mean "not reachable"
            why = f"; {anonymous}" if anonymous else ""
            raise EnvironmentFault(
                f"gs://{bucket}: Cloud Storage did not answer within {time.time() - t0:.1f}s (requests of at most "
                f"{REQUEST_SECONDS:.0f}s, retried for at most {CHECK_SECONDS:.0f}s{why}): {_short(e)}. "
                f"{CREDENTIALS_HINT}") from e


def objects_of(paths: Iterable[str], patterns: Iterable[str]) -> dict[str, dict[str, object]]:
    """``{"size", "generation", "crc32c"}`` of each gs:// path (what Cloud Storage says of the object: any write
    makes a new generation), listed once per pattern's literal prefix; only the paths asked for are kept."""
    wanted = {p for p in paths if p.startswith("gs://")}
    if not wanted:
        return {}
    client, _ = _client()
    out: dict[str, dict[str, object]] = {}
    prefixes = set()
    for pat in patterns:
        if pat.startswith("gs://"):
            bucket, key = split_url(pat)
            m = _GLOB.search(key)
            prefixes.add((bucket, key[:m.start()] if m else key))
    for bucket, prefix in sorted(prefixes):
        for blob in client.list_blobs(bucket, prefix=prefix, timeout=REQUEST_SECONDS * 6, retry=_retry()):
            url = f"gs://{bucket}/{blob.name}"
            if url in wanted:
                out[url] = {"size": blob.size, "generation": blob.generation, "crc32c": blob.crc32c}
    return out


def crc32c_of(paths: Iterable[str], patterns: Iterable[str],
              objects: dict[str, dict[str, object]] | None = None) -> dict[str, str]:
    """Cloud Storage's CRC32C (base64) of each gs:// path (from ``objects``, :func:`objects_of`, if given)."""
    wanted = {p for p in paths if p.startswith("gs://")}
    if not wanted:
        return {}
    objects = objects_of(wanted, patterns) if objects is None else objects
    out = {url: str(o["crc32c"]) for url, o in objects.items() if url in wanted and o.get("crc32c")}
    missing = wanted - set(out)
    if missing:
        LOG.warning("no CRC32C for %d gs:// input(s) (e.g. %s): a rerun reads them again to check them",
                    len(missing), sorted(missing)[0])
    return out
