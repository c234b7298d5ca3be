"""`python -m pipelines.interop`: the tokenizer identity it computes for a spec is the one the builder records,
and its imports (`--tokenizer SPEC`) write the same bytes as the reader's (`--tokenizer_from` a cache built
with that spec, or the identity file it writes)."""

import json
import os

import numpy as np
import pytest

import interop_ref as ref
from build_helpers import FNAPI, sample_texts, train_tiny_tokenizer, tree_bytes, write_shard
from pipelines import build_cache
from pipelines.interop import main as interop
from pipelines.tokenize.tokenizer import resolve
from reader.format import spec as fmt
from reader.format.splits import SPLIT_NAMES
from reader.cli.main import main as reader


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    return d


@pytest.fixture(scope="module")
def built(tmp_path_factory, tok_dir):
    """``{spec: cache root}``: a small cache built by the builder with each tokenizer (tiny one as a split build)."""
    d = tmp_path_factory.mktemp("built")
    shard = write_shard(str(d / "in" / "a.jsonl"), [{"text": t} for t in sample_texts(20, seed=3)])
    out = {}
    for spec, extra in (("tiktoken:cl100k_base", []), (str(tok_dir), ["--validation_fraction", "0.3"])):
        root = str(d / f"cache-{len(out)}")
        build_cache.run(["--input", shard, "--output", root, "--tokenizer", spec] + extra + FNAPI)
        out[spec] = root
    return out


def _identity_cli(capsys, spec, *extra):
    rc = interop(["tokenizer-identity", spec, *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_identity_is_what_the_builder_records(built, tok_dir, capsys):
    for spec, root in built.items():
        ledger = root if spec.startswith("tiktoken:") else os.path.join(root, "train")
        recorded = json.loads(open(os.path.join(ledger, fmt.LEDGER_NAME)).read())["tokenizer"]
        rc, out, _ = _identity_cli(capsys, spec)
        assert rc == 0 and json.loads(out) == recorded == resolve(spec).identity()
    rc, out, _ = _identity_cli(capsys, str(tok_dir / "tokenizer.json"))
    assert json.loads(out) == resolve(str(tok_dir / "tokenizer.json")).identity()
    assert json.loads(out)["eos_id"] == 1  # no tokenizer_config.json beside the file given: the first candidate
    assert resolve(str(tok_dir)).identity()["eos_id"] == 1  # tokenizer_config.json's eos_token: <pad>


def test_the_identity_file_is_written_whole(tmp_path, capsys):
    target = tmp_path / "ids" / "cl100k.json"
    rc, out, _ = _identity_cli(capsys, "tiktoken:cl100k_base", "--out", str(target))
    assert rc == 0 and f"wrote {target}" in out
    assert json.loads(target.read_text()) == resolve("tiktoken:cl100k_base").identity()
    assert os.listdir(tmp_path / "ids") == ["cl100k.json"]  # no temporary file left
    rc, _, err = _identity_cli(capsys, "tiktoken:nope", "--out", str(tmp_path / "nope.json"))
    assert rc == 2 and not (tmp_path / "nope.json").exists()


def test_bad_specs_name_the_fix(tmp_path, capsys):
    rc, _, err = _identity_cli(capsys, "tiktoken:nope")
    assert rc == 2 and "unknown tiktoken encoding 'nope'; known: cl100k_base" in err
    (tmp_path / "tokenizer.json").write_text("{not json")
    rc, _, err = _identity_cli(capsys, str(tmp_path / "tokenizer.json"))
    assert rc == 2 and f"tokenizer '{tmp_path / 'tokenizer.json'}': not a valid tokenizer.json" in err
    rc, _, err = _identity_cli(capsys, str(tmp_path / "empty-dir-that-is-not-there"))
    assert rc == 2 and "not a tokenizer spec, and no such file or directory. A tokenizer is tiktoken:NAME" in err
    os.makedirs(tmp_path / "empty-dir")  # no tokenizer.json: transformers is asked, and finds nothing either
    rc, _, err = _identity_cli(capsys, str(tmp_path / "empty-dir"))
    assert rc == 2 and "not loadable as a Hugging Face tokenizer" in err
    rc, _, err = _identity_cli(capsys, "tiktoken:cl100k_base", "--eos_token", "<|endofprmpt|>")
    assert rc == 2 and "--eos_token '<|endofprmpt|>': not a token of tokenizer 'tiktoken:cl100k_base'" in err


def _megatron_data(tmp_path, vocab):
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, min(vocab, 1000), size=int(rng.integers(0, 40))).tolist() for _ in range(150)]
    ref.write_megatron(str(tmp_path / "data"), [[d] for d in docs], code=8 if vocab < 65500 else 4)
    return str(tmp_path / "data"), docs


