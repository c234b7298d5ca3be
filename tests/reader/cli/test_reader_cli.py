"""`python -m reader inspect|validate|batches`."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from reader import BATCH_KEYS, ReadOptions, Reader
from reader.cli.main import main

import cachegen

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture
def cache_dir():
    d = tempfile.mkdtemp(prefix="cl-cli-")
    rng = np.random.default_rng(9)
    chunks = cachegen.random_chunks(rng, 8, empty_prob=0.2)
    cachegen.write_synthetic_cache(os.path.join(d, "c"), chunks, chunks_per_shard=[5, 3], row_group_tokens=10)
    yield os.path.join(d, "c"), chunks, d
    shutil.rmtree(d, ignore_errors=True)


def test_inspect_reports_counts_and_percentiles(cache_dir, capsys):
    root, chunks, _ = cache_dir
    assert main(["inspect", root, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    lengths = [len(d) for c in chunks for d in c]
    assert info["documents"] == len(lengths)
    assert info["tokens"] == sum(lengths)
    assert info["chunks"] == 8 and info["finished"] is True
    assert info["doc_length_percentiles"]["p50"] == int(np.percentile(lengths, 50))
    assert info["doc_length_percentiles"]["p100"] == max(lengths)
    assert info["tokenizer"]["spec"] == "synthetic"
    assert main(["inspect", root]) == 0
    text = capsys.readouterr().out
    assert f"documents   {len(lengths):,}" in text and "p99=" in text


def test_validate_ok_then_nonzero_on_a_damaged_chunk(cache_dir, capsys):
    root, _, _ = cache_dir
    assert main(["validate", root]) == 0
    assert "OK: 8 chunks" in capsys.readouterr().out
    victim = "chunks/shard-00001/chunk-000001.parquet"
    path = os.path.join(root, victim)
    data = bytearray(open(path, "rb").read())
    data[100] ^= 1
    open(path, "wb").write(bytes(data))
    assert main(["validate", root]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM" in out and victim in out and "checksum mismatch" in out


def test_validate_as_a_subprocess_exits_nonzero(cache_dir):
    root, _, _ = cache_dir
    os.truncate(os.path.join(root, "chunks/shard-00000/chunk-000002.parquet"), 10)
    p = subprocess.run([sys.executable, "-m", "reader", "validate", root], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 1
    assert "chunk-000002.parquet: truncated" in p.stdout


@pytest.mark.parametrize("extra,kw", [
    (["--ideal_readers", "3"], dict(ideal_readers=3)),
    (["--unpacked", "--ideal_readers", "4", "--num_readers", "2", "--reader_index", "1"],
     dict(packed=False, ideal_readers=4)),
    (["--eval", "--start", "1", "--count", "50"], dict(eval_mode=True)),
    (["--eval", "--start", "1", "--count", "0", "--unpacked"], dict(eval_mode=True, packed=False)),
    (["--packing", "unpacked", "--ideal_readers", "4"], dict(packing="unpacked", ideal_readers=4)),
    (["--shuffle_seed", "4", "--ideal_readers", "2", "--num_readers", "2", "--reader_index", "0"],
     dict(shuffle_seed=4, ideal_readers=2)),
])
def test_batches_npz_equals_reader_batch(cache_dir, extra, kw):
    root, _, d = cache_dir
    out = os.path.join(d, "b.npz")
    args = ["batches", root, "--seq_len", "6", "--batch_size", "4", "--start", "2", "--count", "3",
            "--out", out] + extra
    assert main(args) == 0
    got = np.load(out)
    R = int(extra[extra.index("--num_readers") + 1]) if "--num_readers" in extra else 1
    r = int(extra[extra.index("--reader_index") + 1]) if "--reader_index" in extra else 0
    kw.setdefault("ideal_readers", 16)
    opts = ReadOptions(seq_len=6, batch_size=4, **kw)
    with Reader(root, opts, num_readers=R, reader_index=r) as rd:
        bs = got["batch_index"].tolist()
        if kw.get("eval_mode"):
            assert bs == list(range(1, rd.num_batches))  # --start 1, stops at the end of the pass
        else:
            assert bs == [2, 3, 4]
        for i, b in enumerate(bs):
            want = rd.batch(b)
            for k in BATCH_KEYS:
                assert np.array_equal(got[k][i], want[k]), k
    assert got["targets"].shape[1:] == (4 // R, 6)


def test_unpacked_flag_is_an_alias_of_packing_unpacked(cache_dir, capsys):
    root, _, d = cache_dir
    got = {}
    for flags in (["--unpacked"], ["--packing", "unpacked"], ["--unpacked", "--packing", "unpacked"]):
        out = os.path.join(d, f"{len(flags)}.npz")
        assert main(["batches", root, "--seq_len", "6", "--batch_size", "4", "--ideal_readers", "4", "--count", "3",
                     "--out", out] + flags) == 0
        got[len(flags)] = np.load(out)
    for k in BATCH_KEYS:
        assert np.array_equal(got[1][k], got[2][k]) and np.array_equal(got[1][k], got[3][k]), k
    with Reader(root, ReadOptions(seq_len=6, batch_size=4, ideal_readers=4, packed=False)) as rd:
        for b in range(3):
            assert all(np.array_equal(got[1][k][b], rd.batch(b)[k]) for k in BATCH_KEYS), b
    assert json.loads(str(got[1]["options"]))["packing"] == "unpacked"
    capsys.readouterr()
    assert main(["batches", root, "--seq_len", "6", "--batch_size", "4", "--unpacked", "--packing", "concat"]) == 2
    assert "--packing concat packs rows; --unpacked (the older spelling of --packing unpacked)" in capsys.readouterr().err


def test_help_explains_every_command():
    p = subprocess.run([sys.executable, "-m", "reader", "batches", "--help"], cwd=ROOT, capture_output=True,
                       text=True)
    assert p.returncode == 0
    for flag in ("--seq_len", "--batch_size", "--packing", "--unpacked", "--ideal_readers", "--num_readers", "--reader_index",
                 "--start", "--count", "--eval", "--shuffle_seed", "--out", "--show"):
        assert flag in p.stdout


def test_batches_out_is_written_under_exactly_that_name(cache_dir, capsys):
    root, _, d = cache_dir
    out = os.path.join(d, "out", "step2")  # no .npz suffix, in a directory that does not exist yet
    assert main(["batches", root, "--seq_len", "6", "--batch_size", "4", "--start", "2", "--out", out]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: batches 2..2")
    assert os.listdir(os.path.join(d, "out")) == ["step2"]  # not step2.npz, no temporary file left
    with Reader(root, ReadOptions(seq_len=6, batch_size=4)) as r:
        assert np.array_equal(np.load(out)["targets"][0], r.batch(2)["targets"])


def _user_errors(root, d):
    os.makedirs(os.path.join(d, "empty"), exist_ok=True)
    open(os.path.join(d, "m.idx"), "wb").close()
    shard = os.path.join(d, "part-00.jsonl")
    open(shard, "w").write('{"text": "x"}\n')
    return [  # (argv, what the message must name)
        (["inspect", os.path.join(d, "nope")], f"{d}/nope: does not exist"),
        (["validate", os.path.join(d, "empty")], f"{d}/empty: not a chunkledger cache"),
        (["batches", shard, "--seq_len", "4", "--batch_size", "2", "--out", os.path.join(d, "x.npz")],
         f"{shard}: not a chunkledger cache (a cache is a directory): this is a jsonl file"),
        (["batches", root, "--seq_len", "4", "--batch_size", "3", "--num_readers", "2", "--out",
          os.path.join(d, "x.npz")], "batch_size 3 must be a multiple of num_readers 2"),
        (["batches", root, "--seq_len", "4", "--batch_size", "2", "--out", d], f"{d}: is a directory"),
        (["export", root, "--format", "megatron", "--out", os.path.join(d, "m")],
         f"{d}/m.idx exists; pass --overwrite"),
        (["export", os.path.join(d, "empty"), "--format", "megatron", "--out", os.path.join(d, "q")],
         f"{d}/empty: not a chunkledger cache"),
        (["import-megatron", os.path.join(d, "nope"), "--tokenizer_from", root, "--out",
          os.path.join(d, "imp")], f"{d}/nope.idx: no such file"),
        (["import-flat-tokens", os.path.join(d, "nope.zarr"), "--tokenizer_from", root, "--out",
          os.path.join(d, "imp")], f"{d}/nope.zarr: not a zarr group"),
        (["import-megatron", os.path.join(d, "m"), "--tokenizer_from", os.path.join(d, "empty"), "--out",
          os.path.join(d, "imp")], f"{d}/empty: not a chunkledger cache (no ledger.json here)"),
    ]


def test_user_errors_exit_2_with_one_or_two_lines(cache_dir, capsys):
    root, _, d = cache_dir
    seen = set()
    for argv, named in _user_errors(root, d):
        assert main(argv) == 2, argv
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), (argv, out.err)
        assert named in out.err, (argv, out.err)
        seen.add(argv[0])
    assert seen == {"inspect", "validate", "batches", "export", "import-megatron", "import-flat-tokens"}


@pytest.mark.parametrize("argv,said", [
    (["batches", "C", "--seq_len", "0", "--batch_size", "2", "--out", "x"], "argument --seq_len: must be at least 1"),
    (["inspect", "C", "--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["export", "C", "--format", "parquet", "--out", "x"], "argument --format: invalid choice: 'parquet'"),
    (["import-megatron", "p", "--out", "x"], "the following arguments are required: --tokenizer_from"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_arguments_exit_2_with_two_lines(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and said in lines[0] and lines[1].endswith("--help)"), lines


@pytest.mark.parametrize("argv,lines", [
    (["inpect", "C"], ["python -m reader: error: argument command: invalid choice: 'inpect'; did you mean inspect?",
                       "(see python -m reader --help)"]),
    ([], ["python -m reader: error: the following arguments are required: command (one of inspect, validate, "
          "batches, index, export, import-megatron, import-flat-tokens, report)", "(see python -m reader --help)"]),
    (["inspect", "C", "--sqe_len", "3"], ["python -m reader inspect: error: unrecognized arguments: --sqe_len 3; did "
                                          "you mean --seq_len?", "(see python -m reader inspect --help)"]),
    (["export", "C", "--format", "megatorn", "--out", "x"],
     ["python -m reader export: error: argument --format: invalid choice: 'megatorn'; did you mean --format megatron?",
      "(see python -m reader export --help)"]),
    (["export", "C", "--format", "parquet", "--out", "x"],
     ["python -m reader export: error: argument --format: invalid choice: 'parquet' (choose from megatron, "
      "flat-tokens)", "(see python -m reader export --help)"]),
    (["import-megatron", "p", "--tokenizer_frm", "c", "--out", "x"],
     ["python -m reader import-megatron: error: unknown option --tokenizer_frm; did you mean --tokenizer_from? "
      "(--tokenizer_from is required)", "(see python -m reader import-megatron --help)"]),
])
def test_a_mistake_gets_the_fix_did_you_mean_or_the_choices(argv, lines, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == lines


def test_every_option_and_choice_mistyped_gets_did_you_mean(capsys):
    import argparse

    import cli_mistakes
    from reader.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for command, parser in sub.choices.items():
        for argv, fix in cli_mistakes.mistakes(parser):
            with pytest.raises(SystemExit) as e:
                main([command, *cli_mistakes.required_argv(parser), *argv])
            lines = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and len(lines) == 2 and fix in lines[0], (command, argv, lines)
            checked += 1
    assert checked > 60  # every option of every command


@pytest.mark.parametrize("command", ["import-megatron", "import-flat-tokens"])
@pytest.mark.parametrize("given", [["--tokenizer", "tiktoken:cl100k_base"], ["--tokenizer=./tok/"], ["--tokenizer"]])
def test_a_tokenizer_spec_is_refused_naming_both_ways(command, given, capsys):
    with pytest.raises(SystemExit) as e:  # even with --tokenizer_from given, and before any other check
        main([command, "p", *given, "--tokenizer_from", "c", "--out", "x"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"python -m reader {command}: error: argument --tokenizer: not an "
                                                   "option of python -m reader: it takes the tokenizer's identity")
    assert "Either give --tokenizer_from CACHE_OR_JSON (a cache built with that tokenizer, or a JSON file from: " \
           "python -m pipelines.interop tokenizer-identity SPEC --out FILE.json), or run python -m pipelines.interop " \
           f"{command} ... --tokenizer SPEC" in lines[0]


def test_debug_shows_the_traceback(tmp_path):
    args = [sys.executable, "-m", "reader", "inspect", str(tmp_path)]
    plain = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert plain.stderr.strip().splitlines() == [f"error: {tmp_path}: not a chunkledger cache (no ledger.json "
                                                 "here): the directory is empty. Pass the --output directory of a "
                                                 "build (python -m pipelines.build_cache --input 'SHARDS' --output "
                                                 "CACHE --tokenizer SPEC); it holds ledger.json"]
    for debug in (args + ["--debug"], args[:3] + ["--debug"] + args[3:]):  # after or before the command
        loud = subprocess.run(debug, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert loud.returncode == 2 and "Traceback" in loud.stderr and "NotACache" in loud.stderr


@pytest.mark.parametrize("command", ["inspect", "validate", "batches", "report", "export", "import-megatron",
                                     "import-flat-tokens"])
def test_help_explains_the_command_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert len(description.split()) >= 20, description  # says what the command does
    example = text.split("\nexample")[1]  # the "example(s):" section
    assert f"python -m reader {command} " in example
    assert "exit status: 0 done; 1 the cache is damaged" in text and "--debug" in text


def test_output_cut_short_by_its_reader_ends_quietly_as_a_command_killed_by_sigpipe(cache_dir):
    root, _, _ = cache_dir  # `python -m reader batches ... --show | head -1`: head leaves after one line
    p = subprocess.Popen([sys.executable, "-m", "reader", "batches", root, "--seq_len", "16", "--batch_size", "4",
                          "--ideal_readers", "1", "--count", "2000", "--show"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout.readline().startswith(b"batch 0 row 0")
    p.stdout.close()
    err = p.stderr.read().decode()  # (a synthetic cache's rows are token ids: a note says so)
    assert p.wait(timeout=120) == 141 and "error" not in err and "Broken pipe" not in err, err
