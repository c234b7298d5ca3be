"""The report page of the sample cache in a real browser: headless Chromium (Debian's ``chromium``) loads it
without errors or requests beyond the file itself, shows the document count, and is screenshotted.

CI (``CI`` set) must have Chromium (``.ci/run`` installs it): there the test fails instead of skipping.
"""

import json
import os
import subprocess
import sys

import pytest

import chromium
from build_helpers import REPO

PNG = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.slow  # a real browser: make test (and CI) only


@pytest.fixture(scope="module")
def browser():
    if chromium.find() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; CI must have it: .ci/run installs Debian's chromium "
                        "(apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI runs this test")
    return chromium


@pytest.fixture(scope="module")
def sample_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("sample")
    cache = str(d / "sample-cache")
    subprocess.run([sys.executable, "-m", "pipelines.demo", "--output", cache, "--show", "0"], cwd=REPO, check=True,
                   capture_output=True, timeout=600)
    out = str(d / "report")
    subprocess.run([sys.executable, "-m", "reader", "report", cache, "--out", out, "--seq_len", "256", "--batch_size",
                    "8", "--steps", "50", "--shuffle_seed", "0"], cwd=REPO, check=True, capture_output=True,
                   timeout=600)
    with open(os.path.join(cache, "ledger.json")) as f:
        return os.path.join(out, "index.html"), json.load(f)


def test_the_sample_report_loads_in_chromium_without_errors(browser, sample_report, tmp_path):
    page_path, ledger = sample_report
    got = browser.load("file://" + page_path, {
        "documents": "document.getElementById('documents').textContent",
        "images": "Array.from(document.images).map(i => i.complete && i.naturalWidth > 0)",
        "title": "document.title",
        "batches": "document.querySelectorAll('div.row').length",
    }, timeout_s=120)
    assert got.errors == []
    assert got.requests and got.requests[0] == "file://" + page_path
    assert all(u.startswith("data:image/png;base64,") for u in got.requests[1:]), got.requests  # nothing fetched
    assert got.values["documents"] == f"{ledger['totals']['docs']:,}" == "382"
    assert got.values["images"] == [True] * 4  # lengths, shards, chunk sizes, shuffle locality: all decoded
    assert got.values["title"].startswith("chunkledger report: ") and got.values["batches"] == 8
    assert got.screenshot[:8] == PNG and len(got.screenshot) > 10_000
    (tmp_path / "report.png").write_bytes(got.screenshot)


def test_a_page_with_a_broken_image_is_caught(browser, tmp_path):
    """The check above would see a failure: a page whose image does not decode, and one that logs an error."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!doctype html><html><body><img src='data:image/png;base64,AAAA' id='i'>"
                   "<img src='missing.png'><script>console.error('boom')</script></body></html>")
    got = browser.load(bad.as_uri(), {"ok": "document.getElementById('i').naturalWidth > 0"}, timeout_s=120)
    assert got.values["ok"] is False
    assert any("boom" in e for e in got.errors) and any("request failed" in e or "missing.png" in e
                                                       for e in got.errors), got.errors


def test_the_readme_screenshot_is_kept_small():
    with open(os.path.join(REPO, "docs", "report-sample.png"), "rb") as f:
        data = f.read()
    assert data[:8] == PNG and len(data) < 300_000
