"""What the launcher reads and writes before the job starts: inputs, tokenizer, existing cache, plan.

:func:`prepare` matches the input files, resolves the tokenizer, plans the build
(:func:`pipelines.plan.make_plan`, pure) and reconciles the plan with what ``--output`` already holds:
nothing (write the plan ledger), the same build unfinished (resume), the same build finished (nothing
to do, unless chunk files went missing), or another build (refuse).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
from typing import Any, Sequence

from apache_beam.io.filesystems import FileSystems

from reader import format as fmt

from . import fsutil, status
from .errors import BuildError
from .options import Arguments, absolute, chunk_config, is_remote
from .plan import BuildPlan, check_resumable, make_plan
from .tokenizer import TokenizerError, TokenizerSpec, resolve

LOG = logging.getLogger("chunkledger.build")

TOKENIZER_FILE = "tokenizer.json"  # Hugging Face builds: the tokenizer's JSON, at the cache root
READ_CHECK_THREADS = 16  # input files are opened in parallel: on gs:// each check is a round trip


def match_inputs(patterns: Sequence[str]) -> list[tuple[str, int]]:
    """``(path, size)`` of every matched input file, sorted by path, each checked readable.

    Fails (BuildError) naming the pattern that matches nothing or the file that cannot be read.
    """
    found: dict[str, int] = {}
    for pat in patterns:
        full = absolute(pat)
        try:
            res = FileSystems.match([full])[0].metadata_list
        except Exception as e:  # BeamIOError for unreadable buckets, bad patterns
            raise BuildError(f"--input {pat!r}: cannot list files ({e})") from e
        files = [m for m in res if not m.path.endswith("/") and not (not is_remote(m.path) and os.path.isdir(m.path))]
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

    with concurrent.futures.ThreadPoolExecutor(max_workers=READ_CHECK_THREADS) as pool:
        for problem in pool.map(check, paths):
            if problem:
                raise BuildError(problem)
    return [(path, found[path]) for path in paths]


def chunks_intact(output: str, ledger: dict[str, Any]) -> bool:
    """Cheap check of a finished cache: every chunk file exists with its recorded size (one listing)."""
    pattern = fmt.join(output, f"{fmt.CHUNKS_DIR}/*/*.parquet")
    try:
        found = {m.path: m.size_in_bytes for m in FileSystems.match([pattern])[0].metadata_list}
    except Exception:  # noqa: BLE001 - nothing matched
        found = {}
    return all(found.get(fmt.join(output, c["path"])) == c["bytes"] for c in ledger["chunks"])


def ship_tokenizer(output: str, tok: TokenizerSpec) -> TokenizerSpec:
    """A Hugging Face tokenizer's JSON goes into the cache; workers load it from there."""
    if tok.kind != "huggingface":
        return tok
    path = fmt.join(output, TOKENIZER_FILE)
    if fsutil.read_bytes_or_none(path) != tok.payload.encode("utf-8"):
        fsutil.write_atomic(path, tok.payload.encode("utf-8"))
    return tok.shipped_as(path)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A build ready to run (the plan ledger is in ``output``), or one already complete (``finished``)."""

    output: str
    plan: BuildPlan
    tokenizer: TokenizerSpec  # as workers load it
    resumed: bool  # ``output`` held this build's ledger already
    finished: dict[str, Any] | None  # the finished ledger when there is nothing to do


def prepare(args: Arguments) -> Prepared:
    """Match, resolve, plan and reconcile with ``args.output`` (see the module doc). Raises BuildError."""
    options, output = args.options, args.output
    files = match_inputs(options.input)
    try:
        tok = resolve(options.tokenizer)
    except TokenizerError as e:
        raise BuildError(str(e)) from e
    config = chunk_config(options)
    if config.append_eos and tok.eos_id is None:
        raise BuildError(f"--append_eos: tokenizer {options.tokenizer!r} has no end-of-sequence token")
    plan = make_plan(tok.identity(), config, files)
    old = status.read_ledger(output)
    if old is not None:
        check_resumable(plan, old, output)
    if old is not None and old.get("finished") and not chunks_intact(output, old):
        LOG.warning("%s: ledger says finished but chunk files are missing or resized; rebuilding them", output)
        status.write_ledger(output, plan.ledger())
        old = plan.ledger()
    if old is not None and old.get("finished"):
        return Prepared(output=output, plan=plan, tokenizer=tok, resumed=True, finished=old)
    tok = ship_tokenizer(output, tok)
    if old is None:
        status.write_ledger(output, plan.ledger())
    else:
        LOG.warning("resuming the unfinished build in %s", output)
    status.clear_failure(output)
    return Prepared(output=output, plan=plan, tokenizer=tok, resumed=old is not None, finished=None)
