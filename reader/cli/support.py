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
import os
import re
import select
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
EXIT_SIGPIPE = 128 + 13  # what a shell reports for a command whose output's reader went away

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
MAX_TYPO = 2  # edits: a mistyped option or choice within this many gets "did you mean"


def add_pass_rule(p: argparse.ArgumentParser) -> None:
    """``--pass_rule``, wherever read options come from the command line."""
    p.add_argument("--pass_rule", choices=PASS_RULES, default=None,
                   help="how a training read covers the data: spans (every pass serves each row once) or streams "
                        "(loops per stream; follows a running build). Default: spans for caches of format version "
                        "4 on, streams for older ones (ReadOptions.pass_rule); must match the run")


def finish_parsers(parser: argparse.ArgumentParser, sub, examples: dict[str, list[str]] | None = None) -> None:
    """Give every subcommand ``--debug``, its examples (``examples``, default :data:`EXAMPLES`, by subcommand
    name), the exit status in ``--help`` and :func:`two_line_errors`."""
    examples = EXAMPLES if examples is None else examples
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    two_line_errors(parser)
    parser.epilog = _wrap(EXIT_HELP)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for name, p in sub.choices.items():
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error (errors are otherwise one or two lines)")
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        two_line_errors(p)
        for action in p._actions:
            if action.dest in _AT_LEAST and action.type in (int, float):
                action.type = _at_least(action.type, _AT_LEAST[action.dest])
        p.description = p.description or DESCRIPTIONS.get(name)
        if p.description:
            p.description = "\n\n".join(_wrap(par) for par in p.description.split("\n\n"))
        lines = [f"  {ex}" for ex in examples.get(name, [])]
        p.epilog = ("example:\n" if len(lines) == 1 else "examples:\n") * bool(lines) + "\n".join(lines) \
            + ("\n\n" if lines else "") + _wrap(EXIT_HELP)


def two_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make ``parser``'s usage errors two lines instead of argparse's usage block (``--help`` has it): the
    error with its fix (:func:`explain`), then where the details are. Shared by every command line."""
    parse = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        parser._given = list(sys.argv[1:] if args is None else args)  # what explain() looks through
        return parse(args, namespace)

    parser.parse_known_args = parse_known_args
    parser.error = functools.partial(_usage_error, parser)


def _usage_error(parser: argparse.ArgumentParser, msg: str) -> None:
    """argparse's error, explained, then where ``--help`` is (the command's own, if one was named)."""
    where = _command(parser) or parser
    parser.exit(EXIT_ERROR, f"{where.prog}: error: {explain(parser, msg)}\n(see {where.prog} --help)\n")


def _command(parser: argparse.ArgumentParser) -> argparse.ArgumentParser | None:
    """The subcommand's parser named on the command line, if any (the top parser reports its leftovers)."""
    given = getattr(parser, "_given", [])
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return next((action.choices[w] for w in given if w in action.choices), None)
    return None


def edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of two neighbours that turn ``a`` into ``b``."""
    prev2, prev = [], list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def close_matches(word: str, candidates, max_distance: int = MAX_TYPO) -> list[str]:
    """The candidates within ``max_distance`` edits of ``word`` (case aside), nearest first."""
    scored = sorted((edit_distance(word.lower(), c.lower()), c) for c in set(candidates))
    return [c for d, c in scored if d <= max_distance and c != word]


def explain(parser: argparse.ArgumentParser, msg: str) -> str:
    """argparse's message ``msg`` with the fix: "did you mean" when the mistake is a typo of a real option or
    choice, else the valid choices."""
    parsers = [parser] + [_command(parser)] * (_command(parser) is not None)
    options = [o for p in parsers for a in p._actions for o in a.option_strings if o.startswith("--")]
    given = getattr(parser, "_given", [])
    m = re.fullmatch(r"argument (\S+): invalid choice: '(.*)' \(choose from .*\)", msg, re.S)
    if m:
        name, value = m.groups()
        action = next((a for a in parser._actions if a.choices and name in (*a.option_strings, a.dest, a.metavar)),
                      None)
        choices = [str(c) for c in action.choices] if action is not None else []
        close = close_matches(value, choices)
        if close:
            shown = f"{name} {close[0]}" if name.startswith("-") else close[0]
            return f"argument {name}: invalid choice: '{value}'; did you mean {shown}?"
        return f"argument {name}: invalid choice: '{value}' (choose from {', '.join(choices)})" if choices else msg
    m = re.fullmatch(r"the following arguments are required: (.*)", msg)
    if m:
        missing = m.group(1).split(", ")
        for word in given:
            name = word.split("=", 1)[0]
            close = close_matches(name, missing) if name.startswith("--") and name not in options else []
            if close:
                return f"unknown option {name}; did you mean {close[0]}? ({close[0]} is required)"
        commands = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                         and a.dest in missing), None)
        if commands is not None:  # no command given: name them
            return f"{msg} (one of {', '.join(commands.choices)})"
        return msg
    m = re.fullmatch(r"unrecognized arguments: (.*)", msg)
    if m:
        for word in m.group(1).split():
            close = close_matches(word.split("=", 1)[0], options) if word.startswith("--") else []
            if close:
                return f"{msg}; did you mean {close[0]}?"
    return msg


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


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has gone (a BrokenPipeError may also be a socket's)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), 0)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() here, or no descriptor: assume it was stdout
        return True


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
        code = fn(args)
        sys.stdout.flush()  # here, where a reader gone away (| head) is handled below
        return code
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        # as a command killed by SIGPIPE: no message; the interpreter's last flush must not fail either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SIGPIPE
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
