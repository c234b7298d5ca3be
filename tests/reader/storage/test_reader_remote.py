"""gs:// failures end in seconds with one message naming the URL and the cause (reader.storage.remote).

Against a real Cloud Storage emulator (tests/support/gcs_emulator.py): a bucket that does not exist, a typo'd
path, the emulator stopped (no network). Against endpoints that cannot answer: a host that does not
resolve, with no credentials anywhere; a local HTTP server answering as Cloud Storage does when
credentials are missing (401), insufficient (403) or the service is failing (503, which gcsfs retries:
the open gives up after ``OPEN_TIMEOUT_S``). The command line prints one or two lines, no traceback.
Every test is bounded by a timeout; none asserts how fast it ran.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

pytest.importorskip("gcsfs", reason="the gcs extra (gcsfs) is not installed")
pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (test extra) is not installed")

from gcs_emulator import GcsEmulator  # noqa: E402
from reader import NotACache, ReadOptions, Reader, StorageError  # noqa: E402
from reader.storage import remote  # noqa: E402

import cachegen  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    local = tmp_path_factory.mktemp("remote") / "cache"
    cachegen.write_synthetic_cache(str(local), cachegen.random_chunks(np.random.default_rng(2), 3, empty_prob=0.0))
    with GcsEmulator(bucket="b") as emu:
        for d, _, files in os.walk(local):
            for name in files:
                p = os.path.join(d, name)
                emu.upload(p, "caches/web/" + os.path.relpath(p, local))
        yield emu


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """No Google credentials on this machine's usual places (a Google Cloud VM would still have some)."""
    for k in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GCE_METADATA_HOST", "GCE_METADATA_IP",
              "K_SERVICE", "CLOUD_RUN_JOB"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    return dict(os.environ)


def test_the_emulator_cache_opens(emulator):
    with Reader(emulator.url("caches/web"), ReadOptions(seq_len=4, batch_size=2),
                storage_options=emulator.storage_options) as r:
        assert r.cache.complete and r.batch(0)["targets"].shape == (2, 4)


def test_a_bucket_that_does_not_exist(emulator):
    with pytest.raises(NotACache) as e:
        Reader("gs://no-such-bucket/caches/web", storage_options=emulator.storage_options)
    assert str(e.value) == ("gs://no-such-bucket/caches/web: the bucket gs://no-such-bucket does not exist (check "
                            "its name; or these credentials cannot see it)")


def test_a_typo_in_the_path(emulator):
    with pytest.raises(NotACache, match=r"^gs://b/caches/wbe: does not exist\. Did you mean gs://b/caches/web\?$"):
        Reader(emulator.url("caches/wbe"), storage_options=emulator.storage_options)


def test_the_emulator_stopped_is_no_network(emulator):
    with GcsEmulator(bucket="b") as emu:
        so, port = emu.storage_options, emu.port
        with pytest.raises(NotACache):  # reachable: an empty bucket
            Reader(emu.url("cache"), storage_options=so)
    with pytest.raises(StorageError) as e:
        Reader("gs://b/cache", storage_options=so)
    assert str(e.value).startswith(f"gs://b/cache/ledger.json: cannot connect to 127.0.0.1:{port} (")
    assert "no network, or the storage endpoint is down" in str(e.value)


def test_a_host_that_does_not_resolve_without_credentials(no_credentials):
    with pytest.raises(StorageError) as e:
        Reader("gs://b/cache", storage_options={"endpoint_url": "http://storage.nonexistent.invalid"})
    assert str(e.value).startswith("gs://b/cache/ledger.json: cannot resolve storage.nonexistent.invalid (")
    assert str(e.value).endswith("no network, or DNS is down")


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Answers every request as Cloud Storage answers an error (status and JSON error body)."""

    status = 401
    messages = {401: "Anonymous caller does not have storage.objects.get access to the Google Cloud Storage "
                     "object. Permission 'storage.objects.get' denied on resource (or it may not exist).",
                403: "alice@example.com does not have storage.objects.get access to the Google Cloud Storage "
                     "object.",
                503: "We encountered an internal error. Please try again."}

    def do_GET(self):
        body = json.dumps({"error": {"code": self.status, "message": self.messages[self.status]}}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing():
    servers = []

    def start(status: int) -> str:
        handler = type("Handler", (_Refusing,), {"status": status})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_port}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_no_credentials_and_a_private_bucket(refusing, no_credentials):
    so = {"endpoint_url": refusing(401)}
    with pytest.raises(StorageError) as e:
        Reader("gs://b/cache", storage_options=so)
    text = str(e.value)
    assert text.startswith("gs://b/cache/ledger.json: ")
    assert "gcloud auth application-default login" in text and "GOOGLE_APPLICATION_CREDENTIALS" in text
    if remote.filesystem("gs://b/cache", so)[2]:  # no credentials found (not on a Google Cloud VM)
        assert "no credentials found, and the bucket refuses anonymous reads" in text
    else:
        assert "the credentials were refused" in text


def test_permission_denied(refusing):
    with pytest.raises(StorageError) as e:
        Reader("gs://b/cache", storage_options={"endpoint_url": refusing(403), "token": "anon"})
    assert str(e.value).startswith("gs://b/cache/ledger.json: permission denied (alice@example.com does not have "
                                   "storage.objects.get access")


@pytest.mark.slow
def test_a_failing_service_is_given_up_on(refusing):
    with pytest.raises(StorageError) as e:
        Reader("gs://b/cache", storage_options={"endpoint_url": refusing(503), "token": "anon"})
    assert str(e.value) == (f"gs://b/cache/ledger.json: no answer within {remote.OPEN_TIMEOUT_S:.0f} s (retries "
                            "included): the network is down or slow, or the storage service keeps failing")


def _cli(args, env, timeout=60):
    env = dict(env, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "reader", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_without_credentials_fails_in_two_lines(no_credentials):
    """The tester's case: no credentials, gs:// at the default endpoint (no network here: it does not
    resolve; with a network: the bucket does not exist). Bounded by the subprocess timeout."""
    url = "gs://chunkledger-no-such-bucket-4242/cache"
    p = _cli(["inspect", url], no_credentials, timeout=45)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr and 1 <= len(lines) <= 2, p.stderr
    assert lines[0].startswith(f"error: {url}")


def test_cli_names_the_cause_against_the_emulator(emulator, no_credentials):
    env = dict(no_credentials, STORAGE_EMULATOR_HOST=emulator.endpoint)
    p = _cli(["validate", "gs://no-such-bucket/cache"], env)
    assert p.returncode == 2 and p.stderr == ("error: gs://no-such-bucket/cache: the bucket gs://no-such-bucket does "
                                              "not exist (check its name; or these credentials cannot see it)\n")
    p = _cli(["validate", emulator.url("caches/web")], env)
    assert p.returncode == 0 and p.stdout.startswith("OK: 3 chunks"), p.stderr
    env["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:9"  # nothing listens there (discard port): no network
    p = _cli(["export", emulator.url("caches/web"), "--format", "megatron", "--out", "/tmp/never-written"], env)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.startswith("error: gs://b/caches/web/ledger.json: cannot connect to 127.0.0.1:9 ("), p.stderr
    assert not os.path.exists("/tmp/never-written.bin")
