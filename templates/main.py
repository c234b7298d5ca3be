"""Flex Template entry point: the launcher runs ``python main.py --name=value ... [Beam options]``.

The Dataflow launcher passes the template parameters (templates/metadata.json) and the job's Beam options
(``--runner=DataflowRunner --project=... --region=... --temp_location=... --sdk_container_image=...``) as
``--name=value`` flags. The builder is installed in the image (templates/Dockerfile), so the launcher and
the workers run the same code.

A template parameter always carries a value, so boolean switches of the command line (``--append_eos``)
arrive as ``--append_eos=true`` / ``--append_eos=false``; :func:`template_argv` turns them back into the
command-line form. Everything else is passed through unchanged.

The launcher only *describes* the job: Beam writes the job graph (``--template_location``, or nothing
with ``--dry_run``) and the Dataflow service runs it. The builder's last step runs inside that job (it
rewrites ``ledger.json`` with ``"finished": true``); ``build_cache.run`` knows that and returns as soon as
the description is written.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

TRUE = ("true", "1", "yes")
FALSE = ("false", "0", "no", "")


def _switches(parser) -> dict[str, argparse.Action]:
    """Option string -> action, for the builder parser's value-less switches (store_true / store_false)."""
    return {opt: action for opt, action in parser.options.items()
            if action.nargs == 0 and isinstance(action.const, bool)}


def template_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--switch=true`` -> ``--switch``; ``--switch=false`` -> dropped; other arguments unchanged."""
    switches = _switches(parser)
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if eq and name in switches:
            v = value.strip().lower()
            if v in TRUE:
                out.append(name)
            elif v not in FALSE:
                raise SystemExit(f"error: {name} takes true or false, got {value!r}")
            continue
        out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from pipelines import build_cache

    # With --template_location / --dry_run the builder writes the job description and returns without
    # waiting; the Dataflow job's last step finishes ledger.json.
    build_cache.main(template_argv(list(sys.argv[1:] if argv is None else argv), build_cache.build_arg_parser()))


if __name__ == "__main__":
    main()
