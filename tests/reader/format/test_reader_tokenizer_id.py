"""reader.format.tokenizer_id: the tokenizer identity the reader's imports take (`--tokenizer_from`), read from a
cache or a JSON file and checked, with errors that name the file and the fix; and the reader's import side
loads no tokenizer library."""

import json
import os
import subprocess
import sys

import pytest

import interop_ref as ref
from reader.format import tokenizer_id
from reader.interop import tokenizer_from
from reader.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
IDENTITY = {"spec": "tiny", "kind": "huggingface", "name": "tiny", "vocab_size": 50, "eos_id": 3,
            "hash": "sha256:" + "ab" * 32}


def _cache(root, tokenizer=IDENTITY):
    import cachegen

    cachegen.write_synthetic_cache(str(root), [[[1, 2]], [[3]]], tokenizer=tokenizer)
    return str(root)


def test_from_a_cache_a_split_build_and_json_files(tmp_path, capsys):
    assert tokenizer_from.load(_cache(tmp_path / "c")) == IDENTITY
    assert tokenizer_from.load(_cache(tmp_path / "s" / "validation")) == IDENTITY  # a split build's cache
    assert tokenizer_from.load(str(tmp_path / "c" / "ledger.json")) == IDENTITY  # the ledger file itself
    (tmp_path / "id.json").write_text(json.dumps(IDENTITY))
    assert tokenizer_from.load(str(tmp_path / "id.json")) == IDENTITY
    (tmp_path / "identity").write_text(json.dumps(IDENTITY))  # any local file name
    assert tokenizer_from.load(str(tmp_path / "identity")) == IDENTITY
    assert main(["inspect", str(tmp_path / "c"), "--json"]) == 0
    (tmp_path / "inspect.json").write_text(capsys.readouterr().out)
    assert tokenizer_from.load(str(tmp_path / "inspect.json")) == IDENTITY
    # an unfinished build already records its tokenizer
    import cachegen

    cachegen.write_synthetic_cache(str(tmp_path / "running"), [[[1]], [[2]]], finished=False, tokenizer=IDENTITY)
    assert tokenizer_from.load(str(tmp_path / "running")) == IDENTITY


@pytest.mark.parametrize("change,message", [
    ({"hash": None}, "has no key 'hash'"),
    ({"spec": None}, "has no key 'spec'"),
    ({"extra": 1}, "has an unknown key 'extra'"),
    ({"vocab_size": "50"}, "'vocab_size' must be a positive integer, got '50'"),
    ({"vocab_size": 0}, "'vocab_size' must be a positive integer, got 0"),
    ({"eos_id": 50}, "'eos_id' must be null or an integer in [0, 50), got 50"),
    ({"eos_id": True}, "'eos_id' must be null or an integer in [0, 50), got True"),
    ({"kind": ""}, "'kind' must be a non-empty string"),
])
def test_a_bad_identity_file_names_the_file_and_the_key(tmp_path, change, message):
    ident = {k: v for k, v in dict(IDENTITY, **change).items() if v is not None}
    (tmp_path / "id.json").write_text(json.dumps(ident))
    with pytest.raises(tokenizer_id.TokenizerIdError) as e:
        tokenizer_from.load(str(tmp_path / "id.json"))
    assert str(e.value).startswith(f"{tmp_path / 'id.json'}: the tokenizer identity") and message in str(e.value)
    assert "python -m pipelines.interop tokenizer-identity SPEC" in str(e.value)


def test_a_cache_with_a_bad_identity_is_named(tmp_path):
    bad = {k: v for k, v in IDENTITY.items() if k != "name"}
    root = _cache(tmp_path / "c", tokenizer=bad)
    with pytest.raises(tokenizer_id.TokenizerIdError, match=f"^{root}/ledger.json: tokenizer: the tokenizer "
                                                            "identity has no key 'name'"):
        tokenizer_from.load(root)


