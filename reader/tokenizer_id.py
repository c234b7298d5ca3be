"""The tokenizer identity recorded in a ledger (``tokenizer`` key), computed without Beam or transformers.

``identity(spec)`` returns exactly what the builder records for the same spec
(``pipelines.tokenizer.resolve(spec).identity()``): both use the functions here. tiktoken and the
``tokenizers`` library are imported lazily, only when a spec needs them (the reader's base install has
neither: ``pip install 'chunkledger[pipeline]'``).

Specs handled here: ``tiktoken:<encoding>``, and a Hugging Face ``tokenizer.json`` file or a directory
holding one (local, or any fsspec URL such as ``gs://bucket/tok/``). Hub names need transformers: the
builder resolves them, this module does not (save the tokenizer to a directory and give that).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


class TokenizerIdError(ValueError):
    """A tokenizer spec cannot be resolved to an identity."""


def hash_tiktoken(enc) -> str:
    """``sha256:`` of a tiktoken encoding's pattern, special tokens and ranks (the ledger's ``hash``)."""
    h = hashlib.sha256()
    h.update(enc._pat_str.encode())
    h.update(json.dumps(sorted(enc._special_tokens.items())).encode())
    for token, rank in sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
        h.update(rank.to_bytes(4, "little"))
        h.update(len(token).to_bytes(2, "little"))
        h.update(token)
    return "sha256:" + h.hexdigest()


def hash_hf_json(payload: str) -> str:
    """``sha256:`` of a Hugging Face tokenizer's JSON as ``Tokenizer.to_str()`` gives it."""
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


def hf_eos(tok, config_eos: str | None) -> int | None:
    """The end-of-sequence id of a ``tokenizers.Tokenizer``: ``config_eos`` (from tokenizer_config.json)
    if the vocabulary has it, else the first of ``EOS_CANDIDATES`` it has, else None."""
    for cand in ([config_eos] if config_eos else []) + list(EOS_CANDIDATES):
        tid = tok.token_to_id(cand)
        if tid is not None:
            return int(tid)
    return None


def eos_from_config(text: str | None) -> str | None:
    """The ``eos_token`` of a tokenizer_config.json text (a string, or a dict with ``content``)."""
    if not text:
        return None
    try:
        eos = json.loads(text).get("eos_token")
    except (ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def tiktoken_name(encoding: str, names) -> str:
    """The encoding to load: the registered offline twin ``<encoding>_offline`` if there is one."""
    return encoding + "_offline" if encoding + "_offline" in names else encoding


def tiktoken_identity(spec: str) -> dict[str, Any]:
    try:
        import tiktoken
    except ImportError as e:
        raise TokenizerIdError(f"tokenizer {spec!r}: tiktoken is not installed: pip install "
                               "'chunkledger[pipeline]'") from e
    encoding = spec.split(":", 1)[1]
    names = set(tiktoken.list_encoding_names())
    name = tiktoken_name(encoding, names)
    if name not in names:
        raise TokenizerIdError(f"tokenizer {spec!r}: unknown tiktoken encoding {encoding!r}; "
                               f"known: {', '.join(sorted(names))}")
    try:
        enc = tiktoken.get_encoding(name)
    except Exception as e:
        raise TokenizerIdError(f"tokenizer {spec!r}: cannot load tiktoken encoding {name!r} ({e}); "
                               "without network access only the *_offline encodings work") from e
    return {"spec": spec, "kind": "tiktoken", "name": name, "vocab_size": int(enc.n_vocab),
            "eos_id": int(enc.eot_token) if enc.eot_token is not None else None, "hash": hash_tiktoken(enc)}


def _read_text(fs, path: str) -> str | None:
    try:
        return fs.cat_file(path).decode("utf-8")
    except (FileNotFoundError, IsADirectoryError):
        return None


def hf_identity(spec: str) -> tuple[dict[str, Any], str]:
    """``(identity, tokenizer JSON)`` of a tokenizer.json file or a directory holding one."""
    import fsspec

    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise TokenizerIdError(f"tokenizer {spec!r}: the tokenizers library is not installed: pip install "
                               "'chunkledger[pipeline]'") from e
    fs, path = fsspec.core.url_to_fs(spec)
    path = path.rstrip("/")
    if fs.isdir(path):
        base, text = path, _read_text(fs, path + "/tokenizer.json")
    else:
        base, text = path.rsplit("/", 1)[0] if "/" in path else (os.path.dirname(path) or "."), _read_text(fs, path)
    if text is None:
        raise TokenizerIdError(
            f"tokenizer {spec!r}: not 'tiktoken:<encoding>' and no tokenizer.json there. Give a tokenizer.json "
            "file or a directory holding one (a Hugging Face hub name: save it locally first, e.g. "
            "AutoTokenizer.from_pretrained(name).save_pretrained(dir)).")
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - the library raises its own exception types
        raise TokenizerIdError(f"tokenizer {spec!r}: not a valid tokenizer.json ({e})") from e
    config_eos = eos_from_config(_read_text(fs, base + "/tokenizer_config.json"))
    payload = tok.to_str()
    ident = {"spec": spec, "kind": "huggingface", "name": spec,
             "vocab_size": int(tok.get_vocab_size(with_added_tokens=True)), "eos_id": hf_eos(tok, config_eos),
             "hash": hash_hf_json(payload)}
    return ident, payload


def identity(spec: str) -> dict[str, Any]:
    """The ledger's ``tokenizer`` object for ``spec`` (same as the builder records). Raises
    :class:`TokenizerIdError` naming the spec and the fix."""
    if spec.startswith("tiktoken:"):
        return tiktoken_identity(spec)
    return hf_identity(spec)[0]
