"""What the launcher reads and writes before the job starts: inputs, tokenizer, existing cache, plan.

:func:`prepare` checks ``--output``, matches the input files, resolves the tokenizer, plans the build
(:func:`pipelines.plan.make_plan`, pure) and reconciles the plan with what ``--output`` already holds
(:func:`pipelines.plan.reconcile`): nothing (write the plan ledger), the same build unfinished (resume),
the same build finished (verify it, and repair what is damaged), or another build (refuse).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
from typing import Any, Sequence

from apache_beam.io.filesystems import FileSystems

from reader import format as fmt

from . import faults, fsutil, remote, status
from .decompress import open_input
from .errors import BuildError, DamagedInput, EnvironmentFault
from .ledger import EmptyInput
from .options import Arguments, absolute, chunk_config, is_remote
from .plan import BuildPlan, MatchedFile, make_plan, reconcile
from .fast_tokenizer import preflight
from .tokenizer import TokenizerError, TokenizerSpec, resolve

LOG = logging.getLogger("chunkledger.build")

TOKENIZER_FILE = "tokenizer.json"  # Hugging Face builds: the tokenizer's JSON, at the cache root
READ_CHECK_THREADS = 16  # input files are opened in parallel: on gs:// each check is a round trip


def _same_local_file(paths: Sequence[str]) -> dict[str, str]:
    """``alias -> kept path`` for local paths naming one file (symlinks, hard links): the first in path order."""
    kept: dict[tuple[int, int], str] = {}
    aliases = {}
    for path in sorted(paths):
        if is_remote(path):
            continue
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        if key in kept:
            aliases[path] = kept[key]
        else:
            kept[key] = path
    return aliases


def match_inputs(patterns: Sequence[str]) -> list[MatchedFile]:
    """Every matched input file, sorted by path, each checked readable; one shard per file.

    A path matched by several patterns, or a local file reached through several names (a symlink, a hard
    link), is one shard (a warning names the others). Fails (BuildError) naming the pattern that matches
    no file or the file that cannot be read.
    """
    found: dict[str, int] = {}
    for pat in patterns:
        full = absolute(pat)
        try:
            res = FileSystems.match([full])[0].metadata_list
        except Exception as e:  # BeamIOError for unreadable buckets, bad patterns
            raise BuildError(f"--input {pat!r}: cannot list files ({e})") from e
        dirs = [m for m in res if m.path.endswith("/") or (not is_remote(m.path) and os.path.isdir(m.path))]
        files = [m for m in res if m not in dirs]
        if not files:
            if dirs:
                raise BuildError(f"--input {pat!r} is a directory, not a file: give a pattern for its files, "
                                 f"quoted so that the builder expands it: --input '{pat.rstrip('/')}/*.jsonl'")
            where = "" if is_remote(full) else f" (relative paths start at {os.getcwd()})"
            raise BuildError(f"--input {pat!r} matches no file; check the path{where}")
        for m in files:
            if m.path in found:
                LOG.warning("input file %s is matched by more than one --input; it is read once", m.path)
            found[m.path] = m.size_in_bytes
    for alias, kept in _same_local_file(list(found)).items():
        LOG.warning("input %s is the same file as %s (a link); it is read once, as %s", alias, kept, kept)
        del found[alias]
    paths = sorted(found)

    def check(path: str) -> str | None:
        comp = fmt.compression_of(path)
        try:
            with open_input(path, comp) as f:
                f.read(1)
        except DamagedInput as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
            return (f"input file {path} is not readable as {comp} ({type(e).__name__}: {e}); "
                    "fix its permissions/contents or leave it out of --input")
        return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=READ_CHECK_THREADS) as pool:
        for problem in pool.map(check, paths):
            if problem:
                raise BuildError(problem)
    crc = remote.crc32c_of(paths, [absolute(p) for p in patterns])
    return [MatchedFile(path=p, size=found[p], crc32c=crc.get(p)) for p in paths]


def check_output(output: str) -> None:
    """A local ``--output`` must be a directory or not exist yet (its parent not a file)."""
    if is_remote(output):
        return
    if os.path.exists(output) and not os.path.isdir(output):
        raise BuildError(f"--output {output} is a file, not a directory: give a directory (it is created if "
                         "missing)")
    parent = os.path.dirname(output)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise BuildError(f"--output {output}: {parent} is a file, not a directory")


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
    """A build ready to run: the plan ledger (or the finished ledger being verified) is in ``output``."""

    output: str
    plan: BuildPlan
    tokenizer: TokenizerSpec  # as workers load it
    resumed: bool  # ``output`` held this build's ledger already
    finished: dict[str, Any] | None  # the finished ledger, when the run verifies (and repairs) a finished cache
    old_format: bool = False  # ``finished`` was written by an older format: nothing to verify against


def _shards_with_files(output: str, shards: set[int]) -> set[int]:
    return {s for s in shards
            if fsutil.list_sizes(fmt.join(output, f"{fmt.shard_dir(s)}/*"))
            or fsutil.list_sizes(fmt.join(output, f"{fmt.BAD_DIR}/shard-{s:05d}/*"))}


def _empty_files(plan: BuildPlan) -> EmptyInput | None:
    empty = tuple((i.path, 0, 0) for i in plan.inputs if i.size == 0)
    return EmptyInput(files=empty) if empty else None


@dataclasses.dataclass(frozen=True)
class Planned:
    """A plan made from the inputs and options alone (nothing read from or written to ``--output`` yet)."""

    output: str
    plan: BuildPlan
    tokenizer: TokenizerSpec


def plan_build(args: Arguments) -> Planned:
    """Check ``--output``'s path, match the inputs, resolve the tokenizer and plan. Raises BuildError."""
    options, output = args.options, args.output
    check_output(output)
    remote.check_access([absolute(p) for p in options.input] + [output])
    files = match_inputs(options.input)
    try:
        tok = resolve(options.tokenizer).with_backend(options.tokenizer_backend, options.verify_every)
        if tok.backend == "fast":
            preflight(tok)  # fail before writing anything, rather than in every worker
    except TokenizerError as e:
        raise BuildError(str(e)) from e
    config = chunk_config(options)
    if config.append_eos and tok.eos_id is None:
        raise BuildError(f"--append_eos: tokenizer {options.tokenizer!r} has no end-of-sequence token")
    plan = make_plan(tok.identity(), config, files)
    if not options.allow_empty and (empty := _empty_files(plan)) is not None:
        raise BuildError(empty.message(output))
    return Planned(output=output, plan=plan, tokenizer=tok)


