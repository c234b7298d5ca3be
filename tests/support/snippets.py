"""The docs' code blocks, run as a reader would run them (``tests/project/test_snippets.py``).

Every fenced block of README.md and docs/*.md carries an info string from :data:`KINDS`. ``python`` and
``console`` blocks run, unless the line before the fence is ``<!-- illustration -->`` (optionally with a
reason: ``<!-- illustration: needs a Dataflow project -->``); ``text`` (output, layouts), ``json`` (parsed)
and ``jinja`` blocks are data. ``<!-- file: NAME -->`` before a block writes the block to ``NAME`` in the
page's work directory before the page runs (a mixture file, a chat template a command then uses).

One page runs in one fresh Python process (``python snippets.py SPEC.json``), its blocks in order, so state
carries over between a page's blocks as it does for a reader going down the page: Python blocks share one
namespace; a ``console`` block's commands (lines starting ``$ ``, continued by a trailing ``\\``; the other
lines are the output shown, not compared) run with bash in the page's work directory.

The context a page runs in (:func:`make_context`, :class:`Preamble`), and nothing else:

- **Paths.** The work directory holds: ``sample-cache`` (the sample corpus built with ``--chunk_bytes 16384
  --append_eos --keep_fields source``), also named ``demo-cache`` (what ``make demo`` builds, in other
  chunks), ``CACHE``, ``web-cache``, ``math/train``, ``../code``, ``tmp/sample-cache``, ``gs/bucket/cache``
  and ``gs/b/web``; ``tiny`` (three short documents); ``killed`` (a build stopped midway: some chunks, and
  the lock of a builder that is gone); ``data/*.jsonl``, ``data/*.jsonl.zst``, ``gs/bucket/more/*.jsonl.zst``,
  ``corpus/*.jsonl``, ``F.jsonl`` (text records); ``pipelines/sample_corpus`` (the repository's); the
  Megatron datasets ``data/my-corpus_text_document`` and ``data/web_text_document``; ``sft/*.jsonl``
  (prompt/completion), ``chats/*.jsonl`` and ``chats/*.parquet`` (chat messages), ``sharegpt/*.jsonl`` (the
  same conversations in ShareGPT's shape); ``my-tokenizer/`` (a Hugging Face tokenizer with a chat
  template); ``.venv`` (this interpreter's environment).
- **Rewrites.** The runner has no bucket: ``gs://B/K`` is read as the local path ``gs/B/K``, and ``/tmp/X``
  as ``tmp/X`` (remote storage is tested against an emulator elsewhere).
- **Names** (:meth:`Preamble.names`). Python blocks may use, without defining them, what a training
  program around the snippet would define: ``step`` (0), ``state`` (None), ``model`` (None),
  ``train_step(...)`` (an embedding lookup of the batch's inputs, ``jax.jit``-ed for ``jax.Array`` inputs;
  it ends the loop it is called from after :data:`STEPS` calls by raising :class:`EnoughSteps`, which the
  runner takes as success), ``restore_checkpoint()`` (``(0, None)``), ``load_checkpoint()`` (0),
  ``save_checkpoint(...)``, ``save(obj)`` (keeps ``obj`` in ``saved``), ``path`` (``sample-cache``) and
  ``mesh`` (8 of the CPU devices as ``data`` 4 x ``fsdp`` 2, given only to a page that uses ``mesh`` and
  never assigns it).
- **Devices.** JAX runs on 256 CPU devices; torch.distributed is set up as ``torchrun`` would for one
  process (``RANK=0``, ``WORLD_SIZE=1``, ``MASTER_ADDR``, ``MASTER_PORT``); there is no GPU.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KINDS = ("python", "console", "text", "json", "jinja")
RUN = ("python", "console")
ILLUSTRATION = re.compile(r"^\s*<!--\s*illustration\b[^>]*-->\s*$")
FILE = re.compile(r"^\s*<!--\s*file:\s*(\S+)\s*-->\s*$")
OPEN = re.compile(r"^(\s*)```(.*)$")
STEPS = 3
JAX_DEVICES = 256


def pages() -> list[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


@dataclass
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    kind: str  # the info string's first word ("" if none)
    text: str  # the body, dedented by the fence's indent
    illustration: bool = False
    file: str | None = None  # <!-- file: NAME -->

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.kind in RUN and not self.illustration


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file."""
    lines = path.read_text(encoding="utf-8").split("\n")
    out, i = [], 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info = m.group(1), m.group(2).strip()
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:j]]
        before = lines[i - 1] if i else ""
        f = FILE.match(before)
        out.append(Block(page=str(path.relative_to(REPO)), line=i + 1, kind=info.split()[0] if info else "",
                         text="\n".join(body) + "\n", illustration=bool(ILLUSTRATION.match(before)),
                         file=f.group(1) if f else None))
        i = j + 1
    return out


