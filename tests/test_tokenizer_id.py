"""reader.tokenizer_id computes the ledger's tokenizer identity exactly as the builder records it, without
Beam or transformers."""

import json
import subprocess
import sys

import pytest

from build_helpers import train_tiny_tokenizer
from pipelines.tokenizer import resolve
from reader import tokenizer_id


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    return d


def test_same_identity_as_the_builder(tok_dir):
    for spec in ("tiktoken:cl100k_base", str(tok_dir), str(tok_dir / "tokenizer.json")):
        assert tokenizer_id.identity(spec) == resolve(spec).identity()
    assert tokenizer_id.identity(str(tok_dir))["eos_id"] == 1  # tokenizer_config.json's eos_token: <pad>


def test_bad_specs_name_the_fix(tmp_path):
    with pytest.raises(tokenizer_id.TokenizerIdError, match="unknown tiktoken encoding 'nope'"):
        tokenizer_id.identity("tiktoken:nope")
    with pytest.raises(tokenizer_id.TokenizerIdError, match="no tokenizer.json there"):
        tokenizer_id.identity(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(tokenizer_id.TokenizerIdError, match="not a valid tokenizer.json"):
        tokenizer_id.identity(str(tmp_path / "tokenizer.json"))


def test_reader_side_imports_no_beam_transformers_or_pipelines():
    code = ("import sys, reader.cli, reader.export, reader.megatron, reader.flat_tokens, reader.importer, "
            "reader.import_megatron, reader.import_flat_tokens, reader.chunk_file, reader.tokenizer_id; "
            "reader.tokenizer_id.identity('tiktoken:cl100k_base'); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('apache_beam', 'transformers', 'pipelines', "
            "'zarr', 'torch')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
