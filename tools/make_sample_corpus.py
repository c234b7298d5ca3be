"""Generate pipelines/sample_corpus/ once from real offline text (run by hand; the output is committed).

Documents: docstrings of Python standard library modules (one document per module: the module
docstring followed by its public classes' and functions' docstrings) and license texts from
/usr/share/common-licenses. Deterministic for a given Python and machine; shards are written with a
fixed gzip mtime so reruns produce the same bytes.

    python -m tools.make_sample_corpus [--out pipelines/sample_corpus] [--max_bytes 450000]
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import os
import random
import sys
import warnings

MODULES = sorted(
    m for m in sys.stdlib_module_names
    if not m.startswith("_") and m not in {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo",
                                           "lib2to3", "ensurepip", "venv", "pydoc_data"}
)
LICENSE_DIR = "/usr/share/common-licenses"
SAMPLE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pipelines", "sample_corpus")


def module_docs(name: str) -> list[tuple[str, str]]:
    """The module docstring, and each public class's or function's docstring, as separate documents."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - optional platform modules
        return []
    out = []
    if mod.__doc__ and len(mod.__doc__) > 200:
        out.append((f"python-stdlib/{name}", inspect.cleandoc(mod.__doc__)))
    for attr in sorted(getattr(mod, "__all__", None) or [a for a in dir(mod) if not a.startswith("_")]):
        obj = getattr(mod, attr, None)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == name:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 300:
                out.append((f"python-stdlib/{name}.{attr}", f"{name}.{attr}\n\n{doc}"))
    return out


def license_docs() -> list[tuple[str, str]]:
    out = []
    if os.path.isdir(LICENSE_DIR):
        for name in sorted(os.listdir(LICENSE_DIR)):
            path = os.path.join(LICENSE_DIR, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    out.append((f"license/{name}", f.read()))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=SAMPLE_DIR, help="where to write the shards (default pipelines/sample_corpus)")
    ap.add_argument("--max_bytes", type=int, default=450_000, help="stop after this many bytes of jsonl")
    ap.add_argument("--max_doc_chars", type=int, default=12_000, help="truncate long documents")
    args = ap.parse_args(argv)
    docs = []
    for name in MODULES:
        docs.extend(module_docs(name))
    random.Random(0).shuffle(docs)  # variety across modules within the size budget
    lic = license_docs()
    # Interleave: mostly docstrings, a license text every so often.
    mixed, li = [], 0
    for i, d in enumerate(docs):
        mixed.append(d)
        if i % 40 == 39 and li < len(lic):
            mixed.append(lic[li])
            li += 1
    lines, total = [], 0
    for i, (source, text) in enumerate(mixed):
        line = json.dumps({"id": i, "source": source, "text": text[: args.max_doc_chars]}, ensure_ascii=False) + "\n"
        if total + len(line.encode()) > args.max_bytes:
            break
        lines.append(line)
        total += len(line.encode())
    os.makedirs(args.out, exist_ok=True)
    n = 4  # shards: 3 plain jsonl, the last gzip-compressed
    per = -(-len(lines) // n)
    for s in range(n):
        body = "".join(lines[s * per:(s + 1) * per]).encode("utf-8")
        if s == n - 1:
            path = os.path.join(args.out, f"part-{s:02d}.jsonl.gz")
            with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                gz.write(body)
        else:
            path = os.path.join(args.out, f"part-{s:02d}.jsonl")
            with open(path, "wb") as f:
                f.write(body)
        print(f"{path}: {len(lines[s * per:(s + 1) * per])} documents, {len(body)} bytes uncompressed")


if __name__ == "__main__":
    main()
