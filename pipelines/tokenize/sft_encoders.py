"""The encoders of :mod:`pipelines.tokenize.sft`: tiktoken and Hugging Face tokenizers as its ``Encoder``
(ordinary text, and each token's character span, the spans transformers' assistant mask reads)."""

from __future__ import annotations

import functools
import json
import numpy as np

from pipelines.tokenize import chat_template

def offsets_from_lengths(text: str, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token's character span in ``text``, from the tokens' byte lengths (they must sum to the text's
    UTF-8 length): ``(starts, ends)`` as int64 arrays.

    A token covers the characters its bytes belong to: a token holding part of a multi-byte character
    covers that whole character, so two tokens splitting one character both cover it (Hugging Face
    tokenizers' offsets, the ones transformers' assistant mask reads, follow the same rule).
    """
    byte_end = np.cumsum(lens)
    raw = None if text.isascii() else text.encode("utf-8")  # ASCII: bytes are characters
    if (int(byte_end[-1]) if len(lens) else 0) != (len(text) if raw is None else len(raw)):
        raise ValueError("the encoder's tokens do not spell the text byte for byte; cannot place them")
    if raw is None:
        return byte_end - lens, byte_end
    char_of_byte = np.cumsum((np.frombuffer(raw, dtype=np.uint8) & 0xC0) != 0x80) - 1
    return char_of_byte[byte_end - lens], char_of_byte[byte_end - 1] + 1


class TiktokenSft:
    """:class:`Encoder` over a ``tiktoken.Encoding`` (public API only); its special tokens are the
    encoding's ``special_tokens_set``. ``ordinary`` (texts -> int32 arrays, special-token strings as plain
    text), if given, encodes instead of the Encoding: the build's encoder, which may be the fast backend."""

    def __init__(self, enc, ordinary=None):
        self.enc = enc
        self.special_ids = {s: int(enc.encode_single_token(s)) for s in sorted(enc.special_tokens_set)}
        self._ordinary = ordinary
        self._lengths = None  # each token id's byte length (spans from lengths: no bytes per token)

    def _ids(self, text: str) -> np.ndarray:
        if self._ordinary is not None:
            return self._ordinary([text])[0]
        return self.enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def encode_ordinary(self, text: str) -> list[int]:
        return self._ids(text).tolist()

    def encode_with_offsets(self, text: str):
        ids = self._ids(text).astype(np.int64)
        if self._lengths is None:
            self._lengths = token_lengths(self.enc)
        starts, ends = offsets_from_lengths(text, self._lengths[ids])
        return ids, starts, ends


@functools.lru_cache(maxsize=4)
def token_lengths(enc) -> np.ndarray:
    """The byte length of every token id of a tiktoken Encoding (0 for ids that are no token)."""
    out = np.zeros(enc.max_token_value + 1, dtype=np.int64)
    for i in range(len(out)):
        try:
            out[i] = len(enc.decode_single_token_bytes(i))
        except KeyError:
            pass
    return out


class HFSft:
    """:class:`Encoder` over a Hugging Face ``tokenizers.Tokenizer``.

    Its special-token strings are the control tokens of transformers' ``sanitize_control_tokens``: the added
    tokens marked special, plus, for a chat template, the other added tokens its literal text holds (Qwen3's
    ``<think>``), whitespace-only ones excepted. Other added tokens (Gemma's whitespace runs and HTML tags)
    are ordinary text that the tokenizer matches wherever it occurs, content included, as transformers
    does. Ordinary text is encoded by a copy of the tokenizer without the control tokens, truncation or
    padding; token spans are that encoding's offsets (what transformers' assistant mask reads).
    """

    def __init__(self, tokenizer, chat_template_source: str | None = None):
        from tokenizers import Tokenizer

        literals = chat_template.literal_text(chat_template_source) if chat_template_source else ""
        added = {t.content: int(i) for i, t in tokenizer.get_added_tokens_decoder().items()
                 if not (t.special or (t.content in literals and not t.content.isspace()))}
        self.special_ids = {t.content: int(i) for i, t in tokenizer.get_added_tokens_decoder().items()
                            if t.content not in added}
        spec = json.loads(tokenizer.to_str())
        spec.update(added_tokens=[t for t in spec["added_tokens"] if t["content"] in added], truncation=None,
                    padding=None)
        self._plain = Tokenizer.from_str(json.dumps(spec))
        # tokenizers numbers the added tokens a vocabulary lacks after it, whatever ids the JSON gives
        self._ids = {self._plain.token_to_id(c): i for c, i in added.items() if self._plain.token_to_id(c) != i}

    def _encode(self, text: str):
        e = self._plain.encode(text, add_special_tokens=False)
        return ([self._ids.get(t, t) for t in e.ids] if self._ids else e.ids), e.offsets

    def encode_ordinary(self, text: str) -> list[int]:
        return self._encode(text)[0]

    def encode_with_offsets(self, text: str):
        ids, offsets = self._encode(text)
        return ids, [s for s, _ in offsets], [t for _, t in offsets]
