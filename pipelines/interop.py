"""Command line: ``python -m pipelines.interop import-megatron|import-flat-tokens|tokenizer-identity``.

Also installed as the ``chunkledger-interop`` script.

The reader's imports (``python -m reader import-megatron|import-flat-tokens``, docs/INTEROP.md) take the
tokenizer's identity from a cache or a JSON file (``--tokenizer_from``), because computing it needs the
tokenizer's library, which ``reader/`` never imports. Here the identity is computed from a tokenizer spec,
exactly as the builder computes it (``pipelines.tokenize.tokenizer.resolve(SPEC).identity()``):

* ``import-megatron``, ``import-flat-tokens``  the reader's commands, with the same options and the same
  output, but ``--tokenizer SPEC`` instead of ``--tokenizer_from``.
* ``tokenizer-identity SPEC``  print the identity as JSON (or write it to ``--out FILE.json``), the file
  that ``python -m reader import-* --tokenizer_from FILE.json`` takes.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from reader.cli import support as cli_support
from reader.format import spec as fmt
from reader.interop import import_flat_tokens
from reader.interop import import_megatron
from reader.interop.export import write_file

from pipelines.tokenize.tokenizer import resolve, warn_if_guessed

SPEC_HELP = ("'tiktoken:<encoding>', a Hugging Face tokenizer.json file or a directory holding one (local or "
             "gs://...), or a hub name ORG/NAME (needs transformers, and network access or the local hub cache): as "
             "the builder's --tokenizer")
EOS_HELP = ("the end-of-sequence token (a token, or its id), as the builder's --eos_token (default: the one the "
            "tokenizer declares, else a guess, with a warning)")
EXAMPLES = {
    "import-megatron": ["python -m pipelines.interop import-megatron /data/megatron/web_text_document --tokenizer "
                        "tiktoken:cl100k_base --append_eos --out ./cache"],
    "import-flat-tokens": ["python -m pipelines.interop import-flat-tokens data.zarr --tokenizer ./my-tokenizer/ "
                           "--out ./cache"],
    "tokenizer-identity": ["python -m pipelines.interop tokenizer-identity tiktoken:cl100k_base --out cl100k.json",
                           "python -m reader import-megatron /data/megatron/web_text_document --tokenizer_from "
                           "cl100k.json --out ./cache"],
}


def identity(spec: str, eos: str | None = None) -> dict[str, Any]:
    """The ledger's ``tokenizer`` object for ``spec``: what a build with ``--tokenizer spec [--eos_token eos]``
    records."""
    tok = resolve(spec, eos=eos)
    warn_if_guessed(tok)
    return tok.identity()


def identity_from_spec(args: argparse.Namespace) -> dict[str, Any]:
    return identity(args.tokenizer, args.eos_token)


def add_tokenizer_spec(parser: argparse.ArgumentParser) -> None:
    """``--tokenizer SPEC`` in place of the reader's ``--tokenizer_from`` (see
    ``reader.interop.importer.add_cache_arguments``)."""
    parser.add_argument("--tokenizer", required=True, metavar="SPEC",
                        help=f"the tokenizer the data was made with: {SPEC_HELP}. Its identity is recorded in the "
                             "ledger exactly as a build with it records it")
    parser.add_argument("--eos_token", default="", metavar="TOKEN|ID", help=EOS_HELP)
    parser.set_defaults(identity_of=identity_from_spec)


def cmd_identity(args: argparse.Namespace) -> int:
    text = fmt.dumps(identity(args.spec, args.eos_token))
    if args.out is None:
        sys.stdout.write(text)
        return 0
    write_file(args.out, lambda f: f.write(text.encode()))
    print(f"wrote {args.out}: the tokenizer identity of {args.spec}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.interop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    import_megatron.add_parser(sub, tokenizer=add_tokenizer_spec)
    import_flat_tokens.add_parser(sub, tokenizer=add_tokenizer_spec)
    t = sub.add_parser("tokenizer-identity",
                       help="print a tokenizer's identity (the ledger's tokenizer object) as JSON",
                       description="Print the identity a build with --tokenizer SPEC records in its ledger (spec, "
                                   "kind, name, vocab_size, eos_id, hash) as JSON, or write it to --out. python -m "
                                   "reader import-megatron / import-flat-tokens --tokenizer_from FILE.json take "
                                   "that file, so the reader needs no tokenizer library.")
    t.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    t.add_argument("--eos_token", default="", metavar="TOKEN|ID", help=EOS_HELP)
    t.add_argument("--out", metavar="FILE.json", default=None,
                   help="write the JSON here (local or gs://..., written whole or not at all) instead of stdout")
    t.set_defaults(fn=cmd_identity)
    cli_support.finish_parsers(p, sub, examples=EXAMPLES)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return cli_support.run(args.fn, args)


if __name__ == "__main__":
    sys.exit(main())
