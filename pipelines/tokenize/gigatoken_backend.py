"""The GigaToken tokenizer backend (``--tokenizer_backend gigatoken``): the reference's tokens, guarded as fastokens is.

:class:`GigaTokenEncoder` is a :class:`~pipelines.tokenize.guarded_encoder.GuardedEncoder` on GigaToken (Rust), as
fastokens' is: the same conformance check at worker start, ``--verify_every`` sampling, the reference for a
batch it fails on, and long documents cut like the reference's. Only the library call and the loading differ.

Special-token strings. The reference decides what they are:

* ``tiktoken:`` encodings: plain text (``encode_ordinary``). GigaToken is loaded from the encoding's ranks
  with ``special_tokens={}``, so it has no special token to recognize; its pre-tokenizer is named by
  scheme, not given as a pattern, so the encoding's pattern must be one GigaToken implements
  (:data:`SCHEMES`), else it cannot be used.
* ``tokenizer.json``: the reference (Hugging Face ``tokenizers``) turns added tokens inside text into their
  ids, so GigaToken is loaded from the same JSON, added tokens kept. GigaToken 0.10 treats an added token
  with ``single_word`` differently: documents holding the content of such a token are encoded by the
  reference (:func:`reference_only_strings`).

The conformance set holds every special string of the tokenizer in many contexts, so either way the check at
start proves it.

Memory. GigaToken caches the pieces it has encoded, per tokenizer object and without bound (0.10 has no
way to limit or clear them: 3-14 MB of RSS per million characters of distinct unicode-heavy text, a few
on real prose, whose pieces repeat). So the tokenizer is replaced by a fresh one (its caches freed with
it) once the process's RSS has grown by :data:`RSS_BUDGET` since it was loaded: real text, whose caches
level off, seldom pays for a reload, and a worker's RSS stays bounded whatever the text. Where the RSS
cannot be read (no ``/proc``), after every :data:`REBUILD_CHARS` characters instead. The tokens are the
same either way: a fresh tokenizer is the one the conformance check passed.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Callable, Sequence

import numpy as np

from reader.tokenizers import tokenizer_lib

from pipelines.tokenize.guarded_encoder import (CL100K_ORIGINAL_PATTERN, CL100K_PATTERN, GuardedEncoder,
                                                ranks_file, ranks_file_bytes)
from pipelines.tokenize.tokenizer import TokenizerError, TokenizerSpec

# Growth of the process's RSS since the tokenizer was loaded that makes it reloaded, and the characters
# encoded between reloads where the RSS cannot be read (about that growth on the most unicode-heavy text
# measured). benchmarks/gigatoken_facts.py rss measures RSS and speed with them (docs/DESIGN.md,
# "Tokenizer backends").
RSS_BUDGET = 256 << 20
REBUILD_CHARS = 24_000_000
STATM = "/proc/self/statm"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_rss() -> int | None:
    """This process's resident set size in bytes, or None where ``/proc`` does not tell it."""
    try:
        with open(STATM, "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


# tiktoken patterns (as tiktoken's encodings write them) and GigaToken's pre-tokenizer scheme for each. A
# pattern not listed cannot be loaded: GigaToken runs named schemes, not patterns.
R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""])
SCHEMES = {R50K_PATTERN: "gpt2", CL100K_PATTERN: "cl100k", CL100K_ORIGINAL_PATTERN: "cl100k", O200K_PATTERN: "o200k"}


