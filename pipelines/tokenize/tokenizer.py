"""The builder's tokenizers: a spec resolved for the launcher and loaded in workers, and long documents cut.

A spec (``--tokenizer``) is resolved by :mod:`reader.tokenizers.tokenizer_lib`, the one resolver (``tiktoken:NAME``,
a ``tokenizer.json`` file or a directory holding one, local or remote; the reader decodes with the same
module). This module adds what only a build needs:

* Hugging Face hub names (``ORG/NAME``) and saved ``transformers`` tokenizers without a ``tokenizer.json``
  are loaded with ``transformers.AutoTokenizer``, as before: a hub model's tokenizer is what transformers
  makes of it (it may adjust the ``tokenizer.json``), so its identity, and the caches built with it, stay
  what they were. The reader never imports transformers, so this stays here; offline, only the local hub
  cache is tried, and a name it does not hold fails at once.
* a resolution of a local ``tokenizer.json`` is remembered per machine (:mod:`pipelines.tokenize.hf_resolve_memo`).
* ``--eos_token TOKEN|ID`` sets the EOS; otherwise the tokenizer's declared one, or a guess, which
  :func:`warn_if_guessed` reports. How the EOS was chosen is shown, never part of the identity.

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
names a *backend* (``auto``, ``fast``, ``gigatoken`` or ``reference``, see :mod:`pipelines.tokenize.fast_tokenizer`):
the fast ones give the same tokens, checked at worker start and sampled during the build. The backend is not part of
the identity: a cache's bytes never depend on it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any, Sequence

import numpy as np

from reader.storage import files
from reader.tokenizers import tokenizer_files, tokenizer_lib
from reader.format.tokenizer_id import hash_hf_json
from reader.tokenizers.tokenizer_lib import Eos, TokenizerError

from pipelines.tokenize import hf_resolve_memo

LOG = logging.getLogger("chunkledger.tokenizer")

# Long-document splitting (recorded in the ledger config: it defines the tokens of degenerate texts).
PIECE_CHARS = 65_536
MAX_PIECE_CHARS = 131_072

# A safe cut position p: text[p-1] is a word character and text[p] a space or tab, or text[p-1] is a
# newline and text[p] a word character. Zero-width so ``m.start()`` is the cut.
_SAFE_CUT = re.compile(r"(?<=\w)(?=[ \t])|(?<=\n)(?=\w)")

BACKENDS = ("auto", "fast", "gigatoken", "reference")  # see pipelines.tokenize.fast_tokenizer
DEFAULT_VERIFY_EVERY = 1000


def cut_for_encoding(text: str, piece_chars: int = PIECE_CHARS,
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
    backend: str = "auto"  # "auto", "fast", "gigatoken" or "reference"
    verify_every: int = DEFAULT_VERIFY_EVERY  # fast backend: re-encode 1 document in N with the reference (0: never)
    # The EOS's text and how it was chosen (tokenizer_lib.Eos.how): shown in the summary, not in the identity.
    eos_token: str | None = None
    eos_how: str = tokenizer_lib.NONE
    # A chat build's template source (workers render with it); the ledger's config records its identity.
    chat_template: str = dataclasses.field(default="", repr=False)

    @classmethod
    def of(cls, tok: tokenizer_lib.Tokenizer) -> "TokenizerSpec":
        return cls(spec=tok.spec, kind=tok.kind, name=tok.name, vocab_size=tok.vocab_size, eos_id=tok.eos.id,
                   hash=tok.hash, payload=tok.tokenizer_json, eos_token=tok.eos.token, eos_how=tok.eos.how)

    @property
    def eos(self) -> Eos:
        return Eos(self.eos_id, self.eos_token, self.eos_how)

    def shipped_as(self, path: str) -> "TokenizerSpec":
        """The same spec, with workers loading the tokenizer JSON from ``path`` (any Beam filesystem).

        Keeps multi-megabyte tokenizer JSON out of the pickled DoFn: runners that ship the pipeline
        to worker processes over gRPC (DirectRunner multi_processing, portable runners) slow down
        badly with it.
        """
        return dataclasses.replace(self, payload="", payload_path=path)

    def with_backend(self, backend: str, verify_every: int = DEFAULT_VERIFY_EVERY) -> "TokenizerSpec":
        """The same tokenizer, encoded by ``backend`` (one of BACKENDS) in workers."""
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
            return TiktokenEncoder(tokenizer_lib.tiktoken_encoding(self.name)[1])
        # Beam runs one worker process per core; a Rayon pool per process sized to every core would make
        # 2 workers on 2 cores run 4+ threads (measured 2x the CPU per token). Set RAYON_NUM_THREADS to
        # override, before the first HF tokenizer is loaded in the process.
        os.environ.setdefault("RAYON_NUM_THREADS", "1")
        return HFEncoder(tokenizer_lib.hf_library(tokenizer_json or self.tokenizer_json()))

    def tokenizer_json(self) -> str:
        """HF: the tokenizer's JSON, from the spec or from :attr:`payload_path` (checked against the hash)."""
        payload = self.payload
        if not payload and self.payload_path:
            from pipelines.filesystem import BEAM

            payload = BEAM.read(self.payload_path).decode("utf-8")
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
                 for p in cut_for_encoding(text)]
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