def problems(b: Block) -> list[str]:
    """What is wrong with a block's declaration (empty: nothing)."""
    if b.kind not in KINDS:
        return [f"{b.where}: the fence needs an info string, one of {', '.join(KINDS)} (got {b.kind!r}); "
                "python and console blocks run, or mark one <!-- illustration --> on the line before"]
    if b.kind == "json":
        try:
            json.loads(b.text)
        except ValueError as e:
            return [f"{b.where}: the json block does not parse: {e}"]
    if b.kind == "console" and not commands(b.text):
        return [f"{b.where}: a console block shows commands, each on a line starting with '$ '"]
    if b.illustration and b.kind not in RUN:
        return [f"{b.where}: only python and console blocks run; a {b.kind} block needs no illustration mark"]
    return []


def commands(text: str) -> list[str]:
    """A console block's commands: lines starting ``$ ``, with their ``\\`` continuation lines."""
    out, cur = [], None
    for line in text.splitlines():
        if cur is not None:
            cur += "\n" + line
        elif line.startswith("$ "):
            cur = line[2:]
        else:
            continue
        if not cur.endswith("\\"):
            out.append(cur)
            cur = None
    if cur is not None:
        out.append(cur)
    return out


def rewrite(text: str) -> str:
    """The runner's context: no bucket (``gs://B/K`` -> ``gs/B/K``), no shared /tmp (``/tmp/X`` -> ``tmp/X``)."""
    text = text.replace("gs://", "gs/")
    return re.sub(r"(?<![\w./~-])/tmp/", "tmp/", text)


# --------------------------------------------------------------------------------------------------
# The context: files every page's work directory holds


def _run(argv: list[str], cwd: Path, timeout: float = 300, ok=(0,)) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    if p.returncode not in ok:
        raise RuntimeError(f"snippet context: {' '.join(argv)} exited {p.returncode}: {p.stderr[-3000:]}")
    return p


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def _texts(n: int, seed: int) -> list[str]:
    from build_helpers import sample_texts

    return sample_texts(n, seed=seed, max_words=120)