class GigaTokenEncoder(GuardedEncoder):
    """GigaToken behind the :class:`Encoder` interface, with the reference for checks and failures.

    Args:
        load: makes a fresh ``gigatoken.Tokenizer`` (called now, and again whenever the caches are full).
        reference: the reference encoder of the same tokenizer.
        cut_long: cut texts longer than PIECE_CHARS like the reference (tiktoken) does.
        verify_every: re-encode about one document in N with the reference (0: never).
        reference_only: documents holding one of these strings are encoded by the reference.
        rss_budget: RSS growth (bytes) since the tokenizer was loaded that makes it reloaded.
        rebuild_chars: where the RSS cannot be read, characters encoded between reloads.
    """

    backend = "gigatoken"

    def __init__(self, load: Callable[[], object], reference, *, cut_long: bool, verify_every: int,
                 reference_only: Sequence[str] = (), rss_budget: int = RSS_BUDGET,
                 rebuild_chars: int = REBUILD_CHARS):
        super().__init__(load(), reference, cut_long=cut_long, verify_every=verify_every)
        self.load = load
        self.reference_only = tuple(reference_only)
        self.rss_budget = rss_budget
        self.rebuild_chars = rebuild_chars
        self.loaded_rss = process_rss()
        self.encoded_chars = 0
        self.rebuilds = 0
        self._lock = threading.Lock()  # DoFn instances of a worker share the encoder

    def reference_only_strings(self) -> tuple[str, ...]:
        return self.reference_only

    def _flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        tok = self._tokenizer(sum(map(len, texts)))
        layout = tok.encode_batch(texts, parallel=False).layout  # one thread: one worker process per core
        offsets = np.asarray(layout.offsets).astype(np.int64, copy=False)
        return np.asarray(layout.content.data).view(np.int32), offsets

    def _tokenizer(self, chars: int):
        """The tokenizer to encode ``chars`` more characters with: a fresh one once the current one's caches
        have grown by ``rss_budget`` (or it has encoded ``rebuild_chars``, where the RSS cannot be read)."""
        with self._lock:
            rss = process_rss()
            if rss is not None and self.loaded_rss is not None:
                # other memory freed since the load lowers the baseline: only growth counts
                self.loaded_rss = min(self.loaded_rss, rss)
                full = rss - self.loaded_rss > self.rss_budget
            else:
                full = self.encoded_chars >= self.rebuild_chars
            if full:
                self.tok = None  # freed before the next one is made: the caches do not coexist
                self.tok = self.load()
                self.loaded_rss, self.encoded_chars = process_rss(), 0
                self.rebuilds += 1
            self.encoded_chars += chars
            return self.tok


def _import_gigatoken():
    try:
        import gigatoken
    except ImportError as e:
        raise TokenizerError(f"the gigatoken tokenizer backend needs gigatoken ({e}): pip install "
                             "'chunkledger[pipeline]'") from e
    return gigatoken


def tiktoken_loader(definition: tokenizer_lib.TiktokenDefinition) -> Callable[[], object]:
    """A maker of GigaToken tokenizers for a tiktoken encoding (its ranks, its pattern's scheme, no special
    tokens)."""
    scheme = SCHEMES.get(definition.pattern)
    if scheme is None:
        raise TokenizerError(f"gigatoken has no pre-tokenizer for the pattern of tiktoken encoding "
                             f"{definition.name!r}")
    gt = _import_gigatoken()
    data = ranks_file_bytes(definition.ranks)

    def load():
        with ranks_file(data) as path:
            # No special tokens: the reference encodes special-token strings as ordinary text.
            return gt.Tokenizer.from_tiktoken(path, pretokenizer=scheme, special_tokens={})

    return load


def reference_only_strings(tokenizer_json: str) -> list[str]:
    """Contents of the added tokens GigaToken 0.10 does not match as ``tokenizers`` does (``single_word``)."""
    added = json.loads(tokenizer_json).get("added_tokens") or []
    return sorted({t["content"] for t in added if t.get("single_word") and t.get("content")})


def make_gigatoken(spec: TokenizerSpec, reference, tokenizer_json: str = "") -> GigaTokenEncoder:
    """The GigaToken encoder of ``spec`` (unchecked). Raises :class:`TokenizerError` if it cannot be built."""
    try:
        if spec.kind == "tiktoken":
            load = tiktoken_loader(tokenizer_lib.tiktoken_encoding(spec.name)[0])
            return GigaTokenEncoder(load, reference, cut_long=True, verify_every=spec.verify_every)
        tokenizer_json = tokenizer_json or spec.tokenizer_json()
        gt = _import_gigatoken()
        return GigaTokenEncoder(lambda: gt.Tokenizer.from_json(tokenizer_json), reference, cut_long=False,
                                verify_every=spec.verify_every,
                                reference_only=reference_only_strings(tokenizer_json))
    except TokenizerError:
        raise
    except Exception as e:  # noqa: BLE001 - gigatoken reports unsupported tokenizers as RuntimeError and others
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TokenizerError(f"gigatoken cannot load tokenizer {spec.spec!r} ({type(e).__name__}: {first})") from e