def resolve(spec: str, eos: str | int | None = None) -> TokenizerSpec:
    """Resolve a tokenizer spec (see the module doc); ``eos`` is ``--eos_token`` (a token, or an id).

    Raises:
        TokenizerError: at once, naming the spec, the accepted forms and the fix.
    """
    form = tokenizer_lib.classify(spec)
    if form == "hub":
        return _auto_tokenizer(spec, eos, hub=True)
    local = _local_hf_files(spec) if form == "path" and eos in (None, "") else None
    if local is not None:  # remembered from an earlier resolution of the same bytes?
        memo_key = hf_resolve_memo.key(*local)
        hit = hf_resolve_memo.lookup(memo_key)
        if hit is not None and hit.get("eos_how"):
            return TokenizerSpec(spec=spec, kind="huggingface", name=spec, vocab_size=hit["vocab_size"],
                                 eos_id=hit["eos_id"], hash=hit["hash"], payload=hit["payload"],
                                 eos_token=hit["eos_token"], eos_how=hit["eos_how"])
    try:
        resolved = TokenizerSpec.of(tokenizer_lib.resolve(spec, eos=eos, read=_read_remote))
    except tokenizer_files.NoTokenizerJson:
        if form != "path":
            raise
        return _auto_tokenizer(spec, eos, hub=False)  # a saved transformers tokenizer, maybe
    if local is not None:
        hf_resolve_memo.record(memo_key, resolved.vocab_size, resolved.eos_id, resolved.hash, resolved.payload,
                                eos_token=resolved.eos_token, eos_how=resolved.eos_how)
    return resolved


def warn_if_guessed(tok: TokenizerSpec) -> None:
    """Log a warning when the EOS was guessed, naming the pick and ``--eos_token``."""
    if tok.eos_how == tokenizer_lib.GUESSED:
        LOG.warning("tokenizer %s declares no end-of-sequence token; guessed %r (id %d). Pass --eos_token TOKEN|ID "
                    "to choose it", tok.spec, tok.eos_token, tok.eos_id)


def _read_remote(path: str) -> bytes | None:
    """The bytes of a file on any Beam filesystem (a Dataflow launch reads gs:// as the build does), or None."""
    from pipelines.filesystem import read_or_none

    return read_or_none(path)


def _auto_tokenizer(spec: str, eos: str | int | None, hub: bool) -> TokenizerSpec:
    """A hub name, or a directory without tokenizer.json, loaded by ``transformers.AutoTokenizer``."""
    local_only = tokenizer_files.hub_local_only(spec) if hub else False  # offline: fails at once if not cached
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        what = "a Hugging Face hub name" if hub else "a directory without tokenizer.json"
        raise TokenizerError(f"tokenizer {spec!r}: loading {what} needs transformers: pip install "
                             "'chunkledger[hf]'") from e
    try:
        hf = AutoTokenizer.from_pretrained(spec, use_fast=True, local_files_only=local_only)
    except Exception as e:
        raise TokenizerError(
            f"tokenizer {spec!r}: not loadable as a Hugging Face tokenizer ({type(e).__name__}: {e}). A tokenizer "
            f"is {tokenizer_lib.forms()}.") from e
    if not getattr(hf, "is_fast", False):
        raise TokenizerError(f"tokenizer {spec!r}: only fast (Rust) tokenizers are supported")
    return TokenizerSpec.of(tokenizer_lib.from_hf(spec, library=hf.backend_tokenizer, declared=hf.eos_token,
                                                  eos=eos))


def _local_hf_files(spec: str) -> tuple[bytes, bytes | None] | None:
    """The bytes of a local ``tokenizer.json`` (a file, or in a directory) and of the ``tokenizer_config.json``
    beside it (None if there is none); None if ``spec`` names no local tokenizer.json."""
    spec = os.path.expanduser(spec)
    if os.path.isfile(spec):
        path, cfg = spec, os.path.join(os.path.dirname(spec), "tokenizer_config.json")
    elif os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json")):
        path, cfg = os.path.join(spec, "tokenizer.json"), os.path.join(spec, "tokenizer_config.json")
    else:
        return None
    data = files.read_local(path)
    if not os.path.isfile(cfg):
        return data, None
    return data, files.read_local(cfg)