def reconcile_output(planned: Planned) -> Prepared:
    """Reconcile the plan with what ``--output`` holds and write the plan ledger (hold the build lock)."""
    output = planned.output
    try:
        return _reconcile_and_write(planned.plan, planned.tokenizer, output)
    except OSError as e:
        raise EnvironmentFault(faults.explain(e, output) or f"cannot write into --output {output}: {e}. "
                               f"{faults.RERUN}") from e


def prepare(args: Arguments) -> Prepared:
    """:func:`plan_build`, then :func:`reconcile_output` (see the module doc). Raises BuildError."""
    return reconcile_output(plan_build(args))


def _reconcile_and_write(plan: BuildPlan, tok: TokenizerSpec, output: str) -> Prepared:
    old = status.read_ledger(output)
    finished = old if old is not None and old.get("finished") else None
    if old is not None:
        if finished is not None and old.get("format_version") != fmt.FORMAT_VERSION:
            return Prepared(output=output, plan=plan, tokenizer=tok, resumed=True, finished=old, old_format=True)
        changed = {inp.shard for o, inp in zip(old["inputs"], plan.inputs) if o.get("size") != inp.size}
        plan = reconcile(plan, old, output, _shards_with_files(output, changed) if changed else set())
    tok = ship_tokenizer(output, tok)
    if finished is None and (old is None or fmt.dumps_ledger(old) != fmt.dumps_ledger(plan.ledger())):
        status.write_ledger(output, plan.ledger())
    if old is not None:
        LOG.warning("%s %s", "verifying the finished cache in" if finished else "resuming the unfinished build in",
                    output)
    status.clear_failure(output)
    return Prepared(output=output, plan=plan, tokenizer=tok, resumed=old is not None, finished=finished)