def make_context(root: Path) -> Path:
    """Make the shared resources under ``root/res`` (once per session); return ``root``."""
    from build_helpers import SAMPLE_DIR, write_shard

    res = root / "res"
    res.mkdir(parents=True)
    py = sys.executable
    build = [py, "-m", "pipelines.build_cache", "--tokenizer", "tiktoken:cl100k_base", "--runner=FnApiRunner"]
    tiny = [{"text": "Hello world."}, {"text": "A cache of chunks, in order."}, {"text": "Short."}]
    write_shard(str(res / "in" / "tiny.jsonl"), tiny)
    sample = ["--input", f"{SAMPLE_DIR}/*", "--chunk_bytes", "16384", "--append_eos"]
    jobs = [build + sample + ["--keep_fields", "source", "--output", str(res / "sample-cache")],
            build + ["--input", str(res / "in" / "tiny.jsonl"), "--append_eos", "--output", str(res / "tiny")]]
    procs = [subprocess.Popen(j, cwd=res, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for j in jobs]
    _killed(res / "killed")
    for j, p in zip(jobs, procs):
        err = p.communicate(timeout=600)[1]
        if p.returncode != 0:
            raise RuntimeError(f"snippet context: {' '.join(j)} exited {p.returncode}: {err[-3000:]}")
    for i in range(2):
        write_shard(str(res / "data" / f"part-0{i}.jsonl"), [{"text": t} for t in _texts(40, i)])
        write_shard(str(res / "corpus" / f"part-0{i}.jsonl"), [{"text": t} for t in _texts(40, 10 + i)])
    write_shard(str(res / "data" / "part-02.jsonl.zst"), [{"text": t} for t in _texts(40, 2)])
    write_shard(str(res / "gs" / "bucket" / "more" / "part-00.jsonl.zst"), [{"text": t} for t in _texts(40, 3)])
    write_shard(str(res / "F.jsonl"), [{"text": t} for t in _texts(40, 4)])
    for name in ("my-corpus_text_document", "web_text_document"):
        _run([py, "-m", "reader", "export", str(res / "tiny"), "--format", "megatron", "--out",
              str(res / "data" / name)], res)
    _sft_inputs(res)
    (res / ".venv").symlink_to(sys.prefix)
    return root


def _killed(root: Path) -> None:
    """A build stopped midway: the plan, some of its chunks, and the lock of a builder that is gone."""
    import numpy as np
    from cachegen import random_chunks, write_synthetic_cache
    from reader.format.spec import LOCK_NAME

    chunks = random_chunks(np.random.default_rng(3), 12, empty_prob=0)
    write_synthetic_cache(str(root), chunks, finished=False, chunks_per_shard=[8, 4], written=range(7))
    (root / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": -1}))


def _sft_inputs(res: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from build_helpers import train_tiny_tokenizer, write_shard
    from sftgen import conversations

    texts = _texts(40, 5)
    write_shard(str(res / "sft" / "part-00.jsonl"),
                [{"prompt": a, "completion": b} for a, b in zip(texts[::2], texts[1::2])])
    chats = [{"messages": m} for m in conversations(40, seed=6)
             if any(x["role"] == "assistant" and x["content"] for x in m)]  # each has loss tokens
    write_shard(str(res / "chats" / "part-00.jsonl"), chats)
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    write_shard(str(res / "sharegpt" / "part-00.jsonl"),
                [{"conversations": [{"from": names[x["role"]], "value": x["content"]} for x in c["messages"]]}
                 for c in chats])
    pq.write_table(pa.Table.from_pylist(chats), res / "chats" / "part-00.parquet")
    tok = res / "my-tokenizer"
    train_tiny_tokenizer(str(tok / "tokenizer.json"), texts)
    template = ("{% for m in messages %}{{ m['role'] + ': ' }}{% if m['role'] == 'assistant' %}{% generation %}"
                "{{ m['content'] + eos_token }}{% endgeneration %}{% else %}{{ m['content'] + '\n' }}{% endif %}"
                "{% endfor %}")
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))


# relative path in a page's work directory -> what it links to under res/
LINKS = {
    "demo-cache": "sample-cache", "sample-cache": "sample-cache", "CACHE": "sample-cache",
    "web-cache": "sample-cache", "math/train": "sample-cache", "../code": "sample-cache",
    "tmp/sample-cache": "sample-cache", "gs/bucket/cache": "sample-cache", "gs/b/web": "sample-cache",
    "tiny": "tiny", "killed": "killed", "data": "data", "corpus": "corpus", "F.jsonl": "F.jsonl",
    "gs/bucket/more": "gs/bucket/more", "sft": "sft", "chats": "chats", "sharegpt": "sharegpt",
    "my-tokenizer": "my-tokenizer",
    ".venv": ".venv", "pipelines/sample_corpus": str(REPO / "pipelines" / "sample_corpus"),
}


def page_dir(root: Path, page: str) -> Path:
    """A fresh work directory for ``page`` under ``root/pages``, with its own copy of the context (hard links:
    what a page writes into a cache, such as attribute files, every write atomic, stays in that page)."""
    work = root / "pages" / page.replace("/", "_").removesuffix(".md")
    work.mkdir(parents=True)
    for rel, target in LINKS.items():
        dest = (work / rel).resolve() if rel.startswith("..") else work / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        src = root / "res" / target  # (an absolute target stays as it is: linked, never written)
        if os.path.lexists(dest):
            continue
        if os.path.isabs(target) or target == ".venv":
            dest.symlink_to(src)
        elif src.is_dir():
            shutil.copytree(src, dest, copy_function=os.link)
        else:
            os.link(src, dest)
    return work


def run_page(root: Path, page_blocks: list[Block], timeout: float = 600) -> list[dict]:
    """Run one page's blocks in a fresh process; return each run block's result."""
    page = page_blocks[0].page
    work = page_dir(root, page)
    for b in page_blocks:
        if b.file:
            (work / b.file).parent.mkdir(parents=True, exist_ok=True)
            (work / b.file).write_text(rewrite(b.text))
    spec = work / "snippets.json"
    result = work / "snippet-results.json"
    spec.write_text(json.dumps({"work": str(work), "result": str(result),
                                "blocks": [asdict(b) for b in page_blocks if b.runs]}))
    p = subprocess.run([sys.executable, __file__, str(spec)], cwd=work, env=_env(), capture_output=True,
                       text=True, timeout=timeout)
    if not result.exists():
        raise RuntimeError(f"{page}: the snippet runner exited {p.returncode}:\n{p.stdout[-2000:]}\n"
                           f"{p.stderr[-4000:]}")
    return json.loads(result.read_text())


# --------------------------------------------------------------------------------------------------
# In the page's process


class EnoughSteps(BaseException):
    """Raised by the context's ``train_step`` after :data:`STEPS` calls: the snippet's loop has shown enough."""


@dataclass
class Preamble:
    """The names a snippet may use without defining them (see the module's docstring)."""

    calls: int = 0
    saved: dict = field(default_factory=dict)
    _jit: object = None

    def train_step(self, *args, **kwargs):
        self.calls += 1
        if self.calls > STEPS:
            raise EnoughSteps
        batch = next((a for a in args if isinstance(a, dict) and "inputs" in a), None)
        inputs = batch["inputs"] if batch is not None else next(a for a in args if hasattr(a, "shape"))
        if type(inputs).__module__.startswith("jax"):
            if self._jit is None:
                import jax
                import jax.numpy as jnp

                emb = jnp.ones((1 << 17, 4), jnp.float32)
                self._jit = jax.jit(lambda x: emb[x].sum())  # a plain embedding lookup
            loss = float(self._jit(inputs))
        elif type(inputs).__module__.startswith("torch"):
            import torch

            loss = float(torch.nn.functional.embedding(inputs.long() % (1 << 17), torch.ones(1 << 17, 4)).sum())
        else:
            loss = float(inputs.sum())
        state = args[0] if args and batch is not args[0] else None
        return state, {"loss": loss}

    def save(self, obj) -> None:
        self.saved.clear()
        self.saved.update(obj)

    def names(self, work: Path, free: set[str]) -> dict:
        out = {"step": 0, "state": None, "model": None, "train_step": self.train_step,
               "restore_checkpoint": lambda: (0, None), "load_checkpoint": lambda: 0,
               "save_checkpoint": lambda *a, **k: None, "save": self.save, "saved": self.saved,
               "path": str(work / "sample-cache")}
        if "mesh" in free:  # jax is imported only by a page that uses it
            import jax
            from jax.sharding import AxisType

            out["mesh"] = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2,
                                        devices=jax.devices()[:8])
        return out


