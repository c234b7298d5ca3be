"""What the launcher reads and writes before the job starts: inputs, tokenizer, existing cache, plan.

:func:`plan_build` checks ``--output``, matches and checks the input files (:mod:`pipelines.inputs.matching`:
formats, Parquet and Arrow layouts), resolves the tokenizer and plans the build (:func:`pipelines.plan.make_plan`,
pure); :func:`reconcile_output` reconciles the plan with what ``--output`` already holds
(:func:`pipelines.plan.reconcile`): nothing (write the plan ledger), the same build unfinished (resume),
the same build finished (verify it, and repair what is damaged), or another build (refuse). A split build
does this for each of its caches (``OUTPUT/train``, ``OUTPUT/validation``) after writing
``OUTPUT/splits.json``; a plain build and a split build never share an ``--output``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any, Sequence

from reader.format import checks
from reader.format import spec as fmt
from reader.format.splits import SPLIT_NAMES, SPLITS_MANIFEST_NAME, SplitSpec, cache_root
from reader.storage import files

from pipelines import faults, status
from pipelines import filesystem
from pipelines.inputs import keys
from pipelines.inputs import gcs_check
from pipelines.inputs.matching import match_inputs, plan_inputs
from pipelines.errors import BuildError, EnvironmentFault
from pipelines.ledger import EmptyInput
from pipelines.filesystem import absolute, is_remote
from pipelines.options import Arguments, chunk_config, split_spec
from pipelines.plan import BuildPlan, check_ledger, make_plan, reconcile, shape_change
from pipelines.tokenize.fast_tokenizer import preflight
from pipelines.tokenize import chat_template
from pipelines.tokenize.tokenizer import TokenizerError, TokenizerSpec, resolve, warn_if_guessed

LOG = logging.getLogger("chunkledger.build")

TOKENIZER_FILE = "tokenizer.json"  # Hugging Face builds: the tokenizer's JSON, at the cache root
INDEX_DIR = "index"  # reader.storage.index.INDEX_DIR, the reader's files in a cache (not imported: a light launcher)
# Finished caches a rerun checks against their inputs: sidecars record what they were built from from
# version 2 on (a version 1 cache is left as it is).
CHECKABLE = tuple(v for v in fmt.READABLE_FORMAT_VERSIONS if v >= fmt.BASE_FORMAT_VERSION)


def check_output(output: str) -> None:
    """A local ``--output`` must be a directory or not exist yet (its parent not a file), and hold nothing
    but what builds write (:func:`check_output_tree`)."""
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
    if os.path.isdir(output):
        check_output_tree(output)


# What builds write into an output (a cache, or a split build's two), by the entry's place in the tree:
# True for a regular file, a dict for a directory. Any name under ``index/`` is the reader's.
_SHARD = re.compile(r"shard-\d{5,}")
_CACHE: dict[Any, Any] = {
    fmt.LEDGER_NAME: True, TOKENIZER_FILE: True, fmt.FAILED_NAME: True,
    re.compile(r"table-[0-9a-f]{16}\.bin"): True,
    fmt.CHUNKS_DIR: {_SHARD: {re.compile(r"chunk-\d{6,}\.(parquet|json|entry)"): True, fmt.SHARD_DONE_NAME: True}},
    fmt.BAD_DIR: {_SHARD: {re.compile(r"chunk-\d{6,}\.jsonl"): True}},
    INDEX_DIR: None,  # the reader's
}
_OUTPUT = {**_CACHE, SPLITS_MANIFEST_NAME: True, **{name: _CACHE for name in SPLIT_NAMES},
           re.compile(re.escape(fmt.LOCK_NAME) + r".*"): True}


def check_output_tree(output: str) -> None:
    """Refuse (one line naming the entry) an output holding a symlink anywhere below it (chunks would be
    written through it, outside the cache), or an entry no build writes. Temporary files (``.tmp-*``), the
    reader's ``index/`` and the lock (a stale one too) are expected."""
    def walk(path: str, rules: dict[Any, Any] | None) -> None:
        with os.scandir(path) as entries:
            for e in entries:
                if e.is_symlink():
                    raise BuildError(f"--output {output} holds a symlink, {e.path} -> {os.readlink(e.path)}; a build "
                                     "writes only into its own directories: remove the link, or use another --output")
                rule = _rule(rules, e.name) if rules is not None else None
                if rules is not None and (rule is False or (rule is True) != e.is_file()):
                    raise BuildError(f"--output {output} holds {e.path}, which no build writes; use another "
                                     "--output (a new or empty directory), or move it away")
                if e.is_dir():
                    walk(e.path, rule if isinstance(rule, dict) else None)

    walk(output, _OUTPUT)


