"""``python -m reader report`` (a cache or a mixture as one HTML page, :mod:`reader.report`) and the decoded
rows of ``python -m reader batches --show`` in the terminal."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Iterable

from reader.cli import support as cli_support
from reader.tokenizers import tokenizer_lib
from reader.format.spec import FormatError
from reader.interop.export import write_file
from reader.options import PACKINGS, ReadOptions
from reader.report import annotated_rows as rowlib
from reader.report.collect import collect

DEFAULT_STEPS = 100


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="write one HTML page showing a cache or mixture: summary, histograms, bad records, "
                       "decoded batches",
        description="Write DIR/index.html, one self-contained page (no network, no script) about a cache or a "
                    "mixture file: the summary of inspect and the build's progress, histograms of document length, "
                    "tokens per input shard and chunk sizes, bad records by reason with examples, the first rows of "
                    "batch 0 and batch N decoded (document starts, loss mask and padding marked), for a mixture the "
                    "share of each component against its weight, for a shuffled read where rows come from, and "
                    "the command that regenerates the page. It samples: at most --max_chunks chunks are read for "
                    "document lengths. On a running build it shows what exists. Needs matplotlib (the report "
                    "extra).")
    p.add_argument("path", help="cache root (local path or gs://bucket/cache), or a mixture file (*.json)")
    p.add_argument("--out", required=True, help="directory to write index.html into")
    p.add_argument("--seq_len", type=int, default=2048, help="tokens per example (default 2048)")
    p.add_argument("--batch_size", type=int, default=64, help="GLOBAL batch size (default 64)")
    p.add_argument("--ideal_readers", type=int, default=ReadOptions.ideal_readers,
                   help=f"R*, number of streams (default {ReadOptions.ideal_readers})")
    add_packing_arguments(p)
    p.add_argument("--shuffle_seed", type=int, default=None, help="growing-window shuffle seed")
    cli_support.add_pass_rule(p)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"N: show batch N besides batch 0; mixture shares and shuffle locality over steps 0..N "
                        f"(default {DEFAULT_STEPS})")
    p.add_argument("--rows", type=int, default=4, help="rows of each batch shown (default 4)")
    p.add_argument("--tokenizer", default=None,
                   help="decode with this tokenizer spec (default: the one the cache records)")
    p.add_argument("--max_chunks", type=int, default=64,
                   help="read document lengths from at most this many chunks, spread over the cache (default 64)")
    p.add_argument("--threads", type=int, default=8, help="parallel chunk reads")
    p.set_defaults(fn=cmd_report)


def regenerate_command(args: argparse.Namespace) -> str:
    """The command line that writes the same page, every read option spelled out."""
    argv = ["python", "-m", "reader", "report", args.path, "--out", args.out, "--seq_len", str(args.seq_len),
            "--batch_size", str(args.batch_size), "--ideal_readers", str(args.ideal_readers)]
    argv += packing_argv(args)
    argv += ["--shuffle_seed", str(args.shuffle_seed)] if args.shuffle_seed is not None else []
    argv += ["--pass_rule", args.pass_rule] if args.pass_rule is not None else []
    argv += ["--steps", str(args.steps), "--rows", str(args.rows), "--max_chunks", str(args.max_chunks)]
    argv += ["--tokenizer", args.tokenizer] if args.tokenizer is not None else []
    return shlex.join(argv)


def cmd_report(args: argparse.Namespace) -> int:
    try:
        from reader.report import page  # matplotlib, only here
    except ImportError as e:
        print(f"error: python -m reader report draws with matplotlib ({e}): pip install 'chunkledger[report]'",
              file=sys.stderr)
        return 2
    opts = ReadOptions(seq_len=args.seq_len, batch_size=args.batch_size, ideal_readers=args.ideal_readers,
                       shuffle_seed=args.shuffle_seed, pass_rule=args.pass_rule, **packing_options(args))
    data = collect(args.path, opts, args.steps, command=regenerate_command(args), tokenizer=args.tokenizer,
                   rows=args.rows, max_chunks=args.max_chunks, threads=args.threads)
    text = page.render(data).encode("utf-8")
    out = args.out.rstrip("/") + "/index.html"
    write_file(out, lambda f: f.write(text))
    print(f"wrote {out} ({len(text):,} bytes; {data.chunks_read:,} chunk files read)")
    return 0


# --------------------------------------------------------------------------------------------------
# How rows are made: the read options batches, report and inspect --read_batches share


def add_packing_arguments(p: argparse.ArgumentParser) -> None:
    """``--unpacked``, ``--packing``, ``--drop_long``, ``--best_fit_window_tokens``, ``--best_fit_continuations``,
    ``--max_segments``, ``--varlen`` and ``--view`` (the ``ReadOptions`` of the same names; :func:`packing_options`)."""
    p.add_argument("--packing", choices=PACKINGS, default=None,
                   help="how documents become rows: concat (documents concatenated, cut every seq_len tokens; "
                        "default), best_fit (each chunk's documents packed by best-fit decreasing: no document of "
                        "at most seq_len tokens is cut) or unpacked (one document piece per row)")
    p.add_argument("--unpacked", action="store_true", help="the older spelling of --packing unpacked (an alias)")
    p.add_argument("--drop_long", action="store_true",
                   help="with --packing unpacked or best_fit: skip documents longer than --seq_len instead of "
                        "cutting them")
    p.add_argument("--best_fit_window_tokens", type=int, default=ReadOptions.best_fit_window_tokens,
                   help="best_fit: pack each chunk per window of whole row groups of about this many tokens "
                        f"(default {ReadOptions.best_fit_window_tokens}); must match the run")
    p.add_argument("--best_fit_continuations", type=int, default=None,
                   help="best_fit: continuation pieces (tails of documents longer than --seq_len) per row, at most "
                        "(default: 4 for a cache of format version 4 or later, 1 for older ones); must match the run")
    p.add_argument("--max_segments", type=int, default=None,
                   help="at most this many document pieces per row (best_fit or unpacked); must match the run")
    p.add_argument("--varlen", action="store_true",
                   help="add cu_seqlens and max_seqlen (varlen attention's form of the rows; needs --max_segments)")
    p.add_argument("--view", metavar="VIEW", default=None,
                   help="read only the documents VIEW keeps (ReadOptions.view's syntax, e.g. \"not exact_duplicate and "
                        "dump in ['CC-MAIN-2024-10']\"; docs/CURATION.md); inspect also shows the documents and tokens it "
                        "keeps and drops, in all and per input")


def packing_options(args: argparse.Namespace) -> dict:
    """``ReadOptions`` keywords of :func:`add_packing_arguments`' options."""
    return {"packing": packing_of(args), "drop_long": args.drop_long,
            "best_fit_window_tokens": args.best_fit_window_tokens, "best_fit_continuations": args.best_fit_continuations,
            "max_segments": args.max_segments, "varlen": args.varlen, "view": args.view}


