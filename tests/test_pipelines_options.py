"""The builder's command line (pipelines/options.py)."""

from __future__ import annotations

from pipelines.options import build_arg_parser


def test_arg_parser_is_side_effect_free_and_documents_every_option():
    parser = build_arg_parser()
    names = {a.dest for a in parser._actions if a.dest != "help"}
    assert {"input", "output", "tokenizer", "text_key", "append_eos", "chunk_bytes", "row_group_tokens",
            "max_bad_fraction", "parquet_compression", "compression_level"} <= names
    assert all(a.help for a in parser._actions)
    args, rest = parser.parse_known_args(["--input", "a", "--input", "b", "--output", "o", "--tokenizer", "t",
                                          "--chunk_bytes", "64KiB", "--runner=FnApiRunner"])
    assert args.input == ["a", "b"] and args.chunk_bytes == 65536 and rest == ["--runner=FnApiRunner"]
