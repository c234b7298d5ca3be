"""Resolving a local tokenizer.json is remembered per machine, and what is remembered is what parsing gives."""

import json
import os

import pytest

from pipelines.tokenize import hf_resolve_memo
from pipelines.tokenize import tokenizer as tk
from build_helpers import train_tiny_tokenizer


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKLEDGER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "hf-resolve"


def _parsing_fails(monkeypatch):
    """Make any parse of a tokenizer.json fail: a resolution that still works came from the cache."""
    from tokenizers import Tokenizer

    def refuse(*a, **k):
        raise AssertionError("parsed a tokenizer.json")

    monkeypatch.setattr(Tokenizer, "from_str", refuse)
    monkeypatch.setattr(Tokenizer, "from_file", refuse)


def test_a_second_resolution_is_remembered_and_equal(tmp_path, cache_dir, monkeypatch):
    tok_dir = tmp_path / "tok"
    path = train_tiny_tokenizer(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<pad>"}))
    monkeypatch.setenv(hf_resolve_memo.ENV_SWITCH, "0")
    fresh_file, fresh_dir = tk.resolve(path), tk.resolve(str(tok_dir))
    assert not cache_dir.exists()  # switched off: nothing recorded
    monkeypatch.delenv(hf_resolve_memo.ENV_SWITCH)
    assert tk.resolve(path) == fresh_file
    assert len(list(cache_dir.glob("*.json"))) == 1
    _parsing_fails(monkeypatch)
    assert tk.resolve(path) == fresh_file  # every field, the payload included
    assert tk.resolve(str(tok_dir)) == fresh_dir  # the same bytes by directory: the same entry
    assert fresh_file.eos_id == 1  # tokenizer_config.json's eos_token


def test_changed_bytes_are_resolved_again(tmp_path, cache_dir):
    tok_dir = tmp_path / "tok"
    path = train_tiny_tokenizer(str(tok_dir / "tokenizer.json"))
    first = tk.resolve(path)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<pad>"}))
    with_config = tk.resolve(path)
    assert with_config.eos_id == 1 and first.eos_id != 1
    train_tiny_tokenizer(path, vocab_size=300)
    other = tk.resolve(path)
    assert other.hash != first.hash and other.vocab_size != first.vocab_size
    assert len(list(cache_dir.glob("*.json"))) == 3


def test_a_damaged_entry_is_ignored(tmp_path, cache_dir, monkeypatch):
    path = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    want = tk.resolve(path)
    (payload,) = cache_dir.glob("*.payload")
    payload.write_text(payload.read_text().replace('"model"', '"modeL"', 1))
    assert tk.resolve(path) == want  # parsed again, and the entry rewritten
    _parsing_fails(monkeypatch)
    assert tk.resolve(path) == want


def test_an_invalid_file_is_a_clear_error(tmp_path, cache_dir):
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    with pytest.raises(tk.TokenizerError, match="not a valid tokenizer.json"):
        tk.resolve(str(path))
    assert not cache_dir.exists() or not list(cache_dir.glob("*.json"))


def test_an_unwritable_cache_is_ignored(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CHUNKLEDGER_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be made
    path = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    assert tk.resolve(path).hash.startswith("sha256:")
    assert os.path.isfile(blocker)