def test_megatron_import_same_bytes_from_spec_cache_and_identity_file(tmp_path, built, capsys):
    for n, (spec, root) in enumerate(built.items()):
        vocab = resolve(spec).vocab_size
        prefix, docs = _megatron_data(tmp_path, vocab)
        opts = ["--chunk_tokens", "300", "--row_group_tokens", "100"]
        caches = [root] if spec.startswith("tiktoken:") else [os.path.join(root, s) for s in SPLIT_NAMES]
        outs = [str(tmp_path / f"spec-{n}")]
        assert interop(["import-megatron", prefix, "--tokenizer", spec, "--out", outs[0], *opts]) == 0
        for k, cache in enumerate(caches):
            outs.append(str(tmp_path / f"cache-{n}-{k}"))
            assert reader(["import-megatron", prefix, "--tokenizer_from", cache, "--out", outs[-1], *opts]) == 0
        assert interop(["tokenizer-identity", spec, "--out", str(tmp_path / f"id-{n}.json")]) == 0
        outs.append(str(tmp_path / f"file-{n}"))
        assert reader(["import-megatron", prefix, "--tokenizer_from", str(tmp_path / f"id-{n}.json"),
                       "--out", outs[-1], *opts]) == 0
        capsys.readouterr()
        first = tree_bytes(outs[0])
        assert len(first) > 5 and ref.cache_documents(outs[0]) == docs
        assert json.loads(first[fmt.LEDGER_NAME])["tokenizer"] == resolve(spec).identity()
        for other in outs[1:]:
            assert tree_bytes(other) == first, other


def test_flat_tokens_import_same_bytes_from_spec_and_cache(tmp_path, built):
    spec, root = "tiktoken:cl100k_base", built["tiktoken:cl100k_base"]
    ref.synthetic_cache(str(tmp_path / "ds/train"), [[[1, 2, 3]], [[4]]], vocab_size=100)
    ref.synthetic_cache(str(tmp_path / "ds/validation"), [[[9, 8]]], vocab_size=100)
    assert reader(["export", str(tmp_path / "ds"), "--format", "flat-tokens", "--out", str(tmp_path / "d.zarr")]) == 0
    assert interop(["import-flat-tokens", str(tmp_path / "d.zarr"), "--tokenizer", spec, "--append_eos",
                    "--out", str(tmp_path / "a")]) == 0
    assert reader(["import-flat-tokens", str(tmp_path / "d.zarr"), "--tokenizer_from", root, "--append_eos",
                   "--out", str(tmp_path / "b")]) == 0
    a = tree_bytes(str(tmp_path / "a"))
    assert {"train/ledger.json", "validation/ledger.json"} <= set(a) and a == tree_bytes(str(tmp_path / "b"))
    assert ref.cache_documents(str(tmp_path / "a/validation")) == [[9, 8, 100257]]


def test_the_commands_keep_the_readers_options(capsys):
    import argparse

    from pipelines.interop import build_parser as ours
    from reader.cli.main import build_parser as theirs

    def options(parser, command):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
        return {o for a in sub._actions for o in a.option_strings}

    for command in ("import-megatron", "import-flat-tokens"):
        mine, reader_side = options(ours(), command), options(theirs(), command)
        # the reader's --tokenizer only refuses; --eos_token, like --tokenizer SPEC, chooses what the identity holds
        assert mine == reader_side - {"--tokenizer_from"} | {"--eos_token"}, command
        with pytest.raises(SystemExit) as e:
            interop([command, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert f"python -m pipelines.interop {command} " in text.split("\nexample")[1] and "--tokenizer SPEC" in text
    with pytest.raises(SystemExit) as e:
        interop(["import-megatron", "p", "--out", "x"])
    assert e.value.code == 2 and "the following arguments are required: --tokenizer" in capsys.readouterr().err