def test_the_commands_say_what_is_wrong_and_what_to_pass(tmp_path, capsys):
    ref.write_megatron(str(tmp_path / "m"), [[[1, 2]], [[3]]], code=8)
    _cache(tmp_path / "split" / "train")
    _cache(tmp_path / "split" / "validation")
    (tmp_path / "broken.json").write_text('{"spec": "tiny",')
    (tmp_path / "list.json").write_text("[1, 2]")
    os.makedirs(tmp_path / "empty")
    cases = [
        (str(tmp_path / "nope"), f"{tmp_path / 'nope'}: does not exist"),
        (str(tmp_path / "empty"), f"{tmp_path / 'empty'}: not a chunkledger cache (no ledger.json here): the "
                                  "directory is empty"),
        (str(tmp_path / "split"), f"pass {tmp_path / 'split' / 'train'} or {tmp_path / 'split' / 'validation'}"),
        (str(tmp_path / "nope.json"), f"{tmp_path / 'nope.json'}: no such file. --tokenizer_from takes a cache"),
        (str(tmp_path / "broken.json"), f"{tmp_path / 'broken.json'}: not valid JSON"),
        (str(tmp_path / "list.json"), f"{tmp_path / 'list.json'}: not a tokenizer identity (a JSON object"),
    ]
    for where, said in cases:
        rc = main(["import-megatron", str(tmp_path / "m"), "--tokenizer_from", where, "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and said in err, (where, err)
        assert len(err.strip().splitlines()) <= 2
        if where.endswith(("nope", "empty", "split")):  # a path that is no cache: both kinds of argument named
            assert "or give a JSON file holding a tokenizer identity" in err
    assert not os.path.exists(tmp_path / "o")
    assert main(["import-megatron", str(tmp_path / "m"), "--tokenizer_from", str(tmp_path / "split" / "train"),
                 "--out", str(tmp_path / "o")]) == 0


def test_the_import_functions_take_an_identity_not_a_spec(tmp_path):
    from reader.interop.import_flat_tokens import import_flat_tokens
    from reader.interop.import_megatron import import_megatron
    from reader.interop.importer import ImportFailed

    ref.write_megatron(str(tmp_path / "m"), [[[1, 2]]], code=8)
    with pytest.raises(ImportFailed, match="give the tokenizer identity .*not a spec: "
                                           r"reader.interop.tokenizer_from.load\(CACHE_OR_JSON\), or "
                                           r"pipelines.tokenize.tokenizer.resolve\(SPEC\).identity\(\)"):
        import_megatron([str(tmp_path / "m")], "tiktoken:cl100k_base", str(tmp_path / "o"))
    with pytest.raises(ImportFailed, match="give the tokenizer identity"):
        import_flat_tokens(str(tmp_path / "d.zarr"), "tiktoken:cl100k_base", str(tmp_path / "o"))
    with pytest.raises(tokenizer_id.TokenizerIdError, match="^tokenizer: the tokenizer identity has no key 'name'"):
        import_megatron([str(tmp_path / "m")], {k: v for k, v in IDENTITY.items() if k != "name"}, str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o")
    assert import_megatron([str(tmp_path / "m")], IDENTITY, str(tmp_path / "o"))["tokenizer"] == IDENTITY


def test_reader_side_imports_no_tokenizer_library_beam_or_pipelines(tmp_path):
    (tmp_path / "id.json").write_text(json.dumps(IDENTITY))
    code = ("import sys, reader.cli.main, reader.interop.export, reader.interop.megatron, reader.interop.flat_tokens, reader.interop.importer, "
            "reader.interop.import_megatron, reader.interop.import_flat_tokens, reader.format.chunk_file, reader.format.tokenizer_id; "
            f"reader.interop.tokenizer_from.load({str(tmp_path / 'id.json')!r}); reader.cli.main.build_parser(); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('apache_beam', 'transformers', 'pipelines', "
            "'tiktoken', 'tokenizers', 'zarr', 'torch', 'jax')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_from_a_flat_tokens_export(tmp_path):
    out = str(tmp_path / "data.zarr")
    assert main(["export", _cache(tmp_path / "c"), "--format", "flat-tokens", "--keep_eos", "--out", out]) == 0
    assert tokenizer_from.load(out) == IDENTITY  # recorded in the export's root attributes
    attrs = json.loads((tmp_path / "data.zarr" / ".zattrs").read_text())
    attrs["chunkledger"]["tokenizer"]["vocab_size"] = 0
    (tmp_path / "data.zarr" / ".zattrs").write_text(json.dumps(attrs))
    with pytest.raises(tokenizer_id.TokenizerIdError, match=r"data.zarr/.zattrs: chunkledger.tokenizer.*vocab_size"):
        tokenizer_from.load(out)
