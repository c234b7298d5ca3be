"""The builder's command line (pipelines/options.py)."""

from __future__ import annotations

from pipelines.options import build_arg_parser


def test_arg_parser_is_side_effect_free_and_documents_every_option():
    parser = build_arg_parser()
    names = {a.dest for a in parser.options.values()}
    assert {"input", "output", "tokenizer", "text_key", "append_eos", "eos_token", "chunk_bytes", "row_group_tokens",
            "max_bad_fraction", "parquet_compression", "compression_level"} <= names
    assert all(a.help for a in parser.options.values())
    # parser.options is every option argparse knows (checked here through its internals, which the code avoids)
    assert set(parser.options) == {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}
    args, rest = parser.parse_known_args(["--input", "a", "--input", "b", "--output", "o", "--tokenizer", "t",
                                          "--chunk_bytes", "64KiB", "--runner=FnApiRunner"])
    assert args.input == ["a", "b"] and args.chunk_bytes == 65536 and rest == ["--runner=FnApiRunner"]


BASE = ["--input", "a", "--output", "o", "--tokenizer", "t"]


def parse(*extra):
    from pipelines.options import parse_args

    return parse_args([*BASE, *extra])


def test_unknown_options_are_refused_with_a_suggestion():
    import pytest

    from pipelines.errors import BuildError

    cases = {("--chunk_size", "1MiB"): "--chunk_bytes", ("--row_group_size", "1000"): "--row_group_tokens",
             ("--max_bad", "0.5"): "--max_bad_fraction", ("--compression", "zstd"): "--parquet_compression",
             ("--chunkbytes=3000",): "--chunk_bytes"}
    for args, suggestion in cases.items():
        with pytest.raises(BuildError, match=f"unknown option {args[0].split('=')[0]}; did you mean .*{suggestion}"):
            parse(*args)
    with pytest.raises(BuildError, match="unknown option --no_such_thing \\(neither"):
        parse("--no_such_thing")
    with pytest.raises(BuildError, match="unknown option --direct_num_worker; did you mean --direct_num_workers\\?"):
        parse("--direct_num_worker=2")  # the closest of Beam's when none of ours is close


def test_beam_options_pass_through_and_stray_words_are_refused():
    import pytest

    from pipelines.errors import BuildError

    # --experiment and --no_use_public_ips are aliases (their destinations are experiments, use_public_ips)
    beam = ["--runner=DirectRunner", "--project", "p", "--direct_num_workers=2", "--save_main_session",
            "--experiments=a", "--experiments", "b", "--region", "us-central1", "--experiment", "c",
            "--no_use_public_ips"]
    assert parse(*beam).pipeline_args == beam
    pytest.importorskip("dask", reason="the dask extra is not installed")
    dask = ["--runner=DaskRunner", "--dask_client_address=localhost:8786"]
    assert parse(*dask).pipeline_args == dask
    with pytest.raises(BuildError, match="unexpected argument\\(s\\) b c: --input takes one pattern.*quote it"):
        parse("b", "c")


def test_value_ranges(monkeypatch):
    import pytest

    from pipelines.errors import BuildError

    monkeypatch.delenv("CHUNKLEDGER_MIN_CHUNK_BYTES", raising=False)  # the real floor, not the tests' one
    with pytest.raises(SystemExit):
        parse("--chunk_bytes", "1")
    with pytest.raises(SystemExit):
        parse("--chunk_bytes", "8GiB")
    assert parse("--chunk_bytes", "64KiB").options.chunk_bytes == 65536
    for bad in ("0", "100", "1e6", str(1 << 29)):
        with pytest.raises(SystemExit):
            parse("--row_group_tokens", bad)
    with pytest.raises(BuildError, match="--compression_level 99 is not a zstd level \\(use 1 to 22"):
        parse("--compression_level", "99")
    with pytest.raises(BuildError, match="not a gzip level \\(use 1 to 9"):
        parse("--parquet_compression", "gzip", "--compression_level", "0")
    with pytest.raises(BuildError, match="snappy has no levels"):
        parse("--parquet_compression", "snappy", "--compression_level", "5")
    assert parse("--parquet_compression", "brotli", "--compression_level", "11").options.compression_level == 11


def test_eos_token_is_a_string_the_tokenizer_resolves():
    assert parse().options.eos_token == ""  # the tokenizer's own
    assert parse("--eos_token", "</s>").options.eos_token == "</s>"
    assert parse("--eos_token=7").options.eos_token == "7"


