"""How ``python -m reader`` helps and fails: descriptions and examples in ``--help``, exit codes, one-line
errors, ``--debug``.

Exit status: 0 done; 1 the cache is damaged (``validate``: problems found; any command: a chunk,
sidecar or ledger that does not match, :class:`reader.format.spec.DamagedCache`); 2 anything else that
stopped the command: a bad path or option, storage that cannot be reached, an output that exists...
The message (one or two lines on stderr) names the file or option and the fix; ``--debug`` prints the
traceback instead (same exit status). An exception that is none of these is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import textwrap
import traceback
from typing import Callable

from reader.format import spec as fmt
from reader.mixture.mixture import MaxPassesReached
from reader.order.passes import PASS_RULES
from reader.storage import remote

EXIT_DAMAGED = 1
EXIT_ERROR = 2

DESCRIPTIONS = {  # for the subcommands whose parser gives none
    "inspect": "Print what a cache holds: documents, tokens, chunks (and how many are empty), bytes, input "
               "shards, the tokenizer, bad-record counts, and percentiles of document length (from up to "
               "--max_chunks chunks spread over the cache) and of chunk size; the documents longer than "
               "--seq_len (what drop_long skips) and, for a cache with loss masks, the loss tokens' share. On a cache whose build is still "
               "running it shows the chunks written so far.",
    "validate": "Check every chunk of a cache against its ledger, read-only: the Parquet file's size and sha256 "
                "(on a mismatch: where it was truncated, or which row group or the footer changed), its "
                "sidecar, the Parquet layout and counts and, unless --quick, the decoded token columns. Each "
                "problem names the damaged file: a chunk, a sidecar, or ledger.json itself when an entry was "
                "changed by hand. Prints OK or one PROBLEM line per problem.",
}
EXAMPLES = {
    "inspect": ["python -m reader inspect ./cache",
                "python -m reader inspect gs://bucket/caches/web --json --max_chunks 0"],
    "validate": ["python -m reader validate ./cache                  # every chunk, token columns decoded",
                 "python -m reader validate gs://bucket/caches/web --quick --threads 16"],
    "batches": ["python -m reader batches ./cache --seq_len 2048 --batch_size 256 --shuffle_seed 0 --start 1000 "
                "--count 2 --out step1000.npz",
                "python -m reader batches ./cache --seq_len 64 --batch_size 4 --show"],
    "report": ["python -m reader report ./cache --out report/ --seq_len 2048 --batch_size 64 --shuffle_seed 0 "
               "--steps 1000",
               "python -m reader report mix.json --out mix-report/ --steps 5000"],
    "export": ["python -m reader export ./cache --format megatron --out /data/megatron/web_text_document",
               "python -m reader export ./split-build --format flat-tokens --out data.zarr"],
    "import-megatron": ["python -m reader import-megatron /data/megatron/web_text_document --tokenizer_from "
                        "./web-cache --append_eos --out ./cache",
                        "python -m reader import-megatron /data/megatron/code_text_document --tokenizer_from "
                        "cl100k.json --out ./code-cache"],
    "import-flat-tokens": ["python -m reader import-flat-tokens data.zarr --tokenizer_from cl100k.json "
                           "--out ./cache"],
}
EXIT_HELP = ("exit status: 0 done; 1 the cache is damaged (validate: problems found); 2 any other error (bad path "
             "or option, storage unreachable, no credentials). Errors are one or two lines; --debug shows the "
             "traceback.")
# integer options and their lower bounds, checked when parsed (the error names the option)
_AT_LEAST = {"threads": 1, "seq_len": 1, "batch_size": 1, "ideal_readers": 1, "num_readers": 1, "chunk_tokens": 1,
             "row_group_tokens": 1, "tokens_chunk_size": 1, "seq_starts_chunk_size": 1, "max_chunks": 0,
             "reader_index": 0, "start": 0, "count": 0, "wait_timeout_s": 0, "steps": 0, "rows": 0}
_QUIET_LOGGERS = ("gcsfs", "fsspec", "google", "urllib3", "aiohttp")


def add_pass_rule(p: argparse.ArgumentParser) -> None:
    """``--pass_rule``, wherever read options come from the command line."""
    p.add_argument("--pass_rule", choices=PASS_RULES, default=None,
                   help="how a training read covers the data: spans (every pass serves each row once) or streams "
                        "(loops per stream; follows a running build). Default: spans for caches of format version "
                        "4 on, streams for older ones (ReadOptions.pass_rule); must match the run")


def finish_parsers(parser: argparse.ArgumentParser, sub, examples: dict[str, list[str]] | None = None) -> None:
    """Give every subcommand ``--debug``, its examples (``examples``, default :data:`EXAMPLES`, by subcommand
    name) and the exit status in ``--help``."""
    examples = EXAMPLES if examples is None else examples
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.error = functools.partial(_usage_error, parser)
    parser.epilog = _wrap(EXIT_HELP)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for name, p in sub.choices.items():
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error (errors are otherwise one or two lines)")
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.error = functools.partial(_usage_error, p)
        for action in p._actions:
            if action.dest in _AT_LEAST and action.type in (int, float):
                action.type = _at_least(action.type, _AT_LEAST[action.dest])
        p.description = p.description or DESCRIPTIONS.get(name)
        if p.description:
            p.description = "\n\n".join(_wrap(par) for par in p.description.split("\n\n"))
        lines = [f"  {ex}" for ex in examples.get(name, [])]
        p.epilog = ("example:\n" if len(lines) == 1 else "examples:\n") * bool(lines) + "\n".join(lines) \
            + ("\n\n" if lines else "") + _wrap(EXIT_HELP)


def _usage_error(parser: argparse.ArgumentParser, msg: str) -> None:
    """argparse's error, in two lines instead of the usage block (``--help`` has it)."""
    parser.exit(EXIT_ERROR, f"{parser.prog}: error: {msg}\n(see {parser.prog} --help)\n")


def _at_least(kind: type, low: int) -> Callable[[str], int | float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _wrap(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), width=100)


def exit_code(e: BaseException) -> int | None:
    """The exit status for ``e``, or None for an unexpected exception (a bug: keep the traceback)."""
    if isinstance(e, fmt.DamagedCache):
        return EXIT_DAMAGED
    if isinstance(e, (fmt.FormatError, OSError, TimeoutError, ValueError, MaxPassesReached)) \
            or remote.is_storage_error(e):
        return EXIT_ERROR
    return None


def message(e: BaseException, where: str = "") -> str:
    """One or two lines for ``e``: its own message (which names the file), or for a raw storage error
    the URL ``where`` and the cause."""
    if remote.is_storage_error(e) and not isinstance(e, remote.StorageError) and type(e).__module__ != "builtins":
        return str(remote.storage_error(where or "storage", e))
    text = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return text


def run(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``fn(args)``, with errors reported as :func:`exit_code` and :func:`message` say (``args.debug``:
    raised, with their traceback)."""
    debug = bool(getattr(args, "debug", False))
    levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    if not debug:  # storage libraries log every retry and print tracebacks of their own
        for name in _QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return fn(args)
    except Exception as e:  # noqa: BLE001 - classified below; unknown ones are re-raised
        code = exit_code(e)
        if code is None:
            raise
        if debug:
            traceback.print_exc()
            return code
        where = " or ".join(str(w) for w in (getattr(args, "path", None), getattr(args, "out", None)) if w)
        print(f"error: {message(e, where)}", file=sys.stderr)
        return code
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
