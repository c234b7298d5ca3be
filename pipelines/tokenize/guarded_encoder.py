"""What the fast tokenizer backends share: a library's encoder guarded by the reference.

:class:`GuardedEncoder` runs a fast library (fastokens: :mod:`pipelines.tokenize.fast_tokenizer`; GigaToken:
:mod:`pipelines.tokenize.gigatoken_backend`) behind the :class:`~pipelines.tokenize.tokenizer.Encoder` interface:
long documents cut into the reference's pieces, documents holding a string the library gets wrong sent to
the reference, a batch the library fails on encoded by the reference (so dead letters and their messages
are the reference's), and one document in ``verify_every`` (:func:`sampled`) re-encoded by the reference
during the build, a difference failing the job with :class:`TokenMismatchError`. A subclass gives the library
call (``_flat``). The conformance check at worker start is :func:`pipelines.tokenize.fast_tokenizer.load_fast`.
"""

from __future__ import annotations

import base64
import contextlib
import os
import tempfile
from typing import Iterator, Mapping, Sequence

import numpy as np

from pipelines.errors import BuildError
from pipelines.tokenize import conformance
from pipelines.tokenize.tokenizer import PIECE_CHARS, Encoder, cut_for_encoding

MISMATCH_MARKER = "tokenizer backend disagrees with the reference"
_PASSTHROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)

# cl100k's pattern as tiktoken 0.14 writes it (possessive quantifiers), and as it was written before (as
# cl100k's tokenizer.json files have it). See fast_tokenizer.EQUIVALENT_PATTERNS for where the two differ.
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
                  r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
CL100K_ORIGINAL_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


class TokenMismatchError(BuildError):
    """A fast backend's tokens differ from the reference's on a document of the build (the worker records
    it in ``_FAILED.json`` like any reason to stop the build, so the launcher reports it on every runner)."""


def sampled(offsets: Sequence[int], every: int) -> np.ndarray:
    """Indices of the documents (by byte offset) that are re-encoded by the reference: about 1 in ``every``.

    A multiplicative hash of the offset, so the choice depends on the document alone (not on batching,
    workers or retries) and is not tied to line lengths.
    """
    if every <= 0 or not len(offsets):
        return np.zeros(0, dtype=np.int64)
    if every == 1:
        return np.arange(len(offsets))
    h = np.asarray(offsets, dtype=np.uint64) * _GOLDEN  # wraps modulo 2**64, by design
    return np.flatnonzero((h >> np.uint64(32)) % np.uint64(every) == 0)


def ranks_file_bytes(ranks: Mapping[bytes, int]) -> bytes:
    """A ``.tiktoken`` rank file's contents: one base64 token and its rank per line, by rank."""
    lines = [base64.b64encode(tok) + b" " + str(rank).encode()
             for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    return b"\n".join(lines) + b"\n"


@contextlib.contextmanager
def ranks_file(data: bytes) -> Iterator[str]:
    """A temporary ``.tiktoken`` file holding ``data`` (:func:`ranks_file_bytes`), for the libraries that load
    ranks from a path; removed afterwards."""
    fd, path = tempfile.mkstemp(prefix="chunkledger-ranks-", suffix=".tiktoken")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        yield path
    finally:
        os.unlink(path)


class GuardedEncoder(Encoder):
    """A fast library's encoder with the reference for checks and failures.

    Args:
        tok: the library's tokenizer object.
        reference: the reference encoder of the same tokenizer.
        cut_long: cut texts longer than PIECE_CHARS like the reference (tiktoken) does.
        verify_every: re-encode about one document in N with the reference (0: never).
    """

    backend = ""  # --tokenizer_backend's name

    def __init__(self, tok, reference: Encoder, *, cut_long: bool, verify_every: int):
        self.tok = tok
        self.reference = reference
        self.cut_long = cut_long
        self.verify_every = verify_every

    def reference_only_strings(self) -> Sequence[str]:
        """Texts holding one of these are encoded by the reference."""
        return ()

    def _flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The tokens of ``texts`` in one int32 array, and the offsets of each text's tokens in it."""
        raise NotImplementedError

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        texts = list(texts)
        only = self.reference_only_strings()
        # ``in``: O(1) for a character beyond Latin-1 in the usual Latin-1 texts, else a memchr-like scan
        by_reference = [i for i, t in enumerate(texts) if any(c in t for c in only)] if only else []
        if not by_reference:
            return self._encode_fast(texts)
        skip = set(by_reference)
        rest = [i for i in range(len(texts)) if i not in skip]
        out: list = [None] * len(texts)
        for i, a in zip(by_reference, self.reference.encode_many([texts[i] for i in by_reference])):
            out[i] = a
        for i, a in zip(rest, self._encode_fast([texts[i] for i in rest])):
            out[i] = a
        return out

    def _encode_fast(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        try:
            if not self.cut_long or all(len(t) <= PIECE_CHARS for t in texts):
                ids, offs = self._flat(texts)
                return [ids[offs[i]:offs[i + 1]] for i in range(len(texts))]
            pieces, first = [], []
            for t in texts:
                first.append(len(pieces))
                pieces.extend(cut_for_encoding(t) if len(t) > PIECE_CHARS else (t,))
            first.append(len(pieces))
            ids, offs = self._flat(pieces)
            # the pieces of a text are consecutive in the flat buffer: its tokens are one slice
            return [ids[offs[first[i]]:offs[first[i + 1]]] for i in range(len(texts))]
        except BaseException as e:  # noqa: BLE001 - pyo3 panics derive from BaseException
            if isinstance(e, _PASSTHROUGH):
                raise
            # The reference decides: its tokens, or its error (the dead letter's reason and message).
            return self.reference.encode_many(texts)

    def verify(self, texts: Sequence[str], offsets: Sequence[int], arrays: Sequence[np.ndarray | None],
               where: str) -> int:
        idx = [i for i in sampled(offsets, self.verify_every).tolist() if arrays[i] is not None]
        if not idx:
            return 0
        try:
            want = self.reference.encode_many([texts[i] for i in idx])
        except Exception as e:  # the reference would have set these documents aside as bad records
            raise TokenMismatchError(
                f"{self.backend} {MISMATCH_MARKER} on a document among byte offsets {[offsets[i] for i in idx]} of "
                f"{where}: the reference fails on it ({type(e).__name__}: {e}) and the {self.backend} backend does "
                "not. Rerun with "
                "--tokenizer_backend reference (completed chunks are kept) and report the document.") from e
        for i, ref in zip(idx, want):
            pos = conformance.first_difference(arrays[i], ref)
            if pos is not None:
                got = arrays[i]
                raise TokenMismatchError(
                    f"{self.backend} {MISMATCH_MARKER} on the document at byte offset {offsets[i]} of {where}: first "
                    f"difference at token {pos} ({self.backend} {int(got[pos]) if pos < len(got) else 'end'}, "
                    f"reference {int(ref[pos]) if pos < len(ref) else 'end'}). The cache would not be the reference's; "
                    "rerun with --tokenizer_backend reference (completed chunks are kept) and report the document.")
        return len(idx)