def _free_names(sources: list[str]) -> set[str]:
    """Names a page's Python code reads and never assigns."""
    loads, stores = set(), set()
    for src in sources:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Name):
                (loads if isinstance(node.ctx, ast.Load) else stores).add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                stores.add(node.name)
            elif isinstance(node, ast.alias):
                stores.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.arg):
                stores.add(node.arg)
    return loads - stores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_python(b: dict, ns: dict, pre: Preamble) -> None:
    pre.calls = 0
    code = compile("\n" * b["line"] + rewrite(b["text"]), b["page"], "exec")
    try:
        exec(code, ns)
    except EnoughSteps:
        pass


def _run_console(b: dict, work: Path) -> None:
    for cmd in commands(rewrite(b["text"])):
        p = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=work, capture_output=True, text=True,
                           timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"$ {cmd}\nexited {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-3000:]}")


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["work"])
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    sys.path.insert(0, str(Path(__file__).parent))
    from jax_helpers.common import force_cpu_devices

    # a device count inherited from the test process (its jax tests ask for 8) would not hold JAX.md's mesh
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags)
    force_cpu_devices(JAX_DEVICES)
    pre = Preamble()
    py = [b for b in spec["blocks"] if b["kind"] == "python"]
    free = _free_names([rewrite(b["text"]) for b in py]) if py else set()
    ns: dict = {"__name__": "__snippet__", **(pre.names(work, free) if py else {})}
    results = []
    for b in spec["blocks"]:
        t0 = time.time()
        try:
            if b["kind"] == "python":
                _run_python(b, ns, pre)
            else:
                _run_console(b, work)
            error = None
        except Exception:  # noqa: BLE001 - reported with the block
            error = traceback.format_exc(limit=-8)[-6000:]
        results.append({"where": f"{b['page']}:{b['line']}", "kind": b["kind"], "error": error,
                        "seconds": round(time.time() - t0, 2)})
        Path(spec["result"]).write_text(json.dumps(results))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # loaders' threads and workers end with the process


if __name__ == "__main__":
    main(sys.argv[1])