def _rule(rules: dict[Any, Any], name: str) -> Any:
    """What ``name`` may be in a directory with ``rules``: True a file, a dict or None a directory, False nothing."""
    if name.startswith(fmt.TMP_PREFIX):
        return True
    if name in rules:
        return rules[name]
    return next((r for k, r in rules.items() if isinstance(k, re.Pattern) and k.fullmatch(name)), False)


def ship_tokenizer(roots: Sequence[str], tok: TokenizerSpec) -> TokenizerSpec:
    """A Hugging Face tokenizer's JSON goes into each cache; workers load it from the first."""
    if tok.kind != "huggingface":
        return tok
    paths = [fmt.join(root, TOKENIZER_FILE) for root in roots]
    for path in paths:
        if filesystem.read_or_none(path) != tok.payload.encode("utf-8"):
            filesystem.write_atomic(path, tok.payload.encode("utf-8"))
    return tok.shipped_as(paths[0])


def _split_text(fraction: float, seed: int) -> str:
    return f"--validation_fraction {fraction!r}" + (f" --split_seed {seed}" if seed else "")


def check_layout(output: str, split: SplitSpec | None) -> bool:
    """Refuse (BuildError) unless ``output`` is empty or holds this kind of build: a plain cache, or a split
    build with the same fraction and seed. True if ``output`` holds this split build's manifest already."""
    path = fmt.join(output, SPLITS_MANIFEST_NAME)
    raw = filesystem.read_or_none(path)
    manifest = None
    if raw is not None:
        try:
            manifest = checks.load_json(raw, checks.STATUS_JSON_DEPTH)
            held = _split_text(float(manifest["validation_fraction"]), int(manifest["seed"]))
        except (ValueError, KeyError, TypeError) as e:
            raise BuildError(f"{path} is damaged ({type(e).__name__}: {e}); use another --output, or delete "
                             f"{output} to rebuild") from e
    if split is None:
        if manifest is not None:
            raise BuildError(
                f"{output} holds a split build ({held}: caches {output}/train and {output}/validation). "
                "Rerun with those options to resume it, or use another --output.")
        return False
    if status.read_ledger(output) is not None:
        raise BuildError(
            f"{output} already holds a cache built without --validation_fraction; a split build writes "
            f"{output}/train and {output}/validation. Use another --output, delete {output} to rebuild, or "
            "rerun without --validation_fraction to resume it.")
    if manifest is not None and manifest != split.manifest():
        raise BuildError(
            f"{output} holds a split build with {held}, this run asks for "
            f"{_split_text(split.validation_fraction, split.seed)}. Refusing to mix them: rerun with the "
            f"original options to resume, use another --output, or delete {output} to rebuild.")
    return manifest is not None


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A build ready to run: the plan ledgers (or the finished ledgers being verified) are in place."""

    output: str
    plan: BuildPlan
    tokenizer: TokenizerSpec  # as workers load it
    resumed: bool  # ``output`` held this build's ledger(s) already
    # cache name (None for a plain build) -> its finished ledger, for the caches that were finished when
    # planned (this run verifies and repairs them); None if none was
    finished: dict[str | None, dict[str, Any]] | None
    old_format: bool = False  # ``finished`` was written by an older format: nothing to verify against

    @property
    def complete(self) -> bool:
        """Every cache of the build was finished: this run only verifies (and repairs) them."""
        return self.finished is not None and len(self.finished) == len(self.plan.caches())


def _shards_with_files(output: str, shards: set[int]) -> set[int]:
    return {s for s in shards
            if filesystem.list_sizes(fmt.join(output, f"{fmt.shard_dir(s)}/*"))
            or filesystem.list_sizes(fmt.join(output, f"{fmt.BAD_DIR}/shard-{s:05d}/*"))}


def _empty_files(plan: BuildPlan) -> EmptyInput | None:
    empty = tuple((i.path, 0, 0) for i in plan.inputs if i.size == 0)
    return EmptyInput(files=empty) if empty else None


def resolve_chat_template(path: str, tok: TokenizerSpec) -> tuple[str, dict[str, Any]]:
    """A chat build's template: its source and its identity for the ledger's ``config.chat_template``
    (``sha256`` of its UTF-8 bytes, ``source``: the file, or ``tokenizer_config.json``, and the ``bos_token`` /
    ``eos_token`` it is given). ``path`` is ``--chat_template`` (local or gs://; empty: the Hugging Face
    tokenizer's own). Raises BuildError: no template, one that does not compile, or a bos/eos token that
    is not a special token of the tokenizer (a template could not write it as one)."""
    config = _tokenizer_config(tok)
    if path:
        where = absolute(path)
        raw = filesystem.read_or_none(where, limit=files.MAX_SMALL_FILE_BYTES)
        if raw is None:
            raise BuildError(f"--chat_template {path}: no such file")
        try:
            source = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BuildError(f"--chat_template {path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    else:
        where = TOKENIZER_CONFIG
        source = chat_template.template_from_config(config) if config else None
        if not source:
            what = ("a tiktoken encoding has no chat template" if tok.kind == "tiktoken" else
                    f"its {TOKENIZER_CONFIG} has no chat_template")
            raise BuildError(f"--record_format chat with tokenizer {tok.spec!r}: {what}; pass --chat_template FILE "
                             "(a Jinja2 template, docs/SFT.md)")
    try:
        chat_template.compile_template(source)
    except chat_template.ChatTemplateError as e:
        raise BuildError(f"chat template {where}: {e}") from e
    from pipelines.chunking.supervised import sft_encoders  # the tokenizer libraries: only for a chat build

    specials = sft_encoders(tok.load_reference(tok.payload), source)[0].special_ids
    bos = _config_token(config, "bos_token")
    for name, token, fix in (("bos_token", bos, f"fix its {TOKENIZER_CONFIG}"),
                             ("eos_token", tok.eos_token, "choose another with --eos_token")):
        if token is not None and token not in specials:
            raise BuildError(f"tokenizer {tok.spec!r}: its {name} {token!r} is not one of its special tokens, so the "
                             f"chat template could not write it as one; {fix}")
    identity = {"sha256": fmt.checksum(source.encode("utf-8")), "source": where, "bos_token": bos,
                "eos_token": tok.eos_token}
    return source, identity


TOKENIZER_CONFIG = "tokenizer_config.json"


def _tokenizer_config(tok: TokenizerSpec) -> str | None:
    """The text of a Hugging Face tokenizer's tokenizer_config.json, None if it has none (or is tiktoken)."""
    if tok.kind != "huggingface":
        return None
    from reader.tokenizers import tokenizer_files, tokenizer_lib

    spec = tok.spec
    try:
        form = tokenizer_lib.classify(spec)
        if form == "hub":
            return tokenizer_files.hub_files(spec)[1]
        if form == "url":
            return tokenizer_files.url_files(spec, filesystem.read_or_none)[1]
        local = os.path.expanduser(spec)
        folder = local if os.path.isdir(local) else os.path.dirname(local)
        config = os.path.join(folder, TOKENIZER_CONFIG)
        if os.path.isfile(config):
            return files.read_local(config, limit=files.MAX_SMALL_FILE_BYTES).decode("utf-8", errors="replace")
    except TokenizerError:
        pass
    return None


def _config_token(config: str | None, name: str) -> str | None:
    """A token of tokenizer_config.json (``bos_token``: a string, or a dict with ``content``), or None."""
    try:
        value = json.loads(config).get(name) if config else None
    except (ValueError, AttributeError):
        return None
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) and value else None


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
    gcs_check.check_access([absolute(p) for p in options.input] + [output])
    files = match_inputs(options.input)
    try:
        tok = resolve(options.tokenizer, eos=options.eos_token).with_backend(options.tokenizer_backend,
                                                                            options.verify_every)
        warn_if_guessed(tok)
        if tok.backend in ("fast", "gigatoken"):
            preflight(tok)  # fail before writing anything, rather than in every worker
    except TokenizerError as e:
        raise BuildError(str(e)) from e
    template = None
    if options.record_format == keys.CHAT:
        source, template = resolve_chat_template(options.chat_template, tok)
        tok = dataclasses.replace(tok, chat_template=source)
    config = chunk_config(options, template)
    split = split_spec(options)
    if config.append_eos and tok.eos_id is None:
        raise BuildError(f"--append_eos: tokenizer {options.tokenizer!r} has no end-of-sequence token; name one "
                         "with --eos_token TOKEN|ID")
    plan = make_plan(tok.identity(), config, plan_inputs(files, config), split=split)
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


