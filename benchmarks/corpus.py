"""A benchmark corpus of real English text, made on the fly from what is installed on this machine.

Sources (all offline, all real prose written by people):

- ``/usr/share/doc``: Debian package documentation (changelogs, copyright/licence texts, READMEs,
  NEWS, FAQs), gzip or plain;
- ``/usr/share/man/man*``: English man pages, troff markup stripped to text;
- ``/usr/share/info``: GNU info manuals;
- Python docstrings (module, class and function docstrings, one document per module) of the standard
  library and of every installed package, plus the packages' README/METADATA/``*.md``/``*.rst``/``*.txt``.

Each source file becomes one or more documents (long files are cut at blank lines into pieces of at
most ``MAX_DOC_CHARS``), exact duplicates are dropped, and the documents are mixed in a fixed pseudo-random
order and written as ``shard-NNNNN.jsonl`` files (``{"text": ...}`` per line) of about equal size. When
the distinct text is smaller than the requested size, the distinct documents are repeated (each pass in a
different order) and ``manifest.json`` records the repeat factor.

The corpus is cached under ``benchmarks/work/`` keyed by its parameters, so repeated runs reuse it.

    python -m benchmarks.corpus --size_mb 640 --shards 8 --out benchmarks/work/corpus-full
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import os
import random
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Iterator

MAX_DOC_CHARS = 32_000
MIN_DOC_CHARS = 200
CORPUS_VERSION = 2  # bump when extraction changes, so cached corpora are rebuilt

SKIP_SUFFIXES = (
    ".png", ".jpg", ".jpeg", ".gif", ".svg", ".ico", ".pdf", ".ps", ".dvi", ".woff", ".woff2", ".ttf",
    ".js", ".css", ".map", ".so", ".a", ".o", ".pyc", ".whl", ".zip", ".tar", ".bz2", ".xz", ".zst",
    ".db", ".bin", ".dat", ".npy", ".npz", ".json", ".yaml", ".yml", ".xml", ".html", ".htm", ".c",
    ".h", ".cc", ".cpp", ".pyi", ".pyx", ".pxd", ".ipynb", ".csv", ".tsv", ".parquet", ".arrow",
)


@dataclass(frozen=True)
class Source:
    kind: str  # "doc" | "man" | "info" | "pydoc" | "pytext"
    path: str


# --------------------------------------------------------------------------------------------------
# Finding source files


def _site_dirs() -> list[Path]:
    dirs = []
    for key in ("purelib", "platlib", "stdlib"):
        p = sysconfig.get_paths().get(key)
        if p and Path(p).is_dir():
            dirs.append(Path(p))
    for extra in ("/usr/lib/python3/dist-packages", "/usr/lib/python3.11"):
        if Path(extra).is_dir():
            dirs.append(Path(extra))
    seen, out = set(), []
    for d in dirs:
        r = d.resolve()
        if r not in seen:
            seen.add(r)
            out.append(r)
    return out


def find_sources() -> list[Source]:
    """Every candidate file, sorted (the set depends on what this machine has installed)."""
    out: list[Source] = []
    doc = Path("/usr/share/doc")
    if doc.is_dir():
        for p in doc.rglob("*"):
            if p.is_file() and not p.is_symlink():
                name = p.name.lower()
                base = name[:-3] if name.endswith(".gz") else name
                if base.endswith(SKIP_SUFFIXES) or base.endswith(".py"):
                    continue
                out.append(Source("doc", str(p)))
    man = Path("/usr/share/man")
    if man.is_dir():
        for sub in sorted(man.glob("man[1-9]*")):  # English pages only (locales live in man/xx/)
            for p in sub.iterdir():
                if p.is_file() and not p.is_symlink():
                    out.append(Source("man", str(p)))
    info = Path("/usr/share/info")
    if info.is_dir():
        for p in info.iterdir():
            if p.is_file() and p.name != "dir":
                out.append(Source("info", str(p)))
    for d in _site_dirs():
        for root, dirnames, files in os.walk(d):
            dirnames[:] = sorted(x for x in dirnames
                                 if x not in ("__pycache__", "test", "tests", "site-packages", "dist-packages"))
            for f in files:
                p = os.path.join(root, f)
                low = f.lower()
                if low.endswith(".py"):
                    out.append(Source("pydoc", p))
                elif low.endswith((".md", ".rst", ".txt")) or f in ("METADATA", "README", "LICENSE", "NEWS"):
                    if os.path.getsize(p) < 4_000_000:
                        out.append(Source("pytext", p))
    uniq = sorted(set(out), key=lambda s: (s.kind, s.path))
    return uniq


# --------------------------------------------------------------------------------------------------
# Turning one file into text


_MAN_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)")
_MAN_SPECIAL = {
    r"\(em": "—", r"\(en": "–", r"\(bu": "•", r"\(aq": "'", r"\(dq": '"', r"\(lq": "“", r"\(rq": "”",
    r"\(oq": "‘", r"\(cq": "’", r"\(co": "©", r"\(rg": "®", r"\(tm": "™", r"\(mu": "×", r"\(>=": "≥",
    r"\(<=": "≤", r"\(ga": "`", r"\(ti": "~", r"\(ha": "^", r"\(rs": "\\", r"\e": "\\",
}
_MAN_ESC = re.compile(r"\\(\(..|\[[^\]]*\]|[-&|^%:/,0 ~]|\*\(..|\*\[[^\]]*\]|\*.|n\(..|n\[[^\]]*\]|n.|s[-+]?\d+|.)")
_MAN_TEXT_MACROS = {"SH", "SS", "B", "I", "BI", "BR", "IB", "IR", "RB", "RI", "SM", "SB", "TP", "IP", "Nm",
                    "Nd", "Sh", "Ss", "Pa", "Ar", "Fl", "Cm", "Em", "Dq", "Qq", "Sq", "Xr", "It", "Op", "Va"}


def _man_escape(m: re.Match) -> str:
    s = m.group(0)
    if s in _MAN_SPECIAL:
        return _MAN_SPECIAL[s]
    if s in ("\\-",):
        return "-"
    if s in ("\\ ", "\\~", "\\0"):
        return " "
    if s == "\\\\":
        return "\\"
    return ""


def man_to_text(src: str) -> str:
    lines = []
    for line in src.splitlines():
        if line.startswith((".\\\"", "'\\\"", '.\\"', "\\\"")):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].strip().split(None, 1)
            if not parts:
                continue
            macro = parts[0]
            if macro in ("PP", "LP", "P", "Pp", "sp", "br"):
                lines.append("")
                continue
            if macro in _MAN_TEXT_MACROS and len(parts) > 1:
                arg = parts[1].replace('"', "")
                if macro in ("SH", "Sh"):
                    lines.append("")
                    lines.append(arg.strip())
                else:
                    lines.append(arg)
            continue
        lines.append(line)
    text = "\n".join(lines)
    text = _MAN_FONT.sub("", text)
    text = _MAN_ESC.sub(_man_escape, text)
    return text


def info_to_text(src: str) -> str:
    # Drop the node separators and tag tables; keep the prose.
    src = src.split("\x1f\nTag Table:")[0]
    return src.replace("\x1f", "\n").replace("\x7f", "")


def pydoc_to_text(src: str) -> str:
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node, clean=True)
            if d and len(d) >= 40:
                if isinstance(node, ast.Module):
                    docs.append(d)
                else:
                    docs.append(f"{node.name}\n\n{d}")
    return "\n\n".join(docs)


def _read(path: str) -> str | None:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read(50_000_000)
        else:
            with open(path, "rb") as f:
                data = f.read(50_000_000)
    except (OSError, EOFError):
        return None
    if b"\x00" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _looks_like_prose(text: str) -> bool:
    if len(text) < MIN_DOC_CHARS:
        return False
    sample = text[:20_000]
    letters = sum(c.isalpha() for c in sample)
    spaces = sum(c.isspace() for c in sample)
    return letters / len(sample) > 0.5 and spaces / len(sample) > 0.08


def split_doc(text: str, max_chars: int = MAX_DOC_CHARS) -> list[str]:
    """Cut a long text at blank lines into pieces of at most ``max_chars`` (hard cut if a paragraph is longer)."""
    text = text.strip()
    if len(text) <= max_chars:
        return [text]
    pieces, cur, cur_len = [], [], 0
    for para in re.split(r"\n\s*\n", text):
        while len(para) > max_chars:
            if cur:
                pieces.append("\n\n".join(cur))
                cur, cur_len = [], 0
            pieces.append(para[:max_chars])
            para = para[max_chars:]
        if cur_len + len(para) + 2 > max_chars and cur:
            pieces.append("\n\n".join(cur))
            cur, cur_len = [], 0
        cur.append(para)
        cur_len += len(para) + 2
    if cur:
        pieces.append("\n\n".join(cur))
    return [p.strip() for p in pieces if len(p.strip()) >= MIN_DOC_CHARS]


def source_to_docs(src: Source) -> list[str]:
    raw = _read(src.path)
    if raw is None:
        return []
    if src.kind == "man":
        text = man_to_text(raw)
    elif src.kind == "info":
        text = info_to_text(raw)
    elif src.kind == "pydoc":
        text = pydoc_to_text(raw)
    else:
        text = raw
    text = re.sub(r"[ \t]+\n", "\n", text.replace("\r\n", "\n"))
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    if not _looks_like_prose(text):
        return []
    return [d for d in split_doc(text) if _looks_like_prose(d)]


def _worker(batch: list[Source]) -> list[tuple[str, str]]:
    out = []
    for s in batch:
        for d in source_to_docs(s):
            out.append((s.kind, d))
    return out


# --------------------------------------------------------------------------------------------------
# Building the corpus


def collect_docs(limit_bytes: int | None, processes: int = 2, log=print) -> tuple[list[str], dict]:
    """Distinct documents from this machine's sources, in a fixed mixed order; stops near ``limit_bytes``."""
    t0 = time.time()
    sources = find_sources()
    random.Random(1234).shuffle(sources)
    by_kind: dict[str, int] = {}
    docs: list[str] = []
    seen: set[bytes] = set()
    total = 0
    batch_size = 64
    batches = [sources[i : i + batch_size] for i in range(0, len(sources), batch_size)]

    def take(results):
        nonlocal total
        for kind, d in results:
            h = hashlib.blake2b(d.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            if h in seen:
                continue
            seen.add(h)
            try:
                n = len(d.encode("utf-8"))
            except UnicodeEncodeError:  # lone surrogates cannot be written as UTF-8
                continue
            docs.append(d)
            total += n
            by_kind[kind] = by_kind.get(kind, 0) + n

    if processes > 1 and (limit_bytes is None or limit_bytes > 20_000_000):
        with get_context("fork").Pool(processes) as pool:
            for results in pool.imap(_worker, batches, chunksize=1):
                take(results)
                if limit_bytes is not None and total >= limit_bytes:
                    pool.terminate()
                    break
    else:
        for b in batches:
            take(_worker(b))
            if limit_bytes is not None and total >= limit_bytes:
                break
    stats = {
        "source_files": len(sources),
        "distinct_docs": len(docs),
        "distinct_bytes": total,
        "distinct_bytes_by_source": dict(sorted(by_kind.items())),
        "extract_s": round(time.time() - t0, 1),
    }
    log(f"corpus: {len(docs)} distinct documents, {total / 1e6:.1f} MB from {len(sources)} files "
        f"in {stats['extract_s']} s ({stats['distinct_bytes_by_source']})")
    return docs, stats


def _cached_docs(path: Path, limit: int | None, processes: int, log) -> tuple[list[str], dict]:
    """:func:`collect_docs`, remembered in ``path`` (distinct documents, then a stats line)."""
    if path.exists():
        lines = path.read_bytes().splitlines()
        stats = json.loads(lines[-1])
        if stats.get("complete"):
            return [json.loads(x)["text"] for x in lines[:-1]], {k: v for k, v in stats.items() if k != "complete"}
    docs, stats = collect_docs(limit, processes=processes, log=log)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for d in docs:
            f.write(_line(d))
        f.write((json.dumps({**stats, "complete": True}) + "\n").encode())
    os.replace(tmp, path)
    return docs, stats


def _line(doc: str) -> bytes:
    return (json.dumps({"text": doc}, ensure_ascii=False) + "\n").encode("utf-8")


def _docs_of_corpus(corpus_dir: Path, size_bytes: int) -> tuple[list[str], dict]:
    """The first documents of an existing corpus (in shard order), about ``size_bytes`` of them."""
    m = json.loads((Path(corpus_dir) / "manifest.json").read_text())
    docs, seen, total = [], set(), 0
    for name in m["files"]:
        with open(Path(corpus_dir) / name, "rb") as f:
            for line in f:
                d = json.loads(line)["text"]
                if d in seen:
                    continue
                seen.add(d)
                docs.append(d)
                total += len(line)
                if total >= size_bytes:
                    break
        if total >= size_bytes:
            break
    stats = {k: m[k] for k in ("source_files", "distinct_bytes_by_source") if k in m}
    stats.update(distinct_docs=len(docs), distinct_bytes=total, derived_from=str(corpus_dir))
    return docs, stats


def build_corpus(out_dir: Path, size_bytes: int, shards: int, *, processes: int = 2, log=print,
                 from_corpus: Path | None = None) -> dict:
    """Write (or reuse) ``shards`` jsonl shards totalling about ``size_bytes`` under ``out_dir``.

    With ``from_corpus``, the documents are the first ones of that (larger) corpus, so both corpora hold
    the same kind of text.
    """
    out_dir = Path(out_dir)
    manifest_path = out_dir / "manifest.json"
    params = {"version": CORPUS_VERSION, "size_bytes": size_bytes, "shards": shards,
              "from": str(from_corpus) if from_corpus else None}
    if manifest_path.exists():
        m = json.loads(manifest_path.read_text())
        if m.get("params") == params and all((out_dir / f).exists() for f in m["files"]):
            return m
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("shard-*.jsonl"):
        old.unlink()
    # For small corpora read only a bit more than needed; for large ones read everything available.
    limit = None if size_bytes > 50_000_000 else int(size_bytes * 1.2) + 100_000
    if from_corpus is not None:
        docs, stats = _docs_of_corpus(from_corpus, size_bytes)
    else:
        docs, stats = _cached_docs(out_dir.parent / f"distinct-v{CORPUS_VERSION}-{limit or 'all'}.jsonl",
                                   limit, processes, log)
    if not docs:
        raise RuntimeError("no source text found on this machine (looked in /usr/share/doc, man, info, Python)")
    lines = [_line(d) for d in docs]
    distinct_line_bytes = sum(map(len, lines))
    per_shard = size_bytes / shards
    files, shard_bytes, shard_docs = [], [], []
    rng = random.Random(99)
    order = list(range(len(lines)))
    passes, written, k = 0, 0, 0
    f = None
    cur = 0
    cur_docs = 0
    done = False
    while not done:
        passes += 1
        if passes > 1:
            rng.shuffle(order)
        for i in order:
            if f is None:
                name = f"shard-{len(files):05d}.jsonl"
                files.append(name)
                f = open(out_dir / (name + ".tmp"), "wb")
                cur, cur_docs = 0, 0
            f.write(lines[i])
            cur += len(lines[i])
            cur_docs += 1
            written += len(lines[i])
            k += 1
            if cur >= per_shard or written >= size_bytes:
                f.close()
                os.replace(out_dir / (files[-1] + ".tmp"), out_dir / files[-1])
                shard_bytes.append(cur)
                shard_docs.append(cur_docs)
                f = None
                if written >= size_bytes or len(files) >= shards:
                    done = True
                    break
    m = {
        "params": params,
        "files": files,
        "bytes": written,
        "docs": k,
        "shard_bytes": shard_bytes,
        "shard_docs": shard_docs,
        "distinct_line_bytes": distinct_line_bytes,
        "repeat_factor": round(written / distinct_line_bytes, 3),
        "passes": passes,
        **stats,
    }
    tmp = manifest_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(m, indent=1) + "\n")
    os.replace(tmp, manifest_path)
    log(f"corpus: wrote {len(files)} shards, {written / 1e6:.1f} MB, {k} documents, "
        f"repeat factor {m['repeat_factor']} -> {out_dir}")
    return m


def load_texts(corpus_dir: Path, files: list[str]) -> list[str]:
    texts = []
    for name in files:
        with open(Path(corpus_dir) / name, "rb") as f:
            for line in f:
                texts.append(json.loads(line)["text"])
    return texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size_mb", type=float, default=640.0, help="total corpus size in MB (default 640)")
    ap.add_argument("--shards", type=int, default=8, help="number of jsonl shards (default 8)")
    ap.add_argument("--out", default="benchmarks/work/corpus", help="output directory")
    a = ap.parse_args(argv)
    m = build_corpus(Path(a.out), int(a.size_mb * 1e6), a.shards)
    print(json.dumps({k: v for k, v in m.items() if k not in ("shard_bytes", "shard_docs")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