def test_max_doc_bytes_is_a_constant_default_recorded_in_the_config():
    import pytest

    from pipelines.options import chunk_config
    from pipelines.plan import DEFAULT_MAX_DOC_BYTES, MAX_JSON_DEPTH

    config = chunk_config(parse().options).to_json()
    assert config["max_doc_bytes"] == DEFAULT_MAX_DOC_BYTES == 32 << 20 and config["max_json_depth"] == MAX_JSON_DEPTH
    assert chunk_config(parse("--max_doc_bytes", "1MiB").options).to_json()["max_doc_bytes"] == 1 << 20
    for bad in ("0", "-5", "5GiB", "lots"):
        with pytest.raises(SystemExit):
            parse("--max_doc_bytes", bad)


def test_a_config_resuming_an_older_cache_keeps_the_keys_it_lacks_absent():
    from pipelines.options import chunk_config

    config = chunk_config(parse().options)
    old = {k: v for k, v in config.to_json().items() if k not in ("max_doc_bytes", "max_json_depth")}
    assert config.as_in(old).to_json() == old  # the same fingerprint: the rerun resumes
    assert config.as_in(config.to_json()) == config
    other = chunk_config(parse("--max_doc_bytes", "1MiB").options)
    assert other.as_in(old).to_json() == {**old, "max_doc_bytes": 1 << 20}  # another value: refused by reconcile
    # kept fields: a cache built before floats were kept goes on refusing them (its chunks did)
    kept = chunk_config(parse("--keep_fields", "source").options)
    assert kept.to_json()["keep_floats"] is True and kept.as_in(kept.to_json()) == kept
    before = {k: v for k, v in kept.to_json().items() if k != "keep_floats"}
    assert kept.as_in(before).to_json() == before and kept.as_in(before).keep_floats is None


BUILDER = "python -m pipelines.build_cache"


def run_main(argv, capsys) -> list[str]:
    """``python -m pipelines.build_cache ARGV``'s stderr lines, for a command line refused with exit status 2."""
    import pytest

    from pipelines import build_cache

    with pytest.raises(SystemExit) as e:
        build_cache.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_command_line_mistakes_are_two_lines_the_error_with_its_fix_and_where_help_is(capsys, monkeypatch):
    monkeypatch.delenv("CHUNKLEDGER_MIN_CHUNK_BYTES")  # a real build's floor on --chunk_bytes
    see = f"(see {BUILDER} --help)"
    cases = {
        ("--input", "a", "--output", "o", "--tokenzier", "tiktoken:cl100k_base"):
            "unknown option --tokenzier; did you mean --tokenizer? (--tokenizer is required)",
        (*BASE, "--record_format", "chats"): "argument --record_format: invalid choice: 'chats'; did you mean "
                                             "--record_format chat?",
        (*BASE, "--parquet_compression", "zstandard"): "argument --parquet_compression: invalid choice: "
                                                       "'zstandard' (choose from zstd, snappy, gzip, lz4, brotli, none)",
        (*BASE, "--chunk_bytes", "10KB"): "argument --chunk_bytes: 10KB is below the minimum of 64KiB (every chunk is "
                                          "a file and a work unit): give 64KiB to 4GiB, e.g. 64MiB (the default, for "
                                          "most corpora), 512KiB or 67108864",
        (*BASE, "--chunk_bytes", "10 MB/s"): "argument --chunk_bytes: not a size: '10 MB/s' (use a byte count or "
                                             "KiB, MiB, GiB: 67108864, 64MiB, 512KiB)",
        ("--output", "o", "--tokenizer", "t"): "the following arguments are required: --input",
    }
    for argv, said in cases.items():
        assert run_main(list(argv), capsys) == [f"{BUILDER}: error: {said}", see]
    # an unknown option is the builder's own check (Beam's options pass through): one line, --help named in it
    assert run_main([*BASE, "--inptu", "x"], capsys) == [
        "error: unknown option --inptu; did you mean --input? (neither a builder option, see --help, nor an Apache "
        "Beam pipeline option)"]


def test_every_option_and_choice_mistyped_gets_did_you_mean(capsys):
    import cli_mistakes

    for argv, fix in cli_mistakes.mistakes(build_arg_parser()):
        lines = run_main([*BASE, *argv], capsys)
        assert len(lines) <= 2 and fix in lines[0], (argv, lines)