def _read_ledger(root: str) -> dict[str, Any] | None:
    """The ledger in ``root``, its numbers checked (:func:`pipelines.plan.check_ledger`), or None."""
    path = fmt.join(root, fmt.LEDGER_NAME)
    try:
        old = status.read_ledger(root)
    except (OverflowError, TypeError, KeyError, AttributeError) as e:  # a hand-edited ledger the parser took
        raise BuildError(f"{path}: damaged ({type(e).__name__}: {str(e)[:100]}). Restore it, or delete {root} to "
                         "rebuild the cache") from e
    if old is not None:
        check_ledger(old, path)
    return old


def _reconcile_and_write(plan: BuildPlan, tok: TokenizerSpec, output: str) -> Prepared:
    has_manifest = check_layout(output, plan.split)
    caches = plan.caches()
    roots = {name: cache_root(output, name) for name, _ in caches}
    olds = {name: _read_ledger(root) for name, root in roots.items()}
    finished = {name: old for name, old in olds.items() if old is not None and old.get("finished")}
    if len(finished) == len(caches) and all(o.get("format_version") not in CHECKABLE for o in finished.values()):
        return Prepared(output=output, plan=plan, tokenizer=tok, resumed=True, finished=finished, old_format=True)
    # a finished ledger of an older format beside an unfinished one (a split build): resumed as unfinished
    finished = {name: old for name, old in finished.items() if old.get("format_version") in CHECKABLE}
    if any(old is not None for old in olds.values()):
        existing = next(old for old in olds.values() if old is not None)
        # an older cache's keys, and its format version (a rerun writes the version the cache has)
        plan = dataclasses.replace(plan, config=plan.config.as_in(existing["config"]),
                                   resumes=existing.get("format_version"))
        caches = plan.caches()
        trusted = None
        for name, cache_plan in caches:
            old, root = olds[name], roots[name]
            if old is None:  # nothing to trust a cache without a ledger by
                trusted = frozenset()
                continue
            if name not in finished:
                old = {**old, "finished": False}
            changed = {inp.shard for o, inp in zip(old["inputs"], plan.inputs) if shape_change(o, inp)}
            with_files = {s for r in roots.values() for s in _shards_with_files(r, changed)} if changed else set()
            mine = reconcile(cache_plan, old, root, with_files, list(roots.values()))
            trusted = mine.trusted if trusted is None else trusted & mine.trusted
        plan = dataclasses.replace(plan, trusted=trusted)
    if plan.split is not None and not has_manifest:  # first: from now on OUTPUT is known as a split build
        filesystem.write_atomic(fmt.join(output, SPLITS_MANIFEST_NAME), fmt.dumps(plan.split.manifest()).encode())
    tok = ship_tokenizer(list(roots.values()), tok)
    for name, cache_plan in plan.caches():
        old, ledger = olds[name], cache_plan.ledger()
        if name not in finished and (old is None or fmt.dumps_ledger(old) != fmt.dumps_ledger(ledger)):
            status.write_ledger(roots[name], ledger)
    resumed = any(old is not None for old in olds.values())
    if resumed and len(finished) == len(caches):  # routine: the summary says what was checked
        LOG.info("verifying the finished cache in %s", output)
    elif resumed:
        LOG.warning("resuming the unfinished build in %s", output)
    status.clear_failure(output)
    return Prepared(output=output, plan=plan, tokenizer=tok, resumed=resumed, finished=finished or None)