def packing_of(args: argparse.Namespace) -> str:
    """The read's packing: ``--packing``, or ``unpacked`` for its alias ``--unpacked`` (given both, they agree)."""
    if args.unpacked and args.packing not in (None, "unpacked"):
        raise ValueError(f"--packing {args.packing} packs rows; --unpacked (the older spelling of --packing unpacked) "
                         "reads one document piece per row. Drop one of them.")
    return "unpacked" if args.unpacked else args.packing or "concat"


def packing_argv(args: argparse.Namespace) -> list[str]:
    """:func:`add_packing_arguments`' options as given, spelled out (those not at their defaults)."""
    out = ["--packing", packing_of(args)] * (packing_of(args) != "concat")
    out += ["--drop_long"] * args.drop_long
    if args.best_fit_window_tokens != ReadOptions.best_fit_window_tokens:
        out += ["--best_fit_window_tokens", str(args.best_fit_window_tokens)]
    for name in ("best_fit_continuations", "max_segments"):
        out += [f"--{name}", str(getattr(args, name))] if getattr(args, name) is not None else []
    return out + ["--varlen"] * args.varlen + ["--view", args.view] * (args.view is not None)


# --------------------------------------------------------------------------------------------------
# batches --show


def add_show_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--show", action="store_true",
                   help="print the rows decoded: | between documents, [masked tokens], · padding (colours on a "
                        "terminal)")
    b.add_argument("--tokenizer", default=None,
                   help="with --show: decode with this tokenizer spec (default: the one the cache records)")


def show_rows(reader, got: Iterable[tuple[int, dict]], tokenizer: str | None, out=None) -> None:
    """Print this reader's rows of the batches ``got`` decoded (:func:`reader.report.annotated_rows.terminal_row`)."""
    out = out or sys.stdout
    source = reader.cache
    first = source.caches[0] if hasattr(source, "caches") else source  # a mixture's tokenizer is every component's
    names = getattr(source, "names", None) if hasattr(source, "caches") else None
    try:
        tok = tokenizer_lib.for_cache(first, tokenizer)
        decode = rowlib.ids_decoder(tok.decode)
    except (tokenizer_lib.TokenizerError, FormatError) as e:
        if tokenizer is not None:
            raise
        print(f"note: showing token ids: {e}", file=sys.stderr)
        decode = rowlib.ids_decoder(None)
    colour = _is_terminal(out)
    for b, batch in got:
        for i, row in enumerate(reader.my_rows.tolist()):
            if not bool(batch["valid"][i]):
                continue
            comp = int(batch["components"][i])
            where = f", component {names[comp]}" if names is not None and comp >= 0 else ""
            head = (f"batch {b} row {row} (example {int(batch['example_ids'][i])}, epoch {int(batch['epochs'][i])}"
                    f"{where})")
            text = rowlib.terminal_row(rowlib.batch_row_pieces(batch, i, decode), colour=colour)
            print(f"\x1b[1m{head}\x1b[0m" if colour else head, file=out)
            print(text, file=out)


def _is_terminal(out) -> bool:
    try:
        return out.isatty() and "NO_COLOR" not in os.environ
    except (AttributeError, ValueError):
        return False
