"""The README's picture of ``python -m reader report``: the sample cache's page in headless Chromium.

    python -m tools.report_screenshot [--out docs/report-sample.png] [--cache DIR]

Builds the sample corpus's cache (``python -m pipelines.demo``) in a temporary directory unless ``--cache`` names
one, writes its report with the options below (printed), loads the page in Chromium (Debian's ``chromium``,
through tests/support/chromium.py) and saves the top of the page as a PNG of at most 256 colours (Pillow,
matplotlib's own dependency), so the file stays small.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))

REPORT_OPTIONS = ["--seq_len", "256", "--batch_size", "8", "--steps", "50", "--shuffle_seed", "0", "--rows", "3"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "report-sample.png"))
    ap.add_argument("--cache", default=None, help="a built sample cache (default: build one)")
    ap.add_argument("--height", type=int, default=1500, help="pixels of the page to keep")
    args = ap.parse_args(argv)
    import chromium
    from PIL import Image

    out = os.path.abspath(args.out)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="report-shot-") as tmp:  # relative paths: the page names sample-cache
        cache = os.path.abspath(args.cache) if args.cache else "sample-cache"
        if args.cache is None:
            subprocess.run([sys.executable, "-m", "pipelines.demo", "--output", cache, "--show", "0"], cwd=tmp,
                           env=env, check=True, stdout=subprocess.DEVNULL, timeout=600)
        cmd = [sys.executable, "-m", "reader", "report", cache, "--out", "report", *REPORT_OPTIONS]
        print("$ python -m reader report sample-cache --out report " + " ".join(REPORT_OPTIONS))
        subprocess.run(cmd, cwd=tmp, env=env, check=True, timeout=600)
        page = chromium.load("file://" + os.path.join(tmp, "report", "index.html"), width=1100, height=args.height)
        if page.errors:
            raise SystemExit(f"the page loaded with errors: {page.errors}")
    img = Image.open(io.BytesIO(page.screenshot)).convert("RGB").quantize(colors=256)
    img.save(out, optimize=True)
    print(f"wrote {out} ({os.path.getsize(out):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
