"""Typical command-line mistakes for a parser, each with the fix its error must name (the builder's and the
reader's command lines: tests/pipelines/test_pipelines_options.py, tests/reader/cli/test_reader_cli.py).

For every long option: the name with two neighbouring letters swapped (``--tokenzier``) must get "did you
mean --tokenizer". For every option with choices: a choice with one letter more (``chats``) must get
"did you mean --record_format chat", and a word far from every choice the list of choices.
"""

from __future__ import annotations

import argparse


def typo(option: str) -> str:
    """``--name`` with the two letters in the middle of its name swapped (one edit), or one doubled if equal."""
    name = option[2:]
    i = max(1, len(name) // 2)
    if name[i - 1] == name[i]:
        return "--" + name[:i] + name[i] + name[i:]
    return "--" + name[:i - 1] + name[i] + name[i - 1] + name[i + 1:]


def required_argv(parser: argparse.ArgumentParser) -> list[str]:
    """Values for ``parser``'s positionals and required options, so that parsing gets past them."""
    argv: list[str] = []
    for a in parser._actions:
        if not a.option_strings and not isinstance(a, argparse._SubParsersAction):
            argv.append("C")
        elif a.required:
            argv += [a.option_strings[0], str(a.choices[0] if a.choices else "1")]
    return argv


def mistakes(parser: argparse.ArgumentParser) -> list[tuple[list[str], str]]:
    """``(argv, fix)`` pairs: ``argv`` (after the command's required arguments) holds one mistake, and the
    error must say ``fix``."""
    out = []
    for a in parser._actions:
        longs = [o for o in a.option_strings if o.startswith("--") and o not in ("--help", "--debug")]
        if not longs:
            continue
        name = longs[0]
        value = [] if a.nargs == 0 else [str(a.choices[0]) if a.choices else "1"]
        out.append(([typo(name), *value], f"did you mean {name}"))
        if a.choices:
            choice = str(list(a.choices)[-1])
            out.append(([name, choice + "s"], f"did you mean {name} {choice}?"))
            out.append(([name, "qqqqqqqq"], "(choose from " + ", ".join(map(str, a.choices)) + ")"))
    return out
