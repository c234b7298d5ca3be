"""Load a page in headless Chromium (Debian's ``chromium``) and report what happened: console errors, uncaught
exceptions, failed or non-local requests, values read from the DOM, and a screenshot.

It speaks the Chrome DevTools Protocol over ``--remote-debugging-pipe`` (NUL-separated JSON on file descriptors 3
and 4): no port, no extra library. Every wait has a deadline; the browser runs in its own process group with
a fresh profile directory, and both are removed when :func:`load` returns or fails.
"""

from __future__ import annotations

import base64
import dataclasses
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

# Without these, Chromium phones home at start-up (refused on a closed network) and as root needs --no-sandbox.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--hide-scrollbars", "--mute-audio", "--remote-debugging-pipe")


def find() -> str | None:
    """The chromium executable, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclasses.dataclass
class PageLoad:
    errors: list[str]  # console errors, uncaught exceptions, failed requests
    requests: list[str]  # every URL the page asked for
    values: dict[str, Any]  # the expressions evaluated after the load event, by name
    screenshot: bytes  # PNG


class _Pipe:
    def __init__(self, write_fd: int, read_fd: int, deadline: float):
        self.w, self.r, self.deadline, self.buf, self.next_id = write_fd, read_fd, deadline, b"", 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        return self.next_id

    def receive(self) -> dict:
        while b"\0" not in self.buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer in time")
            ready, _, _ = select.select([self.r], [], [], left)
            if ready:
                data = os.read(self.r, 1 << 20)
                if not data:
                    raise EOFError("chromium closed its DevTools pipe")
                self.buf += data
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        want = self.send(method, params, session)
        while True:
            msg = self.receive()
            if msg.get("id") == want:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def until(self, method: str) -> None:
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self.receive())


def load(url: str, expressions: dict[str, str] | None = None, *, width: int = 1200, height: int = 900,
         full_page: bool = False, timeout_s: float = 60.0) -> PageLoad:
    """Open ``url``, wait for its load event, evaluate ``expressions`` (name -> JavaScript) and screenshot it
    (the viewport, or with ``full_page`` up to 4 viewports of the page)."""
    exe = find()
    if exe is None:
        raise FileNotFoundError("chromium is not installed (apt-get install -y chromium)")
    profile = tempfile.mkdtemp(prefix="chunkledger-chromium-")
    to_browser, from_us = os.pipe()
    to_us, from_browser = os.pipe()

    def fds():  # the child's fd 3 reads our commands, fd 4 writes its answers
        a = fcntl.fcntl(to_browser, fcntl.F_DUPFD_CLOEXEC, 10)  # out of the way of 3 and 4 first
        b = fcntl.fcntl(from_browser, fcntl.F_DUPFD_CLOEXEC, 10)
        os.dup2(a, 3)  # dup2 leaves 3 and 4 inheritable; every other descriptor of ours closes at exec
        os.dup2(b, 4)

    # close_fds=False: subprocess would close 3 and 4 after fds() ran; Python's own descriptors are
    # non-inheritable (PEP 446), so nothing else leaks into the browser
    proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                             "about:blank"], close_fds=False, preexec_fn=fds, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    os.close(to_browser)
    os.close(from_browser)
    pipe = _Pipe(from_us, to_us, time.monotonic() + timeout_s)
    try:
        target = pipe.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            pipe.call(f"{domain}.enable", session=session)
        pipe.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False}, session=session)
        pipe.call("Page.navigate", {"url": url}, session=session)
        pipe.until("Page.loadEventFired")
        values = {name: pipe.call("Runtime.evaluate", {"expression": js, "returnByValue": True},
                                  session=session)["result"].get("value")
                  for name, js in (expressions or {}).items()}
        clip = None
        if full_page:
            size = pipe.call("Page.getLayoutMetrics", session=session)["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": width, "height": min(size["height"], 4 * height), "scale": 1}
        shot = pipe.call("Page.captureScreenshot", {"format": "png", **({"clip": clip} if clip else {}),
                                                    "captureBeyondViewport": bool(clip)}, session=session)
        errors, requests = _problems(pipe.events)
        return PageLoad(errors=errors, requests=requests, values=values, screenshot=base64.b64decode(shot["data"]))
    finally:
        try:
            pipe.send("Browser.close")
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        os.close(from_us)
        os.close(to_us)
        shutil.rmtree(profile, ignore_errors=True)


def _problems(events: list[dict]) -> tuple[list[str], list[str]]:
    errors, requests = [], []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.exceptionThrown":
            errors.append(f"exception: {p['exceptionDetails'].get('text')}")
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
        elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
            errors.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}".strip())
        elif m == "Network.loadingFailed":
            errors.append(f"request failed: {p.get('errorText')} ({p.get('requestId')})")
        elif m == "Network.requestWillBeSent":
            requests.append(p["request"]["url"])
    return errors, requests
