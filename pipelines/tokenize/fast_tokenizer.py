"""The fast tokenizer backends: the reference's tokens at several times the speed, guarded.

Backends (``--tokenizer_backend``):

* ``reference``: tiktoken / Hugging Face ``tokenizers``, which define the tokens.
* ``fast``: fastokens (Rust) for ``tiktoken:`` encodings (loaded from the encoding's own ranks and pattern,
  or an equivalent pattern fastokens runs faster, and no special tokens, so special-token strings stay
  plain text as in the reference) and for Hugging Face ``tokenizer.json`` files it supports.
* ``gigatoken``: GigaToken (Rust), the same way (:mod:`pipelines.tokenize.gigatoken_backend`).
* ``auto`` (default): the faster of the two for the tokenizer's kind (:data:`AUTO_BACKENDS`) when it is
  available and passes the conformance check, else the reference, with a warning naming the reason (e.g.
  the first differing conformance text).

With ``fast`` or ``gigatoken``, an unsupported tokenizer or any difference from the reference on the
conformance set (:mod:`pipelines.tokenize.conformance`) is an error.

Exactness is checked, not assumed (:mod:`pipelines.tokenize.guarded_encoder`): the conformance set runs once
per process and tokenizer before a fast backend is used, and during the build one document
in ``verify_every`` (chosen by a hash of its byte offset, so a retried bundle checks the same documents) is
re-encoded by the reference; a difference fails the job, naming the input file, the document's byte offset
and the first differing token. A batch the fast library fails on is encoded by the reference, so dead letters
(and their messages) are the reference's too.

Long documents are cut into the same pieces as the reference's (:func:`pipelines.tokenize.tokenizer.cut_for_encoding`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Mapping, Sequence

import numpy as np

from reader.tokenizers import tokenizer_lib

from pipelines.tokenize import conformance
from pipelines.tokenize import gigatoken_backend
from pipelines.tokenize.guarded_encoder import (CL100K_ORIGINAL_PATTERN, CL100K_PATTERN, GuardedEncoder, ranks_file,
                                                ranks_file_bytes)
from pipelines.tokenize.tokenizer import Encoder, TokenizerError, TokenizerSpec

LOG = logging.getLogger("chunkledger.tokenizer")

# Texts holding one of these characters are encoded by the reference. fastokens 0.3.5, on patterns it runs
# with fancy-regex (tiktoken's possessive ones), treats U+180E MONGOLIAN VOWEL SEPARATOR as whitespace (as
# Unicode did before 6.3) and tiktoken does not, which changes the pre-tokenization of e.g.
# "x\u180e\u094d\u0937". The conformance set found it; scanning every code point in 14 contexts
# (benchmarks/tokenizer_bench.py scan --own_pattern) found no other.
REFERENCE_ONLY_CHARS = "\u180e"

# Patterns fastokens runs on a much faster engine than the Encoding's own, with the same tokens. tiktoken
# 0.14 writes cl100k's pattern with possessive quantifiers (for its own regex engine); fastokens can only run
# those on fancy-regex. The original cl100k pattern (as tiktoken had it before, and as cl100k's
# tokenizer.json files have it) cuts text into the same pieces except one case: a whitespace run that ends
# the text and holds a newline followed by other whitespace is one piece for the possessive pattern, two
# for the original (cut after its last newline). BPE never merges across that cut unless some token is a
# newline followed by non-newline whitespace at its end, so the substitution is used only for ranks that
# have no such token (_NEWLINE_THEN_SPACE_END; cl100k has none). Also checked on the conformance set, every
# code point in 14 contexts and real text (benchmarks/tokenizer_bench.py); the guards check it like any
# fast backend.
EQUIVALENT_PATTERNS = {CL100K_PATTERN: CL100K_ORIGINAL_PATTERN}
# Bytes of the UTF-8 encodings of whitespace characters (str.isspace, a superset of the regex engines' \s)
# other than \r and \n: a token ending in a newline and then only such bytes could span the cut above.
_SPACE_BYTES = set("\t\x0b\x0c\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
                   "\u2009\u200a\u2028\u2029\u202f\u205f\u3000".encode("utf-8"))
_NEWLINE_THEN_SPACE_END = re.compile(rb"[\r\n][" + b"".join(re.escape(bytes([b])) for b in sorted(_SPACE_BYTES))
                                     + rb"]+\Z")


class FastEncoder(GuardedEncoder):
    """fastokens behind the :class:`Encoder` interface, with the reference for checks and failures (the
    arguments are :class:`GuardedEncoder`'s; ``tok`` is a ``fastokens.Tokenizer``)."""

    backend = "fast"

    def reference_only_strings(self) -> Sequence[str]:
        return REFERENCE_ONLY_CHARS

    def _flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids, offs = self.tok.encode_batch_flat(texts, add_special_tokens=False)
        return np.frombuffer(ids, dtype="<i4"), np.frombuffer(offs, dtype="<u8").astype(np.int64)


# --------------------------------------------------------------------------------------------------
# Loading


def _import_fastokens():
    # One worker process per core (as for Rayon in the reference, see TokenizerSpec.load_reference): no
    # helper threads unless the user asks for them.
    os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")
    import fastokens

    return fastokens


def _tiktoken_fast(definition: tokenizer_lib.TiktokenDefinition) -> object:
    """fastokens for a tiktoken encoding: its ranks (written to a temporary file), its pattern (or a faster
    equivalent one, see EQUIVALENT_PATTERNS), no special tokens."""
    fastokens = _import_fastokens()
    ranks: Mapping[bytes, int] = definition.ranks
    data = ranks_file_bytes(ranks)
    pattern = fast_pattern(definition.pattern, ranks)
    with ranks_file(data) as path:
        # No special tokens: the reference encodes special-token strings as ordinary text.
        return fastokens.Tokenizer.from_tiktoken(path, pattern=pattern, special_tokens={})


def fast_pattern(pattern: str, ranks) -> str:
    """The pattern fastokens runs for an Encoding: an equivalent faster one where it applies to ``ranks``."""
    alt = EQUIVALENT_PATTERNS.get(pattern)
    if alt is None or any(_NEWLINE_THEN_SPACE_END.search(token) for token in ranks):
        return pattern
    return alt


def _special_strings(reference: Encoder) -> list[str]:
    enc = getattr(reference, "enc", None)
    if enc is not None:
        return sorted(enc.special_tokens_set)
    tok = getattr(reference, "tok", None)
    if tok is not None:
        return sorted(t.content for t in tok.get_added_tokens_decoder().values())
    return []


def make_fast(spec: TokenizerSpec, reference: Encoder, tokenizer_json: str = "") -> FastEncoder:
    """The fast encoder of ``spec`` (unchecked). Raises :class:`TokenizerError` if it cannot be built."""
    try:
        if spec.kind == "tiktoken":
            tok = _tiktoken_fast(tokenizer_lib.tiktoken_encoding(spec.name)[0])
            return FastEncoder(tok, reference, cut_long=True, verify_every=spec.verify_every)
        tokenizer_json = tokenizer_json or spec.tokenizer_json()
        tok = _import_fastokens().Tokenizer.from_json_str(tokenizer_json)
        return FastEncoder(tok, reference, cut_long=False, verify_every=spec.verify_every)
    except ImportError as e:
        raise TokenizerError(f"the fast tokenizer backend needs fastokens ({e}): pip install "
                             "'chunkledger[pipeline]'") from e
    except TokenizerError:
        raise
    except Exception as e:  # noqa: BLE001 - fastokens reports unsupported tokenizers as ValueError and others
        raise TokenizerError(f"fastokens cannot load tokenizer {spec.spec!r} ({type(e).__name__}: {e})") from e


# Which library "auto" tries, per tokenizer kind: the faster one on distinct text (docs/DESIGN.md,
# "Tokenizer backends"); the reference if it does not qualify.
AUTO_BACKENDS = {"tiktoken": "fast", "huggingface": "fast"}


def make_encoder(backend: str, spec: TokenizerSpec, reference: Encoder, tokenizer_json: str = "") -> GuardedEncoder:
    """The unchecked encoder of ``backend`` ("fast" or "gigatoken"). Raises :class:`TokenizerError`."""
    if backend == "gigatoken":
        return gigatoken_backend.make_gigatoken(spec, reference, tokenizer_json)
    return make_fast(spec, reference, tokenizer_json)


def load_fast(spec: TokenizerSpec, reference: Encoder, tokenizer_json: str = "") -> Encoder:
    """The fast encoder of ``spec.backend`` ("fast", "gigatoken"; "auto": :data:`AUTO_BACKENDS`'s for the kind)
    if it loads and passes the conformance check; else the reference ("auto") or an error.

    Raises:
        TokenizerError: unless ``spec.backend == "auto"``, naming the reason (the first differing text).
    """
    t0 = time.perf_counter()
    backend = AUTO_BACKENDS[spec.kind] if spec.backend == "auto" else spec.backend
    try:
        fast = make_encoder(backend, spec, reference, tokenizer_json)
        texts = conformance.conformance_texts(_special_strings(reference))
        diff = conformance.check(fast, reference, texts)
        if diff is not None:
            raise TokenizerError(f"the {backend} tokenizer backend differs from the reference for {spec.spec!r} on "
                                 f"{diff.describe()}")
    except TokenizerError as e:
        if spec.backend != "auto":
            raise TokenizerError(f"{e}. Use --tokenizer_backend auto or reference.") from e
        LOG.warning("%s; using the reference tokenizer (as fast, exactly, but slower)", e)
        reference.fallback_reason = str(e)
        return reference
    LOG.info("%s tokenizer backend for %s passed the conformance check in %.2fs", backend, spec.spec,
             time.perf_counter() - t0)
    return fast


def preflight(spec: TokenizerSpec) -> None:
    """Launcher, ``--tokenizer_backend fast`` or ``gigatoken``: load it and run the conformance check before any
    worker does.

    Raises:
        TokenizerError: naming why the fast backend cannot be used.
    """
    load_cached(spec)  # in-process runners reuse it


def load_encoder(spec: TokenizerSpec) -> Encoder:
    """The encoder of ``spec.backend`` (the fast one only after it passed its conformance check)."""
    tokenizer_json = spec.tokenizer_json() if spec.kind == "huggingface" else ""
    reference = spec.load_reference(tokenizer_json)
    if spec.backend == "reference":
        return reference
    return load_fast(spec, reference, tokenizer_json)


_LOADED: dict[tuple, Encoder] = {}
_LOAD_LOCK = threading.Lock()


def load_cached(spec: TokenizerSpec) -> Encoder:
    """:func:`load_encoder` once per process (DoFn instances of a worker share the encoder and its checks)."""
    key = (spec.kind, spec.hash, spec.backend, spec.verify_every)
    with _LOAD_LOCK:
        enc = _LOADED.get(key)
        if enc is None:
            enc = _LOADED[key] = load_encoder(spec)
    return enc


# --------------------------------------------------------------------------------------------------
# Reporting (launcher)


def backend_note(counters: Mapping[str, int] | None) -> str:
    """The summary line's words on the tokenizer backends that ran, from the job's counters ("" if none)."""
    counters = counters or {}
    ran = {b: counters.get(f"backend_{b}", 0) for b in ("fast", "gigatoken", "reference")}
    if not any(ran.values()):
        return ""
    checked = f" ({counters.get('tokenizer_verified_docs', 0)} documents re-checked by the reference)"
    parts = [f"{b} on {n} worker{'s' * (n != 1)}{checked if b != 'reference' else ''}" for b, n in ran.items() if n]
    note = "tokenizer backend: " + " and ".join(parts)
    rejected = counters.get("backend_fast_rejected", 0)
    if rejected:
        note += f", the fast one rejected on {rejected} (the worker logs say why)"
    return note
